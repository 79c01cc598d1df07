"""torchzero's clipping modules over numbaccum's core transformations.

Each class takes torchzero 0.4's constructor arguments and defaults, and is two things at once:

* a `GradientTransformation` (``init``/``update``, so it chains with anything in numbaccum:
  ``nba.chain(ClipNormByEMA(), nba.adam(1e-3))``);
* a stateful object like a torchzero module: ``step(updates)`` returns the processed updates and
  keeps the state itself (created from the first updates), ``reset()`` forgets it, and
  ``state_dict()``/``load_state_dict(d)`` round-trip it as plain dicts of NumPy arrays.

``step`` returns numbaccum's updates, the caller's to keep (no later ``step`` writes into them); the
input is never modified, where torchzero works in place.

The semantics are torchzero's without its bugs (`numbaccum.adaptive` and `numbaccum.norms` list
them): ``dim=None`` is per leaf, not "sticky"; a zero first step does not collapse the growth
and EMA clippers; ``min_value`` bounds the allowed norm, not the divisor; ``add=None, mul=None``
is the identity; a negative ``ClipValue`` raises ValueError. ``inner`` (a transformation or a
list of them) runs on the updates and is scaled by the statistics of its input, as in torchzero.
"""

from __future__ import annotations

import copy
from typing import Any

from .. import (
    GradientTransformationExtraArgs,
    centralize,
    clip,
    clip_grad_norm_,
    clip_grad_value_,
    clip_norm,
    clip_norm_growth,
    clip_value_growth,
    normalize,
    normalize_grads_,
)

# torchzero's ``inner`` (and ClipValueByEMA's ``exp_avg_tfm``): another transformation whose
# output is scaled by the statistics of this module's input. The core's public clip_norm_by_ema,
# normalize_by_ema and clip_value_by_ema take no such argument and no public combinator expresses
# it, so these two builders are the one use of the core's internals here (tests/test_imports.py).
from ..adaptive import _ema_norm_transformation, _value_ema_transformation
from ._args import non_negative
from ._state import load_plain, to_plain

__all__ = [
    "Centralize",
    "ClipNorm",
    "ClipNormByEMA",
    "ClipNormGrowth",
    "ClipValue",
    "ClipValueByEMA",
    "ClipValueGrowth",
    "Normalize",
    "NormalizeByEMA",
    "clip_grad_norm_",
    "clip_grad_value_",
    "normalize_grads_",
]


class _Module(GradientTransformationExtraArgs):
    """A GradientTransformation that also keeps its own state, as a torchzero module does."""

    _settings: dict[str, Any]
    _state: Any
    _pending: Any

    @classmethod
    def _build(cls, tx: Any, settings: dict[str, Any]) -> Any:
        self = tuple.__new__(cls, (tx.init, tx.update))
        self._settings = settings
        self._state = None  # created from the first updates
        self._pending = None  # a loaded state waiting for the first updates
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._settings.items())
        return f"{type(self).__name__}({args})"

    def __reduce__(self) -> Any:  # a tuple subclass would pickle as (init, update) otherwise
        raise TypeError(f"{type(self).__name__} does not pickle; save its state_dict() instead")

    @property
    def settings(self) -> dict[str, Any]:
        """The constructor arguments."""
        return dict(self._settings)

    @property
    def state(self) -> Any:
        """The numbaccum state of `step` (None before the first step)."""
        return self._state

    def step(self, updates: Any) -> Any:
        """Processes ``updates`` (a tree or FlatTree) with the module's own state; returns the
        new updates (the caller's to keep). The state is created from the first updates."""
        state = self._state
        if state is None:
            state = self.init(updates)
            if self._pending is not None:
                state = load_plain(state, self._pending)
        out, new_state = self.update(updates, state)
        self._state, self._pending = new_state, None
        return out

    def reset(self) -> None:
        """Forgets the state: the next step starts afresh."""
        self._state = None
        self._pending = None

    def state_dict(self) -> dict[str, Any]:
        """``{"settings": constructor arguments, "state": the state as plain data}`` (copies;
        the state is None before the first step)."""
        state = to_plain(self._state) if self._state is not None else copy.deepcopy(self._pending)
        return {"settings": _plain_settings(self._settings), "state": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a `state_dict` of a module with the same settings.

        Before the first step the state is kept and checked against the first updates.

        Raises:
            ValueError: the keys, the settings, or the state's structure or shapes differ; the
                module's state is unchanged then.
        """
        if not isinstance(state_dict, dict) or set(state_dict) != {"settings", "state"}:
            raise ValueError("state_dict: expected a dict with the keys 'settings' and 'state'")
        mine = _plain_settings(self._settings)
        if state_dict["settings"] != mine:
            raise ValueError(f"state_dict: settings {state_dict['settings']} do not match {mine}")
        plain = state_dict["state"]
        if plain is None:
            self.reset()
        elif self._state is None:
            self._pending = copy.deepcopy(plain)
        else:
            self._state = load_plain(self._state, plain)


def _plain_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings comparable across instances: a child transformation counts as given or not."""
    return {k: (v if k not in ("inner", "exp_avg_tfm") else v is not None) for k, v in settings.items()}


class ClipValue(_Module):
    """Clips every element to ``[-value, value]`` (torchzero's ClipValue; `numbaccum.clip`).

    Raises:
        ValueError: ``value`` is negative (torchzero maps every element to it).
    """

    def __new__(cls, value: float) -> ClipValue:
        non_negative(value, "value")  # checked here: clip's own message names max_delta
        return cls._build(clip(value), dict(value=value))


class ClipNorm(_Module):
    """Clips the norm of each leaf (or slice, or the whole tree) to ``max_norm``
    (torchzero's ClipNorm; `numbaccum.clip_norm`)."""

    def __new__(
        cls, max_norm: float, ord: Any = 2, dim: Any = None, inverse_dims: bool = False, min_size: int = 1
    ) -> ClipNorm:
        settings = dict(max_norm=max_norm, ord=ord, dim=dim, inverse_dims=inverse_dims, min_size=min_size)
        return cls._build(clip_norm(**settings), settings)


class Normalize(_Module):
    """Scales each leaf (or slice, or the whole tree) to the norm ``norm_value``
    (torchzero's Normalize; `numbaccum.normalize`)."""

    def __new__(
        cls,
        norm_value: float = 1,
        ord: Any = 2,
        dim: Any = None,
        inverse_dims: bool = False,
        min_size: int = 1,
    ) -> Normalize:
        settings = dict(norm_value=norm_value, ord=ord, dim=dim, inverse_dims=inverse_dims, min_size=min_size)
        return cls._build(normalize(**settings), settings)


class Centralize(_Module):
    """Subtracts the mean over ``dim`` (torchzero's Centralize and its defaults, which are not
    optax's; `numbaccum.centralize`). GC-paper centralization is ``Centralize(dim=0,
    inverse_dims=True)``."""

    def __new__(cls, dim: Any = None, inverse_dims: bool = False, min_size: int = 2) -> Centralize:
        settings = dict(dim=dim, inverse_dims=inverse_dims, min_size=min_size)
        return cls._build(centralize(**settings), settings)


class ClipNormByEMA(_Module):
    """Clips the norm to that of an EMA of past updates (torchzero's ClipNormByEMA;
    `numbaccum.clip_norm_by_ema`, plus torchzero's ``inner``)."""

    def __new__(
        cls,
        beta: float = 0.99,
        ord: Any = 2,
        tensorwise: bool = True,
        max_ema_growth: float | None = 1.5,
        init: float = 0.0,
        min_norm: float = 1e-6,
        inner: Any = None,
    ) -> ClipNormByEMA:
        settings = dict(
            beta=beta,
            ord=ord,
            tensorwise=tensorwise,
            max_ema_growth=max_ema_growth,
            init=init,
            min_norm=min_norm,
            inner=inner,
        )
        tx = _ema_norm_transformation(
            beta, ord, tensorwise, max_ema_growth, init, min_norm, cls._NORMALIZE, inner
        )
        return cls._build(tx, settings)

    _NORMALIZE = False


class NormalizeByEMA(ClipNormByEMA):
    """Scales the norm to that of an EMA of past updates (torchzero's NormalizeByEMA;
    `numbaccum.normalize_by_ema`)."""

    _NORMALIZE = True


class ClipValueByEMA(_Module):
    """Clips each element to the EMA of its past magnitudes (torchzero's ClipValueByEMA;
    `numbaccum.clip_value_by_ema`). ``exp_avg_tfm`` transforms (a copy of) the EMA before it
    bounds the update."""

    def __new__(
        cls, beta: float = 0.99, init: float = 0, inner: Any = None, exp_avg_tfm: Any = None
    ) -> ClipValueByEMA:
        settings = dict(beta=beta, init=init, inner=inner, exp_avg_tfm=exp_avg_tfm)
        return cls._build(_value_ema_transformation(beta, init, inner, exp_avg_tfm), settings)


class ClipValueGrowth(_Module):
    """Limits the growth of each element's magnitude (torchzero's ClipValueGrowth;
    `numbaccum.clip_value_growth`)."""

    def __new__(
        cls,
        add: float | None = None,
        mul: float | None = 1.5,
        min_value: float | None = 1e-4,
        max_decay: float | None = 2,
    ) -> ClipValueGrowth:
        settings = dict(add=add, mul=mul, min_value=min_value, max_decay=max_decay)
        return cls._build(clip_value_growth(**settings), settings)


class ClipNormGrowth(_Module):
    """Limits the growth of each leaf's (or the tree's) norm (torchzero's ClipNormGrowth;
    `numbaccum.clip_norm_growth`)."""

    def __new__(
        cls,
        add: float | None = None,
        mul: float | None = 1.5,
        min_value: float | None = 1e-4,
        max_decay: float | None = 2,
        ord: Any = 2,
        tensorwise: bool = True,
    ) -> ClipNormGrowth:
        settings = dict(
            add=add, mul=mul, min_value=min_value, max_decay=max_decay, ord=ord, tensorwise=tensorwise
        )
        return cls._build(clip_norm_growth(**settings), settings)
