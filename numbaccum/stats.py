"""`stats(state)`: the numbers a training loop logs, read from any state without computing anything.

The clips record the norm they saw and whether they clipped or skipped (`ClipByGlobalNormState`),
`MultiSteps` its counters and its skip predicate's last answer, `apply_if_finite` its streak of
non-finite updates, `inject_hyperparams` the hyperparameters of the last step, and every state
with a step count its count. `stats` walks a nested state (chains, named chains, wrappers) and
returns them as one flat dict, ``{"clip_by_global_norm/norm": 1.7, "multisteps/mini_step": 3,
...}``, ready for a logger.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .arrays import DeviceScalar
from .flat import FlatTree

__all__ = ["stats"]

# State classes whose name in `stats` is not their class name in snake case minus "_state".
_NAMES = {
    "MultiStepsState": "multisteps",
    "InjectStatefulHyperparamsState": "inject_hyperparams",
    "ScaleByScheduleState": "scale_by_schedule",
}


def _state_name(cls: type) -> str:
    name = _NAMES.get(cls.__name__)
    if name is None:
        base = cls.__name__[: -len("State")] if cls.__name__.endswith("State") else cls.__name__
        name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()
    return name


def _scalar(value: Any) -> Any:
    """``value`` as a loggable scalar, or None when it is not one. A `DeviceScalar` is kept as it
    is: reading it is the caller's synchronisation, not this function's."""
    if isinstance(value, np.generic):  # before float: np.float64 is one
        return value.item()
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, np.ndarray):
        return value.item() if value.size == 1 else None
    if isinstance(value, DeviceScalar):
        return value
    return None


def _walk(state: Any) -> list[tuple[tuple, Any]]:
    """``[(key path, value)]`` of a state."""
    if isinstance(state, FlatTree) or state is None:
        return []
    if isinstance(state, tuple) and hasattr(cls := type(state), "_fields"):  # a state class
        name = _state_name(cls)
        out: list[tuple[tuple, Any]] = []
        for field in cls._fields:
            value = getattr(state, field)
            s = _scalar(value)
            if s is not None:
                out.append(((name, field), s))
            elif isinstance(value, dict) and field != "inner_state":  # hyperparams, skip info
                out += [((name, field, *k), v) for k, v in _walk(value)]
            else:  # an inner state: its own names, under this one's
                out += [((name, *k), v) for k, v in _walk(value)]
        return out
    if isinstance(state, dict):  # a named_chain's states, or a dict of values
        out = []
        for key in state:
            s = _scalar(state[key])
            if s is not None:
                out.append(((str(key),), s))
            else:
                out += [((str(key), *k), v) for k, v in _walk(state[key])]
        return out
    if isinstance(state, (tuple, list)):  # a chain: each stage's names, an index where two clash
        parts = [_walk(s) for s in state]
        seen: dict[tuple, int] = {}
        for part in parts:
            for k in {k for k, _ in part}:
                seen[k] = seen.get(k, 0) + 1
        out = []
        for i, part in enumerate(parts):
            out += [(((str(i), *k) if seen[k] > 1 else k), v) for k, v in part]
        return out
    return []


def stats(state: Any) -> dict[str, Any]:
    """The loggable numbers of a state, as ``{"name/field": value}``.

    Reads what the state already holds, computing nothing: every scalar field of every state
    class in the nest (a step count, a clip's norm and flags, MultiSteps' counters, the
    hyperparameters `inject_hyperparams` used). Names come from the state classes
    (``clip_by_global_norm``, ``multisteps``, ``scale_by_adam``, ...) and the names of a
    `named_chain`, joined by ``/``; where a chain holds two states that would give the same name,
    each is prefixed with its index in the chain. Buffers (FlatTrees) and arrays of more than
    one element are left out.

    Args:
        state: a state from ``init``/``update`` of any transformation (chains, named chains and
            wrappers are walked); anything else gives an empty dict.

    Returns:
        A flat dict from ``/``-joined names to Python scalars (bool, int, float), ready for a
            logger. A CUDA clip's norm stays a `DeviceScalar` (no synchronisation here: ``float(v)``
            reads it).

    References:
        optax.tree_utils.tree_get (reads one value of an optax state by name).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-3))
        >>> params = {"w": np.zeros(2, np.float32)}
        >>> state = tx.init(params)
        >>> _, state = tx.update({"w": np.array([3.0, 4.0], np.float32)}, state, params)
        >>> nba.stats(state)
        {'clip_by_global_norm/norm': 5.0, 'clip_by_global_norm/clipped': True,
         'clip_by_global_norm/skipped': False, 'scale_by_adam/count': 1}
    """
    return {"/".join(k): v for k, v in _walk(state)}
