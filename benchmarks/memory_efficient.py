"""Issue 26: the memory-efficient optimizers (Adafactor, SM3) against AdamW and optax, on
GPT-2-small shapes in float32.

For each optimizer: the optimizer state's bytes per parameter (every array of the state), and
``step_`` (the update added to the params) timed alternated with ``adamw(1e-3,
weight_decay=1e-2)``'s (A, B, A, B, ...); with JAX installed, also optax's own optimizer under
``jax.jit`` (its update and ``apply_updates`` in one jitted function, params donated), alternated
in the same rounds. ``--scale`` keeps a fraction of every leaf's rows.

    PYTHONPATH=.:benchmarks python benchmarks/memory_efficient.py [--scale 0.5] [--repeats 9] [--only sm3]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
from vs_torch import _ours_step, _shrink, _time

import numbaccum as nba
from numbaccum.bench import workloads

OPTIMIZERS = {
    "adafactor": (lambda m: m.adafactor(1e-3)),
    "adafactor (momentum 0.9)": (lambda m: m.adafactor(1e-3, momentum=0.9)),
    "sm3": (lambda m: m.sm3(1e-3)),
    "adamw": (lambda m: m.adamw(1e-3, weight_decay=1e-2)),
}


def _state_bytes(state) -> int:
    """Bytes of every array in a state (FlatTrees' buffers, NumPy arrays), each counted once."""
    seen: dict[int, int] = {}

    def walk(x) -> None:
        if isinstance(x, nba.FlatTree):
            for g in x.groups:
                seen[id(g)] = g.nbytes
        elif isinstance(x, np.ndarray):
            seen[id(x)] = x.nbytes
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)

    walk(state)
    return sum(seen.values())


def _optax_step(make, params, grads):
    """optax's update + apply_updates under one jax.jit (params and state donated)."""
    import jax
    import optax

    tx = make(optax)
    p = jax.tree.map(jax.numpy.asarray, params)
    g = jax.tree.map(jax.numpy.asarray, grads)
    box = [p, tx.init(p)]

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    def call() -> None:
        box[0], box[1] = step(box[0], box[1], g)
        jax.block_until_ready(box[0])

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--only", nargs="+", choices=list(OPTIMIZERS), help="these optimizers only")
    args = ap.parse_args()
    shapes = _shrink(workloads.gpt2_small_shapes(), args.scale)
    params = workloads.make_tree(shapes, np.float32, seed=0)
    grad_tree = workloads.make_tree(shapes, np.float32, seed=1, scale=1e-2)
    grads = nba.FlatTree.from_tree(grad_tree)
    n = grads.layout.size
    try:
        import jax  # noqa: F401

        have_jax = True
    except ImportError:
        have_jax = False
    print(f"# memory-efficient optimizers, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{platform.processor() or platform.machine()}, {n / 1e6:.1f}M float32 params, {args.repeats} rounds")
    print("| optimizer | state B/param | step_ median ms | adamw ms (same rounds) | optax jit ms (same rounds) |")
    print("| --- | --- | --- | --- | --- |")
    base = OPTIMIZERS["adamw"](nba)
    for name, make in OPTIMIZERS.items():
        if args.only and name not in args.only:
            continue
        tx = make(nba)
        state_bytes = _state_bytes(tx.init(params))
        contenders = [(name, _ours_step(tx, params, grads)), ("adamw", _ours_step(base, params, grads))]
        if have_jax:
            contenders.append(("optax", _optax_step(make, params, grad_tree)))
        rows = {label: med for label, med, _, _ in _time(contenders, args.repeats)}
        theirs = f"{rows['optax'] * 1e3:.1f}" if have_jax else "-"
        print(
            f"| {name} | {state_bytes / n:.3f} | {rows[name] * 1e3:.1f} | {rows['adamw'] * 1e3:.1f} | {theirs} |"
        )


if __name__ == "__main__":
    main()
