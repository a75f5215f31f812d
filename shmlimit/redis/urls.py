"""Redis URLs without their secrets: what may be shown, stored in a segment or put in an error.

Both tiers use this module, and it imports neither: the shared-memory core
shows an upstream's URL (``stats``, ``top``, error messages) without ever
importing the Redis tier or redis-py.

A secret is the password of the URL's user information
(``redis://user:PASSWORD@host``) or the value of any query parameter whose
name contains ``password`` (``?password=``, ``?sentinel_password=``).  URLs
are taken apart as strings, not by ``urllib.parse``: parsing must never fail
on the way to hiding a secret (a port of 99999, a malformed IPv6 literal) and
must keep what it does not understand exactly as written (``[::1]``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import parse_qsl, unquote

#: Schemes a ``RedisLimiter`` (and ``upstream=``) accepts, by deployment.
SINGLE_SCHEMES = ("redis", "rediss", "unix", "redis+unix", "valkey", "valkeys", "valkey+unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster", "valkey+cluster", "valkeys+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel", "valkey+sentinel", "valkeys+sentinel")
SCHEMES = SINGLE_SCHEMES + CLUSTER_SCHEMES + SENTINEL_SCHEMES
#: Schemes that connect with TLS (the server's certificate and host name are always verified).
TLS_SCHEMES = (
    "rediss",
    "valkeys",
    "rediss+cluster",
    "valkeys+cluster",
    "rediss+sentinel",
    "valkeys+sentinel",
)

HIDDEN = "***"


def _int(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    def parse(v: str) -> int:
        n = int(v)
        if n < low or (high is not None and n > high):
            raise ValueError
        return n

    return parse


def _seconds(v: str) -> float:
    t = float(v)
    if not 0 < t < float("inf"):
        raise ValueError
    return t


_BOOLS = dict.fromkeys(("true", "yes", "y", "t", "1"), True)
_BOOLS.update(dict.fromkeys(("false", "no", "n", "f", "0"), False))


def _bool(v: str) -> bool:
    return _BOOLS[v.lower()]


#: The query parameters a URL may carry, and how their values read (``options``); ``_TLS`` ones
#: only on TLS schemes, ``sentinel_password`` only on sentinel ones.  Any other is refused when the
#: limiter is built: redis-py would refuse it only when it connects.
_PARAMS: Dict[str, Tuple[Callable[[str], Any], str]] = {
    "db": (_int(0), "an integer >= 0"),
    "socket_timeout": (_seconds, "seconds > 0"),
    "socket_connect_timeout": (_seconds, "seconds > 0"),
    "socket_keepalive": (_bool, "true or false"),
    "retry_on_timeout": (_bool, "true or false"),
    "health_check_interval": (_int(0), "an integer >= 0"),
    "max_connections": (_int(1), "an integer >= 1"),
    "protocol": (_int(2, 3), "2 or 3"),
    "client_name": (str, ""),
    "username": (str, ""),
    "password": (str, ""),
    "sentinel_password": (str, ""),
}
_TLS = {
    "ssl_ca_certs": (str, ""),
    "ssl_ca_path": (str, ""),
    "ssl_certfile": (str, ""),
    "ssl_keyfile": (str, ""),
    "ssl_password": (str, ""),
    "ssl_ciphers": (str, ""),
    "ssl_cert_reqs": (str, ""),
    "ssl_check_hostname": (_bool, "true or false"),
}


def _is_secret_param(key: str) -> bool:
    return "password" in unquote(key).lower()


def parts(url: str) -> Tuple[str, Optional[str], Optional[str], str, Optional[str]]:
    """``(scheme://, user, password, the rest before '?', query)``; user/password None when absent.

    ``check`` reads a URL through it, and so does ``client.connect``: the
    hosts it connects to are the ones checked.

    Everything before the last ``@`` of the part before ``?`` is user
    information when it holds a ``:``; a password holding ``@``, ``/`` or
    ``#`` unescaped is still all hidden.
    """
    i = url.find("://")
    head, rest = (url[: i + 3], url[i + 3 :]) if i >= 0 else ("", url)
    q = rest.find("?")
    if _ambiguous(rest):
        q = rest.find(
            "?", rest.rfind("@")
        )  # the password holds the "?": hide it (check refuses the URL)
    body, query = (rest, None) if q < 0 else (rest[:q], rest[q + 1 :])
    at = body.rfind("@")
    user = password = None
    if at >= 0:
        info = body[:at]
        if ":" in info:
            user, password = info.split(":", 1)
        else:
            user = info
        body = body[at + 1 :]
    return head, user, password, body, query


def _ambiguous(rest: str) -> bool:
    """An ``@`` only after the first ``?``: a password holding an unescaped ``?`` (``u:p?w@host``),
    or a query value holding an ``@``.  No reading is sure, so the text up to that ``@`` counts
    as user information wherever a secret might be shown, and ``check`` refuses the URL."""
    q = rest.find("?")
    return 0 <= q < rest.rfind("@") and "@" not in rest[:q]


def _join(
    head: str, user: Optional[str], password: Optional[str], body: str, query: Optional[str]
) -> str:
    info = ""
    if password is not None:
        info = f"{user or ''}:{password}@"
    elif user:
        info = f"{user}@"
    return head + info + body + ("" if query is None else "?" + query)


def redact(url: object) -> str:
    """``url`` with every secret replaced by ``***``: safe to print, log, store or raise.

    Never raises, whatever ``url`` is; anything that is not a string is
    described by its type only.
    """
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    head, user, password, body, query = parts(url)
    if not head and user is not None and password is None:  # no scheme: "secret@host" is all hidden
        user, password = "", HIDDEN
    if query is not None:
        params = []
        for p in query.split("&"):
            key, eq, _ = p.partition("=")
            params.append(f"{key}={HIDDEN}" if eq and _is_secret_param(key) else p)
        query = "&".join(params)
    return _join(head, user, None if password is None else HIDDEN, body, query)


def split_secrets(url: str) -> Tuple[str, Dict[str, str]]:
    """``(url without its secrets, {redis-py keyword: secret})``.

    The user-information password becomes ``password``; a secret query
    parameter keeps its name (``sentinel_password``).  The URL keeps its
    user name.  Values are percent-decoded, as redis-py decodes them.
    """
    head, user, password, body, query = parts(url)
    secrets: Dict[str, str] = {}
    if password is not None and password != "":
        secrets["password"] = unquote(password)
    if query is not None:
        kept: List[str] = []
        for p in query.split("&"):
            key, eq, value = p.partition("=")
            if eq and _is_secret_param(key):
                secrets[unquote(key)] = unquote(value)
            else:
                kept.append(p)
        query = "&".join(kept) if kept else None
    return _join(head, user, None, body, query), secrets


def scheme_of(url: str) -> str:
    i = url.find("://")
    return url[:i].lower() if i >= 0 else ""


def check(url: object, param: str = "url") -> str:
    """``url`` if its scheme is one we connect to and its TLS (if any) is verified; else ValueError.

    The error shows the URL redacted.  TLS without verification of the
    server's certificate and host name is refused: it would hand the
    password to whoever answers.
    """
    if not isinstance(url, str):
        raise ValueError(f"{param} must be a Redis URL string, got {redact(url)}")
    scheme = scheme_of(url)
    if scheme not in SCHEMES:
        raise ValueError(
            f"{param} must be a URL with one of the schemes {', '.join(s + '://' for s in SCHEMES)}; "
            f"got {redact(url)}"
        )
    if _ambiguous(url[url.find("://") + 3 :]):
        raise ValueError(
            f"{param}: an '@' after the '?' is ambiguous; percent-encode a '?' in the password "
            f"as %3F (or an '@' in a query value as %40): {redact(url)}"
        )
    _, _, _, body, query = parts(url)
    for p in (query or "").split("&"):
        key, _, value = p.partition("=")
        key = unquote(key).lower()
        if (key == "ssl_cert_reqs" and unquote(value).lower() not in ("required", "")) or (
            key == "ssl_check_hostname" and unquote(value).lower() in ("false", "no", "0", "n", "f")
        ):
            raise ValueError(
                f"{param}: TLS must verify the server's certificate and host name; "
                f"drop {key}= from {redact(url)}"
            )
    opts = options(url, param)
    if scheme not in ("unix", "redis+unix", "valkey+unix"):
        netloc, _, path = body.partition("/")
        if not netloc:
            raise ValueError(f"{param} names no host: {redact(url)}")
        if "," in netloc and scheme in SINGLE_SCHEMES:
            raise ValueError(
                f"{param}: several hosts need redis+cluster:// or redis+sentinel://; got {redact(url)}"
            )
        hosts(netloc, 6379, param)
        if scheme in CLUSTER_SCHEMES and (path.strip("/") or "db" in opts):
            what = "db=" if "db" in opts else f"path /{path}"
            raise ValueError(f"{param}: a cluster has one database, so no {what}: {redact(url)}")
        service, _, db = path.partition("/")
        if scheme in SENTINEL_SCHEMES and (not service or not (db == "" or db.isdigit())):
            raise ValueError(
                f"{param}: a sentinel URL's path is /service[/db] (db an integer >= 0); "
                f"got {redact(url)}"
            )
    return url


def options(url: str, param: str = "url") -> Dict[str, Any]:
    """The query parameters of ``url``, read (``db`` an int, timeouts floats...); ValueError naming
    one that is unknown, misplaced, or whose value does not read."""
    scheme = scheme_of(url)
    out: Dict[str, Any] = {}
    for key, value in parse_qsl(parts(url)[4] or ""):  # (an empty value is absent, as in redis-py)
        known = _PARAMS.get(key) or (_TLS.get(key) if scheme in TLS_SCHEMES else None)
        if key == "sentinel_password" and scheme not in SENTINEL_SCHEMES:
            raise ValueError(f"{param}: {key}= belongs on a redis+sentinel:// URL: {redact(url)}")
        if known is None and key in _TLS:
            raise ValueError(f"{param}: {key}= belongs on a rediss:// (TLS) URL: {redact(url)}")
        if known is None:
            hint = " (the limiter's timeout= argument sets it)" if key == "timeout" else ""
            raise ValueError(
                f"{param}: unknown query parameter {key!r}{hint}; known: "
                f"{', '.join(sorted(_PARAMS))}, and with TLS {', '.join(sorted(_TLS))}: "
                f"{redact(url)}"
            )
        parse, what = known
        try:
            out[key] = parse(value)
        except (ValueError, KeyError):
            shown = HIDDEN if _is_secret_param(key) else repr(value)
            raise ValueError(f"{param}: {key} must be {what}, got {shown}: {redact(url)}") from None
    return out


def hosts(netloc: str, default_port: int, param: str = "url") -> List[Tuple[str, int]]:
    """``host[:port][,host[:port]...]`` (IPv6 literals in brackets) as pairs; ValueError naming the bad one."""
    out = []
    for part in netloc.split(","):
        if part.startswith("["):
            host, _, rest = part[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else rest
        else:
            host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
        if not host or (port and (not port.isdigit() or not 0 < int(port) < 65536)):
            raise ValueError(f"{param}: bad host:port {part!r} (ports are 1-65535)")
        out.append((host, int(port) if port else default_port))
    return out
