"""Glue for the tools users already run; each module needs only its own optional extra.

* ``shmlimit.integrations.prometheus``: a ``prometheus_client`` collector (extra ``prometheus``).
* ``shmlimit.integrations.asgi`` and ``.wsgi``: rate-limiting middleware (no extra needed).
* ``shmlimit.integrations.celery``: retry a task later instead of blocking its worker slot (extra ``celery``).
* ``shmlimit.integrations.httpx`` and ``.requests``: throttle per host, pause a host fleet-wide on
  429/503 ``Retry-After`` (extras ``httpx``, ``requests``).

Importing this package imports none of them.
"""
