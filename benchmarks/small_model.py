"""Per-call cost of one optimizer step on a small model (issue 23's table), alternated.

A model with 4 float32 leaves and 4,712 parameters (an MLP 32-64-40), one
``chain(clip_by_global_norm(1.0), adamw(1e-3))`` step:

* ``step_`` with FlatTree gradients and params, and with plain dicts;
* ``update`` then ``apply_updates_`` on plain dicts; ``apply_updates_`` alone; a NumPy ``+=``
  loop over the dict (the floor of the last);
* optax, ``jax.jit(update + apply_updates)`` (when JAX and optax are installed);
* two variants with ``step_`` on FlatTrees: AdamW with a mask (no decay on the biases), and the
  chain in ``MultiSteps(..., 4)`` (the mean cost of a call over its cycle).

Usage: python benchmarks/small_model.py [ROOT ...] [--rounds 6]

Each round starts one process per checkout ROOT (default: this one) and one for optax, in turn
(A, B, ..., A, B, ...: this machine's speed moves within minutes, so contenders are never
timed in blocks). A process warms up, then times batches of 200 calls and reports the fastest
batch (the least disturbed by other work on the machine) in microseconds per call. The report is
the median over rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

SETUP = r"""
import json, time, numpy as np
rng = np.random.default_rng(0)
shapes = {"w1": (32, 64), "b1": (64,), "w2": (64, 40), "b2": (40,)}
P = {k: rng.standard_normal(s).astype(np.float32) * 0.1 for k, s in shapes.items()}
G = {k: (rng.standard_normal(s) * 0.01).astype(np.float32) for k, s in shapes.items()}


def best(f, batches=15, n=200):
    for _ in range(n):
        f()
    out = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(n):
            f()
        out.append((time.perf_counter() - t) / n * 1e6)
    return min(out)
"""

NUMBACCUM = (
    SETUP
    + r"""
import numbaccum as nba
tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-3))
res = {}
p = {k: v.copy() for k, v in P.items()}
s = [tx.init(p)]
def step_dict():
    s[0] = nba.step_(tx, G, s[0], p)
res["step_ (dict)"] = best(step_dict)
fp, fg = nba.FlatTree.from_tree(P), nba.FlatTree.from_tree(G)
sf = [tx.init(fp)]
def step_flat():
    sf[0] = nba.step_(tx, fg, sf[0], fp)
res["step_ (FlatTree)"] = best(step_flat)
su = [tx.init(p)]
def update_apply():
    u, su[0] = tx.update(G, su[0], p)
    nba.apply_updates_(p, u)
res["update + apply_updates_ (dict)"] = best(update_apply)
zero = {k: np.zeros_like(v) for k, v in P.items()}
res["apply_updates_ alone (dict)"] = best(lambda: nba.apply_updates_(p, zero))
def numpy_loop():
    for k in p:
        p[k] += zero[k]
res["NumPy += loop (dict)"] = best(numpy_loop)
# Two common variants, step_ on FlatTrees: no weight decay on the biases, and accumulation.
mask = {"w1": True, "b1": False, "w2": True, "b2": False}
variants = {
    "masked adamw, step_ (FlatTree)": nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-3, mask=mask)),
    "MultiSteps(.., 4), step_ (FlatTree)": nba.MultiSteps(tx, 4).gradient_transformation(),
}
for name, vtx in variants.items():
    sv = [vtx.init(fp)]
    def step_variant():
        sv[0] = nba.step_(vtx, fg, sv[0], fp)
    res[name] = best(step_variant)
print(json.dumps(res))
"""
)

OPTAX = (
    SETUP
    + r"""
import jax, optax
jax.config.update("jax_platforms", "cpu")
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
params = jax.tree_util.tree_map(jax.numpy.asarray, P)
grads = jax.tree_util.tree_map(jax.numpy.asarray, G)

@jax.jit
def step(params, state, grads):
    u, state = tx.update(grads, state, params)
    return optax.apply_updates(params, u), state

st = [params, tx.init(params)]
def run():
    st[0], st[1] = step(st[0], st[1], grads)
    jax.block_until_ready(st[0])
print(json.dumps({"optax jit(update + apply_updates)": best(run)}))
"""
)


def child(code: str, root: str | None) -> dict:
    """Runs ``code`` in a new process importing numbaccum from ``root``: started in ``root``
    (``python -c`` puts the working directory before ``PYTHONPATH``), checked by the child."""
    env = dict(os.environ)
    cwd = tempfile.gettempdir()
    if root is not None:
        env["PYTHONPATH"] = cwd = root
        code = (
            f"import numbaccum; assert numbaccum.__file__.startswith({root!r}), numbaccum.__file__\n" + code
        )
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr[-2000:], file=sys.stderr)
        return {}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    args = sys.argv[1:]
    rounds = 6
    if "--rounds" in args:
        i = args.index("--rounds")
        rounds = int(args[i + 1])
        del args[i : i + 2]
    roots = [os.path.abspath(r) for r in args] or [
        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ]
    got: dict[str, dict[str, list]] = {}
    for _ in range(rounds):
        for root in roots:
            for k, v in child(NUMBACCUM, root).items():
                got.setdefault(root, {}).setdefault(k, []).append(v)
        for k, v in child(OPTAX, None).items():
            got.setdefault("optax", {}).setdefault(k, []).append(v)
    names = [r if r == "optax" else os.path.basename(r.rstrip("/")) for r in got]
    print(f"{'case':38}" + "".join(f"{n[:14]:>16}" for n in names))
    cases = [k for r in got for k in got[r]]
    for case in dict.fromkeys(cases):
        row = [f"{statistics.median(got[r][case]):14.1f}us" if case in got[r] else f"{'':16}" for r in got]
        print(f"{case:38}" + "".join(row))


if __name__ == "__main__":
    main()
