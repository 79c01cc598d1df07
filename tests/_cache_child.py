"""One process of the kernel cache's cross-process test (tests/test_cache_across_processes.py).

``python tests/_cache_child.py JOB [JOB ...]`` runs the named jobs in the order given, each
against plain NumPy (`reference` for the transformations, the formula's own Python function
element by element for the formulas), and prints one JSON line: the jobs whose results were
wrong, with what was seen, and how many cached kernels it compiled rather than loaded. The
kernel cache is whatever ``NUMBACCUM_CACHE_DIR`` says.

The jobs are every reduction kind of the CPU engine (`numbaccum.cpu.reduce.KINDS`, serial and,
for some, the parallel driver), every formula of `numbaccum.formulas` through the CPU driver,
and some fused composites: each kernel a process compiles may share a name with a kernel that
another process compiled and saved, so a later process that loads both must still tell them
apart.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
from numba.core import event
from numba.core.caching import NullCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference as ref  # noqa: E402

import numbaccum as nba  # noqa: E402
from numbaccum import formulas, tables  # noqa: E402
from numbaccum.contract import ONE, Factor  # noqa: E402
from numbaccum.cpu import driver  # noqa: E402
from numbaccum.cpu import reduce as engine  # noqa: E402

PARALLEL_KINDS = ("sumsq", "sumpow", "sumabs")  # the parallel drivers are slow to compile: a few
FORMULAS = formulas.registered()  # every formula numbaccum declares, in any module
BOOLS = {"nesterov", "fresh"}


def _close(got, want, rtol=1e-12) -> str | None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape == want.shape and np.allclose(got, want, rtol=rtol, atol=0.0, equal_nan=True):
        return None
    return f"got {got.ravel()[:4].tolist()} want {want.ravel()[:4].tolist()}"


# --- the reduction kinds ----------------------------------------------------------------------


def _kind_reference(kind: str, seg: np.ndarray, c: float, p: float) -> float:
    a = np.abs(seg)
    return {
        "sumsq": lambda: np.sum(seg * seg),
        "csumsq": lambda: np.sum((seg - c) ** 2),
        "ssumsq": lambda: np.sum((seg * c) ** 2),
        "qsumsq": lambda: np.sum(((seg / c) * p) ** 2),  # through a pending factor (c, p)
        "sumabs": lambda: np.sum(a),
        "sumpow": lambda: np.sum(a**p),
        "sum": lambda: np.sum(seg),
        "nnz": lambda: np.count_nonzero(seg),
        "nancount": lambda: np.count_nonzero(np.isnan(seg)),
        "nonfinite": lambda: np.count_nonzero(~np.isfinite(seg)),
        "maxabs": lambda: np.max(a, initial=0.0),
        "minabs": lambda: np.min(a, initial=np.inf),
    }[kind]()


def kind_job(kind: str, n: int):
    """Reduction ``kind`` per segment of a float64 buffer of ``n`` elements (past the serial
    threshold: the parallel driver)."""

    def run() -> str | None:
        rng = np.random.default_rng(len(kind) + n)
        x = rng.standard_normal(n)
        x[::7] = 0.0
        if kind in ("nancount", "nonfinite"):
            x[3], x[11] = np.nan, np.inf
        offsets = np.array([0, 5, 5, n // 3, n], np.int64)
        centers = np.array([0.5, 1.0, 0.25, 2.0])
        p = {"sumpow": 3.0, "qsumsq": 1.5}.get(kind, 0.0)
        c = centers if kind in ("csumsq", "ssumsq", "qsumsq") else None
        got = engine.reduce(kind, x, tables.segments(offsets), c, p)
        want = [
            _kind_reference(kind, x[a:b], centers[s], p)
            for s, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))
        ]
        return _close(got, want)

    return run


# --- the formulas -------------------------------------------------------------------------------


def formula_job(f: formulas.Formula):
    """Formula ``f`` through the CPU driver against its Python function, element by element."""

    def run() -> str | None:
        rng = np.random.default_rng(len(f.name))
        n = 37
        arrays = []
        for name in f.arrays:
            a = rng.standard_normal(n)
            second_moment = name in ("nu", "e_g", "e_x", "n", "exp_avg_sq")
            arrays.append(np.abs(a) if second_moment else a)
        scalars = [
            np.uint32(rng.integers(0, 2**32))  # a noise key's or counter's word (add_noise)
            if name in ("k0", "k1", "step", "group")
            else bool(k % 2)
            if name in BOOLS
            else float(rng.uniform(0.1, 1.0))
            for k, name in enumerate(f.scalars)
        ]
        factor = Factor(3.0, 0.5) if f.inputs else ONE
        want = [a.copy() for a in arrays]
        ns = len(f.states)
        with np.errstate(all="ignore"):
            for i in range(n):
                vals = [np.float64(a[i]) for a in arrays[: ns + len(f.inputs)]]
                if f.inputs:
                    vals[ns] = (vals[ns] / factor.div) * factor.mul
                kept = [s if isinstance(s, (bool, np.uint32)) else np.float64(s) for s in scalars]
                r = f.fn(*vals, *kept, *([i] if f.indexed else []))
                for k, w in enumerate(f.writes):
                    want[w][i] = r[k] if isinstance(r, tuple) else r
        driver.map_(f, factor, tuple(arrays), tuple(scalars))
        wrong = [_close(arrays[w], want[w], rtol=1e-13) for w in f.writes]
        return next((w for w in wrong if w), None)

    return run


# --- fused composites against tests/reference.py ----------------------------------------------------


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((4, 3)), "b": rng.standard_normal(7).astype(np.float32) * 3}


def _compare_trees(got, want) -> str | None:
    wrong = [_close(g, w, rtol=2e-6) for g, w in zip(ref.tree_leaves(got), ref.tree_leaves(want))]
    return next((w for w in wrong if w), None)


def transform_job(make_nba, make_ref, steps: int = 2):
    """``steps`` updates of a transformation against its reference."""

    def run() -> str | None:
        params = _tree(1)
        tx, rx = make_nba(), make_ref()
        s, rs = tx.init(params), rx.init(params)
        for k in range(steps):
            g = _tree(10 + k)
            u, s = tx.update(g, s, params)
            ru, rs = rx.update(g, rs, params)
            wrong = _compare_trees(u, ru)
            if wrong:
                return f"step {k}: {wrong}"
        return None

    return run


def global_norm_job(ord):
    def run() -> str | None:
        g = _tree(3)
        return _close(nba.global_norm(g, ord=ord), ref.global_norm(g, ord=ord))

    return run


def _stateless(fn):
    return lambda: ref.Transformation(lambda p: ref.EmptyState(), lambda u, s, p=None: (fn(u), s))


def _ref_clip_norm(max_norm, ord):
    return _stateless(lambda u: ref.scale_slices(u, ord=ord, max_norm=max_norm))


def _ref_clip_by_global_norm(max_norm):
    return _stateless(lambda u: ref.scale_slices(u, ord=2, dim="global", max_norm=max_norm))


def _composites() -> dict:
    jobs = {}
    for ord in (0.5, 1, 2, 3, math.inf):
        jobs[f"clip_norm ord={ord}"] = transform_job(
            lambda o=ord: nba.clip_norm(0.5, ord=o), lambda o=ord: _ref_clip_norm(0.5, o)()
        )
    for ord in (2, 1, math.inf):
        jobs[f"global_norm ord={ord}"] = global_norm_job(ord)
    jobs["chain(clip_by_global_norm, adamw)"] = transform_job(
        lambda: nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(0.1)),
        lambda: ref.chain(_ref_clip_by_global_norm(1.0)(), ref.adamw(0.1)),
    )
    jobs["chain(clip_norm(ord=3), ema, trace)"] = transform_job(
        lambda: nba.chain(nba.clip_norm(0.5, ord=3), nba.ema(0.9), nba.trace(0.5)),
        lambda: ref.chain(_ref_clip_norm(0.5, 3)(), ref.ema(0.9), ref.trace(0.5)),
    )
    return jobs


# --- complex buffers: the kernels of the complex helpers, beside the real ones of the same text --


def complex_kind_job(kind: str):
    """Reduction ``kind`` of a complex128 buffer against NumPy's of ``|z|``."""

    def run() -> str | None:
        rng = np.random.default_rng(len(kind))
        z = rng.standard_normal(40) + 1j * rng.standard_normal(40)
        z[::7] = 0.0
        if kind in ("nancount", "nonfinite"):
            z[3], z[11] = complex(1.0, np.nan), complex(np.inf, 0.0)
        offsets = np.array([0, 5, 5, 13, 40], np.int64)
        p = 3.0 if kind == "sumpow" else 0.0
        got = engine.reduce(kind, z, tables.segments(offsets), None, p)
        want = []
        for a, b in zip(offsets[:-1], offsets[1:]):
            seg = np.abs(z[a:b])
            want.append(_kind_reference(kind, seg, 0.0, p) if kind not in ("nancount", "nonfinite") else 0.0)
            if kind == "nancount":
                want[-1] = np.count_nonzero(np.isnan(z[a:b]))
            elif kind == "nonfinite":
                want[-1] = np.count_nonzero(~np.isfinite(z[a:b]))
        return _close(got, want)

    return run


def complex_adam_job(fused: bool):
    """Two steps of ``chain(clip_by_global_norm(1), adam(0.1))`` on complex128 leaves against
    NumPy: ``nu`` of ``|g|^2``, real bias corrections."""

    def run() -> str | None:
        import os

        os.environ["NUMBACCUM_FUSE"] = "1" if fused else "0"
        rng = np.random.default_rng(5)
        params = {"z": rng.standard_normal(30) + 1j * rng.standard_normal(30)}
        tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adam(0.1))
        state = tx.init(params)
        mu, nu = np.zeros(30, complex), np.zeros(30)
        try:
            for t in (1, 2):
                g = rng.standard_normal(30) * 3 + 1j * rng.standard_normal(30)
                u, state = tx.update({"z": g}, state, params)
                norm = np.sqrt(np.sum(np.abs(g) ** 2))
                g = g / norm if norm > 1.0 else g
                mu = 0.1 * g + 0.9 * mu
                nu = 0.001 * np.abs(g) ** 2 + 0.999 * nu
                want = -0.1 * (mu / (1 - 0.9**t)) / (np.sqrt(nu / (1 - 0.999**t)) + 1e-8)
                wrong = _close(u["z"].real, want.real, 1e-12) or _close(u["z"].imag, want.imag, 1e-12)
                if wrong:
                    return f"step {t}: {wrong}"
        finally:
            os.environ.pop("NUMBACCUM_FUSE", None)
        return None

    return run


def jobs() -> dict:
    """Every job by name (the test picks names and orders)."""
    out = {f"kind {k}": kind_job(k, 40) for k in engine.KINDS}
    out.update({f"kind {k} parallel": kind_job(k, (1 << 16) + 37) for k in PARALLEL_KINDS})
    out.update({f"formula {name}": formula_job(f) for name, f in FORMULAS.items()})
    out.update(_composites())
    out.update({f"complex kind {k}": complex_kind_job(k) for k in engine._complex_totals()})
    out.update({f"complex adam fused={f}": complex_adam_job(f) for f in (True, False)})
    return out


class _CountCached(event.Listener):
    """Counts the compiles of kernels that have a disk cache (a loaded one raises no event)."""

    def __init__(self) -> None:
        self.count = 0

    def on_start(self, ev) -> None:
        if not isinstance(getattr(ev.data["dispatcher"], "_cache", None), NullCache):
            self.count += 1

    def on_end(self, ev) -> None:
        pass


def main(names: list[str]) -> None:
    every = jobs()
    if names == ["--list"]:
        print(json.dumps(list(every)))
        return
    counter = _CountCached()
    event.register("numba:compile", counter)
    wrong = {}
    for name in names:
        err = every[name]()
        if err:
            wrong[name] = err
    print(json.dumps({"ran": len(names), "wrong": wrong, "compiled": counter.count}))


if __name__ == "__main__":
    main(sys.argv[1:])
