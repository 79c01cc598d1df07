"""declearn's OptiModules over numbaccum's core transformations.

A module has declearn's class attribute ``name`` (its registry key), ``run(gradients)`` on a dict
of named arrays (NumPy or CUDA) returning a new dict with the same keys, shapes and dtypes, and
declearn's round trips: ``get_config()``/``from_config(cfg)``/``OptiModule.from_specs(name, cfg)``
and ``get_state()``/``set_state(state)`` (a stateless module rejects a non-empty state with
KeyError). `Pipeline` runs modules given as instances, names or ``(name, config)`` pairs, in
order, as declearn's Optimizer does.

=====================  ======================  =============================================
module                 name                    update
=====================  ======================  =============================================
``L2Clipping``         ``"l2-clipping"``       ``g * min(max_norm / |g|, 1)`` per array
``L2GlobalClipping``   ``"l2-global-clipping"`` the same with the norm of all arrays
``EWMAModule``         ``"ewma"``              ``s = beta * s + (1 - beta) * g``; ``s``
``MomentumModule``     ``"momentum"``          ``v = beta * v + g``; ``v`` (or ``beta * v + g``)
``GaussianNoiseModule`` ``"gaussian-noise"``   ``g + N(0, std^2)``
=====================  ======================  =============================================

Differences from declearn (deliberate): ``max_norm=0`` on a zero array gives zeros (declearn:
NaN); a non-finite norm leaves its array unchanged in ``L2Clipping``; ``L2GlobalClipping`` keeps
each array's dtype (declearn upcasts float32 arrays to float64 when any array is float64) and
sums squares in float64; ``GaussianNoiseModule`` draws in float64 and keeps the gradient dtype
(declearn's safe mode returns float64 and can draw +inf in float32) and never turns finite input
into inf.
"""

from __future__ import annotations

import abc
import math
import secrets
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from .. import (
    EmptyState,
    FlatTree,
    GradientTransformation,
    chain,
    clip_by_global_norm,
    ema,
    to_device,
    trace,
)
from ..arrays import kind_of, on_device
from ..backend import ops_for
from ..contract import ONE
from ..flat import as_flat, layout_of
from ..layout import compute_dtype, finfo
from ..norms import leaf_norms
from ..tables import segments
from ._args import non_negative, real
from ._state import load_plain, to_plain

__all__ = [
    "EWMAModule",
    "GaussianNoiseModule",
    "L2Clipping",
    "L2GlobalClipping",
    "MomentumModule",
    "OptiModule",
    "Pipeline",
    "list_optim_modules",
]


def _check_gradients(gradients: Any) -> dict[str, Any]:
    """``gradients`` as a dict after checking it maps strings to arrays (TypeError otherwise)."""
    if not isinstance(gradients, Mapping):
        raise TypeError(f"gradients: expected a dict of named arrays, got {type(gradients).__name__}")
    for k, v in gradients.items():
        if not isinstance(k, str):
            raise TypeError(f"gradients: keys must be strings, got {k!r}")
        if v is None or isinstance(v, (Mapping, list, tuple)):
            raise TypeError(f"gradients[{k!r}]: expected an array, got {type(v).__name__}")
    return dict(gradients)


def _fresh_copy(out: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """A new dict (in ``order``) of new arrays holding the values of ``out``: one buffer per
    dtype, of the caller's array type."""
    kind = kind_of(next(iter(out.values())))
    copied = FlatTree.from_tree(out).tree_as(kind)
    return {k: copied[k] for k in order}


class OptiModule(abc.ABC):
    """Base of the declearn-shaped modules: a registry by ``name`` and the config/state API.

    Subclasses are registered under their ``name`` (pass ``register=False`` to opt out).
    """

    name: ClassVar[str] = ""
    _registry: ClassVar[dict[str, type[OptiModule]]] = {}

    def __init_subclass__(cls, register: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if register:
            known = OptiModule._registry.get(cls.name)
            if known is not None and known.__qualname__ != cls.__qualname__:
                raise TypeError(f"OptiModule name {cls.name!r} is already registered by {known.__name__}")
            OptiModule._registry[cls.name] = cls

    @abc.abstractmethod
    def run(self, gradients: Mapping[str, Any]) -> dict[str, Any]:
        """The processed gradients: a new dict with the same keys, shapes and dtypes."""

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments (JSON-serialisable)."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> OptiModule:
        """``cls(**config)``; an unknown key raises TypeError."""
        return cls(**config)

    @classmethod
    def from_specs(cls, name: str, config: dict[str, Any]) -> OptiModule:
        """The module registered as ``name``, built from ``config``.

        Raises:
            KeyError: no module is registered under ``name``.
        """
        found = OptiModule._registry.get(name)
        if found is None:
            raise KeyError(f"no OptiModule named {name!r}; known: {sorted(OptiModule._registry)}")
        return found.from_config(config)

    def get_state(self) -> dict[str, Any]:
        """The module's state (a stateless module's is ``{}``)."""
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a state from `get_state`.

        Raises:
            KeyError: a stateless module received a non-empty state.
        """
        if state:
            raise KeyError(f"{type(self).__name__} has no state, but received {sorted(state)}")

    def on_round_start(self) -> None:  # noqa: B027 - a hook: doing nothing is the default
        """Called once per federated round (declearn's hook); no-op by default."""


def list_optim_modules() -> dict[str, type[OptiModule]]:
    """``{name: class}`` of the registered modules."""
    return dict(OptiModule._registry)


class _TxModule(OptiModule, register=False):
    """A module running a numbaccum transformation whose state it keeps."""

    _state_key: ClassVar[str] = ""  # the get_state key of a stateful module

    def __init__(self, tx: GradientTransformation) -> None:
        self._tx = tx
        self._state: Any = None
        self._pending: Any = None  # a set_state value waiting for the first gradients

    def _current_state(self, gradients: dict[str, Any]) -> Any:
        """The state to update: the module's own, or (first run) a new one holding a pending
        `set_state` value (checked before anything is written). Changes nothing of the module."""
        state = self._state
        if state is None:
            state = self._tx.init(gradients)
            if self._pending is not None:
                state = self._load(state, self._pending)
        return state

    def _commit(self, state: Any, keys: list[str]) -> None:
        """Keeps the state of a successful update."""
        self._state, self._pending = state, None

    def _apply(self, gradients: dict[str, Any]) -> dict[str, Any]:
        """The transformation's output (views of its workspace, never written again while held); the
        module's state changes only when the whole update succeeded."""
        if not gradients:
            return {}
        out, state = self._tx.update(gradients, self._current_state(gradients))
        self._commit(state, list(gradients))
        return out

    def _load(self, template: Any, value: dict[str, Any]) -> Any:
        return template

    def run(self, gradients: Mapping[str, Any]) -> dict[str, Any]:
        grads = _check_gradients(gradients)
        out = self._apply(grads)
        return _fresh_copy(out, list(grads)) if out else {}


class L2Clipping(_TxModule):
    """Clips each array to an L2 norm of at most ``max_norm``: ``g * min(max_norm / |g|, 1)``.

    A zero array passes unchanged (also with ``max_norm=0``, where declearn gives NaN); an array
    with a non-finite norm passes unchanged.
    """

    name: ClassVar[str] = "l2-clipping"

    def __init__(self, max_norm: float = 1.0) -> None:
        self.max_norm = max_norm
        super().__init__(_l2_clipping(max_norm))

    def get_config(self) -> dict[str, Any]:
        return {"max_norm": self.max_norm}


def _l2_clipping(max_norm: float) -> GradientTransformation:
    """Per-leaf L2 clipping, ``u = g / max(|g| / max_norm, 1)`` (1 for a zero or non-finite
    norm), as a plain pair over the public kernels: the norms in float64 (rescued past 1e154),
    the division in each leaf's dtype."""
    m = non_negative(max_norm, "max_norm")

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        flat, _, kind = as_flat(updates, layout_of(updates, "updates"), "updates")
        norms = leaf_norms(flat)  # scaled: finite for float64 leaves past 1e154
        with np.errstate(divide="ignore", invalid="ignore"):
            factors = np.where((norms > 0) & np.isfinite(norms), np.maximum(norms / m, 1.0), 1.0)
        if np.all(factors == 1.0):
            return updates, state
        out = _divided(flat, factors)
        return (out if kind == "flat" else out.tree_as(kind)), state

    return GradientTransformation(lambda params: EmptyState(), update)


def _divided(flat: FlatTree, factors: np.ndarray) -> FlatTree:
    """A new FlatTree: each leaf of ``flat`` divided by its float64 factor (>= 1), in the leaf's
    dtype with the factor cast to it, as the core's per-leaf clippers divide; where a factor is
    past the range of the dtype the kernel computes in (a float32 leaf with a norm past 3.4e38
    would be divided by inf), ``x * (1 / factor)`` in float64, rounded once, as they do too."""
    lay = flat.layout
    out = FlatTree.empty(lay, device=flat.device)
    for gi, (o, g) in enumerate(zip(out.groups, flat.groups)):
        f = factors[lay.group_index[gi]]
        big = np.finfo(compute_dtype(g.dtype)).max  # float16 and bfloat16 run in float32
        if np.all((f <= big) | (f == np.inf)):  # inf (max_norm 0): exact zeros either way
            ops_for(g).segment_divide_(o, g, ONE, lay.offsets[gi], f.astype(g.dtype))
        else:
            ops_for(g).slice_apply_(o, g, segments(lay.offsets[gi]), None, 1.0 / f)
    return out


class L2GlobalClipping(_TxModule):
    """Clips all arrays together to a global L2 norm of at most ``max_norm``
    (`numbaccum.clip_by_global_norm`): zero gradients pass, ``max_norm=0`` gives zeros."""

    name: ClassVar[str] = "l2-global-clipping"

    def __init__(self, max_norm: float = 1.0) -> None:
        self.max_norm = max_norm
        super().__init__(clip_by_global_norm(max_norm))

    def get_config(self) -> dict[str, Any]:
        return {"max_norm": self.max_norm}


def _check_beta(beta: Any) -> float:
    if not isinstance(beta, float):
        raise TypeError(f"beta must be a float, got {type(beta).__name__}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}")
    return beta


class _Stateful(_TxModule, register=False):
    """A module whose state is one tree shaped like the gradients (0.0 before the first run)."""

    _field: ClassVar[str] = ""  # the field of the numbaccum state holding that tree

    def __init__(self, tx: GradientTransformation, round_reset: bool) -> None:
        super().__init__(tx)
        self.round_reset = bool(round_reset)
        self._keys: list[str] = []

    def run(self, gradients: Mapping[str, Any]) -> dict[str, Any]:
        grads = _check_gradients(gradients)
        out = self._apply(grads)
        return _fresh_copy(out, self._keys) if out else {}

    def _commit(self, state: Any, keys: list[str]) -> None:
        super()._commit(state, keys)
        self._keys = keys

    def get_state(self) -> dict[str, Any]:
        """``{key: 0.0}`` before the first run, else ``{key: {name: array}}`` (host copies)."""
        if self._state is None:
            value = self._pending if self._pending is not None else 0.0
            return {self._state_key: value if not isinstance(value, dict) else dict(value)}
        tree = to_plain(getattr(self._state, self._field))
        return {self._state_key: {k: tree[k] for k in self._keys or sorted(tree)}}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores `get_state`'s value (``0.0`` resets the module).

        Raises:
            KeyError: the state's key is missing.
            TypeError: the value is neither 0.0 nor a dict of arrays.
        """
        if self._state_key not in state:
            raise KeyError(f"{type(self).__name__}.set_state: missing the state variable {self._state_key!r}")
        value = state[self._state_key]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            self._state, self._pending = None, None
            return
        if not isinstance(value, Mapping):
            raise TypeError(
                f"{self._state_key}: expected 0.0 or a dict of arrays, got {type(value).__name__}"
            )
        value = {k: np.array(v, copy=True) for k, v in value.items()}
        if self._state is not None:
            self._state = self._load(self._state, value)
        else:
            self._pending = value
        self._keys = list(value)

    def _load(self, template: Any, value: dict[str, Any]) -> Any:
        fields = to_plain(template)
        fields[self._field] = value
        return load_plain(template, fields)

    def on_round_start(self) -> None:
        """Resets the state when ``round_reset`` is set."""
        if self.round_reset:
            self._state, self._pending = None, None


class EWMAModule(_Stateful):
    """Exponentially weighted moving average: ``s = beta * s + (1 - beta) * g``; returns ``s``
    (`numbaccum.ema` without debias; bit for bit declearn's arithmetic in each dtype).

    Raises:
        TypeError: ``beta`` is not a float.
        ValueError: ``beta`` is not in [0, 1).
    """

    name: ClassVar[str] = "ewma"
    _state_key: ClassVar[str] = "state"
    _field: ClassVar[str] = "ema"

    def __init__(self, beta: float = 0.9, round_reset: bool = False) -> None:
        self.beta = _check_beta(beta)
        super().__init__(ema(beta, debias=False), round_reset)

    def get_config(self) -> dict[str, Any]:
        return {"beta": self.beta, "round_reset": self.round_reset}


class MomentumModule(_Stateful):
    """Momentum: ``v = beta * v + g``; returns ``v``, or ``beta * v + g`` with ``nesterov``
    (`numbaccum.trace`).

    Raises:
        TypeError: ``beta`` is not a float.
        ValueError: ``beta`` is not in [0, 1).
    """

    name: ClassVar[str] = "momentum"
    _state_key: ClassVar[str] = "velocity"
    _field: ClassVar[str] = "trace"

    def __init__(self, beta: float = 0.9, nesterov: bool = False, round_reset: bool = False) -> None:
        self.beta = _check_beta(beta)
        tx = trace(beta, nesterov=nesterov)  # checks nesterov: a bool, or 0 or 1
        self.nesterov = bool(nesterov)
        super().__init__(tx, round_reset)

    def get_config(self) -> dict[str, Any]:
        return {"beta": self.beta, "nesterov": self.nesterov, "round_reset": self.round_reset}


class GaussianNoiseModule(OptiModule):
    """Adds Gaussian noise: ``g + N(0, std^2)``, drawn per array in the dict's order.

    ``safe_mode=False``: ``numpy.random.default_rng(seed)`` is created once and draws
    ``normal(scale=std, size=shape)`` per array, then casts it to the array's dtype (declearn's
    draws, value for value). ``safe_mode=True``: every call draws from a generator seeded with 128
    fresh bits from the operating system (``secrets``); ``seed`` is ignored. Noise is drawn in
    float64, cast with saturation, and each result keeps its array's dtype; a finite input never
    gives an inf (the sum saturates at the dtype's largest value).

    Raises:
        ValueError: ``std`` is negative or not finite.
    """

    name: ClassVar[str] = "gaussian-noise"

    def __init__(self, std: float = 1.0, safe_mode: bool = True, seed: int | None = None) -> None:
        if not (math.isfinite(real(std, "std")) and real(std, "std") >= 0):
            raise ValueError(f"std must be finite and >= 0, got {std!r}")
        self.std = std
        self.safe_mode = bool(safe_mode)
        self.seed = seed
        self._rng = np.random.default_rng(seed) if not self.safe_mode else None

    def get_config(self) -> dict[str, Any]:
        return {"safe_mode": self.safe_mode, "seed": self.seed, "std": self.std}

    def run(self, gradients: Mapping[str, Any]) -> dict[str, Any]:
        grads = _check_gradients(gradients)
        if not grads:
            return {}
        flat, _, kind = as_flat(grads, layout_of(grads, "gradients"), "gradients")
        out = self._add_noise(flat, list(grads), FlatTree.empty(flat.layout, device=flat.device))
        tree = out.tree_as(kind)
        return {k: tree[k] for k in grads}

    def _add_noise(self, flat: FlatTree, order: list[str], out: FlatTree) -> FlatTree:
        """``out = flat + noise`` (``out`` is not ``flat``), the noise drawn per array in
        ``order``, the dict's order (the tree's leaves follow the sorted keys)."""
        rng = self._rng if self._rng is not None else np.random.default_rng(secrets.randbits(128))
        layout = flat.layout
        noise = FlatTree.empty(layout)
        leaf_of = {k: i for i, k in enumerate(sorted(order))}
        for k in order:  # declearn draws in the dict's order
            i = leaf_of[k]
            shape, dt = layout.shapes[i], layout.dtypes[i]
            z = rng.normal(scale=float(self.std), size=shape)
            big = float(finfo(dt).max)
            np.clip(z, -big, big, out=z)  # a huge std must not cast to inf
            noise.leaf(i)[...] = z.astype(dt)
        if flat.device:
            noise = to_device(noise)
        for o, g, z in zip(out.groups, flat.groups, noise.groups):
            ops = ops_for(g)
            ops.add_scaled_(o, g, ONE, z, 1.0)
            if ops.count_nonfinite(o) != ops.count_nonfinite(g):
                _saturate(o, g)
        return out


def _noise_in(module: GaussianNoiseModule, order: list[str]) -> GradientTransformation:
    """A `GaussianNoiseModule` as a plain pair for a `Pipeline`'s chain: foreign code to numbaccum,
    it runs in its turn, after the chain planned every module of the pipeline, and draws its
    noise then, in the pipeline's key order ``order``."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        flat, _, kind = as_flat(updates, layout_of(updates, "updates"), "updates")
        out = module._add_noise(flat, order, FlatTree.empty(flat.layout, device=flat.device))
        return (out if kind == "flat" else out.tree_as(kind)), state

    return GradientTransformation(lambda params: EmptyState(), update)


def _foreign_module(module: OptiModule) -> GradientTransformation:
    """Another OptiModule as a plain pair for a `Pipeline`'s chain: its ``run`` on a dict of
    arrays, with its own checks (which run only when it runs: numbaccum's chain runs foreign
    code in its turn)."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return module.run(updates), state

    return GradientTransformation(lambda params: EmptyState(), update)


def _saturate(out: Any, g: Any) -> None:
    """Where a finite g gave a non-finite sum (an overflow), the dtype's largest value with the
    sum's sign. Rare: done on the host."""
    host_o = out if not on_device(out) else out.copy_to_host()
    host_g = g if not on_device(g) else g.copy_to_host()
    bad = np.isfinite(host_g) & ~np.isfinite(host_o)
    big = finfo(host_o.dtype).max
    host_o[bad] = np.where(host_o[bad] > 0, big, -big)
    if on_device(out):
        out.copy_to_device(host_o)


class Pipeline:
    """Modules run in order on each ``run`` (declearn's Optimizer without learning rate).

    Args:
        modules: OptiModule instances, registered names, or ``(name, config)`` pairs.

    Raises:
        KeyError: an unknown name.
        TypeError: an entry of another kind.
    """

    def __init__(self, modules: list[Any]) -> None:
        self.modules: list[OptiModule] = [_module(m) for m in modules]

    def run(self, gradients: Mapping[str, Any]) -> dict[str, Any]:
        """The gradients after every module (a new dict of new arrays).

        All or nothing: the modules run as one `numbaccum.chain`, planned as a whole (every
        module's state checked against the gradients) before any runs, and each module keeps
        its new state only when the whole pipeline succeeded. A module of your own (another
        OptiModule) runs its own checks when its turn comes.
        """
        grads = _check_gradients(gradients)
        if not grads:
            return {}
        order = list(grads)
        txs: list[GradientTransformation] = []
        states: list[Any] = []
        for m in self.modules:
            if isinstance(m, _TxModule):
                txs.append(m._tx)
                states.append(m._current_state(grads))
            elif isinstance(m, GaussianNoiseModule):
                txs.append(_noise_in(m, order))
                states.append(EmptyState())
            else:
                txs.append(_foreign_module(m))
                states.append(EmptyState())
        # Between two numbaccum modules the values stay in their workspaces (no copy); one copy
        # at the end.
        out, new_states = chain(*txs).update(grads, tuple(states))
        for m, state in zip(self.modules, new_states):
            if isinstance(m, _TxModule):
                m._commit(state, order)
        return _fresh_copy(out, order)

    def get_config(self) -> dict[str, Any]:
        """``{"modules": [(name, config), ...]}``."""
        return {"modules": [(m.name, m.get_config()) for m in self.modules]}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Pipeline:
        return cls(list(config["modules"]))

    def get_state(self) -> dict[str, Any]:
        """``{"modules": [(name, state), ...]}``."""
        return {"modules": [(m.name, m.get_state()) for m in self.modules]}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores `get_state`'s value.

        Raises:
            KeyError: missing ``"modules"``, or a module's state lacks its keys.
            ValueError: the modules differ in number or names.
        """
        entries = state["modules"]
        names = [n for n, _ in entries]
        if names != [m.name for m in self.modules]:
            raise ValueError(f"state: modules {names} do not match {[m.name for m in self.modules]}")
        for m, (_, s) in zip(self.modules, entries):
            m.set_state(s)

    def on_round_start(self) -> None:
        for m in self.modules:
            m.on_round_start()


def _module(spec: Any) -> OptiModule:
    if isinstance(spec, OptiModule):
        return spec
    if isinstance(spec, str):
        return OptiModule.from_specs(spec, {})
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str):
        return OptiModule.from_specs(spec[0], dict(spec[1]))
    raise TypeError(f"modules: expected an OptiModule, a name or a (name, config) pair, got {spec!r}")
