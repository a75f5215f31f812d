"""Keyed inserters stopped at a chosen write: the hooks the slot protocol's tests kill them at."""

from shmlimit.keyed import layout as K


class Stopped(Exception):
    pass


class StopsAt:
    """The cells as an inserter sees them that stops for good before its ``left``-th write (a CAS, an
    add or a store), or (``left`` None) at its first write after it made its slot PEND: it dies
    there, or (under an owner that counts as alive) stalls there forever."""

    def __init__(self, c, left):
        self.c, self.left, self.size, self.pending = c, left, c.size, False

    def load(self, off):
        return self.c.load(off)

    def load_many(self, offsets):
        return self.c.load_many(offsets)  # reads only: never where an inserter stops

    def _write(self):
        if self.left == 0 or (self.left is None and self.pending):
            raise Stopped
        if self.left is not None:
            self.left -= 1

    def store(self, off, value):
        self._write()
        self.c.store(off, value)

    def cas(self, off, expected, desired):
        self._write()
        done = self.c.cas(off, expected, desired)
        self.pending = self.pending or (
            done and desired & 0xFF == K.PEND and expected & 0xFF == K.BUSY
        )
        return done

    def fetch_add(self, off, delta):
        self._write()
        return self.c.fetch_add(off, delta)


class StopsAfterValue(StopsAt):
    """An inserter into the key slots at ``slots`` that stops at its first write after it stored a
    slot's value word ``V0``: its first grant's value is in place, its slot still BUSY."""

    def __init__(self, c, slots):
        super().__init__(c, -1)  # never by count
        self.slots, self.stored = slots, False

    def _write(self):
        if self.stored:
            raise Stopped

    def store(self, off, value):
        super().store(off, value)
        self.stored = self.stored or (off - self.slots) % K.LINE == K.S_V0
