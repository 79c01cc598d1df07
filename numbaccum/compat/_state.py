"""States as plain data (dicts, lists, NumPy arrays, numbers) and back, for the compat faces'
``state_dict``/``get_state`` and ``load_state_dict``/``set_state``.

`to_plain` copies: a FlatTree becomes its tree of host arrays, a NamedTuple a dict of its fields,
a tuple a list, a `Layout` (the tree a state was built for) the list of its leaves' ``[path,
shape, dtype]``. `load_plain` is the inverse against a template state from ``init``: it checks
everything first (ValueError/TypeError naming the path) and writes only then, so a failed load
leaves the state as it was.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import FlatTree, to_device, to_host, tree_map
from ..flat import as_flat
from ..layout import Layout


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _plain_layout(layout: Layout) -> list:
    """A layout as plain data: ``[path, shape, dtype]`` per leaf."""
    return [[layout.path(i, "params"), list(s), str(d)] for i, (s, d) in enumerate(layout.shapes_dtypes)]


def to_plain(state: Any) -> Any:
    """An independent copy of ``state`` as plain data."""
    if isinstance(state, Layout):
        return _plain_layout(state)
    if isinstance(state, FlatTree):
        host = to_host(state) if state.device else state
        return tree_map(lambda x: np.array(x, copy=True), host.tree)
    if _is_namedtuple(state):
        return {f: to_plain(v) for f, v in zip(state._fields, state)}
    if isinstance(state, (tuple, list)):
        return [to_plain(v) for v in state]
    if isinstance(state, dict):
        return {k: to_plain(v) for k, v in state.items()}
    if isinstance(state, np.ndarray):
        return state.copy()
    return state


def load_plain(template: Any, plain: Any, path: str = "state") -> Any:
    """``template`` (a state from ``init``) holding the values of ``plain``; raises before
    writing anything when they do not match."""
    _load(template, plain, path, write=False)
    return _load(template, plain, path, write=True)


def _load(template: Any, plain: Any, path: str, write: bool) -> Any:
    if isinstance(template, Layout):  # nothing to write: the state must be for the same tree
        try:
            same = [[p, list(s), str(d)] for p, s, d in plain] == _plain_layout(template)
        except (TypeError, ValueError):
            same = False
        if not same:
            raise ValueError(
                f"{path}: the state was built for another tree than these updates ({template!r})"
            )
        return template
    if isinstance(template, FlatTree):
        # The structure, the leaves (float arrays on the host: any float dtype casts to the
        # template's) and the shapes, checked naming the path; the values cast to the template's
        # dtypes in a FlatTree of its layout, copied in only when writing.
        checked = as_flat(plain, template.layout, path, device=False)[0]
        if write:
            template.assign_(to_device(checked) if template.device else checked)
        return template
    if _is_namedtuple(template):
        if not isinstance(plain, dict) or set(plain) != set(template._fields):
            got = sorted(plain) if isinstance(plain, dict) else type(plain).__name__
            raise ValueError(f"{path}: expected the fields {list(template._fields)}, got {got}")
        return type(template)(
            *(_load(v, plain[f], f"{path}.{f}", write) for f, v in zip(template._fields, template))
        )
    if isinstance(template, (tuple, list)):
        if not isinstance(plain, (tuple, list)) or len(plain) != len(template):
            raise ValueError(f"{path}: expected a list of {len(template)} entries")
        return type(template)(
            _load(v, p, f"{path}[{i}]", write) for i, (v, p) in enumerate(zip(template, plain))
        )
    if isinstance(template, dict):
        if not isinstance(plain, dict) or set(plain) != set(template):
            raise ValueError(f"{path}: expected the keys {sorted(template)}")
        return {k: _load(v, plain[k], f"{path}[{k!r}]", write) for k, v in template.items()}
    if isinstance(template, np.ndarray):
        arr = np.asarray(plain)
        if arr.shape != template.shape:
            raise ValueError(f"{path}: shape {arr.shape} does not match {template.shape}")
        if not np.can_cast(arr.dtype, template.dtype, "same_kind"):
            raise TypeError(f"{path}: dtype {arr.dtype} does not fit {template.dtype}")
        if write:
            template[...] = arr
        return template
    if template is None:
        if plain is not None:
            raise ValueError(f"{path}: expected None, got {type(plain).__name__}")
        return None
    if isinstance(template, (np.integer, int)) and not isinstance(template, bool):
        if isinstance(plain, (bool, np.bool_)) or not isinstance(plain, (int, np.integer)):
            raise TypeError(f"{path}: expected an integer, got {type(plain).__name__}")
        return type(template)(plain)
    if isinstance(template, (np.floating, float)):
        if not isinstance(plain, (int, float, np.integer, np.floating)) or isinstance(plain, bool):
            raise TypeError(f"{path}: expected a number, got {type(plain).__name__}")
        return type(template)(plain)
    if isinstance(template, (bool, np.bool_)):
        if not isinstance(plain, (bool, np.bool_)):
            raise TypeError(f"{path}: expected a bool, got {type(plain).__name__}")
        return type(template)(plain)
    raise TypeError(f"{path}: cannot load a state entry of type {type(template).__name__}")
