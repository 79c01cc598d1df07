"""Checkpoints: `save_state` and `load_state`, a state's buffers and structure in a versioned .npz.

A checkpoint is an uncompressed ``.npz`` (a zip of ``.npy`` arrays, read back with
``allow_pickle=False``: loading one never runs code from the file) holding

* ``numbaccum_checkpoint``: a uint8 array, the UTF-8 JSON header::

      {"format": "numbaccum-state", "version": 1, "numbaccum": "0.1.0",
       "arrays": [[dtype, shape], ...], "layouts": [layout, ...], "state": node}

* ``a0``, ``a1``, ...: the arrays the header refers to by number: one per dtype group of each
  `FlatTree` (its storage dtype, 1-D) and one per NumPy array of the state.

``node`` describes the state's structure: ``["none"]``, ``["bool", b]``, ``["int", i]``,
``["float", hex]``, ``["str", s]``, ``["np", dtype, value]`` (a NumPy scalar; floats and complex
numbers as the hex of their bytes, so every bit comes back), ``["array", i, writeable]``,
``["tuple", [nodes]]``, ``["list", [nodes]]``, ``["dict", [[key, node], ...]]``,
``["nt", class, [fields], [nodes]]`` (a NamedTuple: numbaccum's states by their public name, other
classes as ``module:qualname``; a reader finds the class by that name in a registry of known
classes, see `register_state_class`, and never imports or looks up anything the file names),
``["flat", layout, [arrays], on_device]``, ``["layout", layout]`` (a `Layout` a state holds:
the tree it was built for) and ``["ref", i]`` (the ``i``-th FlatTree or array met before:
aliasing is kept). A layout is
``{"treedef", "shapes", "dtypes", "keys"}``, its treedef ``["leaf"]``, ``["none"]``,
``["dict", [keys], [treedefs]]``, ``["list", ...]``, ``["tuple", ...]`` or
``["nt", class, [fields], [treedefs]]``.

The walk is generic: any nest of tuples, lists, dicts and NamedTuples whose leaves are FlatTrees, Layouts,
NumPy arrays and scalars, Python numbers, strings and None saves (every numbaccum state is one);
anything else raises TypeError naming its path before a byte is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
from typing import Any

import numpy as np

from .arrays import DeviceScalar
from .flat import FlatTree, to_device, to_host
from .layout import NAMES, STORED, Layout, check_float_dtype, is_float
from .tree import TreeDef, first_difference, format_path, short_repr, tree_flatten

__all__ = ["load_state", "register_state_class", "save_state"]

FORMAT = "numbaccum-state"
VERSION = 1  # bump when a reader of this version cannot read what is written
HEADER = "numbaccum_checkpoint"

_ARRAY_KINDS = "biufc"  # what .npy stores without pickle and a state can hold


class _Malformed(ValueError):
    """A checkpoint that does not follow the format (raised with the reason)."""


# --- names of NamedTuple classes --------------------------------------------------------------


def _class_name(cls: type, path: str) -> str:
    """A NamedTuple class as the file names it: numbaccum's public classes by their public name
    (stable when the code moves between modules), others as ``module:qualname``."""
    # The package is imported whenever this submodule is (not imported here: it imports us).
    if getattr(sys.modules["numbaccum"], cls.__name__, None) is cls:
        return f"numbaccum:{cls.__name__}"
    qualname = cls.__qualname__
    if "<locals>" in qualname:
        raise TypeError(
            f"{path}: {cls.__module__}.{qualname} is defined inside a function; a checkpoint can only "
            "name classes that can be found again by module and name"
        )
    return f"{cls.__module__}:{qualname}"


def _resolve_class(name: Any, fields: Any, known: dict[str, type]) -> Any:
    """The NamedTuple class ``name`` with these fields, from ``known`` (the classes of ``like``)
    or from the registry. A name the file supplies is only ever a key: nothing is imported,
    looked up in a module or called for it."""
    if not (isinstance(name, str) and isinstance(fields, list) and all(isinstance(f, str) for f in fields)):
        raise _Malformed(f"a bad class entry {short_repr(name)}")
    cls = known.get(name) or _registry().get(name)
    if cls is None:
        raise _Malformed(
            f"the class {short_repr(name)} is not a state class numbaccum knows: numbaccum's own "
            "states load by name; register a class of your own with numbaccum.register_state_class "
            "before loading, or pass like="
        )
    if list(cls._fields) != fields and fields not in _earlier_fields(cls):
        raise _Malformed(
            f"the class {short_repr(name)} has the fields {list(cls._fields)}, the file {fields}"
        )
    return cls


# --- states whose fields changed since version 1 files were first written ------------------------


def _earlier_fields(cls: type) -> list[list[str]]:
    """The field lists an earlier numbaccum wrote for ``cls`` (a file keeps loading after a state
    changed its fields; `_build` reads it)."""
    nba = sys.modules["numbaccum"]  # loaded; a load imports nothing (not even our own modules)
    if cls is nba.MultiStepsState:  # before optax's five fields: DP's example count was kept here
        return [[*cls._fields, "examples"]]
    if cls is nba.DifferentiallyPrivateAggregateState:  # before it counted DP accumulation's examples
        return [["rng_key"]]
    if cls.__name__ == "AllreduceMeanState" and cls.__module__ == "numbaccum.distributed":
        return [["mean"]]  # before it counted its steps (its count loads as 0)
    return []


def _build(cls: type, values: dict[str, Any]) -> Any:
    """``cls`` from a file's ``values`` by field: an earlier field list (`_earlier_fields`) gets
    the defaults of the fields it lacks; MultiStepsState's old ``examples`` count moves to the DP
    state inside its inner state, where it is kept now."""
    examples = values.pop("examples", None) if "examples" not in cls._fields else None
    if examples is not None and not isinstance(examples, (int, np.integer)):
        raise _Malformed(f"MultiStepsState.examples: expected an integer, got {short_repr(examples)}")
    state = cls(**values)
    if examples is not None and int(examples) != 0:
        state = state._replace(inner_opt_state=_with_examples(state.inner_opt_state, examples))
    return state


def _with_examples(tree: Any, examples: Any) -> Any:
    """``tree`` with the ``examples`` of its DP aggregation state(s) set (a version 1 file kept
    them in MultiStepsState)."""
    if isinstance(tree, sys.modules["numbaccum"].DifferentiallyPrivateAggregateState):
        return tree._replace(examples=np.int64(examples))
    if isinstance(tree, dict):
        return {k: _with_examples(v, examples) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
        return type(tree)(*(_with_examples(v, examples) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_with_examples(v, examples) for v in tree)
    return tree


# --- the registry of NamedTuple classes a checkpoint may name ------------------------------------

_registered: dict[str, type] = {}  # file name -> class: numbaccum's states, then the user's
_registry_lock = threading.Lock()


def _library_state_classes() -> tuple[type, ...]:
    """Every NamedTuple class of numbaccum that a state can hold (tests/test_checkpoint.py checks
    this list against every NamedTuple class defined in the package)."""
    # Imported here, not at the top: these modules import the package, which imports us.
    from . import (
        accumulation,
        adaptive,
        base,
        clipping,
        distributed,
        inject,
        masking,
        optimizers,
        privacy,
        protocol,
        quasi_newton,
        scaling,
        sharded,
    )
    from .contrib import (
        DAdaptAdamWState,
        HutchinsonState,
        ProdigyState,
        ReduceLROnPlateauState,
        ScaleByAdemamixState,
        ScheduleFreeState,
        SophiaState,
    )
    from .factored import FactoredState, ScaleBySM3State
    from .lookahead import LookaheadState  # (the package's ``lookahead`` is the function)

    return (
        protocol.EmptyState,
        base.SnapshotState,
        LookaheadState,
        FactoredState,
        ScaleBySM3State,
        ScaleByAdemamixState,
        ReduceLROnPlateauState,
        ScheduleFreeState,
        DAdaptAdamWState,
        ProdigyState,
        SophiaState,
        HutchinsonState,
        quasi_newton.ScaleByLBFGSState,
        quasi_newton.ScaleByZoomLinesearchState,
        quasi_newton.ZoomLinesearchInfo,
        quasi_newton.ScaleByBacktrackingLinesearchState,
        quasi_newton.BacktrackingLinesearchInfo,
        accumulation.TraceState,
        accumulation.EmaState,
        accumulation.ApplyEvery,
        accumulation.MultiStepsState,
        adaptive.ClipNormByEmaState,
        adaptive.ClipValueByEmaState,
        adaptive.ClipNormGrowthState,
        adaptive.ClipValueGrowthState,
        clipping.ClipByGlobalNormState,
        clipping.ZeroNansState,
        clipping.ApplyIfFiniteState,
        distributed.AllreduceMeanState,
        sharded.ShardedState,
        inject.InjectStatefulHyperparamsState,
        inject.WrappedScheduleState,
        masking.ConditionallyMaskState,
        masking.ConditionallyTransformState,
        masking.MaskedNode,
        masking.MaskedState,
        masking.PartitionState,
        scaling.ScaleByScheduleState,
        scaling.WeightDecaySchedule,
        optimizers.ScaleByAdaDeltaState,
        optimizers.ScaleByAdamState,
        optimizers.ScaleByAdanState,
        optimizers.ScaleByNovogradState,
        optimizers.ScaleByDistanceOverGradientsState,
        optimizers.ScaleByOptimisticGradientState,
        optimizers.ScaleByAmsgradState,
        optimizers.ScaleByBeliefState,
        optimizers.ScaleByLionState,
        optimizers.ScaleByRmsState,
        optimizers.ScaleByRmsWithCountState,
        optimizers.ScaleByRStdDevState,
        optimizers.ScaleByRStdDevWithCountState,
        optimizers.ScaleByRpropState,
        optimizers.ScaleByRssState,
        privacy.AddNoiseState,
        privacy.DifferentiallyPrivateAggregateState,
    )


def _names_of(cls: type) -> set[str]:
    """The names a file may give ``cls``: the one `save_state` writes and ``module:qualname``."""
    return {_class_name(cls, "cls"), f"{cls.__module__}:{cls.__qualname__}"}


def _registry() -> dict[str, type]:
    """The registry, with numbaccum's own classes added on first use (after the package has
    finished importing, so that their public names are known)."""
    if not _registered:
        with _registry_lock:
            if not _registered:
                library = {n: cls for cls in _library_state_classes() for n in _names_of(cls)}
                _registered.update(library)
    return _registered


def register_state_class(cls: type) -> type:
    """Lets `load_state` rebuild the NamedTuple class ``cls`` from a checkpoint without ``like``.

    A checkpoint names each NamedTuple class of a state (numbaccum's own states, the state class
    of a transformation you wrote, a NamedTuple in your params tree) and `load_state` finds the
    class by that name in a registry: numbaccum's states are in it; register your own classes
    once, at import time, before loading. Nothing a file names is ever imported or looked up
    anywhere else, so a checkpoint cannot run code. (With ``like=``, the classes ``like`` holds
    are found too, without registering.)

    Usable as a decorator; registering a class again, or a new class of the same module and
    name (a module reloaded in a notebook), keeps the latest.

    Args:
        cls: a NamedTuple class defined at the top level of a module (or nested in a class).

    Returns:
        ``cls``.

    Raises:
        TypeError: ``cls`` is not a NamedTuple class, or is defined inside a function (its name
            would not find it again).

    References:
        PyTorch's ``torch.serialization.add_safe_globals`` (the classes a ``weights_only`` load
        may rebuild); orbax restores a JAX state into the structure of a target instead (as
        ``like=`` does here).

    Examples:
        >>> import os, tempfile
        >>> from typing import NamedTuple
        >>> import numpy as np
        >>> import numbaccum as nba
        >>> @nba.register_state_class
        ... class CountState(NamedTuple):
        ...     count: np.int32
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = os.path.join(d, "state.npz")
        ...     nba.save_state(path, CountState(np.int32(3)))
        ...     loaded = nba.load_state(path)
        >>> loaded
        CountState(count=np.int32(3))
    """
    if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
        raise TypeError(f"cls: expected a NamedTuple class, got {short_repr(cls)}")
    names = _names_of(cls)  # TypeError for a class defined inside a function
    registry = _registry()
    with _registry_lock:
        for n in names:
            registry[n] = cls
    return cls


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


# --- save -------------------------------------------------------------------------------------


class _Encoder:
    """Walks a state into a JSON node and a list of arrays (host copies or views)."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.bf16: set[int] = set()  # the numbers of the bfloat16 arrays (stored as uint16)
        self.layouts: list[dict] = []
        self._layout_ids: dict[int, int] = {}
        self._seen: dict[int, int] = {}  # id of a FlatTree or array -> its object number
        self._objects: list[Any] = []  # keeps them alive, so that ids stay unique

    def array(self, a: np.ndarray) -> int:
        """The number of array ``a`` in the file: a bfloat16 one is kept as its raw bits (.npy
        has no bfloat16: NumPy would write two opaque bytes, ``V2``) and named in the header."""
        if a.dtype.kind == "V":
            self.bf16.add(len(self.arrays))
            a = np.ascontiguousarray(a).view(np.uint16)
        self.arrays.append(a)
        return len(self.arrays) - 1

    def node(self, x: Any, path: str) -> Any:
        if x is None:
            return ["none"]
        t = type(x)
        if t is bool:
            return ["bool", x]
        if t is int:
            return ["int", x]
        if t is float:
            return ["float", x.hex()]
        if t is str:
            return ["str", x]
        if isinstance(x, np.generic):
            return ["np", *self._scalar(x, path)]
        if isinstance(x, (FlatTree, np.ndarray)):
            seen = self._seen.get(id(x))
            if seen is not None:
                return ["ref", seen]
            self._seen[id(x)] = len(self._objects)
            self._objects.append(x)
            return self._flat(x, path) if isinstance(x, FlatTree) else self._ndarray(x, path)
        if t is Layout:
            return ["layout", self._layout(x, path)]
        if isinstance(x, DeviceScalar):  # a clip's norm left on the device: its host value
            return self.node(x.host(), path)
        if _is_namedtuple(x):
            cls = _class_name(t, path)
            kids = [self.node(v, f"{path}.{f}") for f, v in zip(x._fields, x)]
            return ["nt", cls, list(x._fields), kids]
        if t is tuple or t is list:
            return [t.__name__, [self.node(v, f"{path}[{i}]") for i, v in enumerate(x)]]
        if t is dict:
            items = []
            for k, v in x.items():
                where = f"{path}[{short_repr(k)}]"
                items.append([self.key(k, where), self.node(v, where)])
            return ["dict", items]
        raise TypeError(
            f"{path}: cannot save a {t.__name__}; a checkpoint holds FlatTrees, NumPy arrays and "
            "scalars, Python numbers, strings and None, in tuples, lists, dicts and NamedTuples"
        )

    def key(self, k: Any, path: str) -> Any:
        t = type(k)
        if k is None or t in (bool, int, float, str):
            return self.node(k, path)
        if t is tuple:
            return ["tuple", [self.key(v, path) for v in k]]
        if isinstance(k, np.generic):
            return ["np", *self._scalar(k, path)]
        raise TypeError(f"{path}: cannot save a dict key of type {t.__name__}")

    @staticmethod
    def _scalar(x: np.generic, path: str) -> list:
        dt = x.dtype
        if dt.kind not in _ARRAY_KINDS and not is_float(dt):
            raise TypeError(f"{path}: cannot save a NumPy scalar of dtype {dt}")
        if dt.kind in "fcV":  # the bytes, so that every bit (NaN payloads too) comes back
            return [_dtype_name(dt), x.tobytes().hex()]
        return [dt.str, x.item()]

    def _ndarray(self, a: np.ndarray, path: str) -> list:
        if a.dtype.kind not in _ARRAY_KINDS and not is_float(a.dtype):
            raise TypeError(f"{path}: cannot save an array of dtype {a.dtype} (no pickle in a checkpoint)")
        return ["array", self.array(a), bool(a.flags.writeable)]

    def _flat(self, flat: FlatTree, path: str) -> list:
        host = to_host(flat) if flat.device else flat
        groups = [self.array(np.ascontiguousarray(g)) for g in host.groups]
        return ["flat", self._layout(flat.layout, path), groups, bool(flat.device)]

    def _layout(self, layout: Layout, path: str) -> int:
        i = self._layout_ids.get(id(layout))
        if i is None:
            i = self._layout_ids[id(layout)] = len(self.layouts)
            self.layouts.append(
                {
                    "treedef": self._treedef(layout.treedef, path),
                    "shapes": [list(s) for s in layout.shapes],
                    "dtypes": [_dtype_name(d) for d in layout.dtypes],
                    "keys": [_dtype_name(layout.group_dtypes[g]) for g in layout.leaf_group],
                }
            )
        return i

    def _treedef(self, td: TreeDef, path: str) -> list:
        kids = [self._treedef(c, path) for c in td.children]
        if td.kind == "leaf":
            return ["leaf"]
        if td.kind == "none":
            return ["none"]
        if td.kind == "dict":
            return ["dict", [self.key(k, f"{path} (a params key)") for k in td.meta], kids]
        if td.kind in ("list", "tuple"):
            return [td.kind, kids]
        if td.kind == "nt":
            return ["nt", _class_name(td.meta, f"{path} (params)"), list(td.meta._fields), kids]
        raise TypeError(f"{path}: a tree node of unknown kind {td.kind!r}")  # pragma: no cover


def save_state(path: str | os.PathLike, state: Any) -> None:
    """Writes ``state`` to ``path`` as a checkpoint, atomically.

    The state is encoded first (TypeError naming the path of anything that cannot be saved, before
    the disk is touched), then written to a temporary file in the same directory, flushed, fsynced
    and renamed over ``path``: a crash leaves either the previous file or the new one, never half
    of one. A CUDA state's buffers are copied to the host for writing.

    Args:
        path: the file to write (no suffix is added; ``.npz`` is customary).
        state: a state from ``init``/``update`` of any numbaccum transformation (or any nest of
            tuples, lists, dicts and NamedTuples of FlatTrees, NumPy arrays and scalars, Python
            numbers, strings and None).

    Returns:
        None; the file at ``path`` holds the state (any previous file there is replaced).

    Raises:
        TypeError: the state holds something a checkpoint cannot hold (names its path); nothing
            is written then.
        OSError: the file cannot be written (the previous file at ``path``, if any, is left as
            it was).

    References:
        orbax.checkpoint, which saves optax states in JAX; PyTorch's
        ``torch.save(optimizer.state_dict(), path)``.

    Examples:
        >>> import os, tempfile
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2, np.float32)}
        >>> tx = nba.adam(0.1)
        >>> state = nba.step_(tx, {"w": np.ones(2, np.float32)}, tx.init(params), params)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = os.path.join(d, "opt.npz")
        ...     nba.save_state(path, state)
        ...     loaded = nba.load_state(path)
        >>> int(loaded[0].count), [round(float(x), 4) for x in loaded[0].mu["w"]]
        (1, [0.1, 0.1])
    """
    path = os.fspath(path)
    enc = _Encoder()
    node = enc.node(state, "state")
    header = {
        "format": FORMAT,
        "version": VERSION,
        "numbaccum": _version(),
        "arrays": [
            ["bfloat16" if i in enc.bf16 else a.dtype.str, list(a.shape)] for i, a in enumerate(enc.arrays)
        ],
        "layouts": enc.layouts,
        "state": node,
    }
    blob = np.frombuffer(json.dumps(header, separators=(",", ":")).encode(), np.uint8)
    arrays: dict[str, Any] = {HEADER: blob, **{f"a{i}": a for i, a in enumerate(enc.arrays)}}
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):  # mkstemp makes the file 0600; keep an old file's mode
            os.chmod(tmp, os.stat(path).st_mode & 0o7777 if os.path.exists(path) else 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    """Makes the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _version() -> str:
    return str(sys.modules["numbaccum"].__version__)


# --- load -------------------------------------------------------------------------------------


def load_state(path: str | os.PathLike, like: Any = None) -> Any:
    """Reads a checkpoint written by `save_state`.

    Continuing from the loaded state gives the same bits as never stopping. The file is checked
    whole before a state is built: its format and version, each array's dtype and shape against
    the header, and (the zip's CRCs) every byte.

    Args:
        path: the file `save_state` wrote.
        like: optional, a state from ``init`` of the transformation that will continue (e.g.
            ``opt.init(params)``): the loaded state must have its structure, shapes and dtypes,
            and is placed where ``like`` lives (host or GPU). Without it the state comes back
            where it was saved from (a CUDA state onto the GPU).

    Returns:
        The state, with new buffers (``like`` is not modified).

    Raises:
        ValueError: the file is truncated or corrupt, from another program, of a newer format
            version, names a NamedTuple class that is neither numbaccum's nor registered (see
            `register_state_class`) nor in ``like``, or (with ``like``) is of another structure,
            shape or dtype; the reason is in the message.
        OSError: the file cannot be opened (FileNotFoundError where there is none).

    References:
        orbax.checkpoint (restoring into the structure of a target state, as ``like`` does);
        PyTorch's ``optimizer.load_state_dict(torch.load(path))``.

    Examples:
        >>> import os, tempfile
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros(2, np.float32)}
        >>> tx = nba.sgd(0.1, momentum=0.9)
        >>> state = nba.step_(tx, {"w": np.ones(2, np.float32)}, tx.init(params), params)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = os.path.join(d, "opt.npz")
        ...     nba.save_state(path, state)
        ...     state = nba.load_state(path, like=tx.init(params))
        >>> state = nba.step_(tx, {"w": np.ones(2, np.float32)}, state, params)  # continue
        >>> [round(float(x), 4) for x in params["w"]]  # -0.1 * 1, then -0.1 * (1 + 0.9)
        [-0.29, -0.29]
    """
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            magic = f.read(4)
            if not magic:
                raise _Malformed("the file is empty")
            if magic != b"PK\x03\x04":
                raise _Malformed("not a numbaccum checkpoint: the file is not an .npz archive")
            header, arrays = _read(f)
        known = _classes_of(like) if like is not None else {}
        state = _Decoder(header, arrays, known, None if like is None else _device_of(like)).node(
            header["state"], "state"
        )
    except _Malformed as e:
        raise ValueError(f"{name}: {e}") from None
    except (RecursionError, MemoryError) as e:
        raise ValueError(f"{name}: not a readable numbaccum checkpoint ({type(e).__name__})") from None
    if like is not None:
        _compare(state, like, "state")
    return state


def _read(f: Any) -> tuple[dict, list[np.ndarray]]:
    """The header and the arrays of an open checkpoint; _Malformed with the reason."""
    f.seek(0)
    try:
        npz = np.load(f, allow_pickle=False)
    except Exception as e:
        raise _Malformed(f"truncated or corrupt ({type(e).__name__}: {e})") from None
    with npz:
        if not isinstance(npz, np.lib.npyio.NpzFile):  # pragma: no cover - the magic was a zip's
            raise _Malformed("not a numbaccum checkpoint: the file is not an .npz archive")
        if HEADER not in npz.files:
            raise _Malformed(
                "not a numbaccum checkpoint: an .npz written by another program (no numbaccum header)"
            )
        raw = _member(npz, HEADER)
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raise _Malformed("not a numbaccum checkpoint: its header is not UTF-8 JSON bytes")
        try:
            header = json.loads(raw.tobytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise _Malformed(f"not a numbaccum checkpoint: its header is not UTF-8 JSON ({e})") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise _Malformed("not a numbaccum checkpoint: an .npz written by another program")
        version = header.get("version")
        if type(version) is not int or version < 1:
            raise _Malformed(f"a bad format version {short_repr(version)}")
        if version > VERSION:
            raise _Malformed(
                f"written by a newer numbaccum (format version {version}, numbaccum "
                f"{short_repr(header.get('numbaccum'))}); this one reads up to version {VERSION}: upgrade"
            )
        specs, layouts = header.get("arrays"), header.get("layouts")
        if not isinstance(specs, list) or not isinstance(layouts, list) or "state" not in header:
            raise _Malformed("a malformed header (missing 'arrays', 'layouts' or 'state')")
        arrays = []
        for i, spec in enumerate(specs):
            dtype, shape = _array_spec(spec, i)
            key = f"a{i}"
            if key not in npz.files:
                raise _Malformed(f"truncated or corrupt: the array {key} is missing")
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if npz.zip.getinfo(f"{key}.npy").file_size < expected:  # type: ignore[union-attr]  # before reading
                raise _Malformed(f"truncated or corrupt: the array {key} is shorter than its header says")
            a = _member(npz, key)
            if dtype.kind == "V":  # bfloat16, kept as its raw bits (`_Encoder.array`)
                a = a.view(dtype) if a.dtype == np.uint16 and a.ndim == 1 else a
            if a.dtype != dtype or a.shape != shape:
                raise _Malformed(
                    f"truncated or corrupt: the array {key} is {a.dtype} {a.shape}, the header says "
                    f"{dtype} {shape}"
                )
            arrays.append(a)
    return header, arrays


def _dtype_name(dt: np.dtype) -> str:
    """A dtype as the header writes it: NumPy's string, or ``"bfloat16"`` (whose NumPy string,
    ``"<V2"``, says only "two bytes")."""
    return "bfloat16" if dt.kind == "V" and is_float(dt) else dt.str


def _dtype_of(name: Any) -> np.dtype:
    """The dtype a header names (`_dtype_name`): ``"bfloat16"`` is ml_dtypes' (imported by this
    one fixed name: a header never names a module); a name NumPy does not know, or a void dtype
    of any other spelling, is malformed."""
    if name == "bfloat16":
        try:
            return check_float_dtype(name, "bfloat16")
        except TypeError as e:
            raise _Malformed(f"a bfloat16 array, which needs ml_dtypes ({e})") from None
    dt = np.dtype(name)
    if dt.kind == "V":
        raise ValueError(f"a void dtype {name!r}")
    return dt


def _member(npz: Any, key: str) -> np.ndarray:
    try:
        return npz[key]  # reads it to the end, which checks the zip's CRC of its bytes
    except Exception as e:
        raise _Malformed(f"truncated or corrupt ({key}: {type(e).__name__}: {e})") from None


def _array_spec(spec: Any, i: int) -> tuple[np.dtype, tuple[int, ...]]:
    try:
        dtype_str, shape = spec
        dtype = _dtype_of(dtype_str)
        ok = (dtype.kind in _ARRAY_KINDS or dtype.kind == "V") and all(
            type(d) is int and d >= 0 for d in shape
        )
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise _Malformed(f"a malformed header (array {i}: {short_repr(spec)})")
    return dtype, tuple(shape)


def _device_of(like: Any) -> bool | None:
    """Where ``like``'s FlatTrees live (None: it has none)."""
    for x in _walk(like):
        if isinstance(x, FlatTree):
            return bool(x.device)
    return None


def _walk(x: Any) -> Any:
    yield x
    if isinstance(x, dict):
        for v in x.values():
            yield from _walk(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _walk(v)


def _classes_of(like: Any) -> dict[str, type]:
    """The NamedTuple classes ``like`` holds (its nodes and its layouts' treedefs), by file name."""
    out: dict[str, type] = {}

    def treedef(td: TreeDef) -> None:
        if td.kind == "nt":
            with contextlib.suppress(TypeError):
                out[_class_name(td.meta, "like")] = td.meta
        for c in td.children:
            treedef(c)

    for x in _walk(like):
        if _is_namedtuple(x):
            with contextlib.suppress(TypeError):
                out[_class_name(type(x), "like")] = type(x)
        elif isinstance(x, FlatTree):
            treedef(x.layout.treedef)
        elif isinstance(x, Layout):
            treedef(x.treedef)
    return out


class _Decoder:
    """Builds a state from a header node, checking every entry (_Malformed with the reason)."""

    def __init__(self, header: dict, arrays: list[np.ndarray], known: dict[str, type], device: bool | None):
        self.arrays = arrays
        self.layouts_raw = header["layouts"]
        self.layouts: dict[int, Layout] = {}
        self.known = known
        self.device = device
        self.objects: list[Any] = []
        self.used: set[int] = set()

    def array(self, i: Any) -> np.ndarray:
        if type(i) is not int or not 0 <= i < len(self.arrays) or i in self.used:
            raise _Malformed(f"a bad array reference {short_repr(i)}")
        self.used.add(i)
        return self.arrays[i]

    def node(self, n: Any, path: str) -> Any:
        try:
            return self._node(n, path)
        except _Malformed:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
            raise _Malformed(f"a malformed entry at {path} ({type(e).__name__}: {e})") from None

    def _node(self, n: Any, path: str) -> Any:
        if not isinstance(n, list) or not n or not isinstance(n[0], str):
            raise _Malformed(f"a malformed entry at {path}")
        tag, args = n[0], n[1:]
        if tag == "none" and not args:
            return None
        if tag == "bool" and len(args) == 1 and type(args[0]) is bool:
            return args[0]
        if tag == "int" and len(args) == 1 and type(args[0]) is int:
            return args[0]
        if tag == "float" and len(args) == 1:
            return float.fromhex(args[0])
        if tag == "str" and len(args) == 1 and type(args[0]) is str:
            return args[0]
        if tag == "np" and len(args) == 2:
            return _scalar(*args)
        if tag == "array" and len(args) == 2:
            a = self.array(args[0])
            if not args[1]:
                a.flags.writeable = False
            self.objects.append(a)
            return a
        if tag == "flat" and len(args) == 3:
            flat = self._flat(args[0], args[1], args[2], path)
            self.objects.append(flat)
            return flat
        if tag == "layout" and len(args) == 1:
            return self.layout(args[0], path)
        if tag == "ref" and len(args) == 1:
            i = args[0]
            if type(i) is not int or not 0 <= i < len(self.objects):
                raise _Malformed(f"a bad reference at {path}")
            return self.objects[i]
        if tag == "nt" and len(args) == 3:
            cls = _resolve_class(args[0], args[1], self.known)
            kids = args[2]
            if not isinstance(kids, list) or len(kids) != len(args[1]):
                raise _Malformed(f"a malformed entry at {path}")
            return _build(cls, {f: self.node(k, f"{path}.{f}") for f, k in zip(args[1], kids)})
        if tag in ("tuple", "list") and len(args) == 1 and isinstance(args[0], list):
            items = [self.node(k, f"{path}[{i}]") for i, k in enumerate(args[0])]
            return tuple(items) if tag == "tuple" else items
        if tag == "dict" and len(args) == 1 and isinstance(args[0], list):
            mapping: dict[Any, Any] = {}
            for item in args[0]:
                k = self.key(item[0], path)
                mapping[k] = self.node(item[1], f"{path}[{short_repr(k)}]")
            return mapping
        raise _Malformed(f"a malformed entry at {path} ({short_repr(tag)})")

    def key(self, n: Any, path: str) -> Any:
        if isinstance(n, list) and n and n[0] == "tuple" and len(n) == 2 and isinstance(n[1], list):
            return tuple(self.key(k, path) for k in n[1])
        if isinstance(n, list) and n and n[0] in ("none", "bool", "int", "float", "str", "np"):
            return self._node(n, path)
        raise _Malformed(f"a malformed dict key at {path}")

    def _flat(self, layout_index: Any, groups: Any, on_device: Any, path: str) -> FlatTree:
        layout = self.layout(layout_index, path)
        if not isinstance(groups, list) or len(groups) != len(layout.groups):
            raise _Malformed(f"{path}: {short_repr(groups)} does not give one array per group of {layout}")
        data = [self.array(i) for i in groups]
        for a, n in zip(data, layout.group_sizes):
            if a.shape != (n,) or a.dtype not in STORED:
                raise _Malformed(f"{path}: a group of {a.dtype} {a.shape} does not fit {layout}")
        out = FlatTree.empty(layout, [a.dtype for a in data])
        for dst, src in zip(out.groups, data):
            dst[...] = src
        device = bool(on_device) if self.device is None else self.device
        return to_device(out) if device else out

    def layout(self, i: Any, path: str) -> Layout:
        if type(i) is not int or not 0 <= i < len(self.layouts_raw):
            raise _Malformed(f"{path}: a bad layout reference {short_repr(i)}")
        lay = self.layouts.get(i)
        if lay is None:
            raw = self.layouts_raw[i]
            treedef = self.treedef(raw["treedef"], path)
            shapes = [tuple(s) for s in raw["shapes"]]
            dtypes = [_dtype_of(d) for d in raw["dtypes"]]
            keys = [_dtype_of(d) for d in raw["keys"]]
            n = treedef.num_leaves
            if not (len(shapes) == len(dtypes) == len(keys) == n):
                raise _Malformed(f"{path}: a layout of {n} leaves with {len(shapes)} shapes")
            if not all(type(d) is int and d >= 0 for s in shapes for d in s):
                raise _Malformed(f"{path}: a layout with a bad shape")
            if not all(d in STORED for d in (*dtypes, *keys)):
                raise _Malformed(f"{path}: a layout with a dtype that is not {NAMES}")
            lay = self.layouts[i] = Layout.get(treedef, shapes, dtypes, keys)
        return lay

    def treedef(self, raw: Any, path: str) -> TreeDef:
        # Built through a tree of placeholder leaves and `tree_flatten`: the treedef is then
        # exactly what flattening the params gives, so the interned layout is the same object.
        return tree_flatten(self._skeleton(raw, path))[1]

    def _skeleton(self, raw: Any, path: str) -> Any:
        if not isinstance(raw, list) or not raw:
            raise _Malformed(f"{path}: a malformed tree structure")
        tag = raw[0]
        if tag == "leaf":
            return 0  # an int is a leaf
        if tag == "none":
            return None
        if tag in ("list", "tuple"):
            kids = [self._skeleton(c, path) for c in raw[1]]
            return kids if tag == "list" else tuple(kids)
        if tag == "dict":
            keys = [self.key(k, path) for k in raw[1]]
            if len(keys) != len(raw[2]) or len(set(keys)) != len(keys):
                raise _Malformed(f"{path}: a malformed dict in a tree structure")
            return {k: self._skeleton(c, path) for k, c in zip(keys, raw[2])}
        if tag == "nt":
            cls = _resolve_class(raw[1], raw[2], self.known)
            kids = raw[3]
            if len(kids) != len(cls._fields):
                raise _Malformed(f"{path}: a malformed NamedTuple in a tree structure")
            return cls(*(self._skeleton(c, path) for c in kids))
        raise _Malformed(f"{path}: a malformed tree structure ({short_repr(tag)})")


def _scalar(dtype_str: Any, value: Any) -> np.generic:
    dt = _dtype_of(dtype_str)
    if dt.kind not in _ARRAY_KINDS and dt.kind != "V":
        raise _Malformed(f"a NumPy scalar of dtype {dt}")
    if dt.kind in "fcV":  # V: bfloat16 (`_dtype_of` refuses every other void dtype)
        raw = bytes.fromhex(value)
        if len(raw) != dt.itemsize:
            raise _Malformed(f"a {dt} scalar of {len(raw)} bytes")
        return np.frombuffer(raw, dt)[0]
    if dt.kind == "b":
        if type(value) is not bool:
            raise _Malformed(f"a bool scalar {short_repr(value)}")
        return np.bool_(value)
    if type(value) is not int:
        raise _Malformed(f"an integer scalar {short_repr(value)}")
    return dt.type(value)  # OverflowError for a value out of range: reported as malformed


# --- like -------------------------------------------------------------------------------------


def _mismatch(path: str, why: str) -> ValueError:
    return ValueError(f"{path}: the checkpoint does not match like: {why}")


def _kind(x: Any) -> str:
    if isinstance(x, FlatTree):
        return "a FlatTree"
    if isinstance(x, np.ndarray):
        return f"an array {x.dtype} {x.shape}"
    if isinstance(x, np.generic):
        return f"a NumPy {x.dtype} scalar"
    return type(x).__name__


def _compare(got: Any, want: Any, path: str) -> None:
    """Raises ValueError naming the first place where the loaded state differs from ``like`` in
    structure, shape or dtype."""
    if isinstance(want, FlatTree):
        if not isinstance(got, FlatTree):
            raise _mismatch(path, f"expected a FlatTree, the file holds {_kind(got)}")
        if got.layout is not want.layout:
            raise _mismatch(path, _layout_difference(got.layout, want.layout))
        if got.group_dtypes != want.group_dtypes:
            g = [str(d) for d in got.group_dtypes]
            w = [str(d) for d in want.group_dtypes]
            raise _mismatch(path, f"storage dtypes {g} in the file, {w} expected")
        return
    if isinstance(want, Layout):
        if not isinstance(got, Layout):
            raise _mismatch(path, f"expected a layout, the file holds {_kind(got)}")
        if got is not want:
            raise _mismatch(path, _layout_difference(got, want))
        return
    if type(got) is not type(want):
        raise _mismatch(path, f"expected {_kind(want)}, the file holds {_kind(got)}")
    if _is_namedtuple(want):
        for f, a, b in zip(want._fields, got, want):
            _compare(a, b, f"{path}.{f}")
    elif isinstance(want, (tuple, list)):
        if len(got) != len(want):
            raise _mismatch(path, f"{len(got)} entries in the file, {len(want)} expected")
        for i, (a, b) in enumerate(zip(got, want)):
            _compare(a, b, f"{path}[{i}]")
    elif isinstance(want, dict):
        if set(got) != set(want):
            missing = [short_repr(k) for k in want if k not in got][:5]
            extra = [short_repr(k) for k in got if k not in want][:5]
            raise _mismatch(path, f"dict keys differ (missing {missing}, unexpected {extra})")
        for k in want:
            _compare(got[k], want[k], f"{path}[{short_repr(k)}]")
    elif isinstance(want, (np.ndarray, np.generic)) and (got.dtype != want.dtype or got.shape != want.shape):
        raise _mismatch(path, f"{_kind(got)} in the file, {_kind(want)} expected")


def _layout_difference(got: Layout, want: Layout) -> str:
    if got.treedef != want.treedef:
        where, why = first_difference(want.treedef, got.treedef)
        return f"params structure differs at {format_path(where, 'params')}: {why}"
    for i in range(want.num_leaves):
        if got.shapes[i] != want.shapes[i]:
            return f"{want.path(i, 'params')}: shape {got.shapes[i]} in the file, {want.shapes[i]} expected"
        if got.dtypes[i] != want.dtypes[i]:
            return f"{want.path(i, 'params')}: dtype {got.dtypes[i]} in the file, {want.dtypes[i]} expected"
    return f"the leaves are grouped differently ({got} in the file, {want} expected)"
