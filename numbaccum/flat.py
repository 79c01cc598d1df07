"""Flat parameter trees: one contiguous 1-D buffer per dtype, leaves as views into it.

A `numbaccum.layout.Layout` says where each leaf lives (its dtype group and its segment within
the group's run of a buffer); a `FlatTree` is a layout plus storage. Two flat trees with the same
layout can be combined by kernels group by group even when their storage dtypes differ (a
float32 accumulator for float16 gradients), which is how states mirror their params. The storage
is NumPy arrays, or numba device arrays for a FlatTree on a CUDA device: this module only stores
and views; device memory, pointers, streams and the caller's array types are `numbaccum.arrays`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _loans, arrays
from . import tree as _tree
from ._marks import check_current, held
from .arrays import as_device_array, is_contiguous, is_cuda_array, on_device, run_view
from .backend import device_leaf_copies, ops_for
from .contract import ONE
from .layout import FLOATS, NAMES, STORED, Layout, check_float_dtype, is_stored, layout_of_leaves
from .tree import TreeDef, format_path

__all__ = ["FlatTree", "Workspace", "as_flat", "layout_of", "to_device", "to_host"]


def _as_leaf(x: Any, where: tuple, name: str) -> Any:
    """A NumPy float array, or a numba view of a CUDA float array, for a leaf; TypeError naming
    its path (``name`` + key path ``where``, formatted only for the message) otherwise.

    As optax takes them: NumPy and Python scalars are 0-d leaves, and an array NumPy reads without
    a copy (a JAX array on the CPU, a CPU tensor, anything with ``__array__`` or ``__dlpack__``)
    is read through a NumPy view. Such a leaf comes back read-only: it is not the caller's array,
    so nothing may write into it believing it changes theirs (`numbaccum.step_` on such params
    says so, and points to `numbaccum.apply_updates`)."""
    if type(x) is np.ndarray and x.dtype in STORED:  # the common case, first and cheap
        return x
    path = format_path(where, name)
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, (np.generic, float, int)) and not isinstance(x, bool):
        arr = _read_only(np.asarray(x))  # a 0-d leaf
    elif is_cuda_array(x):
        try:
            arr = as_device_array(x)
        except Exception as e:  # e.g. an integer dtype, or a bfloat16 tensor without ml_dtypes
            raise TypeError(
                f"{path}: cannot read this CUDA {type(x).__name__} ({type(e).__name__}: {e}); CUDA "
                f"arrays of {NAMES} are read"
            ) from None
        if is_stored(arr.dtype) and arr.size and not is_contiguous(arr):
            raise ValueError(f"{path}: a non-contiguous CUDA array cannot be packed; pass a contiguous copy")
    elif hasattr(x, "__array__") or hasattr(x, "__dlpack__"):
        try:
            arr = _read_only(np.asarray(x) if hasattr(x, "__array__") else np.from_dlpack(x))
        except Exception as e:  # e.g. an array on a device NumPy cannot read
            host = arrays.host_bfloat16(x)
            if host is None:
                raise TypeError(f"{path}: NumPy cannot read this {type(x).__name__} ({e})") from None
            arr = _read_only(host)
    else:
        raise TypeError(
            f"{path}: expected an array (NumPy, CUDA, or one NumPy can read: JAX on the CPU, a CPU "
            f"tensor) or a float, got {type(x).__name__}"
        )
    if not is_stored(arr.dtype):
        raise TypeError(f"{path}: dtype {arr.dtype} is not {NAMES}")
    return arr


def _read_only(arr: np.ndarray) -> np.ndarray:
    """A read-only view of ``arr`` (a leaf read from something that is not a NumPy array)."""
    if arr.flags.writeable:
        arr = arr.view()
        arr.flags.writeable = False
    return arr


def _same_side(leaves: Sequence[Any], paths: Sequence[tuple], name: str, device: bool | None) -> bool:
    """The side (True: CUDA) all leaves live on; TypeError naming the first leaf on the other."""
    for x, p in zip(leaves, paths):
        side = on_device(x)
        if device is None:
            device = side
        elif side != device:
            where = "a CUDA array" if side else "a NumPy array"
            expected = "the GPU" if device else "the host"
            raise TypeError(f"{format_path(p, name)}: {where}, but the other arrays live on {expected}")
    return bool(device)


def leaves_of(tree: Any, name: str) -> tuple[list[Any], TreeDef]:
    """Flattens ``tree`` and checks that each leaf is a float array, all on one side (host or
    GPU); TypeError names the first bad leaf."""
    if isinstance(tree, FlatTree):
        raise TypeError("internal: leaves_of expects a plain tree")
    raw, paths, td = _tree.tree_flatten_with_path(tree)
    leaves = [_as_leaf(x, p, name) for x, p in zip(raw, paths)]
    _same_side(leaves, paths, name, None)
    return leaves, td


class FlatTree:
    """A tree stored in contiguous buffers, one per dtype; ``.tree`` holds views into them.

    Index it like the tree (``flat['dense']['w']``), take ``.tree`` for the plain tree, or pass
    it to any transformation: a FlatTree with the state's layout is used without a copy. The
    leaves of a dtype lie back to back in one 1-D buffer, in `tree_flatten` order, so a kernel
    runs over all of them in one launch; writing a leaf view writes the buffer.

    Make one with `FlatTree.from_tree` (a copy of a tree's leaves, optionally in one storage
    dtype), or of a layout with ``FlatTree.zeros(layout)`` and ``FlatTree.empty(layout)``;
    ``flat.copy()`` and ``flat.zeros_like()`` make one like another. States hold their
    buffers (moments, accumulators) as FlatTrees of the params' layout. The constructor takes
    storage already laid out for ``layout`` and is internal.

    Attributes:
        layout: the tree's `numbaccum.layout.Layout`: structure, shapes, dtypes, and where each
            leaf lives (its dtype group and its segment of the group's run of a buffer).
        groups: a 1-D view of each dtype group's run of its buffer, in group order.
        group_dtypes: the storage dtype of each group (a float32 accumulator may mirror float16
            params).
        buffers: the storage, one 1-D array per storage dtype (NumPy arrays, or numba device
            arrays for a FlatTree on the GPU).
        device: whether the storage lives on a CUDA device.
        tree: the plain tree whose leaves are views into the buffers (built once, then cached).
        leaves: views of the leaves, in tree order.
        treedef: the tree's structure, as `tree_flatten` gives it.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"b": np.zeros(2, np.float32), "w": np.ones((2, 2), np.float32)}
        >>> flat = nba.FlatTree.from_tree(params)
        >>> flat
        FlatTree(2 leaves, {float32: 6})
        >>> flat["w"][0, 1] = 5.0  # a view: writes the buffer
        >>> flat.groups[0]
        array([0., 0., 1., 5., 1., 1.], dtype=float32)
        >>> [round(float(x), 4) for x in params["w"].ravel()]  # a copy was made: unchanged
        [1.0, 1.0, 1.0, 1.0]
    """

    layout: Layout
    group_dtypes: tuple[np.dtype, ...]  # storage dtype of each group
    groups: tuple[np.ndarray, ...]  # 1-D view of each group's run of its buffer
    buffers: dict[np.dtype, Any]  # NumPy arrays, or numba device arrays on the GPU
    _busy = False  # the storage's busy mark, when an update or a reader holds it (`transaction`)

    # A state's buffers are updated in place, so the state an update was given and the one it
    # returns would hold the same FlatTree. The returned one holds a renewal instead: a new
    # FlatTree sharing this one's ``__dict__`` (storage, views, workspaces, flags) with the
    # next generation stamp ``_gen`` (a slot: each wrapper its own); ``_live``, in the shared
    # dict, is the storage's current generation (`numbaccum.transaction.current`).
    __slots__ = ("_gen", "__dict__", "__weakref__")

    def __init__(
        self,
        layout: Layout,
        groups: Sequence[np.ndarray],
        buffers: dict[np.dtype, np.ndarray],
        readonly: bool = False,
    ) -> None:
        self.layout = layout
        self.groups = tuple(groups)
        self.group_dtypes = tuple(map(np.dtype, map(_DTYPE, self.groups)))  # maps: every FlatTree made
        self.buffers = buffers
        self.device = bool(self.groups) and on_device(self.groups[0])  # on a CUDA device
        self._readonly = readonly
        self._trees: dict[str, Any] = {}  # the tree of views, per array type it is shown as
        self._workspaces: dict[str, Workspace] = {}  # `workspace_of`
        self._gen = 0
        self._live = 0

    # --- construction -----------------------------------------------------------------------

    @classmethod
    def empty(cls, layout: Layout, dtypes: Sequence[Any] | Any = None, device: bool = False) -> FlatTree:
        """Uninitialised storage for ``layout`` (on the GPU if ``device``); ``dtypes``: one per
        group, one for all, or None (each group's own dtype). Groups of one storage dtype share a
        buffer."""
        if dtypes is None:
            gdt = list(layout.group_dtypes)
        elif isinstance(dtypes, (list, tuple)):
            gdt = [check_float_dtype(d, "dtypes", complex=True) for d in dtypes]
            if len(gdt) != len(layout.groups):
                raise ValueError(f"dtypes: {len(gdt)} dtypes for the {len(layout.groups)} groups of {layout}")
        else:
            gdt = [check_float_dtype(dtypes, "dtypes", complex=True)] * len(layout.groups)
        totals: dict[np.dtype, int] = {}
        starts = []
        for d, n in zip(gdt, layout.group_sizes):
            starts.append(totals.get(d, 0))
            totals[d] = totals.get(d, 0) + n
        if device:
            buffers = {d: arrays.empty(n, d) for d, n in totals.items()}
        else:
            buffers = {d: np.empty(n, d) for d, n in totals.items()}
        groups = [buffers[d][s : s + n] for d, s, n in zip(gdt, starts, layout.group_sizes)]
        return cls(layout, groups, buffers)

    @classmethod
    def zeros(cls, layout: Layout, dtypes: Sequence[Any] | Any = None, device: bool = False) -> FlatTree:
        """Zero-filled storage for ``layout`` (see `empty`)."""
        out = cls.empty(layout, dtypes, device)
        out.fill_(0.0)
        return out

    def fill_(self, value: float) -> FlatTree:
        """Sets every element to ``value``, in place (one kernel per buffer)."""
        for b in self.buffers.values():
            ops_for(b).fill_(b, value)
        return self

    @classmethod
    def from_tree(cls, tree: Any, dtype: Any = None) -> FlatTree:
        """Copies the leaves of ``tree`` into one contiguous buffer per dtype.

        Args:
            tree: a tree of NumPy float arrays (or a FlatTree, which is copied).
            dtype: store every leaf in this dtype (one buffer); None keeps each leaf's dtype.
        """
        if dtype is not None:
            dtype = check_float_dtype(dtype, "dtype", complex=True)
        if isinstance(tree, FlatTree):
            tree = tree.tree
        found = _device_layout(tree, dtype)
        if found is not None:  # separate CUDA arrays: one launch per group
            out = cls.empty(found[0], device=True)
            pack_leaves_(out, found[1], found[2])
            return out
        leaves, td = leaves_of(tree, "tree")
        layout = layout_of_leaves(td, leaves, dtype)
        out = cls.empty(layout, device=bool(leaves) and on_device(leaves[0]))
        out._copy_leaves_in(leaves)
        return out

    # --- views ------------------------------------------------------------------------------

    def leaf(self, i: int) -> np.ndarray:
        """A view of leaf number ``i``."""
        lay = self.layout
        s = lay.leaf_start[i]
        v = self.groups[lay.leaf_group[i]][s : s + lay.sizes[i]].reshape(lay.shapes[i])
        if self._readonly and not self.device:
            v.flags.writeable = False
        return v

    def leaf_views(self) -> list[np.ndarray]:
        """Views of the leaves in order, made once per storage (a workspace copied back to the
        caller's arrays every step reads them so)."""
        views = self.__dict__.get("_views")
        if views is None:
            views = self.__dict__["_views"] = [self.leaf(i) for i in range(self.layout.num_leaves)]
        return views

    @property
    def leaves(self) -> list[np.ndarray]:
        """Views of the leaves, in tree order."""
        return _tree.tree_flatten(self.tree)[0]

    @property
    def tree(self) -> Any:
        """The tree whose leaves are views into the buffers (built once, then cached): NumPy
        arrays, or numba device arrays for a FlatTree on the GPU."""
        return self.tree_as("numpy" if not self.device else "numba")

    def tree_as(self, kind: str) -> Any:
        """The tree of views as the array type ``kind`` ('numpy', 'numba', 'cupy', 'torch'),
        zero-copy; built once per kind."""
        t = self._trees.get(kind)
        if t is None:
            views = [self.leaf(i) for i in range(self.layout.num_leaves)]
            if kind in arrays.STREAM_KINDS:  # a framework's own tensors, zero-copy
                views = [arrays.as_kind(v, kind) for v in views]
            t = self._trees[kind] = _tree.tree_unflatten(self.layout.treedef, views)
        return t

    @property
    def treedef(self) -> TreeDef:
        return self.layout.treedef

    def __numbaccum_tree__(self) -> Any:
        return self.tree

    def __getitem__(self, key: Any) -> Any:
        return self.tree[key]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        t = self.tree
        if not isinstance(t, np.ndarray):
            raise TypeError("only a FlatTree of a single array converts to an array; use .tree")
        return np.array(t, dtype=dtype, copy=True) if copy else np.asarray(t, dtype=dtype)

    def __repr__(self) -> str:
        bufs = ", ".join(f"{d}: {b.size}" for d, b in self.buffers.items())
        return f"FlatTree({self.layout.num_leaves} leaves, {{{bufs}}})"

    # --- pickle and copy --------------------------------------------------------------------

    def __reduce__(self) -> Any:
        # Pickling the attributes would make each group, buffer and leaf view a separate array:
        # the restored tree's views would no longer alias its buffers and updates would write
        # memory nobody reads. Pickle the values of the groups instead, and rebuild the storage,
        # the views and the interned layout from them. The values are taken (as bytes: the copy
        # pickling an array makes anyway) while the buffers are held (`_marks.held`): a
        # FlatTree of a stale state is refused as `update` refuses it, and an update of the state
        # running on another thread is not read half-done.
        with held([("FlatTree", self)]):
            host = to_host(self) if self.device else self
            data = [g.tobytes() for g in host.groups]
        return (_unpickled_flat, (self.layout, data, self.device, self._readonly, list(self.group_dtypes)))

    def __deepcopy__(self, memo: dict) -> FlatTree:
        """An independent copy (`copy`), read as pickling reads (a stale state refused); two
        FlatTrees over one storage (a state and its renewal) give one copy, as one object does."""
        check_current(self, "FlatTree")
        out = memo.get(id(self.__dict__))
        if out is None:
            with held([("FlatTree", self)]):
                out = self.copy()  # stays on its device; fresh workspaces, as `copy` gives
            if self._readonly:
                out._mark_readonly()
            memo[id(self.__dict__)] = out
            memo.setdefault(id(memo), []).append(self.__dict__)  # keeps that id from being reused
        return out

    def __copy__(self) -> FlatTree:
        """A shallow copy: another FlatTree over the same storage (as ``copy.copy`` of a container
        shares its items), of the same generation: stale or busy when this one is, since it is
        the same buffer; ``copy.deepcopy`` or `copy` give independent storage."""
        out = object.__new__(FlatTree)
        out.__dict__ = self.__dict__
        out._gen = self._gen
        return out

    def _mark_readonly(self) -> None:
        self._readonly = True
        if not self.device:  # NumPy can enforce it; on the GPU it is a promise
            for g in self.groups:
                g.flags.writeable = False

    # --- copies -----------------------------------------------------------------------------

    def zeros_like(self, dtype: Any = None) -> FlatTree:
        """A zero FlatTree of the same layout (storage dtype ``dtype`` if given)."""
        if dtype is not None:
            dtype = check_float_dtype(dtype, "dtype", complex=True)
        return FlatTree.zeros(
            self.layout, dtype if dtype is not None else list(self.group_dtypes), self.device
        )

    def copy(self) -> FlatTree:
        """An independent copy (same layout, storage dtypes and device)."""
        out = FlatTree.empty(self.layout, list(self.group_dtypes), self.device)
        for dst, src in zip(out.groups, self.groups):
            ops_for(dst).scale_(dst, src, ONE)  # a copy
        return out

    def _copy_leaves_in(self, leaves: Sequence[Any]) -> None:
        lay = self.layout
        if not self.device:  # one NumPy call per group, which flattens and casts each leaf
            for members, dst in zip(lay.groups, self.groups):
                src = leaves if len(members) == len(leaves) else [leaves[i] for i in members]
                np.concatenate(src, axis=None, out=dst, casting="same_kind")
            return
        for i, x in enumerate(leaves):
            if lay.sizes[i]:  # one copy kernel per leaf: a plain tree of CUDA arrays is scattered
                s = lay.leaf_start[i]
                dst = self.groups[lay.leaf_group[i]][s : s + lay.sizes[i]]
                ops_for(dst).scale_(dst, x.reshape(lay.sizes[i]), ONE)

    def assign_(self, tree: Any) -> FlatTree:
        """Copies the values of ``tree`` (same structure and shapes) into the buffers in place.

        Raises:
            ValueError: structure or shape mismatch (names the leaf); nothing is written then.
            TypeError: a leaf is not a NumPy float array.
        """
        if self._readonly:
            raise ValueError("this FlatTree is read-only")
        if isinstance(tree, FlatTree) and tree.layout is self.layout and tree.device == self.device:
            for dst, src in zip(self.groups, tree.groups):
                ops_for(dst).scale_(dst, src, ONE)
            return self
        found = arrays.device_leaves(tree, self.layout) if self.device else None
        if found is not None:  # separate CUDA arrays: one launch per group
            pack_leaves_(self, found[0], arrays.kind_of(found[1][0]))
            return self
        leaves = check_leaves(tree, self.layout, "tree", self.device)
        self._copy_leaves_in(leaves)
        return self

    def workspace(self, name: str, dtypes: Sequence[Any] | Any = None) -> FlatTree:
        """The buffer to write of this state's workspace ``name`` (`workspace_of`)."""
        return self.workspace_of(name, dtypes)()

    def workspace_of(self, name: str, dtypes: Sequence[Any] | Any = None) -> Workspace:
        """This state's `Workspace` ``name``: a scratch buffer of the same layout, owned by this
        storage (a renewal of the state shares it; a `copy` gets fresh ones), so that a step
        allocates nothing. ``dtypes``: its storage dtypes, as the first call gives them."""
        ws = self._workspaces.get(name)
        if ws is None:
            ws = self._workspaces[name] = Workspace(self.layout, dtypes, self.device)
        return ws

    # --- handed to the caller -----------------------------------------------------------------

    def lent(self, kind: str) -> Any:
        """These values as the caller is handed them: new views of this memory, as a FlatTree
        (``kind`` 'flat') or a tree of ``kind``'s arrays ('numpy', 'numba', 'cupy', 'torch').

        They are made of fresh roots (`numbaccum._loans.lend`): while the caller holds any of
        them, or a view of one, no workspace of this memory is written again (`Workspace`,
        its spare). The containers are new too: the caller may change them as they like."""
        starts = self.__dict__.get("_starts")
        if starts is None:
            starts = self.__dict__["_starts"] = self._group_starts()
        roots = {}  # loops, not comprehensions: every update returns through here
        for d, b in self.buffers.items():
            roots[d] = _loans.lend(b)
        if self._readonly and not self.device:  # (MultiSteps' zeros) NumPy enforces it
            for d, r in roots.items():
                if r is not self.buffers[d]:
                    r.flags.writeable = False
        if kind == "flat":
            groups = []
            for d, s, g in zip(self.group_dtypes, starts, self.groups):
                groups.append(roots[d][s : s + g.size])
            return FlatTree(self.layout, groups, roots, self._readonly)
        # A tree: each leaf sliced from its buffer's root at once (a few hundred nanoseconds each).
        where = self.__dict__.get("_lent_slices")
        if where is None:
            lay = self.layout
            slices = [
                (self.group_dtypes[g], starts[g] + s, starts[g] + s + n, shape)
                for g, s, n, shape in zip(lay.leaf_group, lay.leaf_start, lay.sizes, lay.shapes)
            ]
            # A dict of leaves (the common tree) is built straight from its keys, as is each of
            # a node of such dicts (`_tree.dict_children`); any other structure by `tree_unflatten`.
            td = lay.treedef
            keys = _tree.leaf_dict_keys(td)
            where = (slices, keys, None if keys is not None else _tree.dict_children(td))
            self.__dict__["_lent_slices"] = where
        slices, keys, nested = where
        views = []
        for d, a, b, shape in slices:
            views.append(roots[d][a:b].reshape(shape))
        if kind in arrays.STREAM_KINDS:  # a framework's own tensors, zero-copy
            views = [arrays.as_kind(v, kind) for v in views]
        if keys is not None:
            return dict(zip(keys, views))
        if nested is not None:
            make, parts = nested
            kids, i = [], 0
            for k in parts:  # a loop, not a comprehension: every update returns through here
                kids.append(dict(zip(k, views[i : i + len(k)])))
                i += len(k)
            return make(kids)
        return _tree.tree_unflatten(self.layout.treedef, views)

    def _group_starts(self) -> tuple[int, ...]:
        """Where each group starts in its buffer, in elements."""
        return tuple(
            (_address(g) - _address(self.buffers[d])) // d.itemsize if g.size else 0
            for d, g in zip(self.group_dtypes, self.groups)
        )


def _address(x: Any) -> int:
    """The address of a buffer's first element (host memory in numba's simulator)."""
    ptr = arrays.data_pointer(x)
    return ptr if ptr is not None else int(x._ary.__array_interface__["data"][0])


class Workspace:
    """A buffer of one layout that a plan writes step after step (the packed updates, the
    params, the returned updates, a run's scratch): owned by one state's storage
    (`FlatTree.workspace_of`) or by one stage on one thread (`numbaccum.base.Stage.kept`), made
    on first use.

    Called, it gives the buffer to write: its own, unless the caller still holds values it was
    handed from it (`FlatTree.lent`; a reference check, nanoseconds). Then it writes its spare
    (the buffer it gave before, if nothing holds that one any more, else a new one), and the
    held one becomes the spare: the loop that holds its last updates while it asks for the next
    writes two buffers by turns and allocates nothing, and a buffer held for good (updates kept
    in a list) is the caller's after two calls. No update is ever written over one the caller
    holds."""

    __slots__ = ("layout", "dtypes", "device", "buffer", "spare")

    def __init__(self, layout: Layout, dtypes: Sequence[Any] | Any = None, device: bool = False) -> None:
        self.layout, self.dtypes, self.device = layout, dtypes, device
        self.buffer: FlatTree | None = None  # the one given last
        self.spare: FlatTree | None = None  # the one given before, maybe still held

    def __call__(self) -> FlatTree:
        b = self.buffer
        if b is None:
            b = self.buffer = FlatTree.empty(self.layout, self.dtypes, self.device)
        elif _loans.LENT and _loans.on_loan(b.buffers.values()):  # the caller holds its last values
            other = self.spare
            if other is None or _loans.on_loan(other.buffers.values()):
                other = FlatTree.empty(b.layout, list(b.group_dtypes), b.device)
            self.spare, b = b, other
            self.buffer = b
        return b


def _unpickled_flat(
    layout: Layout, groups: list[Any], device: bool, readonly: bool, dtypes: list[np.dtype] | None = None
) -> FlatTree:
    """The FlatTree that `FlatTree.__reduce__` pickled: fresh storage (one buffer per storage
    dtype, as `FlatTree.empty` lays it out) holding the pickled group values: the bytes of each
    group, of ``dtypes``; without ``dtypes`` (a pickle of numbaccum 0.1) the group arrays."""
    if dtypes is not None:
        if len(groups) != len(dtypes) or not all(isinstance(g, bytes) for g in groups):
            raise ValueError(f"a pickled FlatTree does not fit its layout {layout}")
        groups = [np.frombuffer(g, np.dtype(d)) for g, d in zip(groups, dtypes)]
    if len(groups) != len(layout.groups) or any(g.shape != (n,) for g, n in zip(groups, layout.group_sizes)):
        raise ValueError(f"a pickled FlatTree does not fit its layout {layout}")
    out = FlatTree.empty(layout, [g.dtype for g in groups])
    for dst, src in zip(out.groups, groups):
        dst[...] = src
    if device:
        out = to_device(out)
    if readonly:
        out._mark_readonly()
    return out


def check_leaves(
    tree: Any, layout: Layout, name: str, device: bool | None = None, kinds: list | None = None
) -> list[Any]:
    """The leaves of ``tree`` after checking them against ``layout``: structure first
    (ValueError naming the first differing path), then leaf types and device (TypeError; with
    ``device`` None any one side), then shapes (ValueError). Raises before anything is written."""
    if isinstance(tree, FlatTree):
        tree = tree.tree
    if device is not True:
        fast = host_leaves(tree, layout)
        if fast is not None:
            if kinds is not None and fast:
                kinds.append("numpy")
            return fast
    raw, paths, td = _tree.tree_flatten_with_path(tree)
    _tree.check_same_structure(layout.treedef, td, name)
    if kinds is not None and raw:
        kinds.append(arrays.kind_of(raw[0]))
    leaves = [_as_leaf(x, p, name) for x, p in zip(raw, paths)]
    _same_side(leaves, paths, name, device)
    for i, (x, shape) in enumerate(zip(leaves, layout.shapes)):
        if x.shape != shape:
            raise ValueError(f"{layout.path(i, name)}: shape {x.shape} does not match {shape}")
        if x.dtype.kind == "c" and layout.group_keys[i].kind != "c":  # read into a real buffer
            raise TypeError(
                f"{layout.path(i, name)}: {x.dtype} values for a {layout.dtypes[i]} leaf would lose "
                "their imaginary parts"
            )
    return leaves


def host_leaves(tree: Any, layout: Layout) -> list[np.ndarray] | None:
    """The leaves of ``tree`` when it is a plain tree of NumPy arrays with exactly the structure,
    shapes and dtypes of ``layout``, else None (then `check_leaves` finds and names what differs).

    The check an update makes on every step with a plain tree: for the common trees (one
    array; one dict, list or tuple of arrays) one loop that reads each leaf, its type, shape and
    dtype once beside the layout's (`_host_check`); else one walk beside the treedef, then
    whole-list comparisons, no per-leaf Python calls."""
    return host_check(layout)(tree)


def host_check(layout: Layout) -> Callable[[Any], list[np.ndarray] | None]:
    """`host_leaves` for ``layout``, as a function of the tree (made once per layout): what a
    kept plan calls on every step's arguments."""
    check = layout.__dict__.get("_host_check")
    if check is None:
        check = layout.__dict__["_host_check"] = _host_check(layout)
    return check


def _walked_leaves(tree: Any, layout: Layout) -> list[np.ndarray] | None:
    """`host_leaves` for any treedef."""
    raw = _tree.leaves_if_structure(tree, layout.treedef)
    if (
        raw is None
        or list(map(type, raw)).count(np.ndarray) != len(raw)
        or list(map(_SHAPE_DTYPE, raw)) != layout.shapes_dtypes
    ):
        return None
    return raw


_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")
_DTYPE = operator.attrgetter("dtype")


def _host_check(layout: Layout) -> Callable[[Any], list[np.ndarray] | None]:
    """`host_leaves` for ``layout``: for a tree that is one array, or one dict, list or tuple of
    arrays (of exactly that type: a subclass takes `_walked_leaves`, as does any other tree), its
    leaves (a dict's by the layout's keys) checked in one loop beside the layout's shapes and
    dtypes; else `_walked_leaves` itself. The same answers: the structure (a dict's keys, a
    sequence's length), every leaf a NumPy array of the layout's shape and dtype.

    The layout's own data, no code written per leaf (a function generated and compiled for a
    100,000-leaf layout took 1.3 GB): a check of any size costs one closure."""
    td = layout.treedef
    kind, n = td.kind, layout.num_leaves
    flat_node = kind in (_tree._DICT, _tree._LIST, _tree._TUPLE) and all(
        c is _tree._LEAF_DEF for c in td.children
    )
    if not (kind == _tree._LEAF or flat_node) or n == 0:
        return lambda tree: _walked_leaves(tree, layout)
    if kind == _tree._LEAF:
        return _one_array_check(layout)
    expected = layout.shapes_dtypes
    cls = {_tree._DICT: dict, _tree._LIST: list, _tree._TUPLE: tuple}[kind]
    keys = td.meta if kind == _tree._DICT else None
    ndarray = np.ndarray  # a local: the loop below reads it once per leaf

    def check(tree: Any) -> list[np.ndarray] | None:
        if type(tree) is not cls:
            return _walked_leaves(tree, layout)
        if len(tree) != n:
            return None
        # get: a missing key gives None (refused below) and a defaultdict does not grow
        leaves = list(map(tree.get, keys)) if keys is not None else list(tree)
        # One loop beside the layout's data: within a few % of code written out per leaf;
        # whole-list comparisons (`_walked_leaves`) cost more below ~50 leaves.
        for x, (shape, dtype) in zip(leaves, expected):
            if type(x) is not ndarray or x.shape != shape or (x.dtype is not dtype and x.dtype != dtype):
                return None
        return leaves

    return check


def _one_array_check(layout: Layout) -> Callable[[Any], list[np.ndarray] | None]:
    """`_host_check` for a tree that is one leaf."""
    ((shape, dtype),) = layout.shapes_dtypes

    def check(tree: Any) -> list[np.ndarray] | None:
        if type(tree) is not np.ndarray:
            return _walked_leaves(tree, layout)
        if tree.shape != shape or (tree.dtype is not dtype and tree.dtype != dtype):
            return None
        return [tree]

    return check


def as_flat(
    tree: Any,
    layout: Layout,
    name: str,
    pack_into: FlatTree | Callable[[], FlatTree] | None = None,
    device: bool | None = None,
    checked: list[np.ndarray] | None = None,
) -> tuple[FlatTree, bool, str]:
    """``(flat, copied, kind)``: ``tree`` as a FlatTree of ``layout``, without a copy when it
    already is one (or is the ``.tree`` of one), else its values packed into ``pack_into`` (or
    a new FlatTree; a callable is called only then) with ``copied`` True. ``kind`` is the array
    type of the input ('numpy', 'numba', 'cupy', 'torch'; 'flat' for a FlatTree).
    ``checked``: the tree's leaves as `host_leaves` returned them for this layout (skips the
    check).

    Raises TypeError/ValueError naming the leaf when the tree does not match ``layout`` or lives
    on the other side (host or GPU) than ``device``; nothing has been written then.
    """
    if isinstance(tree, FlatTree):
        if tree.layout is layout and device in (None, tree.device):
            return tree, False, "flat"
    elif checked is not None and device is not True:
        return host_flat(checked, layout, pack_into)
    if device is not False and checked is None and not isinstance(tree, FlatTree):
        found = arrays.device_leaves(tree, layout)
        if found is not None:  # separate CUDA arrays, read off their own attributes
            return device_flat(found, layout, pack_into)
    kinds: list[str] = []
    leaves = check_leaves(tree, layout, name, device, kinds)
    kind = "flat" if isinstance(tree, FlatTree) else (kinds[0] if kinds else "numpy")
    on_gpu = bool(leaves) and on_device(leaves[0])
    viewed = _viewed(leaves, layout)
    if viewed is not None:
        return viewed, False, kind
    if pack_into is None:
        out = FlatTree.empty(layout, device=on_gpu)
    else:
        out = pack_into if isinstance(pack_into, FlatTree) else pack_into()
    out._copy_leaves_in(leaves)
    return out, True, kind


def _viewed(leaves: list, layout: Layout) -> FlatTree | None:
    """A FlatTree over the leaves' own memory when each group's leaves are one buffer back to
    back (the ``.tree`` of a FlatTree: `run_view`), else None."""
    if not (leaves and all(layout.groups)):
        return None
    first = leaves[0]  # the first leaf of the first group
    if type(first) is np.ndarray and first.base is None and first.size:
        return None  # it owns its memory: a plain tree's leaf (`run_view`'s first test, sooner)
    views = []
    for g in range(len(layout.groups)):
        v = run_view(leaves, layout, g)
        if v is None:
            return None
        views.append(v)
    return FlatTree(layout, views, {np.dtype(v.dtype): v for v in views})


def host_flat(
    leaves: list[np.ndarray], layout: Layout, pack_into: FlatTree | Callable[[], FlatTree] | None
) -> tuple[FlatTree, bool, str]:
    """`as_flat` of a plain tree whose NumPy leaves `host_leaves` checked against ``layout``:
    views of their memory when each group's leaves are one buffer back to back (the ``.tree``
    of a FlatTree), else each leaf copied into its view of ``pack_into`` (the same shapes and
    dtypes: faster than a concatenate for small leaves)."""
    first = leaves[0] if leaves else None
    # `_viewed`'s first test, here: a plain tree's leaf owns its memory (every step of one)
    if not (type(first) is np.ndarray and first.base is None and first.size):
        viewed = _viewed(leaves, layout)
        if viewed is not None:
            return viewed, False, "numpy"
    if pack_into is None:
        out = FlatTree.empty(layout)
    else:
        out = pack_into if isinstance(pack_into, FlatTree) else pack_into()
    for view, x in zip(out.leaf_views(), leaves):
        view[...] = x
    return out, True, "numpy"


def device_flat(
    found: tuple[list[int], list[Any]], layout: Layout, pack_into: FlatTree | Callable[[], FlatTree] | None
) -> tuple[FlatTree, bool, str]:
    """`as_flat` of a tree of CUDA arrays whose addresses `arrays.device_leaves` read (``found``,
    read once per call by a caller that needs them again, as `step_` does to write back): views of
    their memory when each group's leaves sit back to back (the ``.tree`` of a FlatTree), else
    packed with one launch per group over the table of addresses (`numbaccum.cuda.leaves`)."""
    ptrs, raw = found
    kind = arrays.kind_of(raw[0])
    runs = arrays.runs_of(ptrs, layout)
    if runs is not None:
        owners = [raw[next(i for i in m if layout.sizes[i])] for m in layout.groups]
        views = [
            arrays.view_from_pointer(a, n, d, o)
            for a, n, d, o in zip(runs, layout.group_sizes, layout.group_dtypes, owners)
        ]
        return FlatTree(layout, views, {np.dtype(v.dtype): v for v in views}), False, kind
    if pack_into is None:
        out = FlatTree.empty(layout, device=True)
    else:
        out = pack_into if isinstance(pack_into, FlatTree) else pack_into()
    pack_leaves_(out, ptrs, kind)
    return out, True, kind


def pack_leaves_(flat: FlatTree, ptrs: list[int], kind: str) -> None:
    """Copies the CUDA arrays at ``ptrs`` (one per leaf, `arrays.device_pointers`) into the
    device FlatTree ``flat``: one launch per dtype group, on the caller's stream."""
    with arrays.launch_context(kind):
        device_leaf_copies().pack_(flat.groups, flat.layout, ptrs)


def scatter_leaves_(flat: FlatTree, ptrs: list[int], kind: str) -> None:
    """Copies the device FlatTree ``flat`` into the CUDA arrays at ``ptrs``: the inverse of
    `pack_leaves_`."""
    with arrays.launch_context(kind):
        device_leaf_copies().scatter_(flat.groups, flat.layout, ptrs)


def layout_of(tree: Any, name: str) -> Layout:
    """The natural layout of a tree (grouped by leaf dtype), after checking its leaves."""
    return layout_and_device(tree, name)[0]


def _device_layout(tree: Any, dtype: Any = None) -> tuple[Layout, list[int], str] | None:
    """``(layout, addresses, kind)`` of a plain tree of CUDA float arrays that
    `arrays.device_facts` can read (stored in ``dtype`` if given), else None."""
    raw, td = _tree.tree_flatten(tree)
    facts = arrays.device_facts(raw) if raw and not isinstance(raw[0], np.ndarray) else None
    if facts is None or not all(d in FLOATS for d in facts[2]):
        return None
    ptrs, shapes, dtypes = facts
    layout = Layout.get(td, shapes, dtypes, None if dtype is None else [dtype] * len(raw))
    return layout, [p if n else 0 for p, n in zip(ptrs, layout.sizes)], arrays.kind_of(raw[0])


def layout_and_device(tree: Any, name: str) -> tuple[Layout, bool]:
    """The natural layout of a tree and whether its leaves live on a CUDA device."""
    if isinstance(tree, FlatTree):
        return tree.layout, tree.device
    found = _device_layout(tree)
    if found is not None:  # CUDA arrays, read off their own attributes: no conversion
        return found[0], True
    leaves, td = leaves_of(tree, name)
    return layout_of_leaves(td, leaves), bool(leaves) and on_device(leaves[0])


def _moved(tree: Any, device: bool) -> Any:
    src = tree if isinstance(tree, FlatTree) else FlatTree.from_tree(tree)
    if src.device == device:
        return src if isinstance(tree, FlatTree) else tree
    out = FlatTree.empty(src.layout, list(src.group_dtypes), device)
    for dtype, buf in src.buffers.items():  # the same layout: the buffers line up one to one
        arrays.copy_(out.buffers[dtype], buf)
    return out if isinstance(tree, FlatTree) else out.tree


def to_device(tree: Any) -> Any:
    """Copies a tree to the GPU with one transfer per dtype buffer (not one per leaf).

    A FlatTree gives a FlatTree on the device; a plain tree gives the same tree of numba device
    arrays (views into one buffer per dtype). The leaves are packed into a `FlatTree` on the
    host first (one contiguous buffer per dtype), then each buffer is copied in one transfer.
    A tree already on the GPU is returned as it is.

    Args:
        tree: a FlatTree, or a tree of float or complex arrays (float16, bfloat16, float32,
            float64, complex64, complex128).

    Returns:
        A FlatTree on the device for a FlatTree; for a plain tree, the tree of numba device
            arrays. ``tree`` itself when it already lives on the GPU.

    Raises:
        TypeError: a leaf is not a float or complex array, or the leaves do not all live on
            one side.
        ImportError: no CUDA driver or device (numba's ``CudaSupportError``).

    References:
        jax.device_put; PyTorch's ``tensor.to("cuda")`` (one transfer per tensor).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"b": np.zeros(2, np.float32), "w": np.ones(3, np.float32)}
        >>> on_gpu = nba.to_device(params)  # doctest: +SKIP
        >>> nba.to_host(on_gpu)["w"]  # doctest: +SKIP
        array([1., 1., 1.], dtype=float32)
        >>> nba.to_device(nba.FlatTree.from_tree(params))  # doctest: +SKIP
        FlatTree(2 leaves, {float32: 5})
        >>> nba.to_host(params) is params  # already on the host: returned as it is
        True
    """
    return _moved(tree, True)


def to_host(tree: Any) -> Any:
    """Copies a tree from the GPU to NumPy with one transfer per dtype buffer.

    The inverse of `to_device`: the device buffers are copied to the host in one transfer
    each, and the result is views into the host buffers. A tree already on the host is
    returned as it is (no copy).

    Args:
        tree: a FlatTree, or a tree of CUDA float arrays (numba, CuPy, PyTorch; or NumPy).

    Returns:
        A host FlatTree for a FlatTree; for a plain tree, the same tree of NumPy arrays (views
            into one buffer per dtype). ``tree`` itself when it already lives on the host.

    Raises:
        TypeError: a leaf is not a float array, or the leaves do not all live on one side.

    References:
        jax.device_get; PyTorch's ``tensor.cpu()``.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.ones(3, np.float32)}
        >>> nba.to_host(nba.to_device(params))["w"]  # doctest: +SKIP
        array([1., 1., 1.], dtype=float32)
        >>> flat = nba.FlatTree.from_tree(params)
        >>> nba.to_host(flat) is flat  # already on the host: returned as it is
        True
    """
    return _moved(tree, False)
