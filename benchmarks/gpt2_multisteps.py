"""MultiSteps(adam, k=4) on GPT-2-small shapes: numbaccum vs plain NumPy, against the copy roof.

    python benchmarks/gpt2_multisteps.py [--repeats N] [--quick] [--json FILE]

Times, separately, the non-emitting mini-steps (3 of every 4: Welford mean accumulate, return
zeros) and the emitting steps (every 4th: accumulate, Adam on the mean, reset the accumulator),
after a warm-up cycle that also compiles numbaccum's kernels and checks its emitted update
against the NumPy implementation (rtol 1e-5).

Implementations, side by side in one run (cycles interleaved, same gradient buffer):
  numbaccum   ``nba.MultiSteps(nba.adam(lr), 4)`` with params and grads as ``nba.FlatTree``
              (the zero-copy path).
  numpy       per leaf, in-place ufuncs into preallocated leaf-sized scratch buffers.
  numpy-blk   the same ufunc sequence per leaf, run over cache-sized blocks of each leaf so the
              scratch stays in cache; the best plain NumPy does here. Single-threaded, like
              ``numpy``.

Roof: ``np.copyto`` of a 500 MB float32 buffer into a preallocated one (read + write bytes
counted, write-allocate traffic not counted, as STREAM does). A numba ``prange`` copy is also
measured, because numbaccum's kernels may run on several threads while ``np.copyto`` runs on one.

Bytes per parameter (float32, minimal): mini-step 12 (R g, R acc, W acc); emitting step 32
(R g, R acc, W acc := 0, R/W mu, R/W nu, W update).

``cpu/wall`` (process CPU time over wall time of an implementation's timed cycles) and the
load average are printed because a busy machine hurts numba's parallel kernels far more than
single-threaded NumPy: a prange region waits for its slowest thread, and a thread that lost its
core waits a scheduler time slice. ``--workload many_small|tiny`` runs the same comparison on
the other shapes in ``numbaccum/bench/workloads.py``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))

from numbaccum.bench import workloads  # noqa: E402  (plain NumPy: imports nothing of numbaccum's)
from numbaccum.bench.baselines import B1, B2, EPS, LR, K, NumpyMultiStepsAdam  # noqa: E402
from numbaccum.bench.runner import _cpu_model  # noqa: E402

MINI_BYTES = 12  # R g, R acc, W acc
EMIT_BYTES = 32  # R g, R acc, W acc(:=0), R mu, W mu, R nu, W nu, W u


def reference_cycle(grad_cycles, lr=LR, b1=B1, b2=B2, eps=EPS):
    """Naive float64 reference for one leaf list: list of cycles, each a list of K grad lists.

    Returns the emitted update of the last cycle (float64). Used to test NumpyMultiStepsAdam.
    """
    n_leaves = len(grad_cycles[0][0])
    mu = [0.0] * n_leaves
    nu = [0.0] * n_leaves
    out = None
    for c, cycle in enumerate(grad_cycles, start=1):
        mean = [sum(np.asarray(step[j], np.float64) for step in cycle) / len(cycle) for j in range(n_leaves)]
        mu = [b1 * mu[j] + (1 - b1) * mean[j] for j in range(n_leaves)]
        nu = [b2 * nu[j] + (1 - b2) * mean[j] ** 2 for j in range(n_leaves)]
        out = [-lr * (mu[j] / (1 - b1**c)) / (np.sqrt(nu[j] / (1 - b2**c)) + eps) for j in range(n_leaves)]
    return out


# --------------------------------------------------------------------------------------------
# Roof and machine info
# --------------------------------------------------------------------------------------------


def copy_bandwidth(nbytes=500_000_000, reps=7):
    """Median/min/max seconds of np.copyto over a preallocated float32 buffer; GB/s = 2*nbytes/t."""
    n = nbytes // 4
    src = np.ones(n, np.float32)
    dst = np.zeros(n, np.float32)  # touch the pages before timing
    np.copyto(dst, src)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        ts.append(time.perf_counter() - t0)
    del src, dst
    return ts, 2 * n * 4


def numba_parallel_copy_bandwidth(nbytes=500_000_000, reps=7):
    import numba

    @numba.njit(parallel=True, cache=False)
    def pcopy(dst, src):
        for i in numba.prange(src.shape[0]):
            dst[i] = src[i]

    n = nbytes // 4
    src = np.ones(n, np.float32)
    dst = np.zeros(n, np.float32)
    pcopy(dst, src)  # compile + warm
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        pcopy(dst, src)
        ts.append(time.perf_counter() - t0)
    del src, dst
    return ts, 2 * n * 4


cpu_model = _cpu_model


def machine_info(nba=None):
    import numba

    try:
        layer = numba.threading_layer()
    except ValueError:
        layer = f"(not initialised yet; configured: {numba.config.THREADING_LAYER})"
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "numpy": np.__version__,
        "numba": numba.__version__,
        "numba_threads": numba.get_num_threads(),
        "numba_num_threads_config": numba.config.NUMBA_NUM_THREADS,
        "numba_threading_layer": layer,
        "numbaccum": getattr(nba, "__version__", "?") if nba is not None else None,
        "numbaccum_file": getattr(nba, "__file__", None) if nba is not None else None,
    }


def peak_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


# --------------------------------------------------------------------------------------------
# numbaccum side
# --------------------------------------------------------------------------------------------


def import_numbaccum():
    try:
        import numbaccum as nba
    except Exception as e:  # noqa: BLE001 - report any import failure
        return None, f"import numbaccum failed: {type(e).__name__}: {e}"
    missing = [n for n in ("MultiSteps", "adam", "FlatTree") if not hasattr(nba, n)]
    if missing:
        return None, f"numbaccum imported from {getattr(nba, '__path__', '?')} but lacks {missing}"
    return nba, None


def _update_leaves(updates):
    """Leaves of numbaccum's returned updates, in sorted-key order (FlatTree or plain tree)."""
    if hasattr(updates, "tree") and hasattr(updates, "buffers"):
        updates = updates.tree
    return workloads.leaves(updates)


def _fill_random_(flat, rng):
    for buf in flat.buffers.values():
        if buf.dtype in (np.float32, np.float64):
            rng.standard_normal(out=buf, dtype=buf.dtype)
        else:
            buf[...] = rng.standard_normal(buf.shape, dtype=np.float32)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def summarize(ts):
    return {
        "median_s": statistics.median(ts),
        "min_s": min(ts),
        "max_s": max(ts),
        "n": len(ts),
    }


def compare_rtol(a, b, rtol, chunk=1 << 20):
    """``allclose(a, b, rtol, atol=0)`` and the max relative error, in float64 chunks (low RAM)."""
    a, b = a.reshape(-1), b.reshape(-1)
    ok, worst = True, 0.0
    for s in range(0, a.size, chunk):
        x = a[s : s + chunk].astype(np.float64)
        y = b[s : s + chunk].astype(np.float64)
        d = np.abs(x - y)
        ok = ok and bool(np.all(d <= rtol * np.abs(y)) and np.array_equal(np.isnan(x), np.isnan(y)))
        np.divide(d, np.maximum(np.abs(y), np.finfo(np.float64).tiny), out=d)
        worst = max(worst, float(np.nanmax(d, initial=0.0)))
    return ok, worst


def numpy_modes_selfcheck(block):
    """The whole-leaf and blocked NumPy modes give the same bits (small tree, 2 cycles)."""
    shapes = {"a": (37, 29), "b": (3 * block + 5,), "c": (), "d": (0,), "e": (block,)}
    like = workloads.leaves(workloads.zeros_tree(shapes))
    whole, blk = NumpyMultiStepsAdam(like), NumpyMultiStepsAdam(like)
    rng = np.random.default_rng(3)
    for _ in range(2 * K):
        g = workloads.leaves(workloads.make_tree(shapes, np.float32, int(rng.integers(1 << 30))))
        u1, u2 = whole.update(g), blk.update(g, block=block)
        if not all(np.array_equal(x, y) for x, y in zip(u1, u2, strict=True)):
            return False
    return all(
        np.array_equal(x, y)
        for x, y in zip(whole.acc + whole.mu + whole.nu, blk.acc + blk.mu + blk.nu, strict=True)
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed cycles of K=4 steps per implementation (default 10; --quick 3)",
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats, fewer copy reps")
    p.add_argument("--json", metavar="FILE", help="write raw numbers to FILE")
    p.add_argument("--workload", default="gpt2_small", choices=sorted(workloads.WORKLOADS))
    p.add_argument(
        "--block",
        type=int,
        default=1 << 16,
        help="elements per block for numpy-blk (default 65536 = 256 KiB float32)",
    )
    p.add_argument("--no-numpy", action="store_true", help="skip the NumPy baselines")
    p.add_argument("--no-numbaccum", action="store_true", help="skip numbaccum")
    args = p.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 10)
    copy_reps = 5 if args.quick else 11
    if repeats < 1:
        p.error("--repeats must be >= 1")
    if args.block < 1:
        p.error("--block must be >= 1")

    t_start = time.perf_counter()
    out: dict = {
        "workload": args.workload,
        "k": K,
        "repeats_cycles": repeats,
        "hyper": {"lr": LR, "b1": B1, "b2": B2, "eps": EPS},
        "bytes_per_param": {"mini": MINI_BYTES, "emit": EMIT_BYTES},
        "numpy_block": args.block,
    }

    nba, why = (None, "skipped (--no-numbaccum)") if args.no_numbaccum else import_numbaccum()
    if nba is None:
        print(f"numbaccum: unavailable -> {why}\n")
    out["numbaccum_error"] = why

    # ---- copy roof, part 1: before the big allocations (keeps the peak RSS down) ----------
    ts_copy, copy_bytes = copy_bandwidth(reps=copy_reps)

    # ---- workload -------------------------------------------------------------------------
    shapes = workloads.WORKLOADS[args.workload]()
    n_leaves = workloads.count_leaves(shapes)
    n_params = workloads.count_params(shapes)
    if args.workload == "gpt2_small":
        assert n_leaves == workloads.GPT2_SMALL_N_LEAVES, n_leaves
        assert n_params == workloads.GPT2_SMALL_N_PARAMS, n_params
    print(
        f"workload {args.workload}: {n_leaves} leaves, {n_params:,} params "
        f"({n_params / 1e6:.1f}M), float32 = {n_params * 4 / 1e6:.0f} MB per tree"
    )
    out.update(n_leaves=n_leaves, n_params=n_params)

    params_tree = workloads.make_tree(shapes, np.float32, seed=0, scale=0.02)
    grads_tree = workloads.make_tree(shapes, np.float32, seed=1)
    if nba is not None:
        params_flat = nba.FlatTree.from_tree(params_tree)
        del params_tree
        grads_flat = nba.FlatTree.from_tree(grads_tree)
        del grads_tree
        # The NumPy side reads the very same gradient memory, through the FlatTree's views.
        grad_leaves = workloads.leaves(grads_flat.tree)
        bufs = list(grads_flat.buffers.values())
        views_ok = all(any(np.shares_memory(x, b) for b in bufs) for x in grad_leaves if x.size)
        if not views_ok:
            print("ODD: FlatTree.tree leaves are not views into FlatTree.buffers")
        out["flattree_views_ok"] = bool(views_ok)
    else:
        grad_leaves = workloads.leaves(grads_tree)
        del params_tree

    np_state = None if args.no_numpy else NumpyMultiStepsAdam(grad_leaves)
    np_modes = {} if args.no_numpy else {"numpy": None, "numpy-blk": args.block}

    # ---- warm-up cycle (compiles numbaccum) + correctness check ---------------------------
    rng = np.random.default_rng(2)
    check: dict = {}
    cold: dict = {}
    if np_state is not None:
        check["numpy_modes_bitwise_equal"] = numpy_modes_selfcheck(min(args.block, 1000))
        if not check["numpy_modes_bitwise_equal"]:
            print("ODD: numpy whole-leaf and blocked modes differ bitwise")
    if nba is not None:
        opt = nba.MultiSteps(nba.adam(LR), K)
        t0 = time.perf_counter()
        state = opt.init(params_flat)
        cold["init_s"] = time.perf_counter() - t0
        has_updated = getattr(opt, "has_updated", None)
        for step in range(K):
            _fill_random_(grads_flat, rng)  # fresh grads each mini-step; numpy sees the same views
            t0 = time.perf_counter()
            updates, state = opt.update(grads_flat, state, params_flat)
            cold[f"step{step}_s"] = time.perf_counter() - t0
            emit = step == K - 1
            if has_updated is not None and bool(has_updated(state)) != emit:
                print(f"ODD: has_updated(state) = {has_updated(state)} after step {step}")
                check["has_updated_mismatch"] = True
            nba_leaves = _update_leaves(updates)
            np_leaves = np_state.update(grad_leaves) if np_state is not None else None
            if not emit:
                nz = sum(int(np.count_nonzero(x)) for x in nba_leaves)
                neg0 = sum(int(np.count_nonzero(np.signbit(x))) for x in nba_leaves)
                check[f"mini{step}_nonzero"] = nz
                check[f"mini{step}_signbit"] = neg0
                if nz or neg0:
                    print(f"ODD: mini-step {step} update has {nz} non-zeros, {neg0} sign bits set")
            elif np_leaves is not None:
                ok = len(nba_leaves) == len(np_leaves)
                worst = 0.0
                for a, b in zip(nba_leaves, np_leaves, strict=False):
                    if a.shape != b.shape or a.dtype != b.dtype:
                        ok = False
                        print(f"ODD: update leaf {a.shape} {a.dtype} vs numpy {b.shape} {b.dtype}")
                        continue
                    ok_leaf, worst_leaf = compare_rtol(a, b, rtol=1e-5)
                    ok = ok and ok_leaf
                    worst = max(worst, worst_leaf)
                check["emit_allclose_rtol_1e-5"] = ok
                check["emit_max_rel_err"] = worst
                print(
                    f"check: numbaccum emitted update (cycle 1) vs NumPy: "
                    f"{'OK' if ok else 'MISMATCH'} (max rel err {worst:.2e}, rtol 1e-5)"
                )
                if not ok:
                    print("ODD: numbaccum and NumPy disagree on the emitted update")
        print(
            "cold (first-call) numbaccum times: "
            + ", ".join(f"{k}={v * 1e3:.1f} ms" for k, v in cold.items())
        )
    elif np_state is not None:
        for _ in range(K):
            np_state.update(grad_leaves)
    out["check"] = check
    out["cold"] = cold

    # ---- timed cycles, interleaved (numpy modes share one state: same bits, half the RAM) ---
    names = ([] if nba is None else ["numbaccum"]) + list(np_modes)
    times = {
        n: {"mini": [], "emit": [], "by_position": [[] for _ in range(K)], "cpu_s": 0.0, "wall_s": 0.0}
        for n in names
    }
    load_before = os.getloadavg()
    for _ in range(repeats):
        for name in names:
            rec = times[name]
            c0, w0 = time.process_time(), time.perf_counter()
            for step in range(K):
                if name == "numbaccum":
                    t0 = time.perf_counter()
                    updates, state = opt.update(grads_flat, state, params_flat)
                    dt = time.perf_counter() - t0
                else:
                    block = np_modes[name]
                    t0 = time.perf_counter()
                    np_state.update(grad_leaves, block=block)
                    dt = time.perf_counter() - t0
                rec["by_position"][step].append(dt)
                rec["emit" if step == K - 1 else "mini"].append(dt)
            rec["cpu_s"] += time.process_time() - c0
            rec["wall_s"] += time.perf_counter() - w0
    load_after = os.getloadavg()
    out["loadavg_before_after"] = [load_before, load_after]
    if nba is not None and hasattr(opt, "has_updated") and not opt.has_updated(state):
        print("ODD: has_updated(state) is False after the last timed (emitting) step")

    # ---- roofs, part 2: free the NumPy state first; the numba copy runs after numbaccum's
    # kernels so it cannot be the one that picks numba's threading layer -----------------------
    del np_state
    ts2, _ = copy_bandwidth(reps=copy_reps)
    ts_copy = ts_copy + ts2
    roof = copy_bytes / statistics.median(ts_copy)
    out["copy_np"] = {
        "times_s": ts_copy,
        "bytes": copy_bytes,
        "gbps_median": roof / 1e9,
        "gbps_median_before": copy_bytes / statistics.median(ts_copy[:copy_reps]) / 1e9,
        "gbps_median_after": copy_bytes / statistics.median(ts2) / 1e9,
    }
    ts_p, nbytes_p = numba_parallel_copy_bandwidth(reps=copy_reps)
    roof_p = nbytes_p / statistics.median(ts_p)
    out["copy_numba_prange"] = {"times_s": ts_p, "bytes": nbytes_p, "gbps_median": roof_p / 1e9}

    info = machine_info(nba)
    out["machine"] = info

    # ---- report ----------------------------------------------------------------------------
    print()
    print(f"date            {info['date']}")
    print(
        f"cpu             {info['cpu_model']}  (os.cpu_count={info['cpu_count']}, "
        f"affinity={info['cpu_affinity']})"
    )
    print(
        f"versions        python {info['python']}, numpy {info['numpy']}, numba {info['numba']}, "
        f"numbaccum {info['numbaccum']}"
    )
    print(
        f"numba threads   {info['numba_threads']} (NUMBA_NUM_THREADS="
        f"{info['numba_num_threads_config']}), threading layer: {info['numba_threading_layer']}"
    )
    print(
        f"copy roof       np.copyto 500 MB f32: {roof / 1e9:.1f} GB/s median of {len(ts_copy)} "
        f"(before run {out['copy_np']['gbps_median_before']:.1f}, after "
        f"{out['copy_np']['gbps_median_after']:.1f}); numba prange copy "
        f"(threads={info['numba_threads']}): {roof_p / 1e9:.1f} GB/s"
    )
    print(
        f"load average    before timing {load_before[0]:.2f}, after {load_after[0]:.2f} "
        f"(1 min; {info['cpu_count']} CPUs)"
    )
    if max(load_before[0], load_after[0]) > 0.5 * (os.cpu_count() or 1):
        print(
            "WARNING         other processes were busy during the run: multi-threaded timings "
            "(numbaccum, prange copy) suffer most; see cpu/wall"
        )
    print(
        f"workload        {args.workload}: {n_leaves} leaves, {n_params:,} params; "
        f"MultiSteps(adam({LR}), {K}); {repeats} timed cycles after 1 warm-up cycle"
    )
    print(
        f"bytes/param     mini-step {MINI_BYTES} (R g, R/W acc); emitting step {EMIT_BYTES} "
        f"(R g, R/W acc, R/W mu, R/W nu, W u)"
    )
    print(
        f"numpy           per leaf, in-place ufuncs, 1 thread; numpy-blk: same, in runs of "
        f"{args.block} elements"
    )
    hdr = (
        f"{'impl':<10} {'step':<5} {'n':>3} {'median ms':>10} {'min ms':>9} {'max ms':>9} "
        f"{'B/param':>7} {'GB/s':>7} {'x copy':>7} {'x prange':>8} {'cpu/wall':>8}"
    )
    print(
        "cpu/wall        process CPU time / wall time over an impl's timed cycles (all steps): "
        "about 1 for 1 busy thread, up to the thread count"
    )
    print()
    print(hdr)
    print("-" * len(hdr))
    results = {}
    for name in names:
        results[name] = {}
        for kind, bpp in (("mini", MINI_BYTES), ("emit", EMIT_BYTES)):
            st = summarize(times[name][kind])
            gbps = bpp * n_params / st["median_s"]
            st.update(
                bytes_per_param=bpp,
                gbps=gbps / 1e9,
                frac_copy=gbps / roof,
                frac_prange_copy=gbps / roof_p,
                times_s=times[name][kind],
            )
            results[name][kind] = st
            cpu_wall = times[name]["cpu_s"] / max(times[name]["wall_s"], 1e-12)
            print(
                f"{name:<10} {kind:<5} {st['n']:>3} {st['median_s'] * 1e3:>10.4g} "
                f"{st['min_s'] * 1e3:>9.4g} {st['max_s'] * 1e3:>9.4g} {bpp:>7} "
                f"{gbps / 1e9:>7.1f} {gbps / roof:>7.2f} {gbps / roof_p:>8.2f} {cpu_wall:>8.2f}"
            )
        results[name]["cpu_over_wall"] = times[name]["cpu_s"] / max(times[name]["wall_s"], 1e-12)
        results[name]["cycle_median_sum_s"] = (
            3 * results[name]["mini"]["median_s"] + results[name]["emit"]["median_s"]
        )
        results[name]["by_position_median_s"] = [statistics.median(v) for v in times[name]["by_position"]]
        results[name]["by_position_times_s"] = times[name]["by_position"]
    print()
    for name in names:
        pos = " / ".join(f"{t * 1e3:.4g}" for t in results[name]["by_position_median_s"])
        print(
            f"{name:<10} cycle = 3 mini + 1 emit (medians): "
            f"{results[name]['cycle_median_sum_s'] * 1e3:8.4g} ms; by position ms: {pos}"
        )
    if "numbaccum" in results:
        base = results["numbaccum"]
        for name in np_modes:
            r = results[name]
            mini = r["mini"]["median_s"] / base["mini"]["median_s"]
            emit = r["emit"]["median_s"] / base["emit"]["median_s"]
            cycle = r["cycle_median_sum_s"] / base["cycle_median_sum_s"]
            print(f"numbaccum speed-up vs {name:<9}: mini x{mini:.2f}, emit x{emit:.2f}, cycle x{cycle:.2f}")
    out["results"] = results
    out["peak_rss_gb"] = peak_rss_gb()
    out["wall_s"] = time.perf_counter() - t_start
    print(f"\npeak RSS {out['peak_rss_gb']:.2f} GB, wall {out['wall_s']:.1f} s")

    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
