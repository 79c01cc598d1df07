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


def run(root: str, child: str = CHILD) -> dict:
    """The JSON a ``child`` process prints, run with ``root``'s numbaccum: in ``root`` itself, as
    ``python -c`` puts the working directory before PYTHONPATH on sys.path (a child started inside
    another checkout would import that one)."""
    env = dict(os.environ, PYTHONPATH=root)
    code = child + "\nimport numbaccum as _nba, os as _os; print(_os.path.realpath(_nba.__file__))\n"
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    *_, line, where = res.stdout.strip().splitlines()
    if not where.startswith(os.path.realpath(root) + os.sep):
        raise RuntimeError(f"the child for {root} imported {where}")
    return json.loads(line)


def compare(old: str, new: str, rounds: int, child: str = CHILD) -> None:
    """Runs ``child`` in one process per checkout per round, alternated, and prints a table of
    the median over rounds of each case."""
    got: dict[str, dict[str, list]] = {"old": {}, "new": {}}
    for _ in range(rounds):
        for label, root in (("old", old), ("new", new)):
            for k, v in run(root, child).items():
                got[label].setdefault(k, []).append(v)
    print(f"| {'case':32} | {'old us':>8} | {'new us':>8} | {'new-old':>8} | {'new/old':>7} |")
    print(f"| {'-' * 32} | {'-' * 8} | {'-' * 8} | {'-' * 8} | {'-' * 7} |")
    for k in got["old"]:
        a, b = statistics.median(got["old"][k]), statistics.median(got["new"][k])
        print(f"| {k:32} | {a:8.2f} | {b:8.2f} | {b - a:+8.2f} | {b / a:7.2f} |")


def main() -> None:
    old, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 8
    compare(old, new, rounds)


if __name__ == "__main__":
    main()
