"""The values passed between stages: what an update is fed (`Spec`), the updates themselves
with their pending factor (`Updates`), the params as a stage reads them (`ParamsRef`), and a
step skipped by a stage that saw the data (`SkipStep`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from . import arrays
from .backend import ops_for
from .contract import ONE, Factor
from .flat import FlatTree, as_flat, check_leaves, host_leaves
from .layout import Layout

__all__ = ["ParamsRef", "SkipStep", "Spec", "Updates", "check_params"]


class Spec(NamedTuple):
    """What a stage is fed: the updates' layout and whether they live on a CUDA device."""

    layout: Layout
    device: bool


class Updates:
    """Updates between two stages: the value is ``factor(flat)``, group by group.

    Attributes:
        flat: the buffer.
        owned: a workspace this update may overwrite (never the caller's input, never a
            state's accumulator).
        factor: the pending `Factor` ``(x / div) * mul``, applied by the next kernel that reads
            ``flat`` (`ONE`: none).
        returnable: may be handed to the user as is (default: ``owned``).
        scratch: where a stage writes a new value when ``flat`` is not ``owned`` (see `fresh`);
            the runner (`Stage.update`, `chain`) sets it to the running stage's workspace.
    """

    # A plain class with slots, not a dataclass: a few are made per update, and a small tree's
    # whole update costs microseconds.
    __slots__ = ("flat", "owned", "factor", "returnable", "scratch")

    def __init__(
        self,
        flat: FlatTree,
        owned: bool,
        factor: Factor = ONE,
        returnable: bool | None = None,
        scratch: Callable[[], FlatTree] | None = None,
    ) -> None:
        self.flat = flat
        self.owned = owned
        self.factor = factor
        self.returnable = owned if returnable is None else returnable
        self.scratch = scratch

    def __repr__(self) -> str:
        return f"Updates({self.flat!r}, owned={self.owned}, factor={self.factor!r})"

    @property
    def pending(self) -> bool:
        """Whether a factor waits to be applied."""
        return self.factor is not ONE and not self.factor.is_one

    def scaled(self, factor: Factor) -> Updates:
        """``factor(self)``: the same buffer with ``factor`` pending, which rides on the next kernel.

        A factor already pending is never dropped: it is applied first (one pass), so the result
        is ``factor(pending(x))`` rounded exactly as two separate scalings would be.
        """
        if factor is ONE or factor.is_one:
            return self
        u = self.settled() if self.pending else self
        return Updates(u.flat, u.owned, factor, u.returnable, u.scratch)

    def view(self) -> Updates:
        """The same value, read-only: a stage that runs an inner transformation on it and reads
        it again afterwards passes this, so the inner one writes into ``scratch`` instead."""
        return Updates(self.flat, False, self.factor, False, self.scratch)

    def fresh(self) -> FlatTree:
        """A buffer for this update's next value: its own if it may be overwritten, else the
        running stage's scratch (a workspace of its state, or the stateless stage's own)."""
        if self.owned:
            return self.flat
        if self.scratch is not None:
            return self.scratch()
        return FlatTree.empty(self.flat.layout, device=self.flat.device)

    def settled(self, into: FlatTree | None = None, kept: Any = None) -> Updates:
        """This update with the pending factor applied (in place when owned, else into ``into``
        or `fresh`); ``kept``: a declaration's `numbaccum.fuse.Launches`, which keeps the scale
        launches across steps (`numbaccum.fuse.Launches.settle`: the same kernel)."""
        if not self.pending:
            return self
        out = into if into is not None and not self.owned else self.fresh()
        if kept is None:
            self.into(out)
        else:
            kept.settle(self, out)
        return Updates(out, True, scratch=self.scratch)

    def into(self, out: FlatTree) -> FlatTree:
        """Writes the value into ``out`` (same layout; any storage dtypes) and returns it."""
        factor = self.factor
        for dst, src in zip(out.groups, self.flat.groups):
            ops_for(src).scale_(dst, src, factor)
        return out

    def handed_out(self) -> FlatTree:
        """The value in a new buffer of its own, for code that is not numbaccum's: it may keep,
        return or modify it (never the caller's gradients or a state's accumulator)."""
        return self.into(FlatTree.empty(self.flat.layout, device=self.flat.device))


class SkipStep(Exception):
    """Raised inside a run by a stage that decided, from the data, that this step must not
    happen (a clip with ``nonfinite="skip"`` that saw a NaN or inf): the enclosing chain keeps the
    states of the stages after it as they were and passes the exception on, and the outermost
    stage returns zero updates (`Stage.update`, `numbaccum.step_`: params untouched).

    Attributes:
        new_state: the new state of what raised it (a chain: every stage's, the stages after the
            skipping one unchanged).
    """

    def __init__(self, new_state: Any) -> None:
        super().__init__("step skipped")
        self.new_state = new_state


class ParamsRef:
    """The ``params`` argument: checked against the updates' layout before anything runs
    (`Stage.update`), flattened only when a stage asks for it (then once, into a workspace).

    A wrapper that hands an inner transformation part of the params (`numbaccum.masking`) gives
    ``fill`` (makes the flat params) and ``raw_of`` (makes the tree, for a foreign inner
    transformation) instead of ``raw``: both are called only if asked for."""

    __slots__ = ("_raw", "_raw_of", "_layout", "_into", "_device", "_flat", "_fill", "checked")

    def __init__(
        self,
        raw: Any,
        layout: Layout,
        owner: FlatTree | None = None,
        device: bool | None = None,
        into: Callable[[], FlatTree] | None = None,
        *,
        fill: Callable[[], FlatTree] | None = None,
        raw_of: Callable[[], Any] | None = None,
    ) -> None:
        self._raw = raw
        self._raw_of = raw_of
        self._layout = layout
        self._device = device
        self._flat: FlatTree | None = None
        self._fill = fill
        self.checked: list | None = None  # host leaves already checked against the layout
        if into is None and owner is not None:
            into = lambda: owner.workspace("params")  # noqa: E731
        self._into = into

    @property
    def raw(self) -> Any:
        """The params as the caller gave them."""
        if self._raw_of is not None:
            self._raw, self._raw_of = self._raw_of(), None
        return self._raw

    def flat(self) -> FlatTree:
        """The params as a FlatTree of the updates' layout (packed on first use)."""
        if self._flat is None:
            if self._fill is not None:
                self._flat = self._fill()
            else:
                self._flat = as_flat(
                    self.raw,
                    self._layout,
                    "params",
                    self._into,
                    self._device,
                    self.checked if not self._device else None,
                )[0]
        return self._flat


def check_params(params: Any, spec: Spec) -> list | None:
    """ValueError/TypeError naming the leaf when ``params`` do not match ``spec``: structure,
    shapes and dtypes (params of another dtype than the state was made for are refused by
    `Stage.update` and `numbaccum.step_` alike). Cheap for a FlatTree of that layout and for a
    tree of CUDA arrays, read off their own attributes.
    Returns the checked leaves of a plain host tree (so that packing it does not check them
    again), else None."""
    if isinstance(params, FlatTree):
        if params.layout is spec.layout and params.device == spec.device:
            return None
    elif spec.device and arrays.device_pointers(params, spec.layout) is not None:
        return None
    elif not spec.device:
        fast = host_leaves(params, spec.layout)  # structure, shapes and dtypes: the common case
        if fast is not None:
            return fast
    leaves = check_leaves(params, spec.layout, "params", spec.device)
    for i, (x, d) in enumerate(zip(leaves, spec.layout.dtypes)):
        # Params of another dtype than the state was made for: `update` would add float32
        # updates to them and `step_` round them to the state's dtype. Neither is asked for.
        if x.dtype != d:
            raise TypeError(
                f"{spec.layout.path(i, 'params')}: dtype {x.dtype} does not match {d}, the dtype "
                "of the params the state was made for (init the state with these params)"
            )
    return leaves if not spec.device and not isinstance(params, FlatTree) else None
