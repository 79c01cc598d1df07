"""Do the CUDA kernels compile for a GPU? Every kernel built to PTX, on a machine without one.

Usage (from the repository root; not part of the default test run, which skips tests/tools)::

    python -m venv /tmp/ptx && . /tmp/ptx/bin/activate
    pip install "numba-cuda[cu12]" "numpy<2.5" -e .   # NVVM comes with the CUDA toolkit's wheels
    python tests/tools/ptx_check.py

The CUDA simulator (CI's ``-m cuda`` pass) runs the kernels' Python source, so it checks their
arithmetic but not that numba-cuda can type and lower them for a device: a scalar ``view``, a
``type(x)(v)`` or a complex helper can pass there and fail on a GPU. This builds each kernel with
``numba.cuda.compile_ptx`` for sm_90 (no GPU and no CUDA driver needed): the elementwise drivers
of every registered formula (float32 pairs, float32, float64, and complex64/complex128 with the
complex helpers), the fused composites that a few chains make, the reduction engine's partials
kernel for every kind and dtype (and the global norm's finishing tail), the per-slice scalings,
the single stages' kernels (the norm family's factors, the per-slice EMA, Adafactor, SM3, the
axis sums and maxima, DP's weighted sum) and the pointer-table pack and scatter kernels. Prints
one line per failure and a summary; exits 1 if a kernel that should build does not.

numba-cuda compiles a device function for the current device's compute capability: with no
driver that call fails, so the script gives the dispatchers a stand-in device (sm_90).
"""

from __future__ import annotations

import os
import sys
import types as pytypes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CC = (9, 0)
WORDS = {"k0", "k1", "step", "group"}  # uint32 scalars (a noise key's and counter's words)
# Formulas of stages that refuse complex leaves (their comparisons or square roots have no
# complex meaning): not built for complex buffers.
REAL_ONLY = {
    "abs_ema_clip",
    "adopt_direction",
    "clip",
    "clip_by",
    "dadapt_direction",
    "dadapt_weighted",
    "growth_clip",
    "nonnegative_step",
    "prodigy_direction",
    "rprop_direction",
    "sophia_direction",
}


def main() -> int:
    import numba.cuda.dispatcher as dispatcher

    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=CC, id=0)
    sys.path.insert(0, ROOT)
    import numpy as np
    from numba import cuda, types

    import numbaccum as nba
    from numbaccum import formulas, fuse
    from numbaccum.cuda import driver, leaves
    from numbaccum.cuda import reduce as cr

    built, failed = 0, []

    def build(what: str, fn, sig) -> None:
        nonlocal built
        try:
            cuda.compile_ptx(fn, sig, cc=CC)
            built += 1
        except Exception as e:  # a typing or lowering error: the kernel would not build on a GPU
            failed.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")

    i8, f8, b1 = types.int64, types.float64, types.boolean
    dtypes = [
        (types.float32, types.float32, False),
        (types.float64, types.float64, False),
        (types.complex64, types.float32, True),
        (types.complex128, types.float64, True),
    ]

    def scalar_types(names, real) -> tuple:
        return tuple(types.uint32 if s in WORDS else real for s in names) or (b1,)

    # The elementwise drivers: every formula, every storage dtype (pairs for float32).
    for name, f in sorted(formulas.registered().items()):
        for dt, real, cplx in dtypes:
            if cplx and name in REAL_ONLY:
                continue
            for pairs in (False, True) if dt == types.float32 else (False,):
                k = driver._family(f, cplx).kernel(2, pairs)
                sig = (i8, *(dt[:] for _ in f.arrays), real, real, real[:], *scalar_types(f.scalars, real))
                build(f"formula {name} {dt}{' pairs' if pairs else ''}", k.py_func, sig)
        # bfloat16 (raw uint16 bits): every array, and the states kept in float32 / float64.
        n = len(f.arrays)
        for marks, other, real, narrow in (
            ((True,) * n, None, types.float32, "to_bf16"),
            (tuple(i >= len(f.states) for i in range(n)), types.float32, types.float32, "to_bf16"),
            (tuple(i >= len(f.states) for i in range(n)), f8, f8, "to_bf16_from64"),
        ):
            if other is not None and not f.states:
                continue
            k = driver._family(f, False, marks, narrow).kernel(2, False)
            arrs = tuple(types.uint16[:] if m else other[:] for m in marks)
            sig = (i8, *arrs, real, real, real[:], *scalar_types(f.scalars, real))
            build(f"formula {name} bfloat16 ({narrow}, {sum(marks)} of {n})", k.py_func, sig)

    # Fused composites: made by running a few chains on the host, each built for its dtype.
    rng = np.random.default_rng(0)
    import ml_dtypes

    for dtype in (np.float32, np.complex64, ml_dtypes.bfloat16):
        p = {"w": (rng.standard_normal((4, 3)) + (1j if dtype == np.complex64 else 0)).astype(dtype)}
        for tx in (
            nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(0.1, weight_decay=0.1)),
            nba.noisy_sgd(0.1, key=1),
            nba.chain(nba.centralize(), nba.lion(0.1)),
        ):
            state = tx.init(p)
            for _ in range(2):
                state = nba.step_(tx, p, state, {k: v.copy() for k, v in p.items()})
    for (key, _), f in list(fuse._COMPOSITES.items()):
        if key[0] == "bfloat16":  # every buffer bfloat16: its raw bits, computed in float32
            k = driver._family(f, False, (True,) * len(f.arrays)).kernel(1, False)
            sc = _composite_scalars(key, types.float32)
            f4 = types.float32
            sig = (i8, *(types.uint16[:] for _ in f.arrays), f4, f4, f4[:], *sc)
            build(f"composite {f.name} bfloat16", k.py_func, sig)
            continue
        dt, real, cplx = next(d for d in dtypes if d[0].name == key[0])
        sc = _composite_scalars(key, real)
        k = driver._family(f, cplx).kernel(1, False)
        sig = (i8, *(dt[:] for _ in f.arrays), real, real, real[:], *sc)
        build(f"composite {f.name} {dt}", k.py_func, sig)

    # The reduction engine: the partials kernel of every kind and dtype, the global norm's tail.
    head = (i8[:, :], i8[:, :], i8[:], f8[:], b1, f8, f8[:], i8[:], i8[:], f8[:], types.int32[:], b1)
    tail = (types.float32[:], f8[:])
    for kind, (code, _) in cr.KINDS.items():  # bfloat16: the raw bits, each element widened
        k = cr._partials_kernel(code, 128, bf16=True)
        build(f"partials {kind} bfloat16", k.py_func, (types.uint16[:], *head, types.Tuple(()), *tail))
    k = cr._partials_kernel(0, 128, formulas.clip_finish, False, False, True)
    build("global norm finish bfloat16", k.py_func, (types.uint16[:], *head, types.UniTuple(f8, 2), *tail))
    for dt, _, cplx in dtypes:
        for kind, (code, _) in cr.KINDS.items():
            if cplx and kind not in cr._COMPLEX_KINDS:
                continue
            k = cr._partials_kernel(code, 128, complex_=cplx)
            build(f"partials {kind} {dt}", k.py_func, (dt[:], *head, types.Tuple(()), *tail))
        if cplx:
            for code in (cr._REAL_PART, cr._IMAG_PART):
                k = cr._partials_kernel(code, 128, complex_=True)
                build(f"partials part {code} {dt}", k.py_func, (dt[:], *head, types.Tuple(()), *tail))
        rescue = dt in (types.float64, types.complex128)
        k = cr._partials_kernel(0, 128, formulas.clip_finish, rescue, cplx)
        build(f"global norm finish {dt}", k.py_func, (dt[:], *head, types.UniTuple(f8, 2), *tail))
        centers = types.complex128 if cplx else f8
        build(f"apply {dt}", cr._apply.py_func, (dt[:], dt[:], i8[:, :], i8[:, :], centers[:], b1, f8[:], b1))
        real = types.float32 if dt in (types.float32, types.complex64) else f8
        k = cr._divide((1, cplx))
        build(f"divide {dt}", k.py_func, (dt[:], dt[:], real, real, real[:], i8[:, :], i8[:, :], real[:]))

    # The kernels of single stages: the norm family's factors, the per-slice EMA (real: its stages
    # refuse complex), Adafactor's and SM3's passes, the axis sums and maxima, DP's weighted sum.
    from numbaccum.cuda import per_example

    for x, real in ((types.float16, types.float32), (types.float32, types.float32), (types.float64, f8)):
        sig = (f8[::1], i8[::1], i8[::1], x[::1], i8[:, ::1], b1, f8, b1, f8, f8, f8, f8[::1])
        build(f"pnorm factors {x}", cr._pnorm_factors.py_func, sig)
        ema = cr._ema_kernel(1).py_func
        sig = (x[:], x[:], real, real, real[:], i8[:, :], i8[:, :], types.uint8[:], real, real, real)
        build(f"slice ema {x}", ema, sig)
        build(f"axis sums {x}", cr._axis_sums.py_func, (x[:], i8[:, :], i8[:], f8[:]))
        build(f"axis max {x}", cr._axis_max.py_func, (x[:], i8[:, :], i8[:, :], f8[:]))
        sig = (x[:], x[:], real[:], i8[:, :], i8[:, :], f8[:], f8[:], real, real, real, real)
        build(f"adafactor {x}", cr._factored.py_func, sig)
        sig = (x[:], x[:], real[:], real[:], i8[:, :], i8[:, :], i8[:, :], real[:], real[:], *(real,) * 7)
        build(f"sm3 {x}", cr._sm3.py_func, sig)
        sig = (x[:], x[:], i8[:], i8[:], i8[:, :], f8[:, :], f8[:], f8, f8, f8, x[:], b1)
        build(f"dp weighted sum {x}", per_example._weighted_sum.py_func, sig)

    # The pointer-table kernels: every leaf dtype into its storage (bfloat16: its raw bits).
    from numba.np.numpy_support import from_dtype

    bf = np.dtype(ml_dtypes.bfloat16)
    for direction in ("pack", "scatter"):
        for leaf, flat in (
            *((np.dtype(d), np.dtype(np.float32)) for d in (np.float16, np.float32, np.float64)),
            (np.dtype(np.complex64), np.dtype(np.complex64)),
            (np.dtype(np.complex128), np.dtype(np.complex128)),
            (bf, bf),
            (bf, np.dtype(np.float32)),
            (np.dtype(np.float32), bf),
            (np.dtype(np.float64), bf),
        ):
            fn = leaves._kernel(direction, leaf, flat).py_func
            ft = types.uint16 if flat == bf else from_dtype(flat)
            sig = (ft[::1], i8[::1], i8[:, ::1], i8[:, ::1], i8)
            build(f"{direction} {leaf.name} into {flat.name}", fn, sig)

    for line in failed:
        print(line)
    print(f"{built} kernels built to PTX for sm_{CC[0]}{CC[1]}, {len(failed)} failed")
    return 1 if failed else 0


def _composite_scalars(key, real) -> tuple:
    """A composite's scalar types from its key's ops (uint32 for raw words: a noise key's)."""
    from numba import types

    flags: list[bool] = []
    for op in key[2]:
        if op[0] == "settle" or (op[0] == "kernel" and op[3]):
            # a factor's div and mul; its mul alone when it is read as x * mul (div 1)
            mul_only = op[1] if op[0] == "settle" else op[3] == 1
            flags += [False] if mul_only else [False, False]
        if op[0] == "kernel":
            flags += list(op[6])
    return tuple(types.uint32 if raw else real for raw in flags) or (types.boolean,)


if __name__ == "__main__":
    sys.exit(main())
