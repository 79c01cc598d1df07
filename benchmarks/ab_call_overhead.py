"""Per-call host overhead of `update` and `step_` on a tiny tree, two checkouts alternated.

Usage: python benchmarks/ab_call_overhead.py OLD_ROOT NEW_ROOT [--rounds 8]

Each round starts one process per checkout (A, B, A, B, ...: this machine's speed moves within
minutes, so the two are never timed in blocks); a process warms up, then times 2000 calls per
case and prints the median of 20 batches, in microseconds per call. The report is the median
over rounds of each case, and the ratio new/old.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, time, numpy as np, numbaccum as nba
p = {"w": np.ones((32, 32), np.float32), "b": np.ones(32, np.float32)}
g = {k: np.full_like(v, 0.01) for k, v in p.items()}
cases = {
    "trace update": (nba.trace(0.9), False),
    "adam update": (nba.adam(1e-3), False),
    "chain(clip, adamw) update": (nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-3)), False),
    "chain(clip, adamw) step_": (nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-3)), True),
}
out = {}
for name, (tx, step) in cases.items():
    s = tx.init(p)
    for _ in range(50):
        if step:
            s = nba.step_(tx, g, s, p)
        else:
            _, s = tx.update(g, s, p)
    batches = []
    for _ in range(20):
        t = time.perf_counter()
        for _ in range(100):
            if step:
                s = nba.step_(tx, g, s, p)
            else:
                _, s = tx.update(g, s, p)
        batches.append((time.perf_counter() - t) / 100 * 1e6)
    out[name] = sorted(batches)[len(batches) // 2]
print(json.dumps(out))
"""


def run(root: str) -> dict:
    env = dict(os.environ, PYTHONPATH=root)
    res = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    old, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 8
    got: dict[str, dict[str, list]] = {"old": {}, "new": {}}
    for _ in range(rounds):
        for label, root in (("old", old), ("new", new)):
            for k, v in run(root).items():
                got[label].setdefault(k, []).append(v)
    print(f"{'case':32} {'old us':>8} {'new us':>8} {'new-old':>8}")
    for k in got["old"]:
        a, b = statistics.median(got["old"][k]), statistics.median(got["new"][k])
        print(f"{k:32} {a:8.2f} {b:8.2f} {b - a:+8.2f}")


if __name__ == "__main__":
    main()
