"""Layouts: where each leaf of a tree lives in the flat buffers, and the float dtypes we store.

A `Layout` is pure structure (a treedef, leaf shapes and dtypes, and an int64 offsets table per
dtype group); it holds no data and knows nothing of the device the data lives on. Leaves are
grouped by a key (by default their dtype): a *group* is what one kernel launch covers, and the
offsets table gives each leaf's segment within its group. Layouts are interned, so two trees of
the same structure share one object and ``is`` compares them in a few nanoseconds on every step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _locks, tree as _tree
from .tree import TreeDef, format_path, short_repr

__all__ = [
    "COMPLEX",
    "FLOATS",
    "STORED",
    "Layout",
    "check_float_dtype",
    "compute_dtype",
    "finfo",
    "is_float",
    "is_stored",
    "layout_of_leaves",
    "real_dtype",
]

# The dtypes we store. ml_dtypes' bfloat16 joins them when it is first seen (`is_float`): the
# package is imported only by a user who holds such arrays (it is an optional dependency). A
# list, so that every module's ``dt in FLOATS`` sees it once it has joined.
FLOATS: list[np.dtype] = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)]
F32 = FLOATS[1]
FLOAT_NAMES = "float16, bfloat16, float32 or float64"
# Complex leaves (optax's semantics: norms and second moments of |z|^2) are stored as they are;
# only the transformations optax defines on them take them (`numbaccum.base.Stage.complex_leaves`).
COMPLEX: tuple[np.dtype, np.dtype] = (np.dtype(np.complex64), np.dtype(np.complex128))
# Every dtype a leaf may have: the floats, then the complex dtypes (bfloat16 joins on first sight).
STORED: list[np.dtype] = [*FLOATS, *COMPLEX]
NAMES = "float16, bfloat16, float32, float64, complex64 or complex128"  # what an error says we store


def is_float(dt: np.dtype) -> bool:
    """Whether we store arrays of dtype ``dt`` (a NumPy dtype): float16, float32, float64, and
    ml_dtypes' bfloat16 (added to `FLOATS` here, the first time one is seen)."""
    if dt in FLOATS:
        return True
    if dt.kind != "V" or dt.name != "bfloat16" or getattr(dt.type, "__module__", "") != "ml_dtypes":
        return False
    with _BF16_LOCK:
        if dt not in FLOATS:
            FLOATS.append(dt)
            STORED.append(dt)
    return True


def is_stored(dt: np.dtype) -> bool:
    """Whether a leaf of dtype ``dt`` is stored: a float (`is_float`) or complex64/complex128."""
    return dt in STORED or is_float(dt)


def real_dtype(dt: np.dtype) -> np.dtype:
    """The real dtype of ``dt``'s parts (complex64: float32; a float: itself): the dtype of a
    complex group's scalars, norms and second moments."""
    return _REAL.get(dt, dt)


_REAL: dict[np.dtype, np.dtype] = {COMPLEX[0]: F32, COMPLEX[1]: FLOATS[2]}


_BF16_LOCK = _locks.lock()


def check_float_dtype(dtype: Any, what: str, complex: bool = False) -> np.dtype:
    """The canonical float dtype for ``dtype`` (or complex64/complex128 with ``complex``), or
    TypeError naming ``what``. The name ``"bfloat16"`` imports ml_dtypes (whose import teaches
    NumPy the name)."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{what}: bfloat16 needs ml_dtypes (pip install 'numbaccum[bfloat16]')") from None
        dtype = ml_dtypes.bfloat16
    try:
        dt = np.dtype(dtype)
    except Exception as e:  # NumPy's own words name no argument: "format number 1 of '0:' ..."
        raise TypeError(f"{what}: {short_repr(dtype)} is not a dtype") from e
    if not (is_stored(dt) if complex else is_float(dt)):
        raise TypeError(f"{what}: dtype {dt} is not {NAMES if complex else FLOAT_NAMES}")
    return dt


def check_storage(dtypes: Sequence[np.dtype | None], layout: Layout, what: str) -> None:
    """TypeError unless each group's storage dtype (None: the group's own) is complex exactly
    where the group is: a real buffer for complex leaves would drop their imaginary parts (optax
    drops them without a word), a complex one for real leaves would make their updates complex."""
    for dt, gdt in zip(dtypes, layout.group_dtypes):
        if dt is not None and (dt.kind == "c") != (gdt.kind == "c"):
            if gdt.kind == "c":
                lost, use = "drop the imaginary parts of", "complex"
            else:
                lost, use = "make complex the updates of", "real"
            raise TypeError(f"{what}: {dt} would {lost} the {gdt} leaves; use a {use} dtype")


def finfo(dt: np.dtype) -> Any:
    """`numpy.finfo` of a float dtype we store (NumPy's own refuses bfloat16: ml_dtypes')."""
    if dt.kind == "V":
        import ml_dtypes

        return ml_dtypes.finfo(dt)
    return np.finfo(dt)


def compute_dtype(*dtypes: np.dtype) -> np.dtype:
    """The dtype a kernel computes in for buffers of these dtypes: their promoted dtype, with
    float16 and bfloat16 computed in float32 (numba has neither; NumPy cannot even promote
    the two together)."""
    out = F32 if dtypes[0].itemsize == 2 else dtypes[0]
    for dt in dtypes[1:]:
        if dt is not out:
            out = np.promote_types(out, F32 if dt.itemsize == 2 else dt)
    return out


class Layout:
    """Leaf shapes and their place in the flat buffers; interned, so ``is`` compares them."""

    # Interning: one object per key while anything holds it, in a weak-value dict. States,
    # workspaces and the bounded caches of derived data (`numbaccum._bounded`) hold their layouts
    # strongly, so ``is`` stays valid for as long as it can be asked; a layout nobody holds is
    # freed with its treedef (whose dict keys may be large), so the cache never outgrows what is
    # alive. A lock makes get-or-create atomic: two threads that build the same new layout at
    # once (a 20,000-leaf one takes milliseconds) both get the one that was stored first.
    _cache: weakref.WeakValueDictionary[tuple, Layout] = weakref.WeakValueDictionary()
    _lock = _locks.lock()

    treedef: TreeDef
    shapes: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    dtypes: tuple[np.dtype, ...]  # each leaf's dtype (the dtype that defined its group)
    groups: tuple[tuple[int, ...], ...]  # leaf indices of each group, in leaf order
    group_index: tuple[np.ndarray, ...]  # the same as int64 arrays
    group_dtypes: tuple[np.dtype, ...]
    num_leaves: int  # an attribute, not a property: a small tree's step asks it several times
    leaf_group: tuple[int, ...]
    leaf_start: tuple[int, ...]  # start of each leaf within its group
    offsets: tuple[np.ndarray, ...]  # per group: int64 leaf boundaries, len = n_leaves + 1
    group_sizes: tuple[int, ...]
    complex: bool
    shapes_dtypes: list[tuple[tuple[int, ...], np.dtype]]

    @classmethod
    def get(
        cls,
        treedef: TreeDef,
        shapes: Sequence[tuple[int, ...]],
        dtypes: Sequence[np.dtype],
        group_key: Sequence[np.dtype] | None = None,
    ) -> Layout:
        """The layout for leaves of these shapes and dtypes, grouped by ``group_key`` (default
        the dtypes; one key for all gives a single group)."""
        # maps, not generators: every call that derives a layout asks for it
        shapes = tuple([tuple(map(int, s)) for s in shapes])
        dtypes = tuple(map(np.dtype, dtypes))
        keys = tuple(map(np.dtype, group_key if group_key is not None else dtypes))
        key = (treedef, shapes, dtypes, keys)
        lay = cls._cache.get(key)
        if lay is None:
            new = cls(treedef, shapes, dtypes, keys)  # built outside the lock: others may intern
            with cls._lock:
                lay = cls._cache.get(key)
                if lay is None:
                    lay = cls._cache[key] = new
        return lay

    def __init__(self, treedef: TreeDef, shapes: tuple, dtypes: tuple, keys: tuple) -> None:
        self.treedef = treedef
        self.shapes = shapes
        self.num_leaves = len(shapes)  # (an attribute, not a property: asked every step)
        self.sizes = tuple(int(np.prod(s, dtype=np.int64)) for s in shapes)
        self.dtypes = dtypes
        order: list[np.dtype] = []
        for k in keys:
            if k not in order:
                order.append(k)
        self.group_dtypes = tuple(order)
        self.groups = tuple(tuple(i for i, k in enumerate(keys) if k == g) for g in order)
        leaf_group = [0] * len(shapes)
        leaf_start = [0] * len(shapes)
        offsets = []
        for gi, members in enumerate(self.groups):
            off = np.zeros(len(members) + 1, np.int64)
            for j, leaf in enumerate(members):
                leaf_group[leaf] = gi
                leaf_start[leaf] = int(off[j])
                off[j + 1] = off[j] + self.sizes[leaf]
            off.flags.writeable = False
            offsets.append(off)
        self.leaf_group = tuple(leaf_group)
        self.leaf_start = tuple(leaf_start)
        self.offsets = tuple(offsets)
        self.group_index = tuple(np.array(m, np.int64) for m in self.groups)  # for fancy indexing
        self.group_sizes = tuple(int(o[-1]) for o in offsets)
        # Whether any leaf is complex: the runner then asks each stage whether it takes them.
        self.complex = any(d.kind == "c" for d in dtypes)
        self._paths: list[tuple] | None = None
        # A list, as `host_leaves` compares it with the list it builds from a tree's leaves.
        self.shapes_dtypes = list(zip(shapes, dtypes))

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def path(self, leaf: int, root: str = "tree") -> str:
        """The path of leaf number ``leaf`` as a user would index it."""
        if self._paths is None:
            self._paths = _tree.leaf_paths(self.treedef)
        return format_path(self._paths[leaf], root)

    def __repr__(self) -> str:
        groups = ", ".join(f"{d}: {n}" for d, n in zip(self.group_dtypes, self.group_sizes))
        return f"Layout({self.num_leaves} leaves, {{{groups}}})"

    @property
    def group_keys(self) -> tuple[np.dtype, ...]:
        """Each leaf's group key (the ``group_key`` that `get` was given): with the treedef, the
        shapes and the dtypes, what identifies this layout."""
        return tuple(self.group_dtypes[g] for g in self.leaf_group)

    def __reduce__(self) -> Any:
        # Layouts are interned and compared with `is`: an unpickled one must be the interned
        # layout of its key, or a restored state fails every layout check.
        return (_interned_layout, (self.treedef, self.shapes, self.dtypes, self.group_keys))

    def __copy__(self) -> Layout:
        return self  # immutable and interned

    def __deepcopy__(self, memo: dict) -> Layout:
        return self


def _interned_layout(treedef: TreeDef, shapes: tuple, dtypes: tuple, keys: tuple) -> Layout:
    """`Layout.get` for unpickling (a plain function pickles by name everywhere)."""
    return Layout.get(treedef, shapes, dtypes, keys)


def layout_of_leaves(td: TreeDef, leaves: Sequence[Any], dtype: Any = None) -> Layout:
    """The layout of leaves of structure ``td`` (anything with ``.shape`` and ``.dtype``): grouped
    by leaf dtype, or all in one group of ``dtype`` when given."""
    dtypes = [leaf.dtype for leaf in leaves]
    keys = [np.dtype(dtype)] * len(leaves) if dtype is not None else None
    return Layout.get(td, [leaf.shape for leaf in leaves], dtypes, keys)
