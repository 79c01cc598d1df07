"""Issue 26's measure: every new elementwise optimizer's ``step_`` against ``adamw``'s bandwidth.

For each optimizer, ``explain(tx, params, apply=True)`` gives the bytes per parameter its
``step_`` moves and the arithmetic minimum; the step is timed alternated with ``adamw(1e-3,
weight_decay=1e-2)`` (A, B, A, B, ...), and the row reports its bandwidth (bytes moved / median
time) as a fraction of adamw's measured in the same rounds. GPT-2-small shapes, float32
(``--scale`` keeps a fraction of every leaf's rows).

    PYTHONPATH=.:benchmarks python benchmarks/optimizers_bandwidth.py [--scale 0.5] [--repeats 9] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import platform

import numpy as np
from vs_torch import _ours_step, _shrink, _time

import numbaccum as nba
from numbaccum.bench import workloads

OPTIMIZERS = {
    "adamaxw": lambda: nba.adamaxw(1e-3, weight_decay=1e-2),
    "radam": lambda: nba.radam(1e-3),
    "adan": lambda: nba.adan(1e-3, weight_decay=1e-2),
    "signum": lambda: nba.signum(1e-3),
    "rprop": lambda: nba.rprop(1e-3),
    "adadelta": lambda: nba.adadelta(1.0, weight_decay=1e-2),
    "optimistic_gradient_descent": lambda: nba.optimistic_gradient_descent(1e-3),
    "optimistic_adam_v2": lambda: nba.optimistic_adam_v2(1e-3),
    "adopt": lambda: nba.adopt(1e-3),
    "ademamix": lambda: nba.ademamix(1e-3, weight_decay=1e-2),
    "noisy_sgd": lambda: nba.noisy_sgd(1e-3, key=0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--only", nargs="+", choices=sorted(OPTIMIZERS), help="these optimizers (default: all)")
    args = ap.parse_args()
    shapes = _shrink(workloads.gpt2_small_shapes(), args.scale)
    rng = np.random.default_rng(0)
    params = workloads.map_shapes(lambda s: rng.standard_normal(s).astype(np.float32) * 0.02, shapes)
    grads = nba.FlatTree.from_tree(
        workloads.map_shapes(lambda s: rng.standard_normal(s).astype(np.float32), shapes)
    )
    n = grads.layout.size
    base = nba.adamw(1e-3, weight_decay=1e-2)
    base_bytes = nba.explain(base, params, apply=True).total
    machine = platform.processor() or platform.machine()
    print(f"{machine}, {n / 1e6:.1f}M float32 parameters, {args.repeats} rounds")
    print("| optimizer | B/param (minimum) | median ms | adamw ms (same rounds) | bandwidth / adamw's |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.only or OPTIMIZERS:
        tx = OPTIMIZERS[name]()
        e = nba.explain(tx, params, apply=True)
        rows = _time(
            [(name, _ours_step(tx, params, grads)), ("adamw", _ours_step(base, params, grads))], args.repeats
        )
        (_, t, _, _), (_, tb, _, _) = rows
        ratio = (e.total / t) / (base_bytes / tb)
        print(f"| {name} | {e.total:.0f} ({e.minimum:.0f}) | {1e3 * t:.1f} | {1e3 * tb:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
