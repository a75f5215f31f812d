#!/usr/bin/env python3
"""The atomics backend's hand-built composites against the reference ones of shm/composites.py.

    python tools/weigh_composites.py [ROUNDS]     # 3 rounds by default, about a minute each

tools/bench.py's per-call figures on the atomics backend (section 1's acquire, 1b's tries and
refusals, 11's two rates), each round in three fresh processes, one per way of building the
composites (``AtomicsCells.grabber`` and ``gate``, switched in that process only):

* hand-built: as shipped (``_AtomicsGrabber``, ``_AtomicsGate``);
* reference: composites.py's, over ``AtomicsCells``' checked primitives (the branch the backend
  takes where it has no direct primitives);
* ref-raw: composites.py's over raw words (plain loads, the package's CAS), one pass of the close
  guard per composite: the smallest adapter that keeps them safe against ``close``.

Prints one JSON object per process (ns per call), then the best of the rounds.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def patch(kind: str) -> None:
    """Switch this process's ``AtomicsCells`` to the reference composites (``kind``)."""
    from shmlimit.shm import atomics_cells as A
    from shmlimit.shm.composites import CompositesFromPrimitives as R
    from shmlimit.shm.composites import Gate

    if kind == "reference":

        def grabber(self, seq, expected, tail, head, amount, grants, ops, recs=None):
            g = R.grabber(self, seq, expected, tail, head, amount, grants, ops, recs)
            return g if recs is None else self._recorded(g, False)

        def gate(self, *a, **k):
            g = R.gate(self, *a, **k)
            if g.recs is not None:
                g.grab_within = self._recorded(g.grab_within, None)
            return g
    else:

        class Raw(R):
            def __init__(self, c):
                self.size, self.w, self.p, self.base = c.size, c._words, c._p, c._base

            def load(self, off):
                return self.w[off >> 3]

            def store(self, off, v):
                self.p.store(self.base + off, v)

            def fetch_add(self, off, d):
                return self.p.fetch_add(self.base + off, d)

            def cas(self, off, e, d):
                return self.p.cas(self.base + off, e, d) == e

        def raw(c):
            r = c.__dict__.get("_rawc")
            if r is None:
                r = c._rawc = Raw(c)
            return r

        def grabber(self, seq, expected, tail, head, amount, grants, ops, recs=None):
            g = R.grabber(raw(self), seq, expected, tail, head, amount, grants, ops, recs)
            rec = recs is not None
            enter, exit_ = self._enter, self._exit

            def call():
                if not enter(rec):
                    return False
                try:
                    return g()
                finally:
                    exit_(rec)

            return call

        class RawGate(Gate):
            def __init__(self, c, *a, recs=None, fence_hint=None):
                super().__init__(raw(c), *a, recs=recs, fence_hint=fence_hint)
                self.c = c

            def try_grab(self):
                self.c._enter()
                try:
                    return Gate.try_grab(self)
                finally:
                    self.c._exit()

            def grab_within(self, t):
                rec = self.recs is not None
                if not self.c._enter(rec):
                    return None
                try:
                    return Gate.grab_within(self, t)
                finally:
                    self.c._exit(rec)

            def enter(self):
                self.c._enter()

            def exit(self):
                self.c._exit()

        def gate(
            self,
            seq,
            expected,
            tail,
            head,
            ceil,
            repl_ts,
            grants,
            amount,
            ops,
            tpn,
            pend_mul,
            capped,
            max_reserved_ns,
            recs=None,
            fence_hint=None,
        ):
            self._check(seq, tail, head, ceil, repl_ts, grants)
            return RawGate(
                self,
                seq,
                expected,
                tail,
                head,
                ceil,
                repl_ts,
                grants,
                amount,
                ops,
                tpn,
                pend_mul,
                capped,
                max_reserved_ns,
                recs=recs,
                fence_hint=fence_hint,
            )

    A.AtomicsCells.grabber = grabber
    A.AtomicsCells.gate = gate


class Q:
    def put(self, v) -> None:
        self.v = v


def child(kind: str, q) -> None:
    if kind != "hand-built":
        patch(kind)
    qa, qb, qc = Q(), Q(), Q()  # bench's workers report through a queue: these keep the value
    bench._single_cost("atomics", 6000, qa)
    bench._try_costs("atomics", 2000, qb)
    bench._rates_costs("atomics", 2000, qc)
    q.put(dict(single=qa.v, **qb.v, **qc.v))


KINDS = ("hand-built", "reference", "ref-raw")


def main() -> int:
    ctx = mp.get_context("spawn")
    rows = []
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        for kind in KINDS:
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(kind, q))
            p.start()
            v = q.get(timeout=300)
            p.join()
            v["kind"], v["round"], v["load"] = kind, r, os.getloadavg()[0]
            rows.append(v)
            print(json.dumps(v), flush=True)
    print(f"\nbest of {r + 1} rounds, us per call (atomics backend)")
    print(f"{'':36}" + "".join(f"{k:>12}" for k in KINDS))
    for key in rows[0]:
        if isinstance(rows[0][key], float) and "atomic ops" not in key and key != "load":
            best = [min(v[key] for v in rows if v["kind"] == k) / 1000 for k in KINDS]
            print(f"{key:36}" + "".join(f"{b:12.2f}" for b in best))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
