"""Applying updates to params: `apply_updates` (a new tree) and `apply_updates_` (in place).

Also here: the two helpers every function that writes the caller's arrays in place shares,
`writable_flat` (the caller's tree as a FlatTree whose changes reach it, refused before anything
is written when a leaf cannot change) and `scatter_back` (copy a packed FlatTree back into the
caller's arrays); ``step_`` (`numbaccum.passes`) and ``clip_grad_norm_`` (`numbaccum.norms`) use
them too. This is the last step of a training loop, not part of the stage protocol of
`numbaccum.base`: it lives apart from it and needs nothing above the storage layer and the
kernels (`numbaccum.flat`, `numbaccum.backend`), so the stage protocol and the passes built on it
can both import it.

As optax (``p + u``, then cast to the params' dtype), the sum is computed in the promoted dtype of
the two leaves and rounded once: float64 updates of float32 params are added in float64, float32
updates of float16 params in float32 (on the GPU, updates are cast to the params' dtypes first).

Two paths give the same bits. The general one packs the tree into a FlatTree (keeping updates
wider than the params in their own dtype) and runs the ``add_scaled_`` kernel per dtype group (in
the promoted dtype; float16 through float32). The NumPy path serves the common host cases, where a
small tree's update would otherwise cost more in packing than in adding: a plain tree of float32
and float64 params whose structure, shapes and dtypes are those of one of the last few trees seen
(separate writable arrays, or the ``.tree`` of a FlatTree), or a FlatTree with updates of its
layout. There NumPy's ``add``, one call per leaf or per group, makes exactly the kernel's
operations: one IEEE addition in the promoted dtype, rounded once to the params' dtype, with no
floating-point warning (float16 params, whose kernel stages through float32 and
warns as it copies back, take the general path). CUDA arrays and FlatTrees on a device always
take the general path. One thing IEEE 754 leaves open differs: where both operands are NaN, the
result is a NaN either way, but which operand's payload it carries is the compiler's choice (the
kernel gives the update's; NumPy, called ``add(updates, params)`` for that, gives it too except
in the last few elements of an array, which its unrolled tail computes the other way round).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import numpy as np

from . import arrays
from .backend import ops_for
from .contract import ONE
from .flat import FlatTree, as_flat, check_leaves, host_leaves, layout_of, scatter_leaves_
from .layout import FLOATS, Layout, compute_dtype
from .tree import format_path, leaves_if_structure, tree_flatten_with_path

__all__ = ["apply_updates", "apply_updates_", "check_writable", "scatter_back", "writable_flat"]

# Dtypes whose NumPy addition is the kernel's, bit for bit: float16 is computed by the kernel in a
# float32 copy that is rounded (and may warn) as it is copied back.
_NUMPY_ADDS = (np.dtype(np.float32), np.dtype(np.float64))
_F16 = np.dtype(np.float16)

# The natural layouts of the last few plain host trees of params (most recent first), held
# strongly: `host_leaves` against one of them checks a tree's structure, shapes and dtypes in one
# walk, where `layout_of` flattens the tree with paths and interns a layout on every call. A
# tuple replaced whole, so threads need no lock (a lost entry is found again on the next call).
_RECENT_LAYOUTS = 4
_recent: tuple[tuple[Layout, bool], ...] = ()  # (layout, float32/float64 only)


def apply_updates(params: Any, updates: Any) -> Any:
    """Returns ``params + updates`` as a new tree; each leaf keeps its params dtype.

    ``out = params + updates``, leaf by leaf, computed in the promoted dtype of the two leaves and
    rounded once to the params' dtype, as optax does (float16 is computed in float32; on the GPU,
    updates are cast to the params' dtype first).

    Args:
        params: a tree of NumPy or CUDA float arrays, a FlatTree, or None (an empty tree).
        updates: a tree of the same structure and shapes (any float dtypes, on the same side:
            host or GPU), or a FlatTree of one.

    Returns:
        A new tree of the params' structure and dtypes: a FlatTree for a FlatTree, the same
        array type (NumPy, numba, CuPy, PyTorch) for a plain tree; None for None. ``params``
        and ``updates`` are not changed.

    Raises:
        ValueError: the structures or a leaf's shape differ (names the leaf).
        TypeError: a leaf is not a float array, or the two trees live on different sides.

    References:
        optax.apply_updates (the same bits on the host).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> p = {"w": np.ones(2, np.float32)}
        >>> nba.apply_updates(p, {"w": np.array([0.5, -1.0], np.float32)})["w"]
        array([1.5, 0. ], dtype=float32)
    """
    if params is None:  # an empty tree, as in optax
        return None
    out = _added(params, updates)
    if out is not None:
        return out
    layout = params.layout if isinstance(params, FlatTree) else layout_of(params, "params")
    p, _, kind = as_flat(params, layout, "params")
    out = _apply(p, updates, FlatTree.empty(layout, list(p.group_dtypes), p.device))
    if kind == "numpy":
        _remember(layout)
    return out if kind == "flat" else out.tree_as(kind)


def apply_updates_(params: Any, updates: Any) -> Any:
    """``params += updates`` in place (a FlatTree, or a tree of writable arrays); returns params.

    Each leaf becomes ``params + updates`` in the params' dtype, the same bits as
    `apply_updates`. Every check is made before the first element is written, so an error
    leaves every leaf as it was.

    Args:
        params: a FlatTree, a tree of writable NumPy arrays or of CUDA arrays, or None.
        updates: a tree of the same structure and shapes (any float dtypes, on the same side),
            or a FlatTree of one.

    Returns:
        ``params`` itself (None for None), its values changed.

    Raises:
        TypeError: a leaf is a NumPy scalar or a read-only array (it cannot change in place;
            names the leaf), or ``params`` is a read-only FlatTree; a leaf is not a float array,
            or the trees live on different sides.
        ValueError: the structures or a leaf's shape differ (names the leaf).

    References:
        optax.apply_updates (which returns new arrays); PyTorch's in-place ``param.add_(update)``
        (``torch._foreach_add_`` over a list of tensors).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> p = {"w": np.ones(2, np.float32)}
        >>> _ = nba.apply_updates_(p, {"w": np.array([0.5, -1.0], np.float32)})
        >>> p["w"]
        array([1.5, 0. ], dtype=float32)
    """
    if params is None:  # an empty tree: nothing to change
        return None
    if _added_in_place(params, updates):
        return params
    p, copied = writable_flat(params, "params")
    _apply(p, updates, p)
    if copied:
        scatter_back(p, params, "params")
    if not isinstance(params, FlatTree) and not p.device:
        _remember(p.layout)
    return params


def _apply(p: FlatTree, updates: Any, out: FlatTree) -> FlatTree:
    """The general path: ``out = p + updates`` by the kernel, one launch per dtype group."""
    u = as_flat(updates, p.layout, "updates", None if p.device else _inbox(p, updates), p.device)[0]
    for dst, pg, ug in zip(out.groups, p.groups, u.groups):
        ops_for(pg).add_scaled_(dst, pg, ONE, ug, 1.0)
    return out


def _inbox(p: FlatTree, updates: Any) -> Any:
    """Where a host tree of updates is packed (asked only after `as_flat` has checked it): a
    buffer of the params' layout whose groups take the promoted dtype of the params and their
    updates, so that the kernel adds in it and rounds once, as optax does."""

    def make() -> FlatTree:
        raw = leaves_if_structure(updates, p.layout.treedef) or []
        dtypes = [
            _promoted(d, *(raw[i].dtype for i in members)) if raw else d
            for d, members in zip(p.group_dtypes, p.layout.groups)
        ]
        return FlatTree.empty(p.layout, dtypes)

    return make


def _promoted(*dtypes: np.dtype) -> np.dtype:
    """NumPy's promoted dtype, or float32 (the compute dtype) for float16 beside bfloat16, which
    NumPy cannot promote together."""
    try:
        return np.result_type(*dtypes)
    except TypeError:  # numpy.exceptions.DTypePromotionError is a TypeError
        return compute_dtype(*dtypes)


# --- the NumPy path -------------------------------------------------------------------------


def _remember(layout: Layout) -> None:
    global _recent
    if all(lay is not layout for lay, _ in _recent):
        entry = (layout, all(d in _NUMPY_ADDS for d in layout.group_dtypes))
        _recent = (entry, *_recent[: _RECENT_LAYOUTS - 1])


def _known(tree: Any) -> tuple[Layout, list[np.ndarray]] | None:
    """``(layout, leaves)`` of a plain tree of NumPy float32/float64 arrays whose structure,
    shapes and dtypes are those of a remembered layout, else None."""
    for layout, numpy_adds in _recent:
        leaves = host_leaves(tree, layout)
        if leaves is not None:
            return (layout, leaves) if numpy_adds else None
    return None


def _update_leaves(updates: Any, params: list[np.ndarray], layout: Layout) -> list[np.ndarray] | None:
    """The leaves of ``updates`` (a plain host tree or a host FlatTree) when they have the
    structure and shapes of ``layout`` and float dtypes, else None (the general path then names
    what differs): a leaf narrower than its param cast to the param's dtype (exact), a wider one
    kept (NumPy then adds in it and rounds once, as the kernel does)."""
    if isinstance(updates, FlatTree):
        if updates.device:
            return None
        updates = updates.tree
    leaves = host_leaves(updates, layout)
    if leaves is not None:  # the params' dtypes: nothing to cast
        return leaves
    raw = leaves_if_structure(updates, layout.treedef)  # of other dtypes than the params
    if (
        raw is None
        or list(map(type, raw)).count(np.ndarray) != len(raw)
        or [x.shape for x in raw] != list(layout.shapes)
        or not all(x.dtype in FLOATS for x in raw)
    ):
        return None
    return [u if u.dtype.itemsize >= p.dtype.itemsize else u.astype(p.dtype) for p, u in zip(params, raw)]


def _apart(params: list[np.ndarray], updates: list[np.ndarray], layout: Layout) -> bool:
    """True when adding leaf by leaf in place reads and writes what the general path does (it
    packs every leaf before it writes one): each param writable, no two params sharing memory,
    each update its own param or memory that no param's owner holds.

    The owner of a leaf is the leaf, or the base of a view (NumPy makes the array that owns the
    memory the base of every view of it). An array without a base is taken to own its memory:
    NumPy gives a base to every view it makes and to every array over another object's buffer.
    Params that share an owner are apart when they are the ``.tree`` of a FlatTree: each
    group's leaves back to back in one buffer of the group's dtype (`arrays.run_view`)."""
    n = len(params)
    bases = list(map(_BASE, params))
    # The common case, read in whole lists (an update of a small model asks every step): each
    # param owns its memory.
    owns = all(map(operator.is_, bases, itertools.repeat(None)))  # not list.count: it compares
    owners = params if owns else [p if b is None else b for p, b in zip(params, bases)]
    ids = set(map(id, owners))
    if len(ids) != n and any(arrays.run_view(params, layout, g) is None for g in range(len(layout.groups))):
        return False  # one array twice, or overlapping views: the general path packs them
    if not all(map(_WRITEABLE, params)):
        return False  # the general path names it
    if owners is not params:
        for p, owner in zip(params, owners):
            if owner is not p and (type(owner) is not np.ndarray or owner.base is not None):
                return False  # memory whose owner we cannot see
    held = list(map(_BASE, updates))
    first = held[0] if held else None
    if first is not None and len(set(map(id, held))) == 1:
        # Every update a view of one buffer (what `update` returns: a root lent of a workspace,
        # over a memoryview of it, `numbaccum._loans`): that buffer is apart from the params'
        # owners, or the general path decides.
        if type(first) is not np.ndarray or id(first) in ids:
            return False
        if first.base is None:
            return True
        lent = first.base
        if type(lent) is not memoryview:
            return False
        base = getattr(lent.obj, "base", None)
        owner = lent.obj if base is None else base  # (the bytes of a bfloat16 buffer: their base)
        return id(owner) not in ids
    for p, u, h in zip(params, updates, held):
        if u is not p:
            h = u if h is None else h
            if id(h) in ids or (h is not u and (type(h) is not np.ndarray or h.base is not None)):
                return False
    return True


_BASE = operator.attrgetter("base")
_WRITEABLE = operator.attrgetter("flags.writeable")


def _flat_groups(p: FlatTree, updates: Any, in_place: bool) -> tuple[np.ndarray, ...] | None:
    """The groups of ``updates`` when they are a host FlatTree of ``p``'s layout and NumPy's
    ``add`` of each pair of groups is the kernel's (float32/float64 storage, computed in the
    promoted dtype as the kernel does; ``in_place``: each params group writable, and its
    updates either that very group or memory apart from it), else None."""
    if p.device or not isinstance(updates, FlatTree) or updates.layout is not p.layout or updates.device:
        return None
    for pg, ug in zip(p.groups, updates.groups):
        if pg.dtype not in _NUMPY_ADDS or ug.dtype not in _NUMPY_ADDS:
            return None
        if in_place and not (pg.flags.writeable and (ug is pg or not np.may_share_memory(pg, ug))):
            return None
    return updates.groups


def _added_flat(p: FlatTree, updates: Any, out: FlatTree | None) -> FlatTree | None:
    """``out = p + updates`` group by group by NumPy (``out`` None: into a new FlatTree) when it
    gives the kernel's bits (`_flat_groups`); None, having written nothing, when it does not."""
    ug = _flat_groups(p, updates, out is p)
    if ug is None:
        return None
    if out is None:
        out = FlatTree.empty(p.layout, list(p.group_dtypes))
    with np.errstate(all="ignore"):  # the kernel's additions raise and warn about nothing
        for o, pg, u in zip(out.groups, p.groups, ug):
            np.add(u, pg, o)  # the kernel's operand order (see the module)
    return out


def _added(params: Any, updates: Any) -> Any:
    """`apply_updates` by NumPy when it gives the kernel's bits (see the module), else None."""
    if isinstance(params, FlatTree):
        return _added_flat(params, updates, None)
    found = _known(params)
    if found is None:
        return None
    layout, ps = found
    us = _update_leaves(updates, ps, layout)
    if us is None:
        return None
    out = FlatTree.empty(layout)
    tree = out.tree
    outs = host_leaves(tree, layout)
    assert outs is not None  # the tree of a fresh host buffer of this very layout
    with np.errstate(all="ignore"):
        for p, u, o in zip(ps, us, outs):
            np.add(u, p, o)
    return tree


def _added_in_place(params: Any, updates: Any) -> bool:
    """`apply_updates_` by NumPy when it gives the kernel's bits (see the module); False, having
    written nothing, when it does not apply."""
    if isinstance(params, FlatTree):
        return _added_flat(params, updates, params) is not None
    found = _known(params)
    if found is None:
        return False
    layout, ps = found
    us = _update_leaves(updates, ps, layout)
    if us is None or not _apart(ps, us, layout):
        return False
    with np.errstate(all="ignore"):
        for p, u in zip(ps, us):
            np.add(u, p, p)
    return True


# --- writing the caller's arrays in place ---------------------------------------------------


def writable_flat(tree: Any, name: str) -> tuple[FlatTree, bool]:
    """``(flat, copied)``: ``tree`` as a FlatTree whose changes reach the caller's arrays -- the
    FlatTree itself, the buffers behind a FlatTree's ``.tree``, or (``copied``) a packed copy that
    `scatter_back` writes back.

    Raises:
        TypeError: a leaf cannot change in place (a NumPy scalar or a read-only array; names
            the leaf), or ``tree`` is a read-only FlatTree; before anything is written.
    """
    check_writable(tree, name)
    if isinstance(tree, FlatTree):
        return tree, False
    flat, copied, _ = as_flat(tree, layout_of(tree, name), name)
    return flat, copied


def check_writable(tree: Any, name: str) -> None:
    """TypeError naming the leaf of ``tree`` that cannot change in place (a NumPy scalar or a
    read-only array), or for a read-only FlatTree; nothing is written."""
    if isinstance(tree, FlatTree):
        if tree._readonly:
            raise TypeError(f"{name}: a read-only FlatTree cannot be changed in place")
        return
    raw, paths, _ = tree_flatten_with_path(tree)
    for x, path in zip(raw, paths):
        if isinstance(x, np.ndarray):
            if x.flags.writeable:
                continue
            why = "a read-only array"
        elif arrays.is_cuda_array(x):
            continue
        else:  # a scalar, a JAX array, ...: what is written would not reach it
            why = f"{type(x).__name__} is not a writable array"
        raise TypeError(
            f"{format_path(path, name)}: cannot be changed in place ({why}); "
            "numbaccum.apply_updates(params, updates) returns new arrays instead"
        )


def scatter_back(flat: FlatTree, tree: Any, name: str, found: Any = None) -> None:
    """Copies each leaf of ``flat`` into the matching array of ``tree``: separate NumPy arrays
    one by one, separate CUDA arrays with one launch per dtype group (over their addresses,
    ``found`` if the caller has read them: `arrays.device_leaves`)."""
    if found is None and flat.device:
        found = arrays.device_leaves(tree, flat.layout)
    if found is not None:
        scatter_leaves_(flat, found[0], arrays.kind_of(found[1][0]))
        return
    for i, leaf in enumerate(check_leaves(tree, flat.layout, name)):
        if flat.device:
            src = flat.leaf(i).reshape(leaf.size)
            ops_for(src).scale_(leaf.reshape(leaf.size), src, ONE)
        else:
            np.copyto(leaf, flat.leaf(i))
