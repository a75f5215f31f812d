#!/usr/bin/env python3
"""The atomics backend's composites over raw words against the same composites over its checked
primitives.

    python tools/weigh_composites.py [ROUNDS]     # 3 rounds by default, about a minute each

tools/bench.py's per-call figures on the atomics backend (section 1's acquire, 1b's tries and
refusals, 11's two rates), each round in fresh processes, one per way the composites of
shm/composites.py reach the words (``AtomicsCells._raw``, switched in that process only):

* raw: as shipped: plain reads, the package's CAS and add called directly, one pass of the close
  guard per composite;
* checked: the backend's checked primitives (``checked_raw``: each read, CAS and add checks its
  offset and passes the close guard): the plain CAS loops, with no raw access.

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
    """Switch this process's ``AtomicsCells`` to the composites over checked primitives."""
    from shmlimit.shm import atomics_cells as A
    from shmlimit.shm.composites import checked_raw

    if kind == "checked":
        A.AtomicsCells._raw = lambda self: checked_raw(self, self._enter, self._exit)


class Q:
    def put(self, v) -> None:
        self.v = v


def child(kind: str, q) -> None:
    patch(kind)
    qa, qb, qc = Q(), Q(), Q()  # bench's workers report through a queue: these keep the value
    bench._single_cost("atomics", 6000, qa)
    bench._try_costs("atomics", 2000, qb)
    bench._rates_costs("atomics", 2000, qc)
    q.put(dict(single=qa.v, **qb.v, **qc.v))


KINDS = ("raw", "checked")


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
