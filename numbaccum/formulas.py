"""Every per-element formula of numbaccum, written once as plain Python; the drivers compile them.

A formula is a plain function of scalars. Its `Formula` declaration says how a driver feeds it
from flat buffers: the *states* it reads and writes back, the *inputs* it only reads (the first
one is the gradient, read through the pending `numbaccum.contract.Factor`), the *outputs* it only
writes, and the per-step *scalars* (cast to the buffer dtype before the call; bools and NumPy
integers, such as a noise key's words, pass as they are). The function takes
``(*states, *inputs, *scalars)``, and an *indexed* formula the element's index in its buffers
last; it returns the new states followed by the outputs (a tuple, or one value when it writes
one buffer).

The CPU driver (`numbaccum.cpu.driver`) compiles a formula with ``numba.njit(inline="always")``
into a parallel loop, the CUDA driver (`numbaccum.cuda.driver`) with ``cuda.jit(device=True)``
into a grid-stride kernel: one formula, two drivers, the same order of operations (optax's), in
the buffer dtype. Comparisons are written so that NaN goes the documented way.

Where a formula lives: the general ones (each reached by an `numbaccum.contract.Ops` method) are
here; a formula that only one declared stage runs (`numbaccum.declared.Elementwise`) may sit next
to that declaration, in any module. The `formula` decorator registers every formula by its name
(`registered`), which must be unique: a fused chain's composite calls formulas by name
(`numbaccum.fuse`), and both drivers compile each one with the helpers of this module. A formula
declared elsewhere calls those helpers imported by name (``from .formulas import maximum``): it
compiles with its own module's globals, where the helpers and formulas of this module become
their compiled selves.
"""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import _locks

__all__ = ["Formula", "compile_formula", "formula", "registered"]


class Formula(NamedTuple):
    """The declaration of an elementwise formula.

    Attributes:
        fn: ``fn(*states, *inputs, *scalars) -> (*new_states, *outputs)``, plain Python.
        states: buffers read and written back (moments, traces, accumulators).
        inputs: buffers only read; ``inputs[0]`` is read through the pending factor.
        outputs: buffers only written.
        scalars: per-step scalars, in order.
        indexed: the function also takes, last, the element's index in its buffers (an int64):
            what a formula that draws noise per element (`normal`) counts from.
    """

    fn: Callable
    states: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    scalars: tuple[str, ...]
    indexed: bool = False

    @property
    def name(self) -> str:
        return self.fn.__name__

    @property
    def arrays(self) -> tuple[str, ...]:
        """The buffer arguments in the order a driver takes them: states, inputs, outputs."""
        return self.states + self.inputs + self.outputs

    @property
    def writes(self) -> tuple[int, ...]:
        """Positions (in `arrays`) of the buffers the formula writes."""
        n_in = len(self.inputs)
        return tuple(range(len(self.states))) + tuple(
            len(self.states) + n_in + k for k in range(len(self.outputs))
        )


_REGISTRY: dict[str, Formula] = {}
_REGISTRY_LOCK = _locks.lock()


def formula(
    states: tuple = (), inputs: tuple = (), outputs: tuple = (), scalars: tuple = (), indexed: bool = False
) -> Callable:
    """Declares ``fn`` as a `Formula` (the module attribute becomes the declaration) and
    registers it under ``fn.__name__`` (see `registered`).

    Raises:
        ValueError: another function (of another module or qualified name) already declared a
            formula of that name. Declaring the same function again (a reloaded module)
            replaces its formula.
    """

    def declare(fn: Callable) -> Formula:
        f = Formula(fn, tuple(states), tuple(inputs), tuple(outputs), tuple(scalars), indexed)
        with _REGISTRY_LOCK:
            old = _REGISTRY.get(f.name)
            if old is not None and _origin(old.fn) != _origin(fn):
                where = ".".join(_origin(old.fn))
                raise ValueError(f"a formula named {f.name!r} is already declared ({where})")
            _REGISTRY[f.name] = f
        return f

    return declare


def _origin(fn: Callable) -> tuple[str, str]:
    return (fn.__module__, fn.__qualname__)


def registered() -> dict[str, Formula]:
    """Every formula declared so far, by name: this module's, and those declared beside their
    stages in other modules (``import numbaccum`` declares all of numbaccum's)."""
    with _REGISTRY_LOCK:
        return dict(_REGISTRY)


def compile_formula(fn: Callable, jit: Callable[[Callable], Any], complex: bool = False) -> Any:
    """``fn`` compiled by ``jit`` (a driver's decorator), with every plain helper of this module
    and every registered formula it may call compiled by the same ``jit``: they stay plain
    Python, so both drivers compile the one copy. With ``complex`` (a kernel over complex
    buffers), the `COMPLEX_HELPERS` are compiled in place of the helpers of their names.

    A formula declared in another module compiles with its module's globals, where a name bound
    to a helper or a formula (under any name) becomes its compiled self; every other name keeps
    its meaning, so the plain-Python formula and the compiled one read the same names, and
    `numbaccum._cache.code_digest` hashes what they hold. A composite (`numbaccum.fuse`, exec'd
    without a module) compiles with this module's globals."""
    plain = globals()
    glb = dict(plain)
    for name, helper in _helpers().items():
        glb[name] = jit(_rebind(COMPLEX_HELPERS.get(name, helper) if complex else helper, glb))
    # A fused chain's composite (`numbaccum.fuse`) calls formulas by their names: each one is
    # compiled there as a function too (numba compiles a dispatcher on its first typed call, so
    # a scope may be filled after the functions that read it are made).
    scopes: list[tuple[dict, dict]] = []

    def scoped(f: Callable) -> Callable:
        own = f.__globals__
        if own is plain or "__name__" not in own:  # this module, or a composite (exec'd)
            return _rebind(f, glb)
        scope: dict = {}
        scopes.append((scope, own))
        return _rebind(f, scope)

    decls = registered()
    for name, decl in decls.items():
        glb[name] = jit(scoped(decl.fn))
    out = jit(scoped(fn))
    if scopes:
        swap = {id(helper): glb[name] for name, helper in _helpers().items()}
        swap.update({id(decl): glb[name] for name, decl in decls.items()})
        for scope, own in scopes:
            scope.update({name: swap.get(id(v), v) for name, v in own.items()})
    return out


def _rebind(fn: Callable, glb: dict) -> Callable:
    """``fn`` reading its globals from ``glb`` (numba resolves them when it compiles)."""
    return types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)


def _helpers() -> dict[str, Callable]:
    """The plain scalar functions of this module that formulas call (not its machinery)."""
    machinery = {
        "formula",
        "compile_formula",
        "registered",
        "_origin",
        "_rebind",
        "_helpers",
        "bf16_conversions",
        "widening",
    }
    return {
        name: v
        for name, v in globals().items()
        if inspect.isfunction(v) and v.__module__ == __name__ and name not in machinery
    }


# --- helpers (compiled with the formulas that call them) -------------------------------------


def as_float32(v):
    """v rounded to float32 (a fused chain's value between two formulas, stored as a buffer
    of that dtype would hold it)."""
    return np.float32(v)


def as_float64(v):
    """v as float64."""
    return np.float64(v)


def as_complex64(v):
    """v rounded to complex64 (a real v: its imaginary part +0), as such a buffer holds it."""
    return np.complex64(v)


def as_complex128(v):
    """v as complex128."""
    return np.complex128(v)


# bfloat16 has no type in numba: a bfloat16 buffer reaches a kernel as its raw 16 bits (uint16),
# each element widened to float32 when read (exact: bfloat16 is float32's upper half) and rounded
# once, to nearest even, when stored. Written with scalar ``view``s, which numba compiles to a
# bitcast and NumPy runs as is: one copy for both drivers and for reading.


def from_bf16(h):
    """The float32 value of bfloat16 bits ``h`` (exact)."""
    return np.uint32(np.uint32(h) << np.uint32(16)).view(np.float32)


def to_bf16(v):
    """float32 ``v`` rounded to the nearest bfloat16, ties to even, as bits (uint16): carrying
    the rounding into the exponent overflows to inf as it should; NaN stays a quiet NaN of its
    sign (ml_dtypes' bits)."""
    b = np.float32(v).view(np.uint32)
    if v != v:
        return np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def to_bf16_from64(v):
    """float64 ``v`` rounded once to the nearest bfloat16 (ties to even), as bits: through a
    float32 rounded to odd (truncated, its last bit set when inexact), which then rounds to
    bfloat16 as ``v`` itself would (float32 keeps 16 more bits than bfloat16: more than the 2
    that rounding to odd needs); a plain float32 rounding first would round twice."""
    y = np.float32(v)
    if v != v or np.float64(y) == v:
        return to_bf16(y)
    b = y.view(np.uint32)
    if abs(np.float64(y)) > abs(v):  # rounded away from zero (to inf, too): truncate instead
        b = np.uint32(b - np.uint32(1))
    return to_bf16(np.uint32(b | np.uint32(1)).view(np.float32))


def as_bfloat16(v):
    """float32 ``v`` rounded to bfloat16 and widened again (a fused chain's value between two
    formulas, as a bfloat16 buffer would hold it): ``from_bf16(to_bf16(v))`` on the 32 bits,
    without narrowing them to 16 and back (two fewer operations a value: a bfloat16 Adam step
    rounds three times per element)."""
    b = np.float32(v).view(np.uint32)
    if v != v:
        return np.uint32((b | np.uint32(0x400000)) & np.uint32(0xFFFF0000)).view(np.float32)
    r = b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
    return np.uint32(r & np.uint32(0xFFFF0000)).view(np.float32)


def as_bfloat16_from64(v):
    """float64 ``v`` rounded once to bfloat16, widened to float32 (`as_bfloat16`)."""
    return from_bf16(to_bf16_from64(v))


def bf16_as_float64(h):
    """The float64 value of bfloat16 bits ``h`` (exact): how a reduction reads such an element."""
    return np.float64(from_bf16(h))


_BF16_CONVERSIONS = ("from_bf16", "to_bf16", "to_bf16_from64")


def bf16_conversions(jit: Callable[[Callable], Any], into: dict[str, Any]) -> dict[str, Any]:
    """The bfloat16 conversions a driver's generated loop calls, by name, compiled by ``jit``
    into the driver's ``into`` once (when its first bfloat16 kernel is made): one source for
    the CPU loop and the CUDA kernel."""
    if not into:
        into.update({name: compile_formula(globals()[name], jit) for name in _BF16_CONVERSIONS})
    return into


def widening(jit: Callable[[Callable], Any]) -> tuple[Any, Any, Any]:
    """How a reduction engine reads an element, compiled by ``jit``: ``(as float64, as
    complex128, bfloat16 bits as float64)`` (`as_float64`, `as_complex128`, `bf16_as_float64`),
    the same three functions on both backends."""
    return jit(as_float64), jit(as_complex128), compile_formula(bf16_as_float64, jit)


# --- real and complex ------------------------------------------------------------------------
# A formula is written once for real and complex buffers (optax's semantics on complex leaves):
# second moments and norms take |g|^2 (`abs_sq`), a moment optax keeps real-valued in a complex
# buffer (``nu``, imaginary part +0) is read through `re`, and `signum` and `tanh` are jnp's. On a
# real buffer each helper below is what the formula wrote before (the same bits); a complex
# kernel compiles the `COMPLEX_HELPERS` in their place (`compile_formula`). A complex group's
# scalars are real (its parts' dtype), so ``s * g`` and ``g / s`` keep g's dtype.


def abs_sq(x):
    """|x|^2: ``x * x`` for a real x (``re^2 + im^2`` in a complex kernel, `complex_abs_sq`)."""
    return x * x


def re(x):
    """The real part of a moment kept real-valued in a complex buffer; x itself for a real x."""
    return x


def signum(x):
    """``jnp.sign``: 1 for x > 0, -1 for x < 0, x itself for +-0 and NaN (`complex_signum`: x / |x|
    for a complex x)."""
    if x > 0:
        return 1.0
    if x < 0:
        return -1.0
    return x


def tanh(x):
    """``math.tanh`` (``np.tanh`` of a complex x in a complex kernel)."""
    return math.tanh(x)


def quot(x, d):
    """``x / d`` for a real ``d`` (`complex_quot` divides a complex x part by part)."""
    return x / d


def complex_abs_sq(x):
    """|x|^2 of a complex x: ``re^2 + im^2`` (real, in x's parts' dtype; optax's ``abs_sq``)."""
    return x.real * x.real + x.imag * x.imag


def complex_re(x):
    """The real part of x."""
    return x.real


def complex_signum(x):
    """``jnp.sign`` of a complex x: x where |x| is 0, else each part divided by |x|."""
    a = abs(x)
    if a == 0:
        return x
    return complex(x.real / a, x.imag / a)


def complex_tanh(x):
    """The complex tanh (``np.tanh``)."""
    return np.tanh(x)


def complex_quot(x, d):
    """A complex x divided by a real d, part by part: the bits of the complex division by
    ``d + 0j`` for finite values, and a loop LLVM vectorises (numba's complex division, with its
    branches, keeps an Adam step four times slower)."""
    return complex(x.real / d, x.imag / d)


# What a complex kernel compiles in place of each helper of that name (`compile_formula`).
COMPLEX_HELPERS: dict[str, Callable] = {
    "abs_sq": complex_abs_sq,
    "re": complex_re,
    "signum": complex_signum,
    "tanh": complex_tanh,
    "quot": complex_quot,
}


def finite(v):
    """True for every finite value (``v - v`` is NaN for NaN and +-inf, 0 otherwise)."""
    return v - v == 0


def clamp(v, bound):
    """clip(v, -bound, bound); NaN stays NaN."""
    if v > bound:
        return bound
    if v < -bound:
        return -bound
    return v


def next_abs_ema(e, v, one_minus_decay, decay, init, fresh):
    """The next EMA of |v| from ``e`` (from ``|v| * init`` when fresh); ``e`` for a non-finite v:
    one inf would otherwise disable the clipper for that element for good."""
    if not finite(v):
        return e
    a = abs(v)
    if fresh:
        e = a * init
    return one_minus_decay * a + decay * e


# --- counter-based Gaussian noise (add_noise) ----------------------------------------------------
# Each element's normal is a function of its index: Philox4x32-10 (Salmon et al., "Parallel random
# numbers: as easy as 1, 2, 3", SC 2011; cuRAND's default generator), keyed by the 64-bit seed, of
# the counter (index, step, group), then Box-Muller. No state, no buffer of draws, the same value
# for any thread count, chunk and backend: a kernel computes its elements' noise where it uses it.
# The transform is written in float64 arithmetic only (a polynomial log and sine, no libm call),
# so that LLVM vectorises the loop around it (math.log and math.cos keep it scalar: 3x slower).
# Written in uint64 so that NumPy (the CUDA simulator) never warns of a wrapping uint32 sum.

_MASK32, _32 = np.uint64(0xFFFFFFFF), np.uint64(32)
_PHILOX_M0, _PHILOX_M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_PHILOX_W0, _PHILOX_W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476


def philox4x32(c0, c1, c2, c3, k0, k1):
    """The four 32-bit words (as uint64) of Philox4x32-10 for counter ``(c0, c1, c2, c3)`` and
    key ``(k0, k1)`` (each a 32-bit value): Random123's ten rounds, its known answers."""
    c0, c1, c2, c3 = np.uint64(c0), np.uint64(c1), np.uint64(c2), np.uint64(c3)
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(10):
        p0 = c0 * _PHILOX_M0  # exact: both factors are below 2**32
        p1 = c2 * _PHILOX_M1
        c0, c1, c2, c3 = (p1 >> _32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> _32) ^ c3 ^ k1, p0 & _MASK32
        k0 = (k0 + _PHILOX_W0) & _MASK32
        k1 = (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def log_unit(u):
    """ln(u) for a float64 u in (0, 1], to 1 ulp: u = m 2^e with m in [sqrt(1/2), sqrt(2)), then
    ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, summed to s^21."""
    b = np.float64(u).view(np.uint64)
    e = np.float64(np.int64(b >> np.uint64(52)) - 1023)
    m = np.uint64((b & np.uint64(0xFFFFFFFFFFFFF)) | np.uint64(0x3FF0000000000000)).view(np.float64)
    if m > 1.4142135623730951:
        m *= 0.5
        e += 1.0
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    p = 1 / 19 + z / 21
    p = 1 / 17 + z * p
    p = 1 / 15 + z * p
    p = 1 / 13 + z * p
    p = 1 / 11 + z * p
    p = 1 / 9 + z * p
    p = 1 / 7 + z * p
    p = 1 / 5 + z * p
    p = 1 / 3 + z * p
    p = 1.0 + z * p
    return e * _LN2 + 2.0 * s * p


def sin_pi(t):
    """sin(pi t) for |t| <= 1/2, to 1 ulp: its Taylor series to x^19 (the next term is below
    2**-53 of the sum)."""
    x = math.pi * t
    z = x * x
    p = 1 / 355687428096000 - z / 121645100408832000
    p = -1 / 1307674368000 + z * p
    p = 1 / 6227020800 + z * p
    p = -1 / 39916800 + z * p
    p = 1 / 362880 + z * p
    p = -1 / 5040 + z * p
    p = 1 / 120 + z * p
    p = -1 / 6 + z * p
    return x + x * z * p


def cos_pi(t):
    """cos(pi t) for |t| <= 1/2, to 1 ulp: its Taylor series to x^20."""
    x = math.pi * t
    z = x * x
    p = -1 / 6402373705728000 + z / 2432902008176640000
    p = 1 / 20922789888000 + z * p
    p = -1 / 87178291200 + z * p
    p = 1 / 479001600 + z * p
    p = -1 / 3628800 + z * p
    p = 1 / 40320 + z * p
    p = -1 / 720 + z * p
    p = 1 / 24 + z * p
    p = -0.5 + z * p
    return 1.0 + z * p


def box_muller(k0, k1, step, group, index):
    """``(r, t)`` of element ``index``'s Box-Muller pair, ``r = sqrt(-2 ln u)`` and ``t - 1/2``
    for the angle ``2 pi t``: u in (0, 1) from 53 bits of the first two Philox words (the tail
    reaches 8.6 standard deviations), t from the third."""
    i = np.int64(index)
    w0, w1, w2, _ = philox4x32(np.uint64(i) & _MASK32, np.uint64(i) >> _32, step, group, k0, k1)
    u = (np.float64((w0 << np.uint64(21)) | (w1 >> np.uint64(11))) + 0.5) * 1.1102230246251565e-16  # 2**-53
    return math.sqrt(-2.0 * log_unit(u)), np.float64(w2) * 2.3283064365386963e-10 - 0.5  # 2**-32


def normal(k0, k1, step, group, index):
    """The standard normal of element ``index`` (float64): ``r cos(2 pi t)`` of its `box_muller`
    pair (``cos(2 pi t) = 2 sin^2(pi (t - 1/2)) - 1``). A complex kernel draws `complex_normal`."""
    r, h = box_muller(k0, k1, step, group, index)
    s = sin_pi(h)
    return r * (2.0 * s * s - 1.0)


def complex_normal(k0, k1, step, group, index):
    """The complex standard normal of element ``index`` (complex128, ``E|z|^2 = 1`` as JAX's):
    both parts of its `box_muller` pair, each of variance 1/2."""
    r, h = box_muller(k0, k1, step, group, index)
    s, c = sin_pi(h), cos_pi(h)
    r *= _SQRT_HALF
    return complex(r * (2.0 * s * s - 1.0), -2.0 * r * s * c)


COMPLEX_HELPERS["normal"] = complex_normal


def like(x, v):
    """``v`` in the type of ``x`` (a draw rounded to a formula's compute dtype, as a buffer of
    draws in that dtype would hold it)."""
    return type(x)(v)


# --- the formulas ----------------------------------------------------------------------------


@formula(outputs=("x",), scalars=("value",))
def fill(value):
    """x = value."""
    return value


@formula(inputs=("x",), outputs=("out",))
def scale(x):
    """out = x (the pending factor does the scaling; with none, a copy)."""
    return x


@formula(inputs=("x", "y"), outputs=("out",), scalars=("s",))
def add_scaled(x, y, s):
    """out = x + s * y."""
    return x + s * y


@formula(inputs=("x",), outputs=("out",), scalars=("max_delta",))
def clip(x, max_delta):
    """out = clip(x, -max_delta, max_delta); NaN stays NaN."""
    return clamp(x, max_delta)


@formula(inputs=("x",), outputs=("out",))
def zero_nans(x):
    """out = 0 where x is NaN, else x (inf is kept)."""
    return x if x == x else 0.0  # stored in the buffer's dtype: exact


@formula(
    states=("ema",), inputs=("g",), outputs=("out",), scalars=("one_minus_decay", "decay", "bias_correction")
)
def ema(ema, g, one_minus_decay, decay, bias_correction):
    """e = (1 - decay) * g + decay * ema; ema = e; out = e / bias_correction (optax's rounding)."""
    e = one_minus_decay * g + decay * ema
    return e, quot(e, bias_correction)


@formula(states=("acc",), inputs=("g",), scalars=("count", "fresh"))
def mean_accumulate(acc, g, count, fresh):
    """acc = acc + (g - acc) / count (Welford); g + 0 when fresh (then acc == 0 and count == 1:
    0 + (g - 0) / 1 == g + 0 exactly, -0 becomes +0, and acc need not be read)."""
    return g + 0 if fresh else acc + quot(g - acc, count)


@formula(states=("acc",), inputs=("g",), scalars=("fresh",))
def sum_accumulate(acc, g, fresh):
    """acc = g + acc; g + 0 when fresh (acc == 0)."""
    return g + 0 if fresh else g + acc


@formula(
    states=("ema",),
    inputs=("g",),
    outputs=("out",),
    scalars=("one_minus_decay", "decay", "init", "fresh"),
)
def abs_ema_clip(ema, g, one_minus_decay, decay, init, fresh):
    """ema = EMA of |g| (`next_abs_ema`); out = clip(g, -ema, ema)."""
    e = next_abs_ema(ema, g, one_minus_decay, decay, init, fresh)
    return e, clamp(g, e)


@formula(states=("ema",), inputs=("g",), scalars=("one_minus_decay", "decay", "init", "fresh"))
def abs_ema(ema, g, one_minus_decay, decay, init, fresh):
    """ema = EMA of |g| (`next_abs_ema`)."""
    return next_abs_ema(ema, g, one_minus_decay, decay, init, fresh)


@formula(inputs=("x", "bound"), outputs=("out",))
def clip_by(x, bound):
    """out = clip(x, -bound, bound) with a bound per element; NaN stays NaN."""
    return clamp(x, bound)


@formula(
    states=("prev",),
    inputs=("g",),
    outputs=("out",),
    scalars=("add", "max_growth", "min_value", "max_decay", "fresh"),
)
def growth_clip(prev, g, add, max_growth, min_value, max_decay, fresh):
    """torchzero's ClipValueGrowth: ``|out| <= min(|prev| + add, max_growth * max(|prev|,
    min_value))`` with g's sign; prev becomes ``prev / max_decay`` if the growth was below
    ``1 / max_decay``, else out. On the first step (``fresh``) there is no history: g passes and
    becomes it. Afterwards a ``prev`` of 0 is a history of 0 (``0 -> 5`` is limited to
    ``max_growth * min_value``), except that a bound ``max_growth * 0`` (``min_value`` 0) is
    not applied: it would hold the element at 0 for good. A non-finite g is clipped (NaN stays
    NaN) and leaves prev as it is."""
    if fresh:
        return (g if finite(g) else prev), g
    a = abs(g)
    pa = abs(prev)
    if a - pa > add:
        a = pa + add
    pm = max(pa, min_value)
    growth = math.inf  # no ratio to a bound of 0: neither the multiplicative limit nor a decay
    if pm > 0:
        growth = max(a / pm, 1e-8)  # torchzero's floor, measured after the additive clip
        if growth > max_growth:
            a = max_growth * pm
    r = math.copysign(a, g)
    if not finite(g):
        return prev, r
    if growth < 1.0 / max_decay:  # the history shrinks by at most max_decay per step
        return prev / max_decay, r
    return r, r


def balanced(div, mul):
    """A pending factor ``(div, mul)`` (float64) with both scaled by one power of two so that
    ``(x / div) * mul`` can run in float32 where the cast alone gave ``x / inf = 0`` (a norm of
    3.5e38) or ``inf / inf = NaN``: ``div`` goes to [1, 2) (then ``x / div`` cannot overflow),
    unless that would push ``mul`` out of [2**-120, 2**121) (then ``mul`` goes to that edge).
    Powers of two are exact: inside [2**-100, 2**100] (every common case) the pair is returned
    as it is, bit for bit. A zero ``mul`` gives ``(1, 0)``: zeros (NaN for an inf or NaN x)."""
    if not (finite(div) and finite(mul)) or div == 0.0:
        return div, mul
    if mul == 0.0:  # zeros whatever div is; a tiny div would round to 0 in float32 (0 / 0)
        return 1.0, 0.0
    ed = math.frexp(div)[1]
    em = math.frexp(mul)[1]
    if -100 < ed < 100 and -100 < em < 100:
        return div, mul
    k = min(max(ed - 1, em - 120), em + 120)
    return math.ldexp(div, -k), math.ldexp(mul, -k)


def clip_factor(norm, max_norm):
    """clip_by_global_norm's pending factor ``(div, mul)`` for a global L2 ``norm`` (float64):
    ``(1, 1)`` below ``max_norm`` (strict), ``(1, 0)`` at a zero norm (then ``max_norm == 0``
    too: zeros, not 0 / 0), else ``(norm, max_norm)`` made to fit float32 (`balanced`); a NaN
    norm gives ``(NaN, max_norm)`` (NaN updates)."""
    if norm < max_norm:
        return 1.0, 1.0
    if norm == 0.0:
        return 1.0, 0.0
    return balanced(norm, max_norm)


def clip_finish(norm, scalars):
    """clip_by_global_norm's finish of a global norm kept on the device
    (`numbaccum.contract.Ops.global_norm_finish_`), ``scalars = (max_norm,)``: ``(div, mul,
    norm, clipped)``, its pending factor (`clip_factor`), then its state's record: the norm and
    whether it clipped (1.0 for ``norm >= max_norm`` or a NaN norm, else 0.0)."""
    max_norm = scalars[0]
    div, mul = clip_factor(norm, max_norm)
    return div, mul, norm, 0.0 if norm < max_norm else 1.0


# --- the per-example (DP-SGD) weighted sum, element by element --------------------------------
# out[j] = clamp((init[j] + sum_b m_b * g[b, j] + std * noise[j]) / div, +-limit), in float64
# from the first addition to the division. The drivers (`numbaccum.cpu.per_example`,
# `numbaccum.cuda.per_example`) only walk the batch, each its own way (the CPU sweeps the rows of
# four examples over a run of the output, CUDA gives each thread an element and the whole
# batch); both add an element's examples in example order through these helpers, so an element
# has the same bits on both.


def example_counts(m):
    """Whether an example of multiplier ``m`` enters the sum: a dropped one (``m == 0``) is
    skipped, not multiplied (0 * NaN is NaN)."""
    return m != 0.0


def sum_start(init, i, has_init):
    """Where element ``i``'s sum starts: ``init[i]`` in float64 when ``has_init`` (an earlier sum
    continued, DP accumulation: the same additions in the same order), else 0."""
    return np.float64(init[i]) if has_init else 0.0


def add_example(acc, m, v):
    """``acc + m * v``, ``v`` read in float64: one example's term (``m`` float64)."""
    return acc + m * np.float64(v)


def noised_output(acc, noise, i, std, div, limit):
    """``clamp((acc + std * noise[i]) / div, +-limit)`` (NaN stays NaN); ``noise`` is read only
    when ``std != 0`` (it may be a placeholder then)."""
    if std != 0.0:
        acc += std * noise[i]
    return clamp(acc / div, limit)


@formula(inputs=("x",), outputs=("out",))
def sign(x):
    """out = sign(x): 1 for x > 0, -1 for x < 0, x itself for +-0 and NaN (as ``jnp.sign``);
    x / |x| for a complex x (`signum`). Stored in the buffer's dtype: exact."""
    return signum(x)


# --- helpers of optax's optimizer library ---------------------------------------------------------
# Each direction's formula is declared beside its stage (`numbaccum.optimizers`). The moments update
# as optax's ``update_moment``: ``(1 - decay) * g**order + decay * moment``, with ``1 - decay``
# computed on the host in float64 and cast like every scalar; bias corrections ``1 - decay**count``
# arrive computed in the buffer's dtype (`numbaccum.declared.bias_correction`).


def sqrt(x):
    """The square root in ``x``'s own precision, NaN for a negative ``x``.

    Compiled, ``np.sqrt`` of a float32 is float32, as ``math.sqrt`` is there; run as Python (the
    CUDA simulator) ``math.sqrt`` would compute in float64 and give other bits, while ``np.sqrt``
    keeps the compiled code's. A negative ``x`` gives NaN (as the compiled code and ``jnp.sqrt``
    do) through ``(x - x) / (x - x)``, a NaN of x's own dtype, without NumPy's warning."""
    if x < 0:
        return (x - x) / (x - x)
    return np.sqrt(x)


def inv_root(n, eps, eps_in_sqrt):
    """RMSProp's scale of ``g``: ``1 / sqrt(n + eps)`` (``eps_in_sqrt``) or ``1 / (sqrt(n) + eps)``.

    optax computes the first as ``jax.lax.rsqrt``, which XLA builds from the processor's
    approximate reciprocal square root (not correctly rounded, its bits the processor's): here
    it is IEEE's ``sqrt`` and a division, in float64 (a float32 ``g`` scaled by it is rounded
    once; docs/migrating.md, "Numerics"). The second is optax's own division, in ``n``'s dtype,
    so its bits are optax's. A negative ``n`` gives NaN (`sqrt`)."""
    if eps_in_sqrt:
        # float64 on purpose, and spelled so: compiled, a float literal is float64 and so is the
        # quotient; run as Python (the simulator), NumPy 2 would keep a float32 ``n``'s dtype.
        return as_float64(1.0) / sqrt(n + eps)
    return like(n, 1.0) / (sqrt(n) + eps)


def maximum(a, b):
    """``jnp.maximum``: NaN if either is NaN."""
    if a != a or a > b:
        return a
    return b


def minimum(a, b):
    """``jnp.minimum``: NaN if either is NaN."""
    if a != a or a < b:
        return a
    return b
