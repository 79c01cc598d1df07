"""Checkpoints: `save_state` and `load_state`, a state's buffers and structure in a versioned .npz.

A checkpoint is an uncompressed ``.npz`` (a zip of stored ``.npy`` arrays, read back with
``allow_pickle=False``: loading one never runs code from the file, and never costs more memory
than the file's size: a compressed member is refused) holding

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
import errno
import hashlib
import json
import os
import secrets
import stat
import sys
import zipfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _locks
from .arrays import DeviceScalar
from .flat import FlatTree, to_device, to_host
from .layout import NAMES, STORED, Layout, check_float_dtype, is_float
from .transaction import reading
from .tree import TreeDef, first_difference, format_path, short_repr, tree_flatten

try:
    import fcntl  # the lock that tells a save being written from a killed one's leftover (POSIX)
except ImportError:  # pragma: no cover - Windows: no lock, leftovers are never removed
    fcntl = None  # type: ignore[assignment]

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
    cls: type[Any] | None = known.get(name) or _registry().get(name)  # a NamedTuple class
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


def _earlier_fields(cls: type[Any]) -> list[list[str]]:
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


def _build(cls: type[Any], values: dict[str, Any]) -> Any:
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
_registry_lock = _locks.lock()


def _library_state_classes() -> tuple[type, ...]:
    """Every NamedTuple class of numbaccum that a state can hold: those its modules mark where
    they define them (`numbaccum.protocol.state_class`; tests/test_checkpoint.py checks that every
    NamedTuple class of the package is marked or listed as no state)."""
    # Imported here, not at the top: they import the package, which imports us. The package
    # imports every other module that defines states.
    from . import distributed, protocol, sharded  # noqa: F401

    return protocol.state_classes()


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
        self._seen: dict[int, int] = {}  # id of a FlatTree's storage or an array -> its object number
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
            # A FlatTree by its storage: a state and its renewal (`transaction.current`) are
            # two objects over one buffer, which loads as one.
            key = id(x.__dict__) if isinstance(x, FlatTree) else id(x)
            seen = self._seen.get(key)
            if seen is not None:
                return ["ref", seen]
            self._seen[key] = len(self._objects)
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

    The state is checked and encoded first (nothing is written for a state that cannot be
    saved), then written to a temporary file in the same directory, flushed, fsynced and renamed
    over ``path``: a crash leaves either the previous file or the new one, never half of one. A
    CUDA state's buffers are copied to the host for writing.

    The buffers are held while they are written (as `copy_state` holds them): an update of the
    state that starts on another thread meanwhile waits until they are written, so the file
    holds one state, never half of two. A new file gets the mode ``open()`` would give it
    (``0o666`` less the umask), a file replaced keeps its mode; a symbolic link is followed (its
    target is replaced, as ``open()`` writes it); only a regular file is ever replaced. The
    temporary file has a short name of its own (``.nba-*.tmp``: any name that fits the
    directory can be saved) and is locked while it is written, so a later save of the same
    path removes what a killed save left, and never what another process is writing.

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
        ValueError: ``state`` is stale (an update has consumed it; ``update``'s error): save the
            state the last update returned, or a `copy_state` kept from before.
        RuntimeError: an update of ``state`` is running on another thread (``update``'s error).
        OSError: the file cannot be written, or something other than a regular file is at
            ``path`` (a directory, a FIFO, a device); the error names ``path``, and the previous
            file there, if any, is left as it was.

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
    name = os.fspath(path)
    with reading(state):  # until the arrays are written; the fsync and the rename need them not
        arrays = _encoded(state)
        target, mode = _target(name)
        tmp = _Temporary(target, name, mode)
        with tmp.failing():
            _write_npz(tmp.file, arrays)
            tmp.file.flush()
    tmp.commit()


def _encoded(state: Any) -> dict[str, Any]:
    """The members of ``state``'s checkpoint: its header and its arrays (views or host copies of
    its buffers, read when they are written); TypeError naming the path of what cannot be saved."""
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
    return {HEADER: blob, **{f"a{i}": a for i, a in enumerate(enc.arrays)}}


def _write_npz(f: Any, arrays: dict[str, Any]) -> None:
    """Writes ``arrays`` to the open file ``f`` as an uncompressed .npz."""
    np.savez(f, **arrays)


# --- the file a save writes -------------------------------------------------------------------------


def _named(e: OSError, name: str) -> OSError:
    """``e`` naming the caller's path ``name`` (not the temporary file it happened to)."""
    if e.filename == name and e.filename2 is None:
        return e
    if e.errno is None:
        return OSError(f"{name}: {e}")
    return OSError(e.errno, e.strerror, name)  # OSError picks the subclass of the errno


def _target(name: str) -> tuple[str, int | None]:
    """The file a save of ``name`` replaces (symbolic links followed, as ``open()`` follows them)
    and the mode of the file there (None: there is none); OSError naming ``name`` when what is
    there is not a regular file, which a rename would replace (a FIFO, ``/dev/null``)."""
    target = os.path.realpath(name)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return target, None
    except OSError as e:
        raise _named(e, name) from None
    if stat.S_ISREG(st.st_mode):
        return target, stat.S_IMODE(st.st_mode)
    what = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "something that is not a regular file")
    why = f"{what} is there; save_state replaces a regular file only"
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, why, name)
    raise FileExistsError(errno.EEXIST, why, name)


_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}

# The temporary files this process is writing: a save of the same path on another thread never
# takes one for a leftover (on NFS, where a lock is the process's, it would get the lock).
_writing: set[str] = set()
_writing_lock = _locks.lock()


def _temporary_prefix(target: str) -> str:
    """``.nba-<12 hex digits>-``: the start of the temporary names of saves of ``target`` (a
    hash of its name: short, so that they fit wherever ``target``'s name fits, and the same for
    every save of it, so that a later save finds what an earlier one left)."""
    digest = hashlib.blake2b(os.fsencode(os.path.basename(target)), digest_size=6).hexdigest()
    return f".nba-{digest}-"


_TEMPORARY_LENGTH = len(_temporary_prefix("x")) + 8 + len(".tmp")


class _Temporary:
    """The temporary file a save writes next to its target, locked (``flock``) from its creation
    until it is renamed or removed: a file of this name whose lock is free was left by a save
    that was killed (a process's locks go with it), one whose lock is held is being written."""

    def __init__(self, target: str, name: str, mode: int | None) -> None:
        self.target, self.name, self.mode = target, name, mode
        self.directory = os.path.dirname(target)
        prefix = _temporary_prefix(target)
        try:
            _remove_leftovers(self.directory, prefix)
            self.path, fd = _create(self.directory, prefix, mode)
        except OSError as e:
            raise _named(e, name) from None
        self.file = os.fdopen(fd, "wb")

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        """Removes the temporary file if the block raises; an OSError names the caller's path."""
        try:
            yield
        except BaseException as e:
            self.discard()
            if isinstance(e, OSError):
                raise _named(e, self.name) from None
            raise

    def commit(self) -> None:
        """Makes the written file durable and renames it over the target."""
        with self.failing():
            os.fsync(self.file.fileno())
            if self.mode is not None:  # as open() keeps a file's mode; a new one keeps the umask's
                with contextlib.suppress(OSError):
                    os.chmod(self.path, self.mode)
            os.replace(self.path, self.target)  # still locked: no later save removes it first
        self._close()
        _fsync_directory(self.directory)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self._close()

    def _close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()  # lets go of the lock
        with _writing_lock:
            _writing.discard(self.path)


def _create(directory: str, prefix: str, mode: int | None) -> tuple[str, int]:
    """A new temporary file in ``directory``, locked: its path and descriptor. Created with mode
    ``0o666`` (the umask applies, as for ``open()``) for a new target, ``0o600`` until it is given
    the mode of the file it replaces."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    while True:
        path = os.path.join(directory, f"{prefix}{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(path, flags, 0o666 if mode is None else 0o600)
        except FileExistsError:
            continue
        with _writing_lock:
            _writing.add(path)
        if _lock(fd) and _is_named(fd, path):
            return path, fd
        # Another save took it for a leftover between the open and the lock: it is being removed.
        os.close(fd)
        with _writing_lock:
            _writing.discard(path)


def _lock(fd: int) -> bool:
    """Locks ``fd`` for this save: False when another save holds its lock (taking it for a
    leftover); True too where files cannot be locked (their leftovers are then never removed)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # no locks on this file system
        pass
    return True


def _is_named(fd: int, path: str) -> bool:
    """Whether ``path`` is still the name of the open file ``fd``."""
    try:
        here, named = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (named.st_dev, named.st_ino)


def _remove_leftovers(directory: str, prefix: str) -> None:
    """Removes the temporary files of killed saves of the same target from ``directory``: the
    regular files of its temporary names whose lock can be taken (no living save holds it).
    Best effort: what cannot be checked is left."""
    if fcntl is None:
        return
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix) and len(n) == _TEMPORARY_LENGTH]
    except OSError:
        return
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for n in names:
        path = os.path.join(directory, n)
        with _writing_lock:
            if not n.endswith(".tmp") or path in _writing:
                continue
        try:
            fd = os.open(path, flags)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a living save writes it
                if _is_named(fd, path):
                    os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)


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
    the header and its member's size (read from the headers: no array's data is read before the
    whole structure is checked, against ``like`` too), and (the zip's CRCs) every byte. The
    loaded state is current: any ``update`` takes it.

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
            `register_state_class`) nor in ``like``, holds a compressed member, or (with ``like``)
            is of another structure, shape or dtype, or makes buffers one that are separate in
            ``like`` (or the other way); the reason is in the message.
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
            with _Archive(f) as archive:
                state = _decoded(archive, like)
    except _Malformed as e:
        raise ValueError(f"{name}: {e}") from None
    except (RecursionError, MemoryError) as e:
        raise ValueError(f"{name}: not a readable numbaccum checkpoint ({type(e).__name__})") from None
    return state


def _decoded(archive: _Archive, like: Any) -> Any:
    """The state of an open checkpoint. Its structure is decoded and checked first, against the
    arrays' declared dtypes and shapes (`_ArraySpec`) and against ``like`` (structure, shapes,
    dtypes, which buffers are one), before any array's data is read: a file that does not fit
    costs no more memory than its header."""
    header = archive.header
    known = _classes_of(like) if like is not None else {}
    device = None if like is None else _device_of(like)
    skeleton = _Decoder(header, archive.specs, known, device, dry=True).node(header["state"], "state")
    if like is not None:
        _compare(skeleton, like, "state")
        _compare_sharing(skeleton, like)
    arrays = [archive.array(i) for i in range(len(archive.specs))]
    return _Decoder(header, arrays, known, device).node(header["state"], "state")


class _ArraySpec:
    """An array of a checkpoint as its header declares it (its member's .npy header and size
    agree), before its data is read."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape


class _FlatSpec:
    """A FlatTree of a checkpoint as its header declares it (its layout and storage dtypes)."""

    __slots__ = ("layout", "group_dtypes")

    def __init__(self, layout: Layout, group_dtypes: tuple[np.dtype, ...]) -> None:
        self.layout, self.group_dtypes = layout, group_dtypes


class _Archive:
    """An open checkpoint: its header (read and checked) and its arrays' specs (checked against
    their members' .npy headers and sizes without reading their data), then each array on
    demand (`array`).

    Every member read must be stored uncompressed (`save_state` writes it so) and lie inside the
    file: what an array costs to read is then bounded by the file's own size, whatever a header
    declares (a zip member may otherwise inflate a few kilobytes into gigabytes)."""

    def __init__(self, f: Any) -> None:
        f.seek(0)
        self.size = os.fstat(f.fileno()).st_size
        try:
            self.zip = zipfile.ZipFile(f)
        except Exception as e:
            raise _Malformed(f"truncated or corrupt ({type(e).__name__}: {e})") from None

    def __enter__(self) -> _Archive:
        try:
            self.header = self._header()
            self.specs = [self._spec(spec, i) for i, spec in enumerate(self.header["arrays"])]
        except BaseException:
            self.zip.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.zip.close()

    def _info(self, key: str) -> zipfile.ZipInfo:
        try:
            info = self.zip.getinfo(f"{key}.npy")
        except KeyError:
            raise _Malformed(f"truncated or corrupt: the array {key} is missing") from None
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise _Malformed(f"the array {key} is compressed; save_state writes arrays uncompressed")
        if info.header_offset + info.compress_size > self.size:
            raise _Malformed(f"truncated or corrupt: the array {key} is longer than the file")
        return info

    def _npy_header(self, key: str, info: zipfile.ZipInfo) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape the member's .npy header declares (its data not read), after
        checking that its size is that of the header and the data exactly."""
        try:
            with self.zip.open(info) as fp:
                version = np.lib.format.read_magic(fp)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(fp)
                elif version == (2, 0):
                    shape, _, dtype = np.lib.format.read_array_header_2_0(fp)
                else:
                    raise ValueError(f"a .npy format version {version}")
                start = fp.tell()
        except Exception as e:
            raise _Malformed(f"truncated or corrupt ({key}: {type(e).__name__}: {e})") from None
        if dtype.hasobject or info.file_size != start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise _Malformed(f"truncated or corrupt: the array {key} is not the size its .npy header says")
        return dtype, shape

    def _header(self) -> dict:
        if f"{HEADER}.npy" not in self.zip.namelist():
            raise _Malformed(
                "not a numbaccum checkpoint: an .npz written by another program (no numbaccum header)"
            )
        info = self._info(HEADER)
        dtype, shape = self._npy_header(HEADER, info)
        if dtype != np.uint8 or len(shape) != 1:
            raise _Malformed("not a numbaccum checkpoint: its header is not UTF-8 JSON bytes")
        raw = self._read(HEADER, info)
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
        return header

    def _spec(self, spec: Any, i: int) -> _ArraySpec:
        dtype, shape = _array_spec(spec, i)
        key = f"a{i}"
        stored, stored_shape = self._npy_header(key, self._info(key))
        if dtype.kind == "V":  # bfloat16, kept as its raw bits (`_Encoder.array`)
            ok = stored == np.uint16 and stored_shape == shape and len(shape) == 1
        else:
            ok = stored == dtype and stored_shape == shape
        if not ok:
            raise _Malformed(
                f"truncated or corrupt: the array {key} is {stored} {stored_shape}, the header says "
                f"{dtype} {shape}"
            )
        return _ArraySpec(dtype, shape)

    def _read(self, key: str, info: zipfile.ZipInfo) -> np.ndarray:
        try:
            with self.zip.open(info) as fp:
                # Read to its end, which checks the zip's CRC of its bytes.
                return np.lib.format.read_array(fp, allow_pickle=False)
        except Exception as e:
            raise _Malformed(f"truncated or corrupt ({key}: {type(e).__name__}: {e})") from None

    def array(self, i: int) -> np.ndarray:
        """The data of array ``i``, of its spec's dtype and shape."""
        key = f"a{i}"
        a = self._read(key, self._info(key))
        spec = self.specs[i]
        if spec.dtype.kind == "V":
            a = a.view(spec.dtype)
        if a.dtype != spec.dtype or a.shape != spec.shape:  # pragma: no cover - the member changed
            raise _Malformed(f"truncated or corrupt: the array {key} changed while it was read")
        return a


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

    def __init__(
        self, header: dict, arrays: list[Any], known: dict[str, type], device: bool | None, dry: bool = False
    ):
        self.arrays = arrays
        self.dry = dry  # ``arrays`` are their specs (`_ArraySpec`): a skeleton is built, no buffer
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
            if not args[1] and isinstance(a, np.ndarray):
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

    def _flat(self, layout_index: Any, groups: Any, on_device: Any, path: str) -> FlatTree | _FlatSpec:
        layout = self.layout(layout_index, path)
        if not isinstance(groups, list) or len(groups) != len(layout.groups):
            raise _Malformed(f"{path}: {short_repr(groups)} does not give one array per group of {layout}")
        data = [self.array(i) for i in groups]
        for a, n in zip(data, layout.group_sizes):
            if a.shape != (n,) or a.dtype not in STORED:
                raise _Malformed(f"{path}: a group of {a.dtype} {a.shape} does not fit {layout}")
        if self.dry:
            return _FlatSpec(layout, tuple(a.dtype for a in data))
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
    if isinstance(x, (FlatTree, _FlatSpec)):
        return "a FlatTree"
    if isinstance(x, (np.ndarray, _ArraySpec)):
        return f"an array {x.dtype} {x.shape}"
    if isinstance(x, np.generic):
        return f"a NumPy {x.dtype} scalar"
    return type(x).__name__


def _compare(got: Any, want: Any, path: str) -> None:
    """Raises ValueError naming the first place where the checkpoint's skeleton (`_decoded`: its
    buffers and arrays as `_FlatSpec` and `_ArraySpec`) differs from ``like`` in structure, shape
    or dtype."""
    if isinstance(want, FlatTree):
        if not isinstance(got, _FlatSpec):
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
    if isinstance(want, np.ndarray):
        if not isinstance(got, _ArraySpec) or got.dtype != want.dtype or got.shape != want.shape:
            raise _mismatch(path, f"{_kind(got)} in the file, {_kind(want)} expected")
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
    elif isinstance(want, np.generic) and got.dtype != want.dtype:
        raise _mismatch(path, f"{_kind(got)} in the file, {_kind(want)} expected")


def _compare_sharing(got: Any, want: Any) -> None:
    """Raises ValueError naming the first buffer that is one with another in the checkpoint's
    skeleton but not in ``like``, or the other way (after `_compare`: the same structure). A
    file could otherwise make two buffers of a state one (adam's ``nu`` the same as its ``mu``),
    which every update would then compute wrongly. A FlatTree of ``like`` by its storage (a state
    and its renewal are one buffer); arrays are not compared (a state replaces them, it does not
    write them in place)."""
    first_got: dict[int, str] = {}
    first_want: dict[int, str] = {}
    for path, g, w in _flats_beside(got, want, "state"):
        a = first_got.setdefault(id(g), path)
        b = first_want.setdefault(id(w.__dict__), path)
        if a != b:
            in_file = f"the buffer of {a}" if a != path else "a buffer of its own"
            in_like = f"the buffer of {b}" if b != path else "a buffer of its own"
            raise _mismatch(path, f"the file makes it {in_file}, like {in_like}")


def _flats_beside(got: Any, want: Any, path: str) -> Iterator[tuple[str, Any, FlatTree]]:
    """``(path, got's node, want's FlatTree)`` for each FlatTree of ``want``, in its order."""
    if isinstance(want, FlatTree):
        yield path, got, want
    elif _is_namedtuple(want):
        for f, a, b in zip(want._fields, got, want):
            yield from _flats_beside(a, b, f"{path}.{f}")
    elif isinstance(want, (tuple, list)):
        for i, (a, b) in enumerate(zip(got, want)):
            yield from _flats_beside(a, b, f"{path}[{i}]")
    elif isinstance(want, dict):
        for k in want:
            yield from _flats_beside(got[k], want[k], f"{path}[{short_repr(k)}]")


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
