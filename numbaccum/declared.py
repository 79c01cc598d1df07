"""Declared stages: an elementwise transformation is data, and the runner does the rest.

An `Elementwise` stage says what optax's ``scale_by_*`` says in its code, as data: the formula
(`numbaccum.formulas`), the state class with its buffer fields (in the formula's order) and
whether it counts steps, the dtype and initial value of each buffer, the extra inputs the
formula reads (the params), and how a step's scalars follow from the new count
(``scalars(count, compute dtype)``). From that one declaration come its ``init``, its
validation, its per-step values (``tick``), its kernel (the runner's, fused with its
neighbours) and its line in `numbaccum.explain`. It has no ``run`` of its own.

The part a stage declares (`numbaccum.fuse.Kernel`, `Scale`, `Prepass`) is made once per
state and layout and kept in the runner's plan; each step only calls its ``tick``, which checks
that the state is the one declared for (the same buffers, current) and computes the step's
scalars and new state into the part's slots (see `numbaccum.runner`).

The helpers below (``expect_state``, ``safe_increment``, ``bias_correction``, ...) are what
every stateful stage validates and counts with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from . import formulas as F
from ._checks import real, wrong_state
from .base import Stage
from .flat import FlatTree, layout_and_device
from .fuse import Kernel
from .layout import Layout, check_float_dtype, check_storage, real_dtype
from .layout import compute_dtype as _layout_compute
from .protocol import EmptyState
from .traits import ELEMENT
from .transaction import current
from .updates import Spec

__all__ = [
    "Elementwise",
    "bias_correction",
    "check_decay",
    "compute_dtype",
    "expect_state",
    "field_owner",
    "holds",
    "safe_increment",
]

_INT32_MAX = np.iinfo(np.int32).max
_ONE = np.int32(1)


def safe_increment(count: Any) -> np.int32:
    """count + 1, saturating at the int32 maximum instead of wrapping."""
    if type(count) is np.int32 and count != _INT32_MAX:  # the common case: NumPy's own add
        return count + _ONE
    c = int(count)
    return np.int32(c + 1 if c < _INT32_MAX else c)


def check_decay(decay: Any, name: str = "decay") -> float:
    d = real(decay, name)
    if not 0.0 <= d <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {decay!r}")
    return d


def bias_correction(decay: float, count: int, dtype: np.dtype) -> Any:
    """``1 - decay ** count`` computed in ``dtype`` (float32 leaves: float32, like optax; complex64
    leaves: float32 too, as optax computes it before the cast)."""
    consts = _BC_CONSTS.get((decay, dtype))
    if consts is None:  # once per decay and dtype: making NumPy scalars costs more than the power
        if len(_BC_CONSTS) > 1024:
            _BC_CONSTS.clear()
        t = real_dtype(np.dtype(dtype)).type
        consts = _BC_CONSTS[(decay, dtype)] = (t(1), t(decay))
    one, d = consts
    return one - d ** int(count)


_BC_CONSTS: dict[tuple[float, Any], tuple[Any, Any]] = {}


def compute_dtype(*arrays: Any) -> np.dtype:
    """The dtype a kernel computes in for these arrays (or dtypes): float16 and bfloat16 compute
    in float32 (`numbaccum.layout.compute_dtype`)."""
    dt = _COMPUTE.get(arrays)
    if dt is None:
        dt = _layout_compute(*(a if isinstance(a, np.dtype) else np.asarray(a).dtype for a in arrays))
        if all(isinstance(a, np.dtype) for a in arrays):  # dtypes are hashable and few: keep them
            _COMPUTE[arrays] = dt
    return dt


_COMPUTE: dict[tuple, np.dtype] = {}


def expect_state(
    state: Any, cls: type, field: str, layout: Layout | Spec, device: bool | None = None, renew: bool = True
) -> FlatTree:
    """The FlatTree field of a state, after checking the state's type, the field's layout and
    (with a `Spec`, or ``device``) its device. Raises before anything is written.

    With ``renew`` (the field that owns the stage's workspaces: one per state is enough), the
    state must be current and the field comes back renewed (`numbaccum.transaction.current`): build
    the new state from it."""
    if isinstance(layout, Spec):
        device = layout.device
        layout = layout.layout
    if not isinstance(state, cls):
        raise wrong_state(cls.__name__, state)
    flat = getattr(state, field)
    if not isinstance(flat, FlatTree) or flat.layout is not layout:
        raise ValueError(f"state.{field}: its layout does not match the updates ({layout})")
    # A layout without leaves (``masked`` with every leaf masked out) holds nothing anywhere.
    if device is not None and flat.device != device and layout.num_leaves:
        where = "a CUDA device" if flat.device else "the host"
        raise ValueError(f"state.{field}: it lives on {where}, the updates do not")
    return current(flat, field) if renew else flat


def holds(state: Any, cls: type, buffers: tuple) -> bool:
    """Whether ``state`` is a ``cls`` holding ``buffers``, ``((field, flat.__dict__), ...)``:
    the storage of the FlatTrees a part was declared for (their renewals share it). A declared
    part's tick asks this first; False makes the runner declare again, and the new declaration
    says what is wrong with the state."""
    if type(state) is not cls and not isinstance(state, cls):
        return False
    for field, storage in buffers:
        if getattr(getattr(state, field), "__dict__", None) is not storage:
            return False
    return True


def field_owner(state: Any, cls: type, field: str) -> FlatTree | None:
    """``state.<field>`` when ``state`` is a ``cls`` holding a FlatTree there (a stage's
    declared workspace owner), else None."""
    if isinstance(state, cls):
        flat = getattr(state, field)
        if isinstance(flat, FlatTree):
            return flat
    return None


class Elementwise(Stage):
    """A stage whose update is one formula over its state buffers and the updates, per dtype
    group, declared as data (see the module docstring).

    Class attributes (a subclass may set some per instance in ``__init__``):
        formula: the `numbaccum.formulas.Formula`, called as
            ``formula(*buffers, g, *inputs, *scalars)``.
        state_cls: the state class (a NamedTuple); None for a stateless stage (`EmptyState`).
        fields: the state's buffer fields, in the formula's order; the last one owns the
            stage's workspaces (its output buffer).
        counted: whether the state has a step field, advanced every step (`advance`).
        count_field: that field (``"count"``; Adan's is ``t``).
        count_start: the value it starts at (int32 0; optimistic gradients' ``is_initial_step``
            starts True, and their `advance` is not a count's).
        dtype_options: per buffer field, the attribute (the option: ``"mu_dtype"``) holding its
            storage dtype; a field not named, or an option of None: each group's own dtype.
        start_values: per buffer field, the attribute holding the value it starts at (RMSProp's
            ``{"nu": "initial"}``); a field not named starts at 0.
        other_starts: the state's other fields (neither buffers nor the step field) and their
            initial values; each passes through a step unless the stage's tick changes it.
        inputs: what the formula reads after the updates: ``("params",)`` or nothing.
        name: the stage as `numbaccum.explain` shows it.

    Subclasses implement `scalars`.
    """

    scope = ELEMENT  # `numbaccum.traits`: each element's update is of that element
    formula: ClassVar[F.Formula]
    state_cls: type[Any] | None = None  # a NamedTuple class
    fields: tuple[str, ...] = ()
    counted: bool = False
    count_field: ClassVar[str] = "count"
    count_start: ClassVar[Any] = np.int32(0)
    dtype_options: ClassVar[Mapping[str, str]] = {}
    start_values: ClassVar[Mapping[str, str]] = {}
    other_starts: ClassVar[Mapping[str, Any]] = {}
    inputs: ClassVar[tuple[str, ...]] = ()
    name: ClassVar[str]

    def scalars(self, count: Any, ct: np.dtype) -> tuple:
        """The formula's scalars for a group computing in ``ct`` at the new ``count`` (None for
        a stage that does not count)."""
        raise NotImplementedError(f"{type(self).__name__} declares no scalars")

    def field_dtypes(self, field: str, layout: Layout) -> Any:
        """The storage dtypes of buffer ``field`` (None: each group's own): the value of its
        `dtype_options` option."""
        option = self.dtype_options.get(field)
        return None if option is None else getattr(self, option)

    def advance(self, count: Any) -> tuple[Any, Any]:
        """The ``count_field`` of the new state and what `scalars` gets, from the old value:
        the count + 1 (saturating) for both."""
        new = safe_increment(count)
        return new, new

    # --- what the declaration gives -------------------------------------------------------------

    def init(self, params: Any) -> Any:
        if self.state_cls is None:
            return EmptyState()
        layout, device = layout_and_device(params, "params")
        values: dict[str, Any] = {}
        for f in self.fields:
            dts = self.field_dtypes(f, layout)
            if dts is not None:  # an explicit mu_dtype or accumulator_dtype: complex where the leaves are
                per = dts if isinstance(dts, list) else [np.dtype(dts)] * len(layout.groups)
                check_storage(per, layout, self.dtype_options[f])
            buf = FlatTree.zeros(layout, dts, device)
            at = self.start_values.get(f)
            start = getattr(self, at) if at is not None else 0.0
            values[f] = buf.fill_(start) if start else buf
        if self.counted:
            values[self.count_field] = self.count_start
        values.update(self.other_starts)
        return self.state_cls(**values)

    def owner(self, state: Any) -> FlatTree | None:
        if not self.fields:
            return None
        assert self.state_cls is not None  # (a stage with buffer fields has a state class)
        return field_owner(state, self.state_cls, self.fields[-1])

    def declare(self, spec: Spec, state: Any) -> Kernel:
        """The `Kernel` of this stage over ``state``'s buffers, after checking them (type,
        layout, device); its ``tick`` computes a step's values."""
        cls, fields = self.state_cls, self.fields
        bufs = tuple(expect_state(state, cls, f, spec, renew=False) for f in fields)  # type: ignore[arg-type]
        cts = [  # the dtype of each group's scalars: a complex group's are real
            real_dtype(compute_dtype(*(b.groups[gi].dtype for b in bufs), gdt))
            for gi, gdt in enumerate(spec.layout.group_dtypes)
        ]
        out: Callable[[], FlatTree] | None = None
        if bufs:  # the last buffer's workspace "out", called for the buffer to write
            out = bufs[-1].workspace_of("out", spec.layout.group_dtypes)
        part = Kernel(self.formula, bufs, [], None, out=out, name=self.name)
        part.tick = self._ticker(part, bufs, cts)
        return part

    def _ticker(self, part: Kernel, bufs: tuple, cts: list) -> Callable[..., bool]:
        """The part's ``tick``: this step's scalars and new state, from a state holding ``bufs``
        (the same storage: else False, and the runner declares again)."""
        cls, counted, scalars, name = self.state_cls, self.counted, self.scalars, self.name
        reads_params = bool(self.inputs)
        if not counted:  # the scalars follow from the count only: these never change
            part.scalars = [scalars(None, ct) for ct in cts]
        if cls is None:  # stateless: the state passes through

            def passing(state: Any, params: Any, extra: dict) -> bool:
                if reads_params:
                    part.inputs = _params_input(params, name)
                part.new_state = state
                return True

            return passing
        # The state's fields by position: the buffers to check (by their storage, which their
        # renewals share), the owner to renew, the count to advance; any other field passes.
        order = cls._fields  # type: ignore[union-attr]
        checks = tuple((order.index(f), b.__dict__) for f, b in zip(self.fields, bufs))
        owner_field = self.fields[-1] if self.fields else None  # (a state of scalars only: none)
        owner_at = order.index(owner_field) if self.fields else -1
        count_at = order.index(self.count_field) if counted else -1

        # The scalars once per distinct compute dtype (one, unless groups differ), as they come:
        # the drivers cast them for the call and the kernels to each formula's compute dtype.
        distinct = list(dict.fromkeys(cts))
        where = [distinct.index(ct) for ct in cts]  # each group's, among the distinct ones
        # ct0: the one dtype when every group computes in it, else None
        ct0, n_groups = distinct[0] if len(distinct) == 1 else None, len(cts)
        new = tuple.__new__  # the NamedTuple made from its values, without its keyword __new__
        advance = None if type(self).advance is Elementwise.advance else self.advance

        def tick(state: Any, params: Any, extra: dict) -> bool:
            if type(state) is not cls and not isinstance(state, cls):  # type: ignore[arg-type]
                return False
            for i, storage in checks:
                if getattr(state[i], "__dict__", None) is not storage:
                    return False
            if reads_params:
                part.inputs = _params_input(params, name)
            values = list(state)
            if owner_field is not None:  # (then owner_at is its index)
                values[owner_at] = current(values[owner_at], owner_field)
            if counted:
                if advance is None:  # a count: inline, the common case
                    count = values[count_at] = safe_increment(values[count_at])
                else:
                    values[count_at], count = advance(values[count_at])
                if ct0 is not None:  # every group computes in one dtype: no comprehension per step
                    part.scalars = [scalars(count, ct0)] * n_groups
                else:  # (loops, not comprehensions: each of those is a call, every step)
                    each = []
                    for ct in distinct:
                        each.append(scalars(count, ct))
                    if len(each) != n_groups:
                        each = [each[i] for i in where]
                    part.scalars = each
            part.new_state = new(cls, values)
            return True

        return tick


def _params_input(params: Any, name: str) -> Callable[[], tuple]:
    """The extra input of a formula that reads the params (packed once, when first read)."""
    if params is None:
        raise ValueError(f"{name} needs params: call update(updates, state, params)")
    return lambda: (params.flat(),)
