"""Exceptions raised by shmlimit.  Every one names what was wrong and what is allowed."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Tuple


class ShmlimitError(Exception):
    """Base class of shmlimit's own errors."""

    def __reduce__(self):  # type: ignore[override]
        # As it is, not by calling the class again with its message: a subclass takes other
        # arguments (a name, a retry_after), so a pool's or a task queue's unpickling would fail.
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type, args: tuple, state: dict) -> BaseException:
    """A pickled ``ShmlimitError``, as it was raised: its message and its attributes."""
    e = cls.__new__(cls, *args)  # type: ignore[call-overload]  # (an OSError's errno, from its args)
    e.args = args
    e.__dict__.update(state)
    return e


class LimiterNotFoundError(ShmlimitError, FileNotFoundError):
    """No limiter segment exists under that name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no shmlimit limiter named {name!r} exists on this machine")
        self.name = name


class ConfigMismatchError(ShmlimitError, ValueError):
    """The segment exists with a configuration different from the one asked for."""

    def __init__(
        self,
        name: str,
        existing: object,
        requested: object,
        live: bool = False,
        group: Optional[Tuple[str, str, bool]] = None,
        settable: bool = True,
    ) -> None:
        # ``group``: ``name`` is one rate of a limiter of several rates, ``(its name, the rate's
        # key, whether its constructor takes reconfigure=)``: attached by the group's name;
        # ``settable``: ``set_rate`` can change what differs (not an adaptive rate's ``adapt=``)
        who = name if group is None else group[0]
        if not live:
            then = "unlink it first."
        elif group is None or group[2]:
            then = "pass reconfigure=True to apply this configuration to every process using it."
        elif not settable:
            then = (
                "create it with this configuration once no process uses it (set_rate cannot "
                "change adapt=; the rates learned are kept within the new bounds)."
            )
        else:
            then = f"change it for every process using it with set_rate({group[1]!r}, ...)."
        super().__init__(
            f"limiter {name!r} already exists with {existing}; this call asked for {requested}. "
            f"Attach with shmlimit.attach({who!r}) to use it as it is, or {then}"
        )
        self.name = name
        self.existing = existing
        self.requested = requested
        self.live = live
        self.settable = settable

    def of_group(self, group: str, key: str, reconfigure: bool) -> "ConfigMismatchError":
        """This mismatch of rate ``key`` of the limiter of several rates ``group``, advising what
        works there (``reconfigure``: whether its constructor takes ``reconfigure=``)."""
        return ConfigMismatchError(
            self.name,
            self.existing,
            self.requested,
            self.live,
            (group, key, reconfigure),
            self.settable,
        )


class SegmentError(ShmlimitError):
    """A segment under that name is corrupt, foreign, truncated or of another layout version."""


class CorruptWordsError(SegmentError):
    """Words of a segment no reader accepts (a config, an adaptive rate, an upstream's description),
    refused by a layer that reads words, not names: ``naming`` says which segment."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"segment is corrupt: {detail}")
        self.detail = detail


@contextmanager
def naming(name: str) -> Iterator[None]:
    """A ``CorruptWordsError`` raised inside, raised again naming segment ``name``: one of several
    limiters is then found by the error alone."""
    try:
        yield
    except CorruptWordsError as e:
        raise SegmentError(f"segment {name!r} is corrupt: {e.detail}") from None


class UntrustedSegmentError(SegmentError, PermissionError):
    """The segment is owned by a user this process does not trust, or writable beyond the mode asked for.

    Attaching would hand its rate, its stop switch and (hierarchical mode) its
    upstream to whoever can write it.  Trust another owner with
    ``trusted_uids=``; accept wider write bits by asking for that ``mode``.
    """

    def __init__(self, name: str, owner: int, mode: int, reason: str) -> None:
        super().__init__(
            f"refusing limiter {name!r}: owned by uid {owner}, mode {mode:#o}: {reason}"
        )
        self.name = name
        self.owner = owner
        self.mode = mode


class RateLimited(ShmlimitError):
    """Raised by ``throttle(..., on_limit="raise")`` (and by ``"wait"`` past its ``max_wait``).

    ``retry_after`` is the number of seconds after which the call could be
    granted at the current rate (None when the limiter cannot tell).
    """

    def __init__(self, name: str, retry_after: "float | None") -> None:
        when = "unknown" if retry_after is None else f"{retry_after:.6g} s"
        super().__init__(f"rate limit {name!r} reached; retry after {when}")
        self.name = name
        self.retry_after = retry_after


class RedisUnavailableError(ShmlimitError, ConnectionError):
    """Redis could not be reached in time: a connection error or a timeout (the cause is chained).

    Only this is "unavailable": the hierarchical mode's ``on_redis_error``
    fallback applies to it and to nothing else.
    """


class RedisDataError(ShmlimitError, RuntimeError):
    """Redis answered, with an error: the limiter's key holds something else (``WRONGTYPE``), the
    script failed, or the server refused the credentials or the command (the cause is chained).

    Never a reason to let calls through: a direct ``RedisLimiter`` raises it
    and a hierarchical limiter fails closed (state ``"error"``) until Redis
    answers correctly again, whatever its ``on_redis_error``.
    """


class KeyTableFullError(ShmlimitError):
    """A new key found no slot: every slot it may use holds a key that is still limited.

    Raised by an untimed ``KeyedLimiter.acquire``; ``try_acquire`` and timed
    calls return False instead.  Limited keys are never evicted, so the cure
    is a larger table (``keys=``) or a faster rate (keys free up sooner).

    ``busy`` (a table of window counters only): the key's slot is held by
    another live process's insert of the same key that has not moved for
    0.2 s -- a process stopped mid-insert, or a segment written by hand.
    """

    def __init__(self, name: str, slots: int, busy: bool = False) -> None:
        if busy:
            msg = (
                f"keyed limiter {name!r}: no slot for this key now: another live process has been inserting "
                f"it for over 0.2 s (a stopped process, or a segment written by hand); nothing was counted"
            )
        else:
            msg = (
                f"keyed limiter {name!r}: no free slot for a new key (the table of {slots} slots is full of keys "
                f"that are still limited near this key's home slot); create it with more keys= or wait"
            )
        super().__init__(msg)
        self.name = name
        self.slots = slots
        self.busy = busy


class SharedMemoryFullError(ShmlimitError, OSError):
    """The segment does not fit in the free space of /dev/shm."""


class QueueFullError(ShmlimitError):
    """Joining the queue would put more than ``MAX_QUEUE_TOKENS`` of schedule ahead of the head.

    The bound keeps every signed comparison of the rovers valid: a queue
    deeper than 2**63 tokens would flip them and grant everything.  Nothing
    was taken; retry once the queue has drained.
    """

    def __init__(self, tokens: int, tpn: int) -> None:
        from shmlimit.config import MAX_QUEUE_TOKENS, NS_PER_S

        super().__init__(
            f"the queue is full: this request ({tokens / tpn / NS_PER_S:.6g} s of schedule) would put more than "
            f"{MAX_QUEUE_TOKENS / tpn / NS_PER_S:.6g} s of schedule (2**62 tokens) ahead of the limiter; nothing was taken"
        )
        self.tokens = tokens


class ConfigWriterTakenOver(ShmlimitError, RuntimeError):
    """A config change stalled past the lock's timeout and was taken over: it was not published."""


class AbandonedSegmentError(SegmentError):
    """A segment whose creator died (or vanished) before finishing its initialisation.

    Attaching refuses it; creating the limiter again replaces it.  ``inode``
    says which segment was judged, so a replacement never unlinks a newer one.
    """

    def __init__(self, name: str, inode: int, creator: int, kind: str = "limiter") -> None:
        who = f"its creator (pid {creator}) died" if creator else "no creator ever wrote its header"
        super().__init__(
            f"segment {name!r} was never initialised: {who}; creating the {kind} again replaces it, "
            f"or remove it with shmlimit.unlink({name!r})"
        )
        self.inode = inode


class UnsupportedError(ShmlimitError, NotImplementedError, ValueError):
    """A verb of the common interface (``shmlimit.RateLimit``) that this kind cannot keep.

    The message names the kind, the verb and why; nothing was taken or
    changed.  A ``NotImplementedError`` (the kind does not implement the verb),
    and a ``ValueError`` as ``io.UnsupportedOperation`` is, so that code
    written for the ``ValueError`` such a call raised before keeps working.
    """

    def __init__(self, kind: str, verb: str, why: str) -> None:
        super().__init__(f"{kind}.{verb} is not supported: {why}")
        self.kind = kind
        self.verb = verb


class MissingExtraError(ImportError):
    """An optional dependency is not installed: the message names the extra that installs it,
    ``pip install 'shmlimit[<extra>]'``."""

    __reduce__ = ShmlimitError.__reduce__

    def __init__(self, module: str, extra: str, cause: ImportError) -> None:
        missing = (cause.name or extra).split(".")[0]  # the package to install, not a module of it
        super().__init__(
            f"{module} needs {missing!r}, which is not installed ({cause}); "
            f"install the {extra} extra: pip install 'shmlimit[{extra}]'",
            name=missing,
        )
        self.extra = extra
