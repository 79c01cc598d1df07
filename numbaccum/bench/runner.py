"""`numbaccum bench`: numbaccum next to a NumPy per-leaf version of the same math and, when they are
installed, PyTorch's foreach ops and optax under ``jax.jit``, in one run, on the CPU and (when one
works) on a CUDA device.

Workloads (float32): GPT-2-small shapes (124M parameters in 148 leaves), 2000 small leaves of
100-5000 elements, and a tiny tree of 10 leaves of 10 elements, where what is measured is the
per-call overhead (reported in microseconds). Operations: clip_by_global_norm (``max_norm`` far
below the norm, so it always scales), a MultiSteps mini-step, ema with debias, and the emitting
step of ``MultiSteps(chain(clip_by_global_norm(1.0), adam(1e-3)), 4)`` (the full step: accumulate,
clip the mean, Adam, reset).

Each operation is timed call by call after a warm-up (which also compiles the kernels), the
implementations of a row alternately (A, B, C, A, B, C, ...; MultiSteps: a whole cycle each in
turn), so that a shared machine's changing load falls on all of them alike (timed in blocks, the
ratio against PyTorch moved between 0.64x and 1.37x in back-to-back runs; alternated, by less than
0.2x): median, min and max of each. GB/s counts the minimal bytes per float32 parameter
(DESIGN.md): a mini-step reads g and reads and writes acc (12), except the first of a cycle, which
only writes acc (8); the full step reads g and acc for the norm, reads them again beside mu and
nu, writes mu, nu, the update and the zeroed acc (40); ema with debias reads g, reads and writes
ema, writes the update (16); clip_by_global_norm reads g for the norm and again for the output,
and writes the output (12).
The copy floor is measured in the same run: on the CPU the faster of ``np.copyto`` and a parallel
copy of a large buffer, on the GPU a device-to-device copy of the workload's size. On the GPU,
calls are timed between CUDA events (optax: wall time, its step blocks until ready).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import workloads
from .baselines import B1, B2, DECAY, EPS, LR, NumpyClipByGlobalNorm, NumpyEma, NumpyMultiStepsAdam
from .peers import FULL_MAX_NORM, Steps, optax_available, optax_steps, torch_available, torch_steps

K = 4  # mini-steps per MultiSteps cycle
CLIP_MAX_NORM = 1e-3  # far below the gradients' norm: the standalone clip always scales

OPS = ("clip", "multisteps", "ema")
MINI = "MultiSteps mini-step"
FULL = "full step: MultiSteps(chain(clip, adam)), emitting"
LABELS = {"clip": ("clip_by_global_norm",), "multisteps": (MINI, FULL), "ema": ("ema (debias)",)}
BYTES_PER_PARAM = {
    "clip_by_global_norm": 12.0,
    MINI: (8 + 12 * (K - 2)) / (K - 1),  # the first mini-step of a cycle reads no acc
    FULL: 40.0,
    "ema (debias)": 16.0,
}

DEVICES = ("cpu", "cuda")
DEFAULT_WORKLOADS = ("gpt2_small", "many_small", "tiny")
QUICK_WORKLOADS = ("many_small", "tiny")
# Timed calls per operation (MultiSteps: calls of all positions of a cycle, after a warm-up cycle).
REPEATS = {"gpt2_small": 12, "many_small": 40, "tiny": 2000}
QUICK_REPEATS = {"gpt2_small": 4, "many_small": 4, "tiny": 200}
PER_CALL = {"tiny"}  # overhead-bound: reported in microseconds per call, no GB/s

Clock = Callable[[Callable[[], Any]], float]


def _wall(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _times(fn: Callable[[], Any], repeats: int) -> list[float]:
    return [_wall(fn) for _ in range(repeats)]


def copy_floor(nbytes: int, repeats: int) -> float:
    """GB/s (read + write bytes) of the faster of ``np.copyto`` (one thread) and a parallel numba
    copy (all threads) between two preallocated float32 buffers: the roof a kernel can reach."""
    from numbaccum.backend import ops_for
    from numbaccum.contract import ONE

    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    ops = ops_for(a)
    ops.scale_(b, a, ONE)  # a scale by one is a copy through our own kernel
    t_np = min(_times(lambda: np.copyto(b, a), repeats))
    t_par = min(_times(lambda: ops.scale_(b, a, ONE), repeats))
    return 2 * a.nbytes / min(t_np, t_par) / 1e9


# --- what is timed --------------------------------------------------------------------------


def numbaccum_steps(params: Any, grads: Any, k: int = K) -> Steps:
    """numbaccum's steps on ``params`` and ``grads`` as given: FlatTrees (host or device), plain
    trees of NumPy arrays, or trees of PyTorch CUDA tensors."""
    import numbaccum as nba

    full = nba.MultiSteps(nba.chain(nba.clip_by_global_norm(FULL_MAX_NORM), nba.adam(LR, B1, B2, EPS)), k)
    clip, ema = nba.clip_by_global_norm(CLIP_MAX_NORM), nba.ema(DECAY)
    box = {"ms": full.init(params), "clip": clip.init(params), "ema": ema.init(params)}

    def multisteps() -> None:
        _, box["ms"] = full.update(grads, box["ms"], params)

    def ema_step() -> None:
        _, box["ema"] = ema.update(grads, box["ema"])

    def clip_step() -> None:
        clip.update(grads, box["clip"])

    return {"multisteps": multisteps, "ema": ema_step, "clip": clip_step}


def numpy_steps(params: list[np.ndarray], grads: list[np.ndarray], k: int = K) -> Steps:
    """The NumPy per-leaf baselines (`baselines`) of the same math."""
    ms = NumpyMultiStepsAdam(params, k, max_norm=FULL_MAX_NORM)
    ema, clip = NumpyEma(params), NumpyClipByGlobalNorm(params, CLIP_MAX_NORM)
    return {
        "multisteps": lambda: ms.update(grads),
        "ema": lambda: ema.update(grads),
        "clip": lambda: clip.update(grads),
    }


class Impl:
    """One implementation on one device: a name, how to build its steps from the workload's
    trees, how to time a call."""

    def __init__(
        self, name: str, build: Callable[[dict[str, Any]], Steps], clock: Callable[[], Clock]
    ) -> None:
        self.name, self.build, self.clock = name, build, clock


def _flat_pair(trees: dict[str, Any], device: bool) -> tuple[Any, Any]:
    import numbaccum as nba

    p, g = nba.FlatTree.from_tree(trees["params"]), nba.FlatTree.from_tree(trees["grads"])
    return (nba.to_device(p), nba.to_device(g)) if device else (p, g)


def _torch_views(trees: dict[str, Any]) -> Steps:
    p, g = _flat_pair(trees, True)
    return numbaccum_steps(p.tree_as("torch"), g.tree_as("torch"))


def _peer(build: Callable[..., Steps], device: str) -> Callable[[dict[str, Any]], Steps]:
    return lambda t: build(t["p_leaves"], t["g_leaves"], K, CLIP_MAX_NORM, device)


PEERS = ("torch", "optax")


def implementations(device: str, workload: str, peers: bool | Sequence[str]) -> list[Impl]:
    """What runs on ``device`` for ``workload`` (the peers named in ``peers``, or all of them for
    True, when installed)."""
    peers = PEERS if peers is True else () if peers is False else tuple(peers)
    wall = lambda: _wall  # noqa: E731
    if device == "cpu":
        out = [Impl("numbaccum", lambda t: numbaccum_steps(*_flat_pair(t, False)), wall)]
        if workload in PER_CALL:  # the overhead of a plain tree (checked and packed every call)
            plain = lambda t: numbaccum_steps(t["params"], t["grads"])  # noqa: E731
            out.append(Impl("numbaccum (plain tree)", plain, wall))
        out.append(Impl("numpy", lambda t: numpy_steps(t["p_leaves"], t["g_leaves"]), wall))
        if "torch" in peers and torch_available("cpu"):
            out.append(Impl("torch foreach", _peer(torch_steps, "cpu"), wall))
        if "optax" in peers and optax_available("cpu"):
            out.append(Impl("optax jit", _peer(optax_steps, "cpu"), wall))
        return out
    from . import gpu

    out = [Impl("numbaccum", lambda t: numbaccum_steps(*_flat_pair(t, True)), gpu.Clock)]
    if gpu.status()[1]:  # the simulator: numba's own arrays only (PyTorch and JAX need a real GPU)
        return out
    if torch_available("cuda"):  # the same device buffers seen as PyTorch tensors: torch in and out
        out.append(Impl("numbaccum (torch tensors)", _torch_views, gpu.Clock))
    if "torch" in peers and torch_available("cuda"):
        out.append(Impl("torch foreach", _peer(torch_steps, "cuda"), gpu.Clock))
    if "optax" in peers and optax_available("cuda"):  # its step blocks until ready: wall time
        out.append(Impl("optax jit", _peer(optax_steps, "cuda"), lambda: gpu.Clock(wall=True)))
    return out


# A row stops repeating once it has spent this long (with at least 3 samples): a slow peer (a
# 2000-leaf tree converted leaf by leaf, say) would otherwise hold the whole run for minutes.
ROW_SECONDS = 5.0


def measure(step: Callable[[], Any], op: str, clock: Clock, repeats: int, warmup: int) -> dict:
    """``{row label: per-call seconds}`` of one implementation (`measure_alternating`)."""
    return measure_alternating([(step, clock)], op, repeats, warmup)[0]


def measure_alternating(
    contenders: list[tuple[Callable[[], Any], Clock]], op: str, repeats: int, warmup: int
) -> list[dict]:
    """``[{row label: per-call seconds}]``, one per ``(step, clock)`` contender, timed in turn:
    call by call (A, B, C, A, B, C, ...); MultiSteps cycle by cycle (a warm-up cycle each, then
    the mini-steps and the emitting (full) steps of ``max(2, repeats // K)`` cycles timed apart).
    Each row takes ``repeats`` samples, or fewer (at least 3; 2 cycles) once ``ROW_SECONDS`` per
    contender have passed."""
    n = max(1, len(contenders))

    def more(samples: int, least: int) -> bool:
        return samples < least or time.perf_counter() - start < ROW_SECONDS * n

    start = time.perf_counter()
    if op == "multisteps":
        minis: list[list[float]] = [[] for _ in contenders]
        emits: list[list[float]] = [[] for _ in contenders]
        for cycle in range(max(2, repeats // K) + 1):
            if not more(cycle, 3):
                break
            for (step, clock), mini, emit in zip(contenders, minis, emits):
                for position in range(K):
                    t = clock(step)
                    if cycle:
                        (emit if position == K - 1 else mini).append(t)
        return [{MINI: mini, FULL: emit} for mini, emit in zip(minis, emits)]
    for step, _ in contenders:
        for _ in range(warmup):
            step()
    start = time.perf_counter()
    times: list[list[float]] = [[] for _ in contenders]
    while len(times[0]) < repeats and more(len(times[0]), 3):
        for (step, clock), ts in zip(contenders, times):
            ts.append(clock(step))
    return [{LABELS[op][0]: ts} for ts in times]


class Progress:
    """A progress bar on stderr (one line per step when stderr is not a terminal)."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total, self.done = max(total, 1), 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, label: str) -> None:
        self.done += 1
        if self.tty:
            filled = 24 * self.done // self.total
            bar = "#" * filled + "-" * (24 - filled)
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {label[:70]:<70}")
        else:
            self.stream.write(f"  [{self.done}/{self.total}] {label}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# --- a run ----------------------------------------------------------------------------------


def _trees(workload: str) -> dict[str, Any]:
    shapes = workloads.WORKLOADS[workload]()
    params = workloads.make_tree(shapes, np.float32, seed=0)
    grads = workloads.make_tree(shapes, np.float32, seed=1, scale=1e-2)
    return {
        "params": params,
        "grads": grads,
        "p_leaves": workloads.leaves(params),
        "g_leaves": workloads.leaves(grads),
    }


def run_workload(
    device: str,
    workload: str,
    ops: tuple[str, ...],
    repeats: int,
    impls: list[Impl],
    floor: float | None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Times every implementation and operation on one device and workload. ``floor``: the CPU
    copy floor in GB/s (the GPU measures its own, of the workload's size)."""
    trees = _trees(workload)
    n_params = sum(x.size for x in trees["g_leaves"])
    if device == "cuda":
        from . import gpu

        floor = gpu.copy_roof(n_params, 10)
    per_call = workload in PER_CALL
    rows = []
    # Every implementation is built first: a row's contenders are then timed alternately.
    built = [(impl, impl.build(trees), impl.clock()) for impl in impls]
    for op in ops:
        here = [(impl, steps[op], clock) for impl, steps, clock in built if op in steps]
        if progress is not None:
            for impl, _, _ in built:
                progress.step(f"{device} {workload}: {op}, {impl.name}")
        warmup = 20 if per_call else 1
        results = measure_alternating([(step, clock) for _, step, clock in here], op, repeats, warmup)
        for (impl, _, _), result in zip(here, results):
            for label, ts in result.items():
                med = statistics.median(ts)
                gbs = None if per_call else BYTES_PER_PARAM[label] * n_params / med / 1e9
                rows.append(
                    dict(
                        op=label,
                        impl=impl.name,
                        median_s=med,
                        min_s=min(ts),
                        max_s=max(ts),
                        calls=len(ts),
                        gbs=gbs,
                        floor_fraction=None if gbs is None or not floor else gbs / floor,
                    )
                )
    del built
    gc.collect()
    if device == "cuda":
        from . import gpu

        gpu.free()
    return {
        "device": device,
        "workload": workload,
        "n_params": int(n_params),
        "n_leaves": len(trees["g_leaves"]),
        "per_call": per_call,
        "copy_floor_gbs": floor,
        "rows": rows,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def _threading_layer() -> str:
    import numba

    try:
        return str(numba.threading_layer())
    except ValueError:
        return "not yet chosen"


def _versions() -> dict[str, str]:
    """Versions of the peers this run imported."""
    out = {}
    for name in ("torch", "jax", "optax", "matplotlib"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = str(getattr(mod, "__version__", "?"))
    return out


def run(
    workload_names: tuple[str, ...],
    devices: tuple[str, ...],
    ops: tuple[str, ...] = OPS,
    peers: bool | Sequence[str] = True,
    repeats: dict[str, int] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Every device x workload, with the machine's description; the JSON that ``--json`` writes."""
    import numba

    repeats = repeats or REPEATS
    gpu_name = None
    if "cuda" in devices:
        from . import gpu

        works, _, gpu_name = gpu.status()
        if not works:
            raise SystemExit(f"numbaccum bench --device cuda: {gpu_name}")
    # The implementations are decided before anything is timed: the progress bar knows its length.
    plan = [(d, w, implementations(d, w, peers)) for d in devices for w in workload_names]
    bar = Progress(sum(len(impls) * len(ops) for _, _, impls in plan)) if progress else None
    floor = None
    if "cpu" in devices:
        biggest = max(workloads.count_params(workloads.WORKLOADS[w]()) for w in workload_names)
        floor = copy_floor(min(500_000_000, max(64 * biggest, 1 << 22)), 5)
    runs = [
        run_workload(d, w, ops, repeats[w], impls, floor if d == "cpu" else None, bar) for d, w, impls in plan
    ]
    if bar is not None:
        bar.close()
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{_cpu_model()}, {os.cpu_count()} cpus, {platform.system()} {platform.machine()}",
        "gpu": gpu_name,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "numba_threads": numba.get_num_threads(),
        "threading_layer": _threading_layer(),
        "peers": _versions(),
        "k": K,
        "runs": runs,
    }


# --- output ---------------------------------------------------------------------------------


def _num(v: float) -> str:
    return f"{v:.4g}" if v < 10_000 else f"{v:,.0f}"


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def format_table(result: dict[str, Any]) -> str:
    """The run as Markdown: a header, then one table per device and workload."""
    peers = ", ".join(f"{k} {v}" for k, v in result.get("peers", {}).items())
    lines = [
        f"numbaccum bench -- {result['date']}; {result['machine']}"
        + (f"; GPU: {result['gpu']}" if result.get("gpu") else ""),
        f"python {result['python']}, numpy {result['numpy']}, numba {result['numba']} "
        f"({result['numba_threads']} threads, {result['threading_layer']})" + (f", {peers}" if peers else ""),
    ]
    for run in result["runs"]:
        per_call = run["per_call"]
        unit, scale = ("us", 1e6) if per_call else ("ms", 1e3)
        floor = run["copy_floor_gbs"]
        lines += [
            "",
            f"{run['device']} -- {run['workload']}: {run['n_params']:,} float32 params in "
            f"{run['n_leaves']} leaves" + (" (per-call overhead)" if per_call else ""),
        ]
        if floor and not per_call:
            what = (
                "a device-to-device copy of the same size"
                if run["device"] == "cuda"
                else "best of np.copyto and a parallel copy"
            )
            lines.append(f"copy floor ({what}, R+W): {floor:.1f} GB/s")
        lines += [
            "",
            f"| operation | implementation | median {unit} | min-max {unit} | GB/s | of copy floor "
            "| vs numpy | numbaccum speed-up |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        by = {(r["op"], r["impl"]): r["median_s"] for r in run["rows"]}
        order = list(dict.fromkeys(r["op"] for r in run["rows"]))
        for r in sorted(run["rows"], key=lambda r: order.index(r["op"])):
            t = r["median_s"]
            cells = [
                r["op"],
                r["impl"],
                _num(t * scale),
                f"{_num(r['min_s'] * scale)}-{_num(r['max_s'] * scale)}",
                "-" if r["gbs"] is None else f"{r['gbs']:.1f}",
                "-" if r["floor_fraction"] is None else f"{r['floor_fraction']:.2f}",
                _ratio(by.get((r["op"], "numpy")), t),
                _ratio(t, by.get((r["op"], "numbaccum"))),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _default_devices() -> tuple[str, ...]:
    """The CPU, and CUDA when a real GPU works here (not the simulator: too slow for the default)."""
    from . import gpu

    works, simulated, why = gpu.status()
    if not works and why != gpu.NO_DEVICE:  # a GPU is there but cannot run kernels: say why
        print(f"numbaccum bench: CUDA skipped: {why}", file=sys.stderr)
    return ("cpu", "cuda") if works and not simulated else ("cpu",)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="numbaccum bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload", action="append", choices=sorted(workloads.WORKLOADS), help="(repeatable) default: all"
    )
    parser.add_argument(
        "--op",
        action="append",
        choices=OPS,
        help="(repeatable) default: all; multisteps times the mini-step and the full step",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda", "all"), help="default: the CPU, and CUDA when a GPU works"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per operation")
    parser.add_argument("--quick", action="store_true", help="the two small workloads, few repeats (< 1 min)")
    parser.add_argument("--json", metavar="FILE", help="also write the raw numbers here")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the comparison (needs matplotlib)")
    parser.add_argument("--no-peers", action="store_true", help="skip PyTorch and optax even if installed")
    parser.add_argument(
        "--peer",
        action="append",
        choices=PEERS,
        help="time only this peer (repeatable; default: every installed one). optax's jit of the "
        "2000-leaf tree takes minutes and much memory on a small machine",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--from-json", metavar="FILE", help="time nothing: the table (and --plot) of an earlier --json run"
    )
    args = parser.parse_args(argv)
    if args.plot:
        from .plot import require_matplotlib

        require_matplotlib()  # before minutes of timing, not after
    if args.from_json:
        try:
            saved = load_result(args.from_json)
        except ValueError as e:
            print(f"numbaccum bench --from-json: {e}", file=sys.stderr)
            return 2
        return _report(saved, None, args.plot)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    names = tuple(args.workload or (QUICK_WORKLOADS if args.quick else DEFAULT_WORKLOADS))
    base = QUICK_REPEATS if args.quick else REPEATS
    repeats = {w: args.repeats or base[w] for w in names}
    if args.device == "all":
        devices: tuple[str, ...] = DEVICES
    elif args.device:
        devices = (args.device,)
    else:
        devices = _default_devices()
    ops = tuple(dict.fromkeys(args.op or OPS))
    print(
        f"numbaccum bench: {', '.join(devices)} x {', '.join(names)}; {', '.join(ops)} ...",
        file=sys.stderr,
        flush=True,
    )
    peers = () if args.no_peers else (args.peer or PEERS)
    result = run(names, devices, ops, peers, repeats, not args.no_progress)
    return _report(result, args.json, args.plot)


# What a --json run holds and `format_table` reads: key -> the types its value may have.
_RESULT_KEYS: dict[str, tuple[type, ...]] = {
    "date": (str,),
    "machine": (str,),
    "python": (str,),
    "numpy": (str,),
    "numba": (str,),
    "numba_threads": (int,),
    "threading_layer": (str,),
    "runs": (list,),
}
_RUN_KEYS: dict[str, tuple[type, ...]] = {
    "device": (str,),
    "workload": (str,),
    "n_params": (int,),
    "n_leaves": (int,),
    "per_call": (bool,),
    "copy_floor_gbs": (int, float, type(None)),
    "rows": (list,),
}
_ROW_KEYS: dict[str, tuple[type, ...]] = {
    "op": (str,),
    "impl": (str,),
    "median_s": (int, float),
    "min_s": (int, float),
    "max_s": (int, float),
    "gbs": (int, float, type(None)),
    "floor_fraction": (int, float, type(None)),
}


def load_result(path: str) -> dict[str, Any]:
    """A result that ``--json`` wrote, checked and with control characters removed from its strings
    (a file's text must not drive the terminal); ValueError with the reason for anything else."""
    shown = _printable(repr(path))
    try:
        with open(path, "rb") as f:
            data = f.read(64 << 20)
    except OSError as e:
        raise ValueError(f"{shown}: cannot read it ({_printable(e.strerror or str(e))})") from None
    try:
        result = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = type(e).__name__ if isinstance(e, RecursionError) else _printable(str(e))[:200]
        raise ValueError(f"{shown}: not the JSON of a numbaccum bench --json run ({why})") from None
    _check_keys(result, _RESULT_KEYS, "the file", shown)
    peers, gpu = result.get("peers", {}), result.get("gpu")
    if not isinstance(peers, dict) or not all(isinstance(v, str) for v in peers.values()):
        raise ValueError(f"{shown}: 'peers' is not a dict of versions: not a numbaccum bench --json run")
    if gpu is not None and not isinstance(gpu, str):
        raise ValueError(f"{shown}: 'gpu' is a {type(gpu).__name__}: not a numbaccum bench --json run")
    for i, run in enumerate(result["runs"]):
        _check_keys(run, _RUN_KEYS, f"runs[{i}]", shown)
        for j, row in enumerate(run["rows"]):
            _check_keys(row, _ROW_KEYS, f"runs[{i}].rows[{j}]", shown)
            if not row["median_s"] > 0 or not row["min_s"] > 0 or not row["max_s"] > 0:
                raise ValueError(f"{shown}: runs[{i}].rows[{j}]: times must be positive")
    return _clean(result)


def _check_keys(obj: Any, keys: dict[str, tuple[type, ...]], where: str, shown: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{shown}: {where} is not a JSON object: not a numbaccum bench --json run")
    for key, types in keys.items():
        if key not in obj:
            raise ValueError(f"{shown}: {where} has no {key!r}: not a numbaccum bench --json run")
        value = obj[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(f"{shown}: {where}: {key!r} is a {type(value).__name__}, not a bench result's")


def _printable(text: str) -> str:
    """``text`` without control characters (ANSI escapes among them), each shown as ``?``."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _clean(x: Any) -> Any:
    if isinstance(x, str):
        return _printable(x)
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, dict):
        return {_clean(k): _clean(v) for k, v in x.items()}
    return x


def _report(result: dict[str, Any], json_path: str | None, plot_path: str | None) -> int:
    print(format_table(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    if plot_path:
        from .plot import plot

        plot(result, plot_path)
        print(f"plot: {plot_path}", file=sys.stderr)
    return 0
