"""Python calls into the package per steady step, for every registered transformation.

Issue 43's measure of the per-call planning cost: a ``sys.setprofile`` counter counts the Python
functions of ``numbaccum/`` entered during one ``step_`` and one ``update`` after warm-up steps
(C functions and NumPy's own Python code are not counted). Every Case of ``tests/registry.py``
runs on a small tree (3 leaves: two float32, one float64; per-example cases get a batch of 2).

Usage: python benchmarks/python_calls.py [--top N] [--json PATH] [CASE ...]

Prints one row per case (the named ones, else all), highest ``step_`` count first (``--top``:
only the N highest). The ``update`` is counted as a user's loop makes it: holding the updates
the call before returned.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import numbaccum as nba  # noqa: E402
from _testutil import package_calls  # noqa: E402
from registry import CASES  # noqa: E402

PACKAGE = os.path.dirname(os.path.abspath(nba.__file__)) + os.sep


def _tree(seed: int, per_example: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    t = {
        "w": rng.standard_normal((8, 16)).astype(np.float32),
        "b": rng.standard_normal(16).astype(np.float32),
        "d": rng.standard_normal(4),
    }
    if per_example:
        t = {k: np.stack([v, 0.5 * v]) for k, v in t.items()}
    return t


def count_calls(fn) -> int:
    """The package's Python functions entered while ``fn()`` runs (the tests' counter)."""
    return package_calls(fn)


# Transformations the registry's Cases cannot drive here (`registry.OWN_TESTS`), measured the
# same way with the params they take: lookahead's are a `LookaheadParams(fast, slow)` pair.
OWN = {
    "lookahead_adam": lambda: nba.lookahead(nba.adam(1e-2), 3, 0.5),
    "lookahead_sgd_momentum": lambda: nba.lookahead(nba.sgd(0.1, momentum=0.9), 3, 0.5),
}
# DP accumulation (MultiSteps over dpsgd), fed per-example gradients: with k = 2 the counted
# step (the fifth) is a mini-step that only adds to the sums; with k = 1 every step emits.
OWN_PER_EXAMPLE = {
    "multisteps_dpsgd": lambda: nba.MultiSteps(nba.dpsgd(0.1, 1.0, 0.5, seed=0, momentum=0.9), 2),
    "multisteps_dpsgd_k1": lambda: nba.MultiSteps(nba.dpsgd(0.1, 1.0, 0.5, seed=0, momentum=0.9), 1),
}


def measure(name: str, warm: int = 4) -> dict:
    """Calls per steady ``step_`` and per steady ``update`` of Case ``name`` (or of `OWN`'s,
    `OWN_PER_EXAMPLE`'s)."""
    if name in OWN:
        tx, batch = OWN[name](), False
        pair = nba.LookaheadParams.init_synced
    elif name in OWN_PER_EXAMPLE:
        tx, batch = OWN_PER_EXAMPLE[name](), True
        pair = lambda p: p  # noqa: E731
    else:
        case = CASES[name]
        tx, batch = case.make(), case.per_example
        pair = lambda p: p  # noqa: E731
    out = {}
    params = pair(_tree(1))
    state = [tx.init(params)]
    for k in range(warm):
        state[0] = nba.step_(tx, _tree(10 + k, batch), state[0], params)
    g = _tree(99, batch)

    def step():
        state[0] = nba.step_(tx, g, state[0], params)

    out["step_"] = count_calls(step)
    params2 = pair(_tree(2))
    s2 = [tx.init(params2)]
    # A user's loop holds the last updates while it asks for the next (``u, state =
    # tx.update(...)`` rebinds ``u`` after the call): the call writes elsewhere than what is held.
    held = [None]
    for k in range(warm):
        held[0], s2[0] = tx.update(_tree(20 + k, batch), s2[0], params2)

    def update():
        held[0], s2[0] = tx.update(g, s2[0], params2)

    out["update"] = count_calls(update)
    return out


def main() -> None:
    args = sys.argv[1:]
    top = None
    dest = None
    if "--top" in args:
        i = args.index("--top")
        top = int(args[i + 1])
        del args[i : i + 2]
    if "--json" in args:
        i = args.index("--json")
        dest = args[i + 1]
        del args[i : i + 2]
    rows = {}
    for name in sorted(args or [*CASES, *OWN, *OWN_PER_EXAMPLE]):
        try:
            rows[name] = measure(name)
        except Exception as e:  # a case this driver cannot run without extra arguments
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:120]}
    ok = {k: v for k, v in rows.items() if "error" not in v}
    order = sorted(ok, key=lambda k: (-ok[k]["step_"], k))
    if top is not None:
        order = order[:top]
    print(f"{'case':40}{'step_':>8}{'update':>8}")
    for k in order:
        print(f"{k:40}{ok[k]['step_']:8d}{ok[k]['update']:8d}")
    for k, v in rows.items():
        if "error" in v:
            print(f"{k:40}  not run: {v['error']}")
    over = [k for k in ok if max(ok[k].values()) > 70]
    print(f"\n{len(ok)} cases; {len(over)} over 70 calls in a steady step_ or update")
    if dest:
        with open(dest, "w") as f:
            json.dump(rows, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
