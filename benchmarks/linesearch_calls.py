"""Python calls into the package per steady step_/update of L-BFGS and the line searches.

`python_calls.py`'s measure for the transformations the registry cannot drive (every update
needs ``value``, ``grad`` and ``value_fn``): the same tree, a quadratic objective whose value
and gradient come from ``value_fn``. Run from the repository root.

Usage: python benchmarks/linesearch_calls.py [NAME ...]   (DETAIL=N: the N most called functions)
"""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import python_calls as pc  # noqa: E402

import numbaccum as nba  # noqa: E402

def f(p):
    v = sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in p.values())
    return v, {k: (2 * x).astype(x.dtype) for k, x in p.items()}

def fv(p):
    return f(p)[0]

CASES = {
    "lbfgs": lambda: nba.lbfgs(),
    "scale_by_lbfgs": lambda: nba.scale_by_lbfgs(memory_size=3),
    "zoom": lambda: nba.chain(nba.sgd(0.1), nba.scale_by_zoom_linesearch(10)),
    "backtracking": lambda: nba.chain(nba.sgd(0.1), nba.scale_by_backtracking_linesearch(10)),
    "backtracking_store": lambda: nba.chain(nba.sgd(0.1), nba.scale_by_backtracking_linesearch(10, store_grad=True)),
}

def measure(name, detail=0):
    tx = CASES[name]()
    needs = name != "scale_by_lbfgs"
    fn = fv if name == "backtracking" else f
    out = {}
    for mode in ("step_", "update"):
        params = pc._tree(1 if mode == "step_" else 2)
        st = [tx.init(params)]
        def one():
            v, g = f(params)
            extra = dict(value=v, grad=g, value_fn=fn) if needs else {}
            if mode == "step_":
                st[0] = nba.step_(tx, g, st[0], params, **extra)
            else:
                u, st[0] = tx.update(g, st[0], params, **extra)
                nba.apply_updates_(params, u)
        for _ in range(4):
            one()
        cnt = collections.Counter()
        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(pc.PACKAGE):
                cnt[(os.path.basename(frame.f_code.co_filename), frame.f_code.co_name)] += 1
        v, g = f(params)
        extra = dict(value=v, grad=g, value_fn=fn) if needs else {}
        def go():
            if mode == "step_":
                st[0] = nba.step_(tx, g, st[0], params, **extra)
            else:
                u, st[0] = tx.update(g, st[0], params, **extra)
        sys.setprofile(profile)
        go()
        sys.setprofile(None)
        out[mode] = sum(cnt.values())
        if detail and mode == "step_":
            for k, n in cnt.most_common(detail):
                print("   ", n, k)
    return out

if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES)
    detail = int(os.environ.get("DETAIL", "0"))
    for n in names:
        print(f"{n:24}", measure(n, detail))
