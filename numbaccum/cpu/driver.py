"""The CPU driver: compiles the formulas of `numbaccum.formulas` into numba ``@njit`` loops.

For each formula it generates one loop body over an index range ``[lo, hi)`` (the buffers are
sliced and walked from 0: a provably non-negative index lets LLVM drop numba's wraparound check
and vectorise, measured 2x on a mean accumulate) and two drivers: a parallel one (``prange``
over fixed chunks of ``_config.CHUNK``) and a serial one for buffers under
``_config.SERIAL_BELOW``. ``error_model="numpy"``: a division by zero gives inf or NaN as in
NumPy (optax's ``ema`` with ``decay = 1`` is NaN), never an exception.

`map` is the one entry point of elementwise work: it casts the scalars to the compute dtype of
the call, stages float16 buffers through float32 copies (numba has no float16 arithmetic on the
CPU; the buffers the formula writes are copied back, rounded once), runs bfloat16 buffers through
a variant of the loop that reads their raw bits, widened to float32, and rounds each stored value
once (two bytes an element moved, not six), and never lets two threads into numba's
``workqueue`` layer at once (it aborts the process, numba#9288).

Fork. A child of ``os.fork`` gets numbaccum's locks free again (`numbaccum._locks`). When
its parent had started numba's GNU OpenMP layer, whose threads the child does not have (numba
terminates such a child at its first parallel region), parallel regions are off in the child
(`_config.PARALLEL`): every kernel, the reductions' and the per-example sums' too, takes its
serial driver (`runs_serial`), which gives the same bits, and the child warns once.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import njit, prange

from .. import _cache, _config, _locks, formulas
from ..contract import Factor, cast_scalars
from ..formulas import Formula, compile_formula
from ..layout import compute_dtype, real_dtype
from . import streaming

__all__ = ["NAME", "map_", "parallel_guard", "runs_serial"]

NAME = "cpu"

_workqueue_lock = _locks.lock()
_NO_GUARD = contextlib.nullcontext()
_guard: Any = None  # decided after the first parallel call
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
# Called with each formula before it runs (`map_` and prepared launches alike): how tests count
# the kernels a step launches. Empty: nothing is called.
observers: list[Callable[[Formula], Any]] = []


def parallel_guard() -> Any:
    """A lock when numba fell back to the ``workqueue`` layer, which aborts the process when two
    threads enter parallel kernels at once (numba#9288); nothing for the thread-safe omp/tbb."""
    global _guard
    if _guard is None:
        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel kernel has run yet: be safe this once
            return _workqueue_lock
        _guard = _workqueue_lock if layer == "workqueue" else _NO_GUARD
    return _guard


def guard_for(size: int) -> Any:
    """The guard of a call over ``size`` elements: numba is asked for its layer only after a call
    big enough to have entered a parallel region (asking before raises, which costs more than a
    small tree's kernel); until then, the lock."""
    guard = _guard
    if guard is None:
        guard = parallel_guard() if size >= _config.SERIAL_BELOW else _workqueue_lock
    return guard


def runs_serial(n: int) -> bool:
    """Whether a kernel over ``n`` elements takes its serial driver: below `_config.SERIAL_BELOW`
    (a parallel region costs more than the work), or wherever parallel regions are off
    (`_config.PARALLEL`: a child forked after GNU OpenMP's threads started, which says so once,
    `_after_fork_in_child`). The serial drivers give the same bits."""
    if n < _config.SERIAL_BELOW:
        return True
    if _config.PARALLEL:
        return False
    if _fork_note:
        _say_forked_serial()
    return True


# --- fork ---------------------------------------------------------------------------------------

_fork_note: list[str] = []  # in a forked child: the layer whose warning its first big kernel owes


def _after_fork_in_child() -> None:
    """Runs in every child of ``os.fork`` (``multiprocessing``'s default start method on Linux up
    to Python 3.13). numbaccum's locks are made again: a fork while another thread held one
    (inside an update under the workqueue lock, compiling a formula) left the child's copy held
    forever. Where the parent's threading layer cannot run in a child (`_unforkable_layer`),
    parallel regions are off (`_config.PARALLEL`): every kernel runs its serial driver."""
    global _guard
    _guard = None  # the locks themselves are made free by `numbaccum._locks`
    layer = _unforkable_layer()
    if layer is not None:
        _config.PARALLEL = False
        _fork_note[:] = [layer]  # each process says it once, a child of a child too


def _unforkable_layer() -> str | None:
    """numba's threading layer when it has started in this process (a fork inherits it) and
    cannot run parallel regions in a forked child: GNU OpenMP, whose threads a child does not
    have (numba raises SIGTERM in the child at its first parallel region; a grandchild would wait
    for threads forever). Else None: tbb and workqueue start again in a child (numba's notes on
    threading layers), and a layer not started yet starts in the child itself."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # not started
        return None
    if layer != "omp":
        return None
    from numba.np.ufunc import omppool  # type: ignore[attr-defined]  # a compiled module, no stub

    vendor = getattr(omppool, "openmp_vendor", "GNU")
    return f"omp, {vendor} OpenMP" if vendor == "GNU" else None


def _say_forked_serial() -> None:
    """The one warning of a forked child whose kernels run serially, at its first kernel that
    would have run in parallel."""
    try:
        layer = _fork_note.pop()
    except IndexError:  # another thread said it
        return
    warnings.warn(
        f"numbaccum: this process was forked from one whose numba threading layer ({layer}) had "
        "started, and its threads do not survive a fork: kernels run on one thread here (the same "
        "results). For parallel kernels in worker processes, start them with "
        "multiprocessing.get_context('spawn') (or 'forkserver').",
        RuntimeWarning,
        stacklevel=_caller_level(),
    )


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside numbaccum (the user's call, from wherever
    in the package the warning is raised; code numbaccum generates is named ``<numbaccum ...>``)."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE_DIR, "<numbaccum")):
        frame, level = frame.f_back, level + 1
    return level


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@njit(inline="always", error_model="numpy")
def read(v, div, mul, scaled):  # pragma: no cover - compiled
    """The pending factor on a read: (v / div) * mul, skipped (two divisions saved) when 1, 1."""
    return (v / div) * mul if scaled else v


@njit(inline="always", error_model="numpy")
def read_complex(v, div, mul, scaled):  # pragma: no cover - compiled
    """`read` of a complex v: divided by the real div part by part (`formulas.complex_quot`)."""
    return complex(v.real / div, v.imag / div) * mul if scaled else v


# --- code generation --------------------------------------------------------------------------

_BODY = """
def body(lo, hi, {arrays}, div, mul, scaled, {scalars}):
{slices}
    for k in range(hi - lo):
        r = fn({args})
{stores}
"""

# The streaming variant (`numbaccum.cpu.streaming`): blocks of the output computed into scratch
# by the usual loop (vectorised), each then written out with streaming stores.
_STREAM_BODY = """
def body(lo, hi, {arrays}, div, mul, scaled, {scalars}):
{slices}
{scratch}
    for b in range(0, hi - lo, BLOCK):
        m = min(BLOCK, hi - lo - b)
{blocks}
        for k in range(m):
            r = fn({args})
{stores}
{copies}
    sfence()
"""

_DRIVERS = """
def parallel(n, chunk, {arrays}, div, mul, scaled, {scalars}):
    for c in prange((n + chunk - 1) // chunk):
        body(c * chunk, min(n, (c + 1) * chunk), {arrays}, div, mul, scaled, {scalars})

def serial(n, chunk, {arrays}, div, mul, scaled, {scalars}):
    body(0, n, {arrays}, div, mul, scaled, {scalars})
"""


def _source(f: Formula, variant: tuple | None = None) -> tuple[str, str]:
    """The generated loop body and drivers of formula ``f`` (Python source). ``variant``
    (`_variant`): ``(bf16, ctype, stream, alias)``, which arrays are bfloat16 (passed as their raw
    bits, uint16), the compute dtype's name, whether the outputs are written with streaming
    stores (`numbaccum.cpu.streaming`), and for an array passed twice, each array's first
    position (empty: none is). A bfloat16 array's elements are widened when read
    (`formulas.from_bf16`) and rounded once when stored (`formulas.to_bf16`, or
    `to_bf16_from64` from float64)."""
    arrays = [f"a{i}" for i in range(len(f.arrays))]
    scalars = [f"p{i}" for i in range(len(f.scalars))] or ["_unused"]
    ns, ni = len(f.states), len(f.inputs)
    bf16, ctype, stream, alias = variant if variant is not None else ((False,) * len(arrays), "", False, ())
    written = list(f.writes)
    streamed = [w for w in written if stream and w >= ns + ni]
    view = "u" if streamed else "v"  # the streaming variant reads and writes each block's views
    reads = [f"from_bf16({view}{i}[k])" if bf16[i] else f"{view}{i}[k]" for i in range(ns + ni)]
    if ni:
        reads[ns] = f"read({reads[ns]}, div, mul, scaled)"
    index = ["lo + b + k" if streamed else "lo + k"] if f.indexed else []  # the element's, in its buffers
    args = ", ".join(reads + [f"p{i}" for i in range(len(f.scalars))] + index)
    narrow = "to_bf16_from64" if ctype == "float64" else "to_bf16"
    values = ["r"] if len(written) == 1 else [f"r[{j}]" for j in range(len(written))]
    indent = " " * (12 if streamed else 8)
    stores = []
    for w, r in zip(written, values):
        if w in streamed:
            stores.append(f"{indent}s{w}[k] = {narrow}({r})" if bf16[w] else f"{indent}s{w}[k] = {r}")
        elif bf16[w]:
            stores.append(f"{indent}{view}{w}[k] = {narrow}({r})")
        else:
            stores.append(f"{indent}{view}{w}[k] = {r}")
    fmt = {"arrays": ", ".join(arrays), "scalars": ", ".join(scalars)}
    kept = [i for i in range(len(arrays)) if i not in streamed]
    # An array passed twice (an output that is an input: the updates scaled in place) is sliced
    # once: LLVM vectorises a loop that reads and writes one slice, but one that writes a slice
    # that may overlap another it reads runs its scalar fallback (measured 2.5x slower in place).
    sliced = [f"    v{i} = v{alias[i]}" if alias and alias[i] != i else f"    v{i} = a{i}[lo:hi]" for i in kept]
    if not streamed:
        body = _BODY.format(slices="\n".join(sliced), args=args, stores="\n".join(stores), **fmt)
    else:
        body = _STREAM_BODY.format(
            slices="\n".join(sliced),
            scratch="\n".join(f"    s{w} = np.empty(BLOCK, a{w}.dtype)" for w in streamed),
            blocks="\n".join(f"        u{i} = v{i}[b : b + m]" for i in kept),
            args=args,
            stores="\n".join(stores),
            copies="\n".join(f"        stream_copy(a{w}, lo + b, s{w}, m)" for w in streamed),
            **fmt,
        )
    return body, _DRIVERS.format(**fmt)


_COMPILED: dict[Any, tuple[Any, Any]] = {}
_COMPILE_LOCK = _locks.lock()


def compiled(f: Formula, variant: tuple | None = None) -> tuple[Any, Any]:
    """The (parallel, serial) drivers of formula ``f`` (of its ``variant``, see `_source`),
    generated once per formula and variant (keyed by the declaration, so two formulas of one
    name never share drivers)."""
    key = f if variant is None else (f, variant)  # the plain drivers by the formula alone: hashed every call
    pair = _COMPILED.get(key)
    if pair is None:
        with _COMPILE_LOCK:
            pair = _COMPILED.get(key)
            if pair is None:
                pair = _COMPILED[key] = _compile(f, variant)
    return pair


def _compile(f: Formula, variant: tuple | None) -> tuple[Any, Any]:
    """Generates the module of ``f``'s drivers and jits them. With the kernel cache on, the
    module is a file in the cache named by a hash of its source and of ``f`` (numba caches only
    functions with a source file), so a later process loads the compiled drivers."""
    body_src, drivers_src = _source(f, variant)
    complex_ = variant is not None and variant[1].startswith("complex")
    # A complex kernel's source says so: its helpers differ (`formulas.COMPLEX_HELPERS`), so its
    # cache file must not be the real kernel's of the same text.
    kind = " (complex helpers)" if complex_ else ""
    source = f"# numbaccum.cpu.driver: the drivers of formula {f.name}{kind}\n{body_src}{drivers_src}"
    digest = _cache.code_digest(f)
    path = _cache.source_file(source, f"cpu_{f.name}", f"cpu\0{digest}") if digest else None
    ns = _cache.namespace(path, f"<numbaccum.cpu.driver {f.name}>")
    ns["fn"] = compile_formula(f.fn, _inline, complex=complex_)
    ns["read"] = read_complex if complex_ else read
    ns["prange"] = prange
    if variant is not None:
        ns.update(formulas.bf16_conversions(_inline, _BF16))
        ns.update(np=np, BLOCK=streaming.BLOCK, stream_copy=streaming.stream_copy, sfence=streaming.sfence)
    exec(compile(source, ns["__file__"], "exec"), ns)
    # Globals are resolved when a function compiles: `parallel` and `serial` call the jitted body.
    ns["body"] = njit(error_model="numpy")(_cache.identify(ns["body"], f.name))
    parallel = njit(parallel=True, error_model="numpy")(ns["parallel"])
    serial = njit(error_model="numpy")(ns["serial"])
    if path:
        parallel, serial = _cache.cached(parallel), _cache.cached(serial)
    return parallel, serial


_inline = njit(inline="always", error_model="numpy")
_BF16: dict[str, Any] = {}  # the bfloat16 conversions a variant's loop calls (`formulas.bf16_conversions`)


# --- the entry point --------------------------------------------------------------------------


def map_(f: Formula, factor: Factor, arrays: tuple, scalars: tuple) -> None:
    """Runs formula ``f`` over ``arrays`` (its states, inputs and outputs, all of one size),
    reading ``arrays[len(f.states)]`` through ``factor``, with ``scalars`` cast to the compute
    dtype (bools stay bools)."""
    dtypes = [a.dtype for a in arrays]
    ctype = dtypes[0]
    bf16 = False
    if dtypes.count(ctype) != len(dtypes):
        kinds = set(dtypes)  # hashing first: == between dtypes is slow
        if _F16 in kinds:
            return _staged(f, factor, arrays, scalars)
        ctype = compute_dtype(*kinds)
        bf16 = any(d.kind == "V" for d in kinds)
    elif ctype.type is np.float16:
        return _staged(f, factor, arrays, scalars)
    elif ctype.kind == "V":  # bfloat16: computed in float32
        ctype, bf16 = _F32, True
    n = arrays[0].size
    variant, twice = None, _passed_twice(arrays)
    if bf16 or ctype.kind == "c" or n >= _config.STREAM_BYTES // 8 or twice:
        arrays, variant = _variant(f, arrays, ctype, bf16, twice)
    _run(f, _kernel_for(f, n, variant), (n, _config.CHUNK, *arrays), real_dtype(ctype).type, factor, scalars)


def _passed_twice(arrays: tuple) -> bool:
    """Whether an array is passed more than once (`_source`'s ``alias``)."""
    for i in range(1, len(arrays)):  # a loop: a few arrays, every call
        a = arrays[i]
        for j in range(i):
            if arrays[j] is a:
                return True
    return False


def _variant(
    f: Formula, arrays: tuple, ctype: np.dtype, bf16: bool, twice: bool
) -> tuple[tuple, tuple | None]:
    """The arrays as the kernel takes them (bfloat16 ones as their raw bits, uint16 views) and
    the variant of the drivers that runs them (`_source`), None for the plain drivers; ``twice``:
    whether an array is passed more than once (`_passed_twice`, asked once by the caller). Streaming
    stores write the outputs when one of at least `_config.STREAM_BYTES` is not an input or a
    state, on a parallel call (x86-64 only)."""
    n, first_out = arrays[0].size, len(f.states) + len(f.inputs)
    stream = n >= max(_config.SERIAL_BELOW, 1) and ctype.kind != "c" and streaming.available()
    stream = stream and any(
        a.dtype.kind in "fV"
        and n * a.dtype.itemsize >= _config.STREAM_BYTES
        and all(a is not b for b in arrays[:first_out])
        for a in arrays[first_out:]
    )
    if not bf16 and not stream and ctype.kind != "c" and not twice:
        return arrays, None
    # Loops, not generators: an in-place call of a small tree (L-BFGS's) comes here every step.
    alias: tuple = ()
    if twice:  # each array's first position among the arrays (itself unless passed twice)
        first = []
        for i, a in enumerate(arrays):
            j = 0
            while arrays[j] is not a:
                j += 1
            first.append(j)
        alias = tuple(first)
    if not bf16:
        return arrays, ((False,) * len(arrays), ctype.name, stream, alias)
    marks = tuple([a.dtype.kind == "V" for a in arrays])
    raw = tuple([a.view(np.uint16) if b else a for a, b in zip(arrays, marks)])
    return raw, (marks, ctype.name, stream, alias)


def prepare(f: Formula, arrays: tuple) -> Callable[[Factor, tuple], None]:
    """`map_` of formula ``f`` over these very ``arrays``, returned as ``launch(factor,
    scalars)``: what `map_` derives from the arrays (the compute dtype, the driver and its
    variant, the leading arguments) is derived once, and after the first call the serial
    driver's compiled function is called without numba's dispatch (`entry_point`). What a kept
    plan's group call replays every step (`numbaccum.fuse`): a small tree's step costs
    microseconds, and these are some of them."""
    kinds = {a.dtype for a in arrays}
    if _F16 in kinds:
        return lambda factor, scalars: map_(f, factor, arrays, scalars)
    if len(kinds) == 1:  # the common case, asked by every plan made for one step
        (ctype,) = kinds
        bf16 = ctype.kind == "V"
        ctype = _F32 if bf16 else ctype
    else:
        ctype, bf16 = compute_dtype(*kinds), any(d.kind == "V" for d in kinds)
    n = arrays[0].size
    variant, twice = None, _passed_twice(arrays)
    if bf16 or ctype.kind == "c" or n >= _config.STREAM_BYTES // 8 or twice:
        arrays, variant = _variant(f, arrays, ctype, bf16, twice)
    cast = real_dtype(ctype).type  # a complex call's scalars are real
    head, kernel = (n, _config.CHUNK, *arrays), _kernel_for(f, n, variant)
    found: list = []

    def launch(factor: Factor, scalars: tuple) -> None:
        if found and found[0] is not kernel:
            # The compiled function converts each scalar to its argument's type as the first
            # call's cast did (a float rounded once to float32; a bool by its truth): no cast.
            if observers:
                for o in observers:
                    o(f)
            div, mul = factor.div, factor.mul
            found[0](*head, div, mul, not (div == 1.0 and mul == 1.0), *(scalars or _NO_SCALARS))
            return
        args = _run(f, kernel, head, cast, factor, scalars)
        if n < _config.SERIAL_BELOW and not found:
            found.append(entry_point(kernel, args))  # the dispatcher itself if none is found

    return launch


_NO_SCALARS = (False,)  # a formula without scalars still gets one: the signature needs a name


def entry_point(kernel: Any, args: tuple) -> Any:
    """The compiled function a numba dispatcher ``kernel`` runs for ``args`` (the signature of
    these very arguments), to be called with arguments of the same types without the
    dispatcher's type matching (a microsecond for twenty arguments); the dispatcher if none."""
    try:
        return kernel.overloads[tuple(map(kernel.typeof_pyval, args))].entry_point
    except (AttributeError, KeyError):
        return kernel


def _kernel_for(f: Formula, n: int, variant: tuple | None = None) -> Any:
    """The driver of ``f`` (its ``variant``) for ``n`` elements: the serial one below
    `_config.SERIAL_BELOW` (which never enters a parallel region, so needs no guard), else a
    launch that runs the parallel one behind its guard (`guard_for`), or the serial one where
    parallel regions are off (`runs_serial`: asked at every call, since a launch prepared before
    a fork runs in the child too)."""
    parallel, serial = compiled(f, variant)
    if n < _config.SERIAL_BELOW:
        return serial

    def launch(*args: Any) -> None:
        if runs_serial(n):
            serial(*args)
            return
        with guard_for(n):  # asked at every call: the layer is known after the first parallel call
            parallel(*args)

    return launch


def _run(f: Formula, kernel: Any, head: tuple, cast: type, factor: Factor, scalars: tuple) -> tuple:
    """The call of `map_` and of a prepared launch: ``kernel`` (`_kernel_for`) called with the
    leading arguments ``head`` (the size, the chunk, the arrays), the factor and the scalars cast
    (a float16 call is observed in the float32 call it stages). Returns the arguments."""
    if observers:
        for o in observers:
            o(f)
    div, mul = factor.div, factor.mul
    values = cast_scalars((div, mul, *scalars), cast)
    values.insert(2, not (div == 1.0 and mul == 1.0))
    if len(values) == 3:  # a formula without scalars still gets one: the signature needs a name
        values.append(False)
    args = (*head, *values)
    kernel(*args)
    return args


def _staged(f: Formula, factor: Factor, arrays: tuple, scalars: tuple) -> None:
    """`map_` with float16 buffers: each computed through a copy in the call's compute dtype
    (float32, or float64 beside a float64 buffer: a float16 result is then rounded once, from
    the promoted dtype); the buffers the formula writes are copied back once."""
    wide = compute_dtype(_F32, *(a.dtype for a in arrays))
    staged: dict[int, np.ndarray] = {}  # id(float16 buffer) -> its copy
    for a in arrays:
        if a.dtype == _F16 and id(a) not in staged:
            staged[id(a)] = a.astype(wide)
    run_arrays = tuple(staged.get(id(a), a) for a in arrays)
    map_(f, factor, run_arrays, scalars)
    for i in f.writes:
        if id(arrays[i]) in staged:
            np.copyto(arrays[i], run_arrays[i], casting="same_kind")
