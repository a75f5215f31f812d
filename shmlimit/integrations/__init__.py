"""Glue for the tools users already run; each module needs an optional extra.

* ``shmlimit.integrations.prometheus``: a ``prometheus_client`` collector (extra ``prometheus``).
* ``shmlimit.integrations.asgi`` and ``.wsgi``: rate-limiting middleware (no extra needed).
* ``shmlimit.integrations.celery``: retry a task later instead of blocking a worker (extra ``celery``).

Importing this package imports none of them.
"""
