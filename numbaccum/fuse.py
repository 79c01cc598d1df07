"""The chain compiler: a run of elementwise stages becomes one generated formula, one pass.

A stage declares its work as *parts* (`numbaccum.base.Stage.declare`), kept in the runner's plan:

* `Kernel`: one formula of `numbaccum.formulas` over the updates, with the stage's state
  buffers, extra inputs (params), per-group scalars and the buffer it writes its output to;
* `Scale`: a pending factor (``scale``, a learning rate), no pass of its own;
* `Prepass`: a reduction over the updates that yields a pending factor (``clip_by_global_norm``:
  the global norm; ``normalize_by_update_norm``). It can only start a run, since it must read
  the run's input, not a value inside the fused pass.

* `Collective`: a sum over processes (``allreduce_mean``), which writes a buffer of its own
  and leaves its 1/n pending. It can only start a run; a `Prepass` that takes a global sum of
  squares may follow it, and then rides on it: the collective reduces each bucket as it
  arrives, through the pending factor, and the pre-pass reads no buffer at all.

* `Host`: work between passes that is not one formula over the elements (per-leaf and
  per-slice factors, axis passes, host reductions and decisions, a control node's choice among
  its inner plans, user code): declared and kept like the others, ticked each step, and one unit
  of the plan that no run spans.

A combinator declares its inner steps' parts: a nested chain as `Chained`, a wrapper whose state
holds its inner stage's (`inject_hyperparams`) as `Wrapped`.

`cut` cuts a plan's parts into maximal runs (a host step runs as it is). `FusedRun.run` runs one: at most one pre-pass over its input, then, per dtype group,
**one** kernel: a *composite formula* generated here, a plain-Python function that calls each
part's formula in sequence and threads the running update from one to the next; it reads every
input and state buffer once and writes every state and the output once. Both drivers compile it
unchanged (`numbaccum.formulas.compile_formula` compiles the formulas it calls by name), the CPU
into a parallel loop, CUDA into a grid-stride kernel.

Why a generated formula and not a driver of its own: the drivers already know how to walk a
buffer on each backend (chunks, float32 pairs, streams, the pending factor), and a composite is
just one more formula to them. The stage-by-stage path stays (``NUMBACCUM_FUSE=0``) and the fused
one gives the same bits on the CPU, because the composite rounds as the separate passes would:

* each part computes in the dtype the driver would use for that formula alone (the promoted
  dtype of its buffers) with its scalars cast to that dtype, and its output is rounded to the
  group's storage dtype before the next part reads it (``as_float32``: the intermediate buffer);
* a pending factor is read by the next formula in that formula's dtype, and a second factor
  settles the first (``(v / div) * mul`` rounded), as `numbaccum.updates.Updates.scaled` does;
* float16 groups (the CPU driver stages them through float32, and an intermediate float16
  rounding has no numba cast) run their parts one formula at a time: the stage-by-stage bits.

Composites are cached by the sequence of (formula name, dtypes, wiring), not by Python objects,
and named from that key (``fused_<sha1>``), which is what the drivers cache by: two chains of
the same formulas over the same dtypes share one compiled kernel.

On CUDA a clip's factor never leaves the device: the composite reads its input through the
driver's device factor (mode 2), so a fused update is one pre-pass plus one pass per group.
"""

from __future__ import annotations

import hashlib
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import _locks, formulas as F
from ._loans import lent_moved
from .backend import ops_for
from .contract import ONE, Factor
from .flat import FlatTree
from .layout import compute_dtype
from .updates import ParamsRef, Updates

__all__ = [
    "Chained",
    "Collective",
    "FusedRun",
    "Host",
    "Kernel",
    "Later",
    "Prepass",
    "Scale",
    "Wrapped",
    "adopter",
    "cut",
    "enabled",
    "pack",
    "packer",
    "run_part",
    "shells",
    "split",
    "structure",
]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _fusable_dtype(dt: np.dtype) -> bool:
    """Whether a composite may hold buffers of dtype ``dt``: float32, float64, bfloat16 (whose
    raw bits the drivers widen and round) and complex64/complex128; not float16 (see the
    module's docstring)."""
    return dt in _FLOATS or dt.kind == "V" or dt.kind == "c"


def enabled() -> bool:
    """Whether chains fuse (read at each update): ``NUMBACCUM_FUSE=0`` runs stage by stage."""
    raw = _ENV.get(_FUSE_KEY)  # the environment's own dict: os.environ.get costs a microsecond
    return raw is None or _decode(raw).strip() != "0"


# ``os.environ`` keeps the process environment in a dict of encoded keys and values (``_data``,
# updated by every ``os.environ[...] =``, ``putenv`` aside); where it has none, the mapping.
_ENV = getattr(os.environ, "_data", os.environ)
_FUSE_KEY = os.environ.encodekey("NUMBACCUM_FUSE") if _ENV is not os.environ else "NUMBACCUM_FUSE"  # type: ignore[attr-defined]
_decode = os.environ.decodevalue if _ENV is not os.environ else str  # type: ignore[attr-defined]


# --- the parts a stage declares -------------------------------------------------------------


class _Part:
    """A declared part: slots, and ``_replace`` (a copy with some slots changed).

    Every part has ``tick``: ``tick(state, params, extra) -> bool``, set by the stage that
    declares it, which computes this step's values into the part's slots (its scalars, its
    factor, its new state) from the state it is given, before anything runs; False when that
    state is not the one the part was declared for (other buffers: the runner declares again).
    None: the part's values were given when it was made (a part built for one step).
    """

    __slots__: tuple[str, ...] = ()

    def _replace(self, **changes: Any) -> Any:
        new = object.__new__(type(self))
        for name in self.__slots__:
            setattr(new, name, changes.pop(name, getattr(self, name)))
        if changes:
            raise TypeError(f"{type(self).__name__} has no slot {next(iter(changes))!r}")
        return new

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self, 'name', '')!r})"


class Kernel(_Part):
    """A stage's elementwise formula over the updates.

    Attributes:
        formula: a `numbaccum.formulas.Formula` with exactly one output (the new updates);
            ``inputs[0]`` is the updates.
        states: the FlatTrees of its states, in the formula's order (read and written).
        scalars: per dtype group, the formula's scalars (this step's: see ``tick``).
        new_state: the stage's new state (its buffers are updated in place by the pass).
        inputs: made at run time, the FlatTrees of ``formula.inputs[1:]`` (params), or None.
        out: made at run time, where the stage writes its output; None: the updates' own buffer
            when it may be overwritten, else the running stage's scratch.
        name: the stage, as `numbaccum.explain` shows it.
        tick: see `_Part`.
    """

    __slots__ = ("formula", "states", "scalars", "new_state", "inputs", "out", "name", "tick")

    def __init__(
        self,
        formula: F.Formula,
        states: tuple,
        scalars: list,
        new_state: Any = None,
        inputs: Callable[[], tuple] | None = None,
        out: Callable[[], FlatTree] | None = None,
        name: str = "",
        tick: Callable[..., bool] | None = None,
    ) -> None:
        self.formula, self.states, self.scalars, self.new_state = formula, states, scalars, new_state
        self.inputs, self.out, self.name, self.tick = inputs, out, name, tick


class Scale(_Part):
    """A pending factor on the updates (`Factor`; `ONE`: nothing at all)."""

    __slots__ = ("factor", "new_state", "name", "tick")

    def __init__(
        self,
        factor: Factor,
        new_state: Any = None,
        name: str = "scale",
        tick: Callable[..., bool] | None = None,
    ) -> None:
        self.factor, self.new_state, self.name, self.tick = factor, new_state, name, tick


class Prepass(_Part):
    """A reduction over the updates that gives the factor left pending on them.

    Attributes:
        factor_of: ``factor_of(flat) -> Factor`` over the settled updates (one reduction pass).
        new_state: the stage's state.
        name: the stage; ``reads``: what the reduction computes (for `numbaccum.explain`).
        finite_of: ``finite_of(flat) -> True | None``: True when this pre-pass's own reduction
            shows every element finite (then `apply_if_finite` needs no reduction of its own);
            None: it cannot tell.
        from_sumsq: ``from_sumsq(flat, sums) -> Factor | None``: the factor from the plain
            per-leaf sums of squares of the updates, computed by a `Collective` before it (then
            the pre-pass reads nothing; ``flat`` holds the updates up to a factor that keeps
            every element's finiteness); None from it: the sums cannot tell (a float64 norm
            that needs its rescue), reduce as usual. None: the reduction is not a global L2
            norm.
        tick: see `_Part`.
    """

    __slots__ = ("factor_of", "new_state", "name", "reads", "finite_of", "from_sumsq", "tick")

    def __init__(
        self,
        factor_of: Callable[[FlatTree], Factor],
        new_state: Any = None,
        name: str = "",
        reads: str = "global norm",
        finite_of: Callable[[FlatTree], bool | None] | None = None,
        tick: Callable[..., bool] | None = None,
        from_sumsq: Callable[[FlatTree, np.ndarray], Factor | None] | None = None,
    ) -> None:
        self.factor_of, self.new_state, self.name, self.reads = factor_of, new_state, name, reads
        self.finite_of, self.tick, self.from_sumsq = finite_of, tick, from_sumsq


class Collective(_Part):
    """A collective over the updates: the sum over processes, into a buffer of the stage's own.

    Attributes:
        reduce: ``reduce(flat, factor, sums) -> (out, factor)``: the updates ``factor(flat)``
            summed over the processes into ``out``, whose value is ``factor(out)`` (a mean's 1/n
            left pending). With ``sums`` (a float64 array, one per leaf) it also writes there
            the plain sum of squares of each leaf of the value (`numbaccum.backend.leaf_sumsq`'s
            bits), computed bucket by bucket as the sum arrives; it returns ``sums`` None when
            it cannot (then the caller reduces the value itself).
        new_state: the stage's new state.
        name: the stage; ``messages``: what travels, for `numbaccum.explain`.
        tick: see `_Part`.
    """

    __slots__ = ("reduce", "new_state", "name", "messages", "tick")

    def __init__(
        self,
        reduce: Callable[..., tuple],
        new_state: Any = None,
        name: str = "",
        messages: str = "",
        tick: Callable[..., bool] | None = None,
    ) -> None:
        self.reduce, self.new_state, self.name = reduce, new_state, name
        self.messages, self.tick = messages, tick


class Host(_Part):
    """A stage's work between passes that the chain compiler does not fuse, run on the host:
    per-leaf or per-slice factors (the trust ratio, block RMS, the norm family), axis passes
    (Adafactor, SM3), host reductions and decisions (L-BFGS, DoG), control over sub-plans
    (MultiSteps, masked). Declared once per state and layout like every part, kept in the
    runner's plan, and ticked each step; it is one unit of the plan (a run of parts never
    spans it).

    Attributes:
        run: ``run(updates) -> (updates, new_state)``: the step's work, with the values its
            ``tick`` computed (a closure over the part: ``part.params`` holds the step's
            `numbaccum.updates.ParamsRef`, or None).
        passes: what it moves, for `numbaccum.explain`: ``(kind, what, read, written)`` per
            pass, ``read`` and ``written`` in buffers of the updates' dtypes per parameter (a
            reduction over the updates and the params reads 2, writes 0); None for user code
            (an "opaque" row). A control node's passes depend on the step: a function
            ``passes(apply) -> list`` of this step's (after its tick), each such a tuple (a
            fifth item: what it adds to the arithmetic minimum; a None ``read``: user code) or
            a `numbaccum.runner.Sub` (an inner plan, described in its place).
        name: the stage, as `numbaccum.explain` and `numbaccum.stats` name it.
        settles: whether it reads the updates settled (a pending factor applied first:
            `numbaccum.explain` shows that pass); ``pending``: whether it may leave one.
        new_state: the state its last run returned (the plan's new state reads it).
        params: the step's params (set by ``tick``).
        tick: see `_Part`.
        apply: None, or for a control node whose inner plan can add the updates to the params
            in its last pass (MultiSteps): ``apply(updates, params) -> new_state``, which the
            runner calls instead of ``run`` when the part ends a plan run by `numbaccum.step_`.
        spec: the `numbaccum.updates.Spec` of the updates ``run`` returns when it is not the
            input's (a per-example aggregation returns params-shaped updates; see
            `returned_spec`); None otherwise.
    """

    __slots__ = ("run", "passes", "name", "settles", "pending", "new_state", "params", "tick", "apply", "spec")

    def __init__(
        self,
        run: Callable[[Updates], tuple[Updates, Any]],
        passes: tuple | Callable[[Any], Sequence] | None,
        name: str,
        tick: Callable[..., bool] | None = None,
        settles: bool = True,
        pending: bool = False,
        apply: Callable[[Updates, FlatTree], Any] | None = None,
        spec: Any = None,
    ) -> None:
        self.run, self.passes, self.name, self.tick = run, passes, name, tick
        self.settles, self.pending, self.apply, self.spec = settles, pending, apply, spec
        self.new_state: Any = None
        self.params: ParamsRef | None = None


class Later(NamedTuple):
    """A part's new state that the pass itself determines (a clip records the norm it saw):
    ``make()`` builds it once the pass has run."""

    make: Callable[[], Any]


class Chained(_Part):
    """A nested chain whose every step is fusable: its steps' parts, spliced into the enclosing
    chain's runs (``names``: a named_chain's, to rebuild its state dict). ``split(state)``: the
    steps' states in order, None when ``state`` is not the chain's (set with ``tick``)."""

    __slots__ = ("parts", "names", "name", "tick", "split")

    def __init__(
        self,
        parts: list,
        names: list | None = None,
        name: str = "chain",
        tick: Callable[..., bool] | None = None,
        split: Callable[[Any], tuple | None] | None = None,
    ) -> None:
        self.parts, self.names, self.name, self.tick, self.split = parts, names, name, tick, split


class Wrapped(_Part):
    """A wrapper stage's part (`numbaccum.inject_hyperparams`): the declaration of its inner
    stage, whose leaves run in the enclosing plan's runs as they are (fused with the
    neighbours'), and the wrapper's new state around the inner one.

    Attributes:
        part: the inner declaration's part (a leaf, a `Chained` nest, another `Wrapped`).
        wrap: ``wrap(inner_new_state) -> new_state``, with the values this step's ``tick``
            computed. The inner part's new state may be known only after the pass (a `Later`,
            a `Chained` one's): ``wrap`` is called with it once it is.
        name: the wrapper, as errors name it (`numbaccum.explain` shows the inner stages).
        tick: see `_Part`: the wrapper's own checks and values, and its inner part's tick.
        inner: ``inner(state) -> inner_state``: where the inner stage's state is in the
            wrapper's (`split`).
    """

    __slots__ = ("part", "wrap", "name", "tick", "inner")

    def __init__(
        self,
        part: Any,
        wrap: Callable[[Any], Any],
        name: str = "",
        tick: Callable[..., bool] | None = None,
        inner: Callable[[Any], Any] | None = None,
    ) -> None:
        self.part, self.wrap, self.name, self.tick, self.inner = part, wrap, name, tick, inner


def returned_spec(root: Any) -> Any:
    """The `numbaccum.updates.Spec` of the updates a declaration returns when it is not its
    input's (a reshaping `Host`'s ``spec``, through the wrappers around it); None otherwise."""
    while type(root) is Wrapped:
        root = root.part
    return root.spec if type(root) is Host else None


def leaves(part: Any) -> list:
    """The `Kernel`, `Scale` and `Prepass` parts of a part, nested chains and wrapped parts
    spliced in order."""
    if isinstance(part, Chained):
        return [leaf for p in part.parts for leaf in leaves(p)]
    if isinstance(part, Wrapped):
        return leaves(part.part)
    return [part]


def _fusable(part: Any) -> bool:
    """Whether a step's part can join a run: a pre-pass or a collective only where it may start
    one (`_joins`)."""
    if part is None or type(part) is Host:
        return False
    if not isinstance(part, (Chained, Wrapped)):
        return True
    inner = leaves(part)
    return all(type(p) is not Host for p in inner) and all(_joins(inner[:k], p) for k, p in enumerate(inner) if k)


def _joins(before: list, part: Any) -> bool:
    """Whether leaf ``part`` may follow the leaves ``before`` in one run: a collective only
    starts one, and a pre-pass too, except right after a collective whose sum it rides on."""
    kind = type(part)
    if kind is Collective or kind is Host:
        return False
    if kind is Prepass:
        return len(before) == 1 and type(before[0]) is Collective and part.from_sumsq is not None
    return True


def pack(root: Any, states: list) -> Any:
    """The new state of ``root`` (a part, or a `Chained` nest of them) from its leaves' new
    states in order."""
    return packer(root)(iter(states))


def packer(root: Any) -> Callable[[Any], Any]:
    """`pack` made once for ``root``: ``packer(root)(states)`` takes the leaves' new states from
    the iterator ``states`` (a kept plan and a fused run build their new states so every step)."""
    if isinstance(root, Chained):
        subs = [packer(p) for p in root.parts]
        names = root.names
        if names is None:
            return lambda it: tuple([f(it) for f in subs])
        return lambda it: dict(zip(names, [f(it) for f in subs]))
    if isinstance(root, Wrapped):
        inner = packer(root.part)
        return lambda it: root.wrap(inner(it))  # read each time: `adopter` may change it
    return next


def flat_tick(root: Any) -> Callable[[Any, Any, dict], bool]:
    """``root.tick`` with its nested chains unrolled: one function that splits the state with
    each chain's ``split`` and ticks the leaves in order (a kept plan ticks every step: a
    small tree's step costs microseconds, and each nested call is some of them). The same
    checks in the same order as the chains' own ticks."""
    nest = _nest(root)
    if not isinstance(root, Chained) or any(isinstance(p, Chained) and p.split is None for p in nest):
        return root.tick
    env: dict[str, Any] = {}
    lines: list[str] = []

    def walk(part: Any, var: str) -> None:
        if isinstance(part, Chained):
            env[f"split_{var}"] = part.split
            subs = [f"{var}_{i}" for i in range(len(part.parts))]
            if part.names is None:  # a plain tuple, the split's own first test, inline
                lines.append(f"    if type({var}) is tuple and len({var}) == {len(subs)}:")
                lines.append(f"        t = {var}")
                lines.append("    else:")
                lines.append(f"        t = split_{var}({var})")
            else:
                lines.append(f"    t = split_{var}({var})")
            lines.append("    if t is None:")
            lines.append("        return False")
            if subs:
                lines.append(f"    {', '.join(subs)}, = t")
            for p, sub in zip(part.parts, subs):
                walk(p, sub)
        else:  # a leaf, or a `Wrapped` (its tick ticks its inner part)
            env[f"tick_{var}"] = part.tick
            lines.append(f"    if not tick_{var}({var}, params, extra):")
            lines.append("        return False")

    walk(root, "s")
    source = "def tick(s, params, extra):\n" + "\n".join(lines) + "\n    return True\n"
    exec(compile(source, "<numbaccum plan tick>", "exec"), env)
    return env["tick"]


def new_state_maker(root: Any) -> Callable[[], Any]:
    """``new_state()``: the new state of ``root`` from its leaves' new states after a pass
    (`pack` of them, a `Later` made), as one function for a kept plan."""
    env: dict[str, Any] = {"Later": Later}
    lines: list[str] = []
    count = [0]

    def walk(part: Any) -> str:
        if isinstance(part, Chained):
            items = [walk(p) for p in part.parts]
            tup = f"({', '.join(items)},)" if items else "()"
            if part.names is None:
                return tup
            k = len(env)
            env[f"names_{k}"] = part.names
            return f"dict(zip(names_{k}, {tup}))"
        if isinstance(part, Wrapped):
            k = len(env)
            env[f"wrapped_{k}"] = part  # its wrap read each time: `adopter` may change it
            return f"wrapped_{k}.wrap({walk(part.part)})"
        i = count[0]
        count[0] += 1
        env[f"leaf_{i}"] = part
        lines.append(f"    n{i} = leaf_{i}.new_state")
        lines.append(f"    if type(n{i}) is Later:")
        lines.append(f"        n{i} = n{i}.make()")
        return f"n{i}"

    result = walk(root)
    source = "def new_state():\n" + "\n".join(lines) + f"\n    return {result}\n"
    exec(compile(source, "<numbaccum plan new state>", "exec"), env)
    return env["new_state"]


def _nest(part: Any) -> list:
    """``part`` and every part nested in it, in order, but not inside a `Wrapped` (whose tick
    ticks what is inside it)."""
    out = [part]
    if isinstance(part, Chained):
        for p in part.parts:
            out += _nest(p)
    return out


def split(root: Any, state: Any) -> list:
    """The states of ``root``'s leaves in order, taken from ``state`` (the inverse of `pack`)."""
    if isinstance(root, Wrapped):
        return split(root.part, root.inner(state))  # type: ignore[misc]
    if not isinstance(root, Chained):
        return [state]
    subs = tuple(state) if root.names is None else [state[n] for n in root.names]
    return [s for part, sub in zip(root.parts, subs) for s in split(part, sub)]


def shells(root: Any) -> Any:
    """A copy of the nest ``root`` with a new object for each part (the same slot values): the
    parts a kept plan runs while the declarations of other stages compute their values
    (`adopter`). Chains' own ticks and splits are kept as they are."""
    if isinstance(root, Chained):
        return root._replace(parts=[shells(p) for p in root.parts])
    if isinstance(root, Wrapped):
        return root._replace(part=shells(root.part))
    return root._replace()


def structure(root: Any, nodes: list | None = None) -> tuple:
    """What a plan's runs are cut and compiled from (`cut`, `_GroupCall`), as a declaration
    makes it: the nest, each part's kind, a kernel's formula (by name, as its composite names
    it), state buffers (by their storage) and output, a host step's mode. Two declarations of
    the same structure run as one plan, each with its own values (`adopter`). ``nodes``, when
    given, gets the parts whose values change from step to step (all but the chains), in order."""
    if isinstance(root, Chained):
        subs = []  # loops, not generators: a new declaration's every step with a schedule
        for p in root.parts:
            subs.append(structure(p, nodes))
        return ("chain", None if root.names is None else tuple(root.names), tuple(subs))
    if nodes is not None:
        nodes.append(root)
    if isinstance(root, Wrapped):
        return ("wrapped", structure(root.part, nodes))
    kind = type(root)
    if kind is Kernel:
        storage = []
        for s in root.states:
            storage.append(id(s.__dict__))
        return ("kernel", root.formula.name, tuple(storage), root.out is None)
    if kind is Host:
        return ("host", root.apply is None, root.spec is None, root.settles, root.pending, root.passes is None)
    if kind is Prepass:
        return ("prepass", root.finite_of is None, root.from_sumsq is None)
    return (kind.__name__,)


# What `adopter` copies of each kind of part: every slot but a `Wrapped` one's inner part.
_ADOPTED = {
    kind: tuple(n for n in kind.__slots__ if n != "part")
    for kind in (Kernel, Scale, Prepass, Collective, Host, Wrapped)
}


def adopter(shell: list, shape: tuple, root: Any) -> Callable[[], None] | None:
    """``adopt()``: after ``root`` (a new declaration) has ticked, its values put into the
    parts ``shell`` (the ``nodes`` of `structure` of the `shells` of a declaration whose
    structure is ``shape``), so that the plan made of them runs ``root``'s step: every slot of
    each leaf (a host step's run is its own closure, over its own values), a `Wrapped` one's new
    state (``wrap``). None when ``root``'s structure is another: then it needs a plan of its
    own."""
    nodes: list = []
    if structure(root, nodes) != shape:
        return None
    pairs = [(s, p, _ADOPTED[type(p)]) for s, p in zip(shell, nodes)]

    def adopt() -> None:
        for s, p, names in pairs:  # loops, not calls: this runs every step
            for name in names:
                setattr(s, name, getattr(p, name))

    return adopt


# numba cannot inline a call of more than 30 arguments ("Calling a closure with *args"): a run
# is cut before its composite would take more (arrays and scalars; 3 kept for step_'s apply).
MAX_ARGS = 27


def _cost(part: Any) -> int:
    """The composite arguments a part may add: buffers, scalars, and a factor's two."""
    if isinstance(part, Kernel):
        f = part.formula
        return len(f.states) + len(f.inputs) - 1 + len(f.scalars) + 2
    return sum(_cost(p) for p in leaves(part)) if isinstance(part, (Chained, Wrapped)) else 2


def cut(parts: list) -> list[tuple[int, int, FusedRun | None]]:
    """``(start, stop, run)`` covering ``parts`` in order (parts, nested chains of them, or None
    for a unit that runs as it is): a `FusedRun` of ``parts[start:stop]``, or ``(i, i + 1,
    None)`` for a unit that runs alone. A run holds at least one `Kernel` (else fusing saves
    nothing); a `Prepass` only starts one; a run is cut where its composite would take more
    than `MAX_ARGS` arguments; a `Collective` only starts one, and a pre-pass that rides on its
    sum may follow it (`_joins`). A plan's runs (`numbaccum.runner.Plan`) are cut so."""
    out: list[tuple[int, int, FusedRun | None]] = []
    i, n = 0, len(parts)
    while i < n:
        j, cost = i, 1  # the updates' buffer
        run: list = []  # the run's leaves so far
        while j < n and parts[j] is not None and type(parts[j]) is not Host:
            if j > i and not _joins(run, leaves(parts[j])[0]):
                break
            run += leaves(parts[j])
            cost += _cost(parts[j])
            if cost > MAX_ARGS:
                break
            j += 1
        if any(type(p) is Kernel for part in parts[i:j] for p in leaves(part)):
            out.append((i, j, FusedRun(parts[i:j])))
            i = j
        else:  # nothing to fuse: the unit runs as it is
            out.append((i, i + 1, None))
            i += 1
    return out


class FusedRun:
    """A maximal run of fusable steps: at most one collective, at most one pre-pass, then one
    pass per dtype group.

    ``steps``: each step's part (a nested chain's `Chained`); ``parts``: their leaves in order."""

    __slots__ = (
        "steps", "parts", "memo", "recent", "collective", "pre", "body", "kernels", "scales",
        "packers", "riding", "sums",
    )  # fmt: skip

    def __init__(self, steps: list) -> None:
        self.steps = steps
        self.parts = [leaf for p in steps for leaf in leaves(p)]
        self.memo: dict = {}  # the shapes of its groups' calls (`_run_group`), made once each
        self.recent: dict = {}  # the last of them per group, with the buffers it was given
        # What a run does, found once: the collective, the pre-pass, the parts of the pass after
        # them, their kernels and factors.
        rest = self.parts
        self.collective = rest[0] if type(rest[0]) is Collective else None
        rest = rest[1:] if self.collective is not None else rest
        self.pre = rest[0] if rest and type(rest[0]) is Prepass else None
        self.body = rest[1:] if self.pre is not None else rest
        self.kernels = [p for p in self.body if type(p) is Kernel]
        self.scales = [p for p in self.body if type(p) is Scale]
        self.packers = [packer(p) for p in steps]  # each step's new state from its leaves'
        # A pre-pass riding on the collective: its factor, known once the sum has arrived, is
        # a second factor after the collective's 1/n, on the body's input (read through both
        # and rounded between them, as the settled updates would be: the same bits).
        self.riding: Scale | None = None
        self.sums: np.ndarray | None = None  # the per-leaf sums of squares, allocated once
        if self.collective is not None and self.pre is not None:
            self.riding = Scale(ONE, name=self.pre.name)

    def new_states(self) -> list:
        """One new state per step (nested chains' states rebuilt)."""
        made = []  # (loops, not comprehensions: each of those is a call, every step)
        for p in self.parts:
            made.append(p.new_state.make() if isinstance(p.new_state, Later) else p.new_state)
        it, out = iter(made), []
        for f in self.packers:
            out.append(f(it))
        return out

    def run(
        self,
        flat: FlatTree,
        factor: Factor,
        fresh: Callable[[], FlatTree],
        apply: FlatTree | None = None,
        settle: bool = False,
        with_states: bool = True,
    ) -> Any:
        """Runs the parts on the updates ``factor(flat)``; ``fresh()`` gives the buffer a stage
        without an output of its own writes to. With ``apply`` (params of the same layout) the
        updates are added to it in the pass (``apply += updates``) and never written. With
        ``settle`` a factor left pending at the end (a trailing learning rate) is applied in the
        pass, as the caller would settle it right after (rounded the same way).

        Returns ``(out, factor, new_states)``: the updates are ``factor(out)`` (out None with
        ``apply``), and one new state per part (``(out, factor)`` without ``with_states``: the
        runner packs the new states itself)."""
        pre, body, scales, memo, recent = self.pre, self.body, self.scales, self.memo, self.recent
        if self.collective is not None:
            sums = None
            if self.riding is not None:
                sums = self.sums
                if sums is None or sums.size != flat.layout.num_leaves:
                    sums = self.sums = np.empty(flat.layout.num_leaves, np.float64)
            flat, factor, sums = self.collective.reduce(flat, factor, sums)
            fresh = lambda: flat  # noqa: E731  # the collective's own buffer: owned
            riding = self.riding
            # sums: the pre-pass rides on the collective, so it is one and has from_sumsq
            known = None if sums is None else pre.from_sumsq(flat, sums)  # type: ignore[union-attr, misc]
            if known is not None and riding is not None:  # the pre-pass rode on the collective
                riding.factor = known
                pre, body, scales = None, [riding, *body], [riding, *scales]
                # Calls of another shape (one more factor): kept apart from the plain ones.
                memo, recent = memo.setdefault("riding", {}), recent.setdefault("riding", {})
        if pre is not None:
            if factor is not ONE and not factor.is_one:  # the reduction reads settled updates
                into = fresh()
                for dst, src in zip(into.groups, flat.groups):
                    ops_for(src).scale_(dst, src, factor)
                flat = into
                fresh = lambda: into  # noqa: E731  # owned now
            factor = pre.factor_of(flat)
        kernels = self.kernels
        out = None
        if apply is None:
            last = kernels[-1]
            out = last.out() if last.out is not None else fresh()
        extras = []  # a loop, not a comprehension: this runs every step
        for k in kernels:
            extras.append(k.inputs() if k.inputs is not None else ())
        if apply is None and len(body) == 1:  # one kernel alone: its own formula, per group
            assert out is not None  # (made above: no apply)
            solo = recent.get("solo")
            if solo is None:
                solo = recent["solo"] = Launches()
            _solo(kernels[0], extras[0], flat, factor, out, solo)
            return (out, ONE, self.new_states()) if with_states else (out, ONE)
        pending = factor
        # The shape of the calls, the same for every group: the pending factors.
        mode = 0 if factor.is_one else 2 if factor.device is not None else 1
        flags = [0 if mode == 0 else 1 if mode == 1 and factor.div == 1.0 else 2]  # `_factor_kind`s,
        for sc in scales:  # inline (every step of a kept plan)
            f = sc.factor
            flags.append(0 if f is ONE or f.is_one else 1 if f.device is None and f.div == 1.0 else 2)
        for gi in range(len(flat.groups)):
            pending = _run_group(
                body,
                extras,
                gi,
                flat,
                factor,
                out,
                apply,
                (gi, mode, settle, tuple(flags)),
                memo,
                recent,
            )
        pending = pending if apply is None else ONE
        return (out, pending, self.new_states()) if with_states else (out, pending)


def _solo(k: Kernel, ins: Any, flat: FlatTree, factor: Factor, out: FlatTree, launches: Launches) -> None:
    """A run of one kernel and nothing else, written to ``out``: its own formula over each dtype
    group (`map_`), through the run's kept ``launches``."""
    for gi, x in enumerate(flat.groups):  # loops, not comprehensions: every step of such a run
        arrays = []
        for st in k.states:
            arrays.append(st.groups[gi])
        arrays.append(x)
        for e in ins:
            arrays.append(e.groups[gi])
        arrays.append(out.groups[gi])
        launches.run(k.formula, gi, arrays, factor, k.scalars[gi])


def _factor_kind(factor: Factor) -> int:
    """How a pending factor is read (part of a call's shape): 0 not at all (none, or one);
    1 as ``x * mul`` (``div`` is 1: a learning rate; the bits of ``(x / 1) * mul`` without a
    division, which bounds Adam's pass on a CPU); 2 as ``(x / div) * mul`` (a clip's, or a factor
    on the device, applied by the driver)."""
    if factor is ONE or factor.is_one:
        return 0
    return 1 if factor.device is None and factor.div == 1.0 else 2


def _run_group(
    parts: list,
    extras: list,
    gi: int,
    flat: FlatTree,
    factor: Factor,
    out: FlatTree | None,
    apply: FlatTree | None,
    shape: tuple,
    memo: dict,
    recent: dict,
) -> Factor:
    """One dtype group of a run: one composite kernel (float32/float64), or the parts one formula
    at a time (float16). Returns the factor left pending on the output.

    What the call looks like (the composite, where each buffer and scalar goes) depends only on
    the buffers' dtypes and aliasing and on which factors are pending (``shape``: the group,
    the incoming factor's mode (0 none, 1 on the host, 2 on the device), whether a trailing
    factor is settled, which scales are pending): it is made once per such shape and kept in
    ``memo`` (the run's). ``recent`` keeps, per shape, the last call with the very buffers it
    was given and its launch prepared for them: a replayed step, on the same buffers, only
    gathers its scalars."""
    x = flat.groups[gi]
    og = out.groups[gi] if out is not None else None
    pg = apply.groups[gi] if apply is not None else None
    ins = []  # the extra inputs' buffers of the group (a loop: every step)
    for ex in extras:
        for e in ex:
            ins.append(e.groups[gi])
    last = recent.get(shape)
    if last is not None:
        # (the same objects, tested inline: every group of every replayed step asks)
        held = last[3]
        same = len(held) == len(ins) and all(map(operator.is_, held, ins))
        if last[0] is x and last[1] is og and last[2] is pg and same:
            return last[4].run(parts, extras, flat, factor, out, apply, last[5])
        before = last[6]  # the call before, on the other output buffer (`Launches.run`)
        if (
            before is not None
            and before[0] is x
            and before[1] is og
            and before[2] is pg
            and len(before[3]) == len(ins)
            and all(map(operator.is_, before[3], ins))
        ):
            return before[4].run(parts, extras, flat, factor, out, apply, before[5])
    _, mode, settle, flags = shape
    key = (
        gi,
        mode,
        settle,
        x.dtype,
        None if og is None else (og.dtype, og is x),
        None if pg is None else (pg.dtype, tuple([a is pg for a in ins]) if ins else ()),
        tuple([a.dtype for a in ins]) if ins else (),
        flags,
    )
    call = memo.get(key)
    if call is None:
        call = memo[key] = _GroupCall(parts, gi, x, mode, og, pg, ins, settle, flags[0])
    launch = call.prepare(x, og, pg, ins)
    # The call before is kept when only buffers lent to the caller moved (the loop holding its
    # last updates writes a workspace and its spare by turns): two prepared launches, not one a step.
    before = None
    if last is not None and last[4] is call and lent_moved((*last[:3], *last[3]), (x, og, pg, *ins)):
        before = (*last[:6], None)
    recent[shape] = (x, og, pg, ins, call, launch, before)
    return call.run(parts, extras, flat, factor, out, apply, launch)


def _walk(parts: list, gi: int, d: np.dtype, ins: list, mode: int, lead: int) -> tuple:
    """The parts of one group's call in order (`_GroupCall`): the composite's ops, the recipe of
    its scalars, the state arrays, every buffer's dtype (float16 anywhere: the one-by-one
    fallback), and the factor left pending after them (``pend``, and ``src``: the incoming
    factor (-1), part k's, or None). ``lead``: the incoming factor's `_factor_kind`."""
    states: list = []
    recipe: list = []
    ops: list = []
    kinds: list = []
    pend = (None, "host", "device")[mode]
    src: int | None = -1 if mode else None
    n_in = 0
    for k, p in enumerate(parts):
        if type(p) is Scale:
            if p.factor is ONE or p.factor.is_one:
                continue  # Updates.scaled: nothing pending, nothing settled
            if pend == "host":
                _settle(ops, recipe, parts, src, lead)
            elif pend == "device":
                ops.append(("cast",))
            pend, src = "host", k
            continue
        if type(p) is Prepass:
            raise AssertionError("a pre-pass only starts a run")  # `cut` guarantees it
        sts = [s.groups[gi] for s in p.states]
        n = len(p.formula.inputs) - 1
        its = ins[n_in : n_in + n]
        n_in += n
        c = compute_dtype(*(a.dtype for a in sts), d, *(a.dtype for a in its), d)
        raw = tuple(isinstance(v, (bool, np.bool_, np.uint32)) for v in p.scalars[gi])  # passed as they are
        read = _read_kind(parts, src, lead) if pend == "host" else 0
        ops.append(("kernel", p.formula.name, c.name, read, len(sts), n, raw, p.formula.indexed))
        if read:
            recipe.append((src, "mul" if read == 1 else None))
        recipe.append((k, gi))
        states += sts
        kinds += [a.dtype for a in sts + its]
        pend, src = None, None
    return ops, recipe, states, kinds, pend, src


def _read_kind(parts: list, src: int | None, lead: int) -> int:
    """The `_factor_kind` of the host factor pending from ``src`` (-1: the incoming one)."""
    assert src is not None, "a host factor pending has a source"  # (`_walk` sets both at once)
    return lead if src < 0 else _factor_kind(parts[src].factor)


def _settle(ops: list, recipe: list, parts: list, src: int | None, lead: int) -> None:
    """Appends the settling of the host factor pending from ``src`` (`_walk`): its op, and its
    ``div, mul`` (``mul`` alone when ``div`` is 1) to the scalars' recipe."""
    mul_only = _read_kind(parts, src, lead) == 1
    ops.append(("settle", mul_only))
    recipe.append((src, "mul" if mul_only else None))


class _GroupCall:
    """The shape of one group's call in a run (`_run_group`): the composite formula, or None
    for the one-formula-at-a-time fallback (float16); the state arrays (the parts' storage,
    the same on every step), which inputs are passed (not the params themselves), and the
    recipe of its scalars: ``(-1, None)`` the incoming factor's ``div, mul``, ``(k, None)`` part
    ``k``'s factor's, ``(k, gi)`` part ``k``'s scalars of the group. ``final``: where the factor
    left pending on the output comes from (None: nothing pending)."""

    __slots__ = ("composite", "states", "keep", "copy_out", "recipe", "gather", "final", "gi", "settle")

    def __init__(
        self, parts: list, gi: int, x: Any, mode: int, og: Any, pg: Any, ins: list, settle: bool, lead: int
    ) -> None:
        self.gi, self.settle = gi, settle
        d = x.dtype
        ops, recipe, states, kinds, pend, src = _walk(parts, gi, d, ins, mode, lead)
        if pg is None and settle and pend == "host":
            _settle(ops, recipe, parts, src, lead)
            pend, src = None, None
        alias: tuple = ()
        if pg is not None:
            if pend == "host":
                _settle(ops, recipe, parts, src, lead)
            elif pend == "device":
                ops.append(("cast",))
            pend, src = None, None
            # An input that is the params themselves (weight decay in `step_`) is read through
            # the apply's state argument instead of a second array argument: two arguments
            # aliasing one buffer make LLVM add runtime overlap checks per pair of arrays, and
            # past its limit it leaves the loop scalar (4x slower for adamw's sqrt and division).
            alias = tuple(i + 1 for i, a in enumerate(ins) if a is pg)
            ops.append(("apply", compute_dtype(pg.dtype, d, pg.dtype).name, alias))
            states.append(pg)
            kinds.append(pg.dtype)
        else:
            kinds.append(og.dtype)
        self.recipe, self.final = tuple(recipe), src
        self.gather = _gatherer(self.recipe)
        self.keep = tuple(i for i in range(len(ins)) if i + 1 not in alias)
        if not _fusable_dtype(d) or any(not _fusable_dtype(t) for t in kinds):
            self.composite, self.states, self.copy_out = None, (), False
            return
        # Written in place (the output is the input buffer, an owned workspace): the input is
        # then the composite's last state, read and written through one argument. As two
        # arguments, LLVM cannot rule out their overlap and leaves the loop scalar (3x slower
        # for Adam's sqrt and division). Not with a device factor, which the driver applies to
        # the first input.
        inplace = pg is None and og is x and mode != 2
        self.composite = _composite((d.name, mode == 2, tuple(ops), pg is None, inplace))
        self.states = tuple(states[:-1]) if pg is not None else tuple(states)
        self.copy_out = pg is None and not inplace

    def prepare(self, x: Any, og: Any, pg: Any, ins: list) -> Any:
        """The composite's launch over these buffers (the driver's `prepare`), None for the
        one-formula-at-a-time fallback."""
        if self.composite is None:
            return None
        arrays = [*self.states] if pg is None else [*self.states, pg]
        arrays.append(x)
        arrays += [ins[i] for i in self.keep]
        if self.copy_out:
            arrays.append(og)
        return ops_for(x).driver.prepare(self.composite, tuple(arrays))

    def run(
        self, parts: list, extras: list, flat: FlatTree, factor: Factor, out: Any, apply: Any, launch: Any
    ) -> Factor:
        """Runs the group with ``launch``, `prepare`'s for its buffers."""
        gi = self.gi
        final = self.final
        fac = ONE if final is None else factor if final < 0 else parts[final].factor
        if launch is None:
            x = flat.groups[gi]
            _one_by_one(ops_for(x), parts, extras, gi, x, factor, out, apply, self.settle)
            return fac
        launch(factor if factor.device is not None else ONE, self.gather(parts, factor))
        return fac


def _gatherer(recipe: tuple) -> Callable[[list, Factor], list]:
    """``gather(parts, factor)``: a group call's scalars in the composite's order, from its
    ``recipe`` (`_GroupCall`): ``(-1, None)`` the incoming factor's ``div, mul``, ``(k, None)``
    part ``k``'s factor's, ``(k, g)`` part ``k``'s scalars of group ``g``; written out once, as
    every replayed step gathers them."""
    items = []
    for k, g in recipe:
        if g is None or g == "mul":
            f = "factor" if k < 0 else f"parts[{k}].factor"
            items += [f"{f}.mul"] if g == "mul" else [f"{f}.div", f"{f}.mul"]
        else:
            items.append(f"*parts[{k}].scalars[{g}]")
    env: dict[str, Any] = {}
    source = f"def gather(parts, factor):\n    return [{', '.join(items)}]\n"
    exec(compile(source, "<numbaccum scalars>", "exec"), env)
    return env["gather"]


def _one_by_one(
    ops_: Any,
    parts: list,
    extras: list,
    gi: int,
    x: Any,
    factor: Factor,
    out: FlatTree | None,
    apply: FlatTree | None,
    settle: bool,
) -> None:
    """A float16 group: each part its own formula, through ``out`` (or a scratch copy with
    ``apply``), as the stages would run one by one."""
    buf = out.groups[gi] if out is not None else np.empty_like(x) if isinstance(x, np.ndarray) else None
    if buf is None:
        from .arrays import empty

        buf = empty(x.size, x.dtype)
    val, fac, k = x, factor, 0
    for p in parts:
        if isinstance(p, Scale):
            if p.factor is ONE or p.factor.is_one:
                continue
            if fac is not ONE and not fac.is_one:
                ops_.scale_(buf, val, fac)
                val = buf
            fac = p.factor
            continue
        arrays = (*(s.groups[gi] for s in p.states), val, *(e.groups[gi] for e in extras[k]), buf)
        k += 1
        ops_.driver.map_(p.formula, fac, arrays, tuple(p.scalars[gi]))
        val, fac = buf, ONE
    if apply is None and settle and fac is not ONE and not fac.is_one:
        ops_.scale_(buf, val, fac)
    if apply is not None:
        pg = apply.groups[gi]
        if fac is not ONE and not fac.is_one:
            ops_.scale_(buf, val, fac)
            val = buf
        ops_.add_scaled_(pg, pg, ONE, val, 1.0)


# --- composite formulas ---------------------------------------------------------------------

_COMPOSITES: dict[tuple, F.Formula] = {}
_LOCK = _locks.lock()


def _composite(key: tuple) -> F.Formula:
    """The composite formula of ``key`` (made once per key and declarations of the formulas it
    calls: a formula declared again, by a reloaded module, gets a composite of its own)."""
    registry = F.registered()
    callees = tuple(registry[op[1]] for op in key[2] if op[0] == "kernel")
    memo = (key, callees)
    f = _COMPOSITES.get(memo)
    if f is None:
        with _LOCK:
            f = _COMPOSITES.get(memo)
            if f is None:
                f = _COMPOSITES[memo] = _make_composite(key, callees)
    return f


def composite_source(key: tuple) -> tuple[str, str, tuple, tuple, tuple, tuple, bool]:
    """The Python source of the composite of ``key`` and its declaration
    ``(name, source, states, inputs, outputs, scalars, indexed)``.

    ``key = (dtype, raw_input, ops, has_output, inplace)``: the group's storage dtype; whether
    the input arrives already scaled by a device factor (kept in the driver's dtype, not
    rounded); whether there is an output, and whether it is the input buffer itself; and the
    ops, each ``("kernel", formula, compute dtype, how it reads a factor (0 not, 1 ``x * mul``,
    2 ``(x / div) * mul``), n_states, n_inputs, which scalars pass uncast (bools, uint32 words),
    indexed)``, ``("settle", mul_only)`` (a factor applied and rounded; ``x * mul`` when its
    ``div`` is 1), ``("cast",)`` (a device factor's value rounded) or ``("apply", compute
    dtype)`` (``params += value``). The composite is indexed (takes the element's index last)
    when one of its formulas is."""
    d, raw_input, ops, has_output, inplace = key
    name = "fused_" + hashlib.sha1(repr(key).encode()).hexdigest()[:16]
    # The group's values are rounded to its storage dtype ``d`` between parts, and its settled
    # factors computed in its compute dtype ``cd``: bfloat16 values are float32 ones rounded to
    # bfloat16 (`numbaccum.formulas.as_bfloat16`), computed in float32.
    cd = "float32" if d == "bfloat16" else d
    rcd = _REAL.get(cd, cd)  # the dtype of its scalars: a complex group's are real
    # Inputs (by index among all inputs, x first) that are the apply's target: read as its state.
    aliased = next((op[2] for op in ops if op[0] == "apply"), ())
    n_in = 1  # inputs seen so far, x included
    states: list[str] = []
    inputs: list[str] = ["x"]
    scalars: list[str] = []
    # A bfloat16 buffer's element reaches the composite widened, exactly: nothing to round.
    body = ["    v = x" if raw_input or d == "bfloat16" else f"    v = as_{d}(x)"]
    new_states: list[str] = []

    def scalar() -> str:
        s = f"p{len(scalars)}"
        scalars.append(s)
        return s

    for op in ops:
        if op[0] == "settle" and op[1]:  # div 1: x * mul, the bits of (x / 1) * mul
            body.append(f"    v = as_{d}(as_{cd}(v) * as_{rcd}({scalar()}))")
        elif op[0] == "settle":
            div, mul = scalar(), scalar()
            body.append(
                f"    v = as_{d}({_quotient(f'as_{cd}(v)', f'as_{rcd}({div})', cd)} * as_{rcd}({mul}))"
            )
        elif op[0] == "cast":
            body.append(f"    v = {_rounding(d, cd)}(v)")
        elif op[0] == "apply":
            c = op[1]
            st = "sp"  # the params (also what an aliased input reads)
            states.append(st)
            new_states.append(f"n{len(new_states)}")
            body.append(f"    {new_states[-1]} = {st} + as_{_REAL.get(c, c)}(1.0) * as_{c}(v)")
        else:
            n_in = _call_formula(op, d, n_in, aliased, states, inputs, new_states, body, scalar)
    returns = new_states + (["v"] if has_output else [])
    if inplace:  # x is the last state: its new value is the output
        states, inputs = [*states, "x"], inputs[1:]
    indexed = any(op[0] == "kernel" and op[7] for op in ops)
    params = states + inputs + (scalars or []) + (["idx"] if indexed else [])
    src = f"def {name}({', '.join(params)}):\n" + "\n".join(body) + f"\n    return {', '.join(returns)}\n"
    outputs = ("out",) if has_output and not inplace else ()
    return name, src, tuple(states), tuple(inputs), outputs, tuple(scalars), indexed


def _call_formula(
    op: tuple,
    d: str,
    n_in: int,
    aliased: tuple,
    states: list,
    inputs: list,
    new_states: list,
    body: list,
    scalar: Callable[[], str],
) -> int:
    """Appends to a composite's ``body`` the call of one formula (a ``("kernel", ...)`` op of
    `composite_source`): its input ``g`` (the running value, through a pending factor), its
    states, extra inputs (the params read through the apply's state when ``aliased``) and
    scalars as new arguments; its new states and the new running value ``v``. Returns the
    number of inputs seen so far."""
    _, fname, c, factored, n_states, n_inputs, raw, indexed = op
    rc = _REAL.get(c, c)  # the scalars' dtype: real for a complex group (optax's real * complex)
    # Names of this call's own: numba gives a variable one type for the whole function, so a
    # ``g`` of float64 in one part and float32 in the next would be float64 in both (and the
    # float32 part computed in float64: not the bits of the separate passes).
    k = len(body)
    g, r = f"g{k}", f"r{k}"
    if factored == 1:  # div 1: the bits of (x / 1) * mul, without the division
        body.append(f"    {g} = as_{c}(v) * as_{rc}({scalar()})")
    elif factored:
        div, mul = scalar(), scalar()
        body.append(f"    {g} = {_quotient(f'as_{c}(v)', f'as_{rc}({div})', c)} * as_{rc}({mul})")
    else:
        body.append(f"    {g} = as_{c}(v)")
    sts = [f"s{len(states) + i}" for i in range(n_states)]
    states += sts
    ins = []
    for _ in range(n_inputs):
        if n_in in aliased:
            ins.append("sp")
        else:
            ins.append(f"x{len(inputs)}")
            inputs.append(ins[-1])
        n_in += 1
    scs = [scalar() if b else f"as_{rc}({scalar()})" for b in raw]
    # The driver reads every array in the call's widest compute dtype (a float64 accumulator
    # elsewhere in the chain makes it float64): this part's states and inputs are cast to its
    # own (exactly: it is at least as wide as their storage), so that it computes as its
    # separate pass does.
    args = [f"as_{c}({a})" for a in sts] + [g] + [f"as_{c}({a})" for a in ins] + scs
    if indexed:  # the element's index, which the composite takes last
        args.append("idx")
    body.append(f"    {r} = {fname}({', '.join(args)})")
    if n_states == 0:
        body.append(f"    v = {_rounding(d, c)}({r})")
    else:
        for i in range(n_states):
            new_states.append(f"n{len(new_states)}")
            body.append(f"    {new_states[-1]} = {r}[{i}]")
        body.append(f"    v = {_rounding(d, c)}({r}[{n_states}])")
    return n_in


_REAL = {"complex64": "float32", "complex128": "float64"}


def _quotient(x: str, d: str, c: str) -> str:
    """The source of ``x / d`` (``d`` real) in compute dtype ``c``: ``quot`` for a complex ``x``
    (`numbaccum.formulas.complex_quot`, part by part), else the plain division (the same text
    as ever for real groups)."""
    return f"quot({x}, {d})" if c in _REAL else f"({x} / {d})"


def _rounding(d: str, c: str) -> str:
    """The helper that rounds a value computed in dtype ``c`` to storage dtype ``d`` once (a
    float64 value goes to bfloat16 directly, not through float32)."""
    return "as_bfloat16_from64" if d == "bfloat16" and c == "float64" else f"as_{d}"


def _make_composite(key: tuple, callees: tuple[F.Formula, ...]) -> F.Formula:
    name, src, states, inputs, outputs, scalars, indexed = composite_source(key)
    # The formulas it calls, in its globals: not for running (`numbaccum.formulas.compile_formula`
    # binds their compiled selves) but for its `code_digest`, the key of its kernels on disk,
    # which then covers their code: a formula declared outside the package (whose edits the
    # cache's package hash does not see) changes the digest of every composite calling it.
    ns: dict[str, Any] = {f.name: f.fn for f in callees}
    exec(compile(src, f"<numbaccum.fuse {name}>", "exec"), ns)
    fn = ns[name]
    fn.__doc__ = src  # the generated source, readable where a driver names the kernel
    return F.Formula(fn, states, inputs, outputs, scalars, indexed)


def cached_composites() -> int:
    """How many composite formulas exist (each compiled once per driver)."""
    return len(_COMPOSITES)


# --- running parts outside a kept plan ------------------------------------------------------


def run_part(part: Any, u: Updates) -> tuple[Updates, Any]:
    """Runs one ticked part on ``u``: ``(updates, new_state)``. A `Scale` is a pending factor; a
    `Prepass` reduces the settled updates to the factor it leaves pending; a `Kernel` is one pass
    (the same composite a fused run makes of it, `numbaccum.FusedRun`); a `Collective` sums
    over the processes into its buffer."""
    kind = type(part)
    if kind is Host:
        u, part.new_state = part.run(u)
        return u, part.new_state
    if kind is Scale:
        return u.scaled(part.factor), part.new_state
    if kind is Prepass:
        u = u.settled()
        factor = part.factor_of(u.flat)
        new_state = part.new_state
        if type(new_state) is Later:
            new_state = new_state.make()
        return Updates(u.flat, u.owned, factor, u.returnable, u.scratch), new_state
    if kind is Kernel:
        out, factor, (new_state,) = FusedRun([part]).run(u.flat, u.factor, u.fresh)
        return Updates(out, True, factor, scratch=u.scratch), new_state
    if kind is Collective:
        out, factor, _ = part.reduce(u.flat, u.factor, None)
        return Updates(out, True, factor, scratch=u.scratch), part.new_state
    raise TypeError(f"run_part: {part!r} is not one part")


def apply_settled(u: Updates, params: FlatTree, memo: tuple | None = None) -> None:
    """``params += settled(u)`` in one pass per dtype group: the factor left pending on the
    updates (a trailing learning rate after a stage that fuses nothing: Adafactor, SM3,
    NovoGrad, user code) applied and rounded as `Updates.settled` rounds it, then added, as the
    settle pass and the apply pass would (the same bits, 12 bytes a float32 parameter instead
    of 20). ``memo``: ``({}, {})`` of group calls (`_run_group`'s memo and recent), kept across
    steps by the caller (the stage, per thread)."""
    calls, recent = memo if memo is not None else ({}, {})
    factor = u.factor
    mode = 2 if factor.device is not None else 1
    flags = (_factor_kind(factor),)
    for gi in range(len(u.flat.groups)):
        _run_group([], [], gi, u.flat, factor, None, params, (gi, mode, False, flags), calls, recent)


class Launches:
    """Kernel launches kept across steps: per formula and dtype group, the driver's launch of
    `map_` prepared (`prepare`) for the very buffers it was last given, prepared again when
    they change. The kernels the general paths run (`Updates.into`, `numbaccum.apply`'s
    ``_apply``, a lone kernel's formula), without deriving the launch from the buffers on every
    call: the same bits. A plan keeps one (`numbaccum.runner.Plan.launches`), a lone kernel's
    run another."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        # (formula, group) -> (arrays, launch, the entry before or None)
        self.last: dict = {}

    def run(self, f: Any, gi: int, arrays: list, factor: Factor, scalars: tuple) -> None:
        """``map_(f, factor, arrays, scalars)`` on group ``gi``'s buffers ``arrays``, whose last
        is the output.

        The launch before is kept too when only buffers lent to the caller moved since
        (`numbaccum._loans.lent_moved`): the loop that holds its last updates while it asks for
        the next gets them in a workspace and its spare by turns, and both launches stay
        prepared."""
        key = (f, gi)
        last = self.last.get(key)
        if last is not None:  # inline tests: every launch of a kept plan asks
            if len(last[0]) == len(arrays) and all(map(operator.is_, last[0], arrays)):
                last[1](factor, scalars)
                return
            before = last[2]
            if before is not None and len(before[0]) == len(arrays) and all(map(operator.is_, before[0], arrays)):
                before[1](factor, scalars)
                return
        launch = ops_for(arrays[0]).driver.prepare(f, tuple(arrays))
        before = (last[0], last[1]) if last is not None and lent_moved(last[0], arrays) else None
        self.last[key] = (arrays, launch, before)
        launch(factor, scalars)

    def copy(self, key: Any, dst: Any, d0: int, src: Any, s0: int, n: int, factor: Factor) -> None:
        """``dst[d0:d0 + n] = factor(src[s0:s0 + n])`` (`Ops.scale_` over those slices), its
        launch kept under ``key`` (the caller's: one per fixed pair of bounds) while ``src`` and
        ``dst`` are the buffers it was prepared for."""
        last = self.last.get(key)
        if last is not None:
            if last[0] is src and last[1] is dst:
                last[2](factor, ())
                return
            before = last[3]  # the launch for the other buffers of a pair (`run`)
            if before is not None and before[0] is src and before[1] is dst:
                before[2](factor, ())
                return
        launch = ops_for(src).driver.prepare(F.scale, (src[s0 : s0 + n], dst[d0 : d0 + n]))
        before = (*last[:3], None) if last is not None and lent_moved(last[:2], (src, dst)) else None
        self.last[key] = (src, dst, launch, before)
        launch(factor, ())

    def sliced(self, key: Any, f: Any, bufs: tuple, starts: tuple, n: int, factor: Factor, scalars: tuple) -> None:
        """``map_(f, factor, [b[s:s + n] for b, s in zip(bufs, starts)], scalars)`` (the output
        last), its launch kept under ``key`` (the caller's: one per fixed bounds) while ``bufs``
        are the buffers it was prepared for (`copy` for any formula)."""
        last = self.last.get(key)
        if last is not None:
            if all(map(operator.is_, last[0], bufs)):
                last[1](factor, scalars)
                return
            before = last[2]
            if before is not None and all(map(operator.is_, before[0], bufs)):
                before[1](factor, scalars)
                return
        views: list = []  # one view per (buffer, start): an array passed twice is one object
        for i, (b, s) in enumerate(zip(bufs, starts)):  # (the driver's in-place variant, as `map_`)
            j = next((j for j in range(i) if bufs[j] is b and starts[j] == s), i)
            views.append(b[s : s + n] if j == i else views[j])
        launch = ops_for(bufs[0]).driver.prepare(f, tuple(views))
        before = (last[0], last[1]) if last is not None and lent_moved(last[0], bufs) else None
        self.last[key] = (bufs, launch, before)
        launch(factor, scalars)

    def settle(self, u: Updates, out: FlatTree) -> FlatTree:
        """`Updates.into`: writes ``u``'s value into ``out`` (``u.flat`` itself when owned)."""
        factor, sources = u.factor, u.flat.groups
        for gi, dst in enumerate(out.groups):  # a loop, not calls: every update of such a plan
            self.run(F.scale, gi, [sources[gi], dst], factor, ())
        return out

    def add(self, p: FlatTree, updates: FlatTree) -> None:
        """``p += updates`` (the same layout and group dtypes), as `numbaccum.apply_updates_`
        adds them."""
        groups = updates.groups
        for gi, pg in enumerate(p.groups):
            self.run(F.add_scaled, gi, [pg, groups[gi], pg], ONE, (1.0,))
