"""The on-disk kernel cache: where compiled kernels are kept between processes, and how.

A fresh process compiles every kernel it runs (about 16 s for a first Adam step on the 2-core
VM); with the cache it loads them instead. The cache is numba's own (``cache=True`` machinery:
an index file and data files per function), pointed at one directory of ours:

* ``NUMBACCUM_CACHE_DIR`` when set; set to nothing, ``0``, ``off``, ``false`` or ``no`` turns
  the cache off (kernels compile in memory, as without a cache);
* else the user cache directory of the platform: ``$XDG_CACHE_HOME/numbaccum`` or
  ``~/.cache/numbaccum`` (Linux), ``~/Library/Caches/numbaccum`` (macOS),
  ``%LOCALAPPDATA%\\numbaccum\\Cache`` (Windows).

Namespace. Inside it, everything lives under one subdirectory per (`FORMAT`, numba version,
Python version, hash of the package's sources): numba checks only the source file of the
function it loads, not the functions that function calls (numba's caching notes), so an edit
anywhere in the package starts a new subdirectory rather than loading a kernel that inlined an
older helper; `FORMAT` changes when the layout or the naming of the entries does, so a cache
filled by a version with other rules is never read.

Identity. Every kernel is named after what it computes, never after where its source sits.
numba names a compiled function's symbol after its module, its qualified name and a counter
that starts again in every process, and a cached kernel reaches the functions it calls by
those names: two closures of one factory (the reduction engine's per-kind drivers) compiled in
two processes could carry one name for two codes, and a third process that loaded both ran one
in place of the other. So `identify` puts a readable tag (the kind, the driver variant) and the
`code_digest` of the function (its bytecode, and what its names and closure cells hold,
recursively) into the qualified name of every function that numba compiles on its own (not
inlined) for a cached kernel, before the first compile; `cached` does it for the kernels
themselves. One name then means one code, and each kernel has an index file of its own; the
index key is the digest too (`LockedCache._index_key`). numba's counter is also started at a
random place in each process (`_unique_ids`), for the callees no name of ours reaches (numba's
own helpers, a parallel loop's body).

Kernels generated at run time (the drivers' loops around each `numbaccum.formulas.Formula`) are
exec'd source with no file, which numba cannot cache: `source_file` writes each generated module
once under a name that hashes its source and everything the formula's code reaches
(`code_digest`), so any formula, including one composed at run time, gets its own entry and a
changed formula never loads a stale kernel. The file is written to a temporary name and linked
into place, never rewritten (numba stamps a function with its source file).

Safety. The cache imports the generated modules and unpickles numba's indexes, so whoever may
write its directories may run code in this process. Like ssh with its keys, the cache uses a
directory (the cache directory, its namespace and every subdirectory it reads) only when it
belongs to this user and neither group nor others may write it, below directories that belong to
root or to this user and that no one else may write unless they are sticky (``/tmp``), checked up
to the home directory as ssh's ``StrictModes`` does; otherwise it warns once and kernels compile
in memory (`describe` says why). The directories it makes are mode 0o700. The cache directory is
one absolute path, resolved when the module is imported (`directory`): a relative
``NUMBACCUM_CACHE_DIR`` does not follow a later ``os.chdir`` into a directory no one checked.

Two processes filling an empty cache at once: numba writes each index and data file to a unique
temporary name and renames it, but the index is read, extended and written back, so two writers
can lose each other's entries or give two signatures the same data file (numba#4807). Loads and
saves of one function hold an ``flock`` on a lock file beside its index (shared to load,
exclusive to save); a failed load compiles instead, a failed save is reported once and ignored.
An index that cannot be read is replaced by the next save, not kept (it would fail every save).

A directory that cannot be written (a read-only install, a read-only home) turns the cache off
for the process with one warning; kernels then compile in memory.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import itertools
import os
import re
import secrets
import stat
import sys
import tempfile
import types
import warnings
from pathlib import Path
from typing import Any

import numba
import numpy as np
from numba.core.caching import CompileResultCacheImpl, FunctionCache, _CacheLocator

from . import _locks

try:  # POSIX: advisory locks between processes (Windows gets numba's own renames only)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "cached",
    "code_digest",
    "describe",
    "directory",
    "identified",
    "identify",
    "named",
    "namespace",
    "root",
    "source_file",
]

ENV = "NUMBACCUM_CACHE_DIR"
_OFF = frozenset({"", "0", "off", "false", "no", "none"})
PACKAGE = Path(__file__).resolve().parent
GENERATED = "generated"  # subdirectory of the generated kernel modules
# The layout of a namespace and the naming of its kernels. 2: kernels named by what they compute
# (`identify`); a cache written under 1 held entries that a process could confuse, never read it.
FORMAT = 2
_PRIVATE = 0o700  # the mode of every directory the cache makes

_lock = _locks.lock()
_state: dict[str, Any] = {}  # "root": the usable cache root (None: off), "why": why not
_warned: set[str] = set()


def directory() -> Path | None:
    """The cache directory the environment asks for (``None``: turned off), whether or not it
    can be written: an absolute path with no symbolic links, resolved the first time this value
    is read (a relative ``NUMBACCUM_CACHE_DIR`` names the same directory after a later
    ``os.chdir``, as in a Hydra run directory)."""
    raw = os.environ.get(ENV)
    if raw is not None:
        if raw.strip().lower() in _OFF:
            return None
        return _resolved(raw.strip())
    home = Path.home()
    if sys.platform.startswith("win"):
        base = os.environ.get("LOCALAPPDATA")
        path = (Path(base) if base else home / "AppData" / "Local") / "numbaccum" / "Cache"
    elif sys.platform == "darwin":
        path = home / "Library" / "Caches" / "numbaccum"
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        path = (Path(xdg) if os.path.isabs(xdg) else home / ".cache") / "numbaccum"
    return _resolved(str(path))


_RESOLVED: dict[str, Path] = {}  # a directory as the environment names it -> its absolute path


def _resolved(name: str) -> Path:
    """``name`` (``~`` expanded) as an absolute path without symbolic links, the same on every
    call of this process: the cache checks and uses one directory, wherever the working
    directory later moves. Its parents are what `_check_parents` checks, as ssh checks the
    canonical path of a key file."""
    path = _RESOLVED.get(name)
    if path is None:
        path = _RESOLVED.setdefault(name, Path(os.path.realpath(os.path.expanduser(name))))
    return path


if os.environ.get(ENV) is not None:  # resolved at import: a chdir before the first kernel is no matter
    directory()


@functools.lru_cache(maxsize=1)
def tag() -> str:
    """The subdirectory of this numba, this Python and these package sources."""
    h = hashlib.sha256()
    for p in sorted(PACKAGE.rglob("*.py")):
        h.update(p.relative_to(PACKAGE).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    py = f"{sys.version_info[0]}{sys.version_info[1]}"
    return f"v{FORMAT}-numba{numba.__version__}-py{py}-{h.hexdigest()[:16]}"


def root() -> Path | None:
    """The writable cache directory of this process (its `tag` subdirectory), or ``None`` when
    the cache is off or cannot be written (decided once per process)."""
    if "root" not in _state:
        with _lock:
            if "root" not in _state:
                _state["root"], _state["why"] = _probe()
    return _state["root"]


def _probe() -> tuple[Path | None, str]:
    base = directory()
    if base is None:
        return None, f"off ({ENV} is set to turn it off)"
    where = base / tag()
    try:
        _private_path(base)
        for d in (where, where / GENERATED):
            _private_dir(d)
        with tempfile.TemporaryFile(dir=where):  # writable, not just present
            pass
    except _Unsafe as e:
        why = f"off: {e}; kernels compile in memory"
        _warn_once(
            "probe",
            f"numbaccum kernel cache {why}. The cache imports and unpickles what it finds there: "
            f"set {ENV} to a new directory that only you can write.",
        )
        return None, why
    except OSError as e:
        why = f"off: {base} cannot be written ({e.strerror or e}); kernels compile in memory"
        _warn_once("probe", f"numbaccum kernel cache {why}. Set {ENV} to a writable directory.")
        return None, why
    return where, "on"


class _Unsafe(Exception):
    """A cache directory that someone else owns or may write."""


_private: set[str] = set()  # directories found private in this process


def _private_dir(path: Path) -> None:
    """Makes directory ``path`` (mode 0o700) unless it exists, and checks it as ssh checks a key
    file: it must belong to this user and be writable by no one else (`_Unsafe` otherwise), since
    the cache imports the modules and unpickles the indexes it finds there. Checked once per
    directory and process."""
    key = str(path)
    if key in _private:
        return
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=_PRIVATE)
    if hasattr(os, "geteuid"):  # POSIX (Windows guards its profile folders with ACLs instead)
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{path} is not a directory")
        if st.st_uid != os.geteuid():
            raise _Unsafe(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            mode = oct(stat.S_IMODE(st.st_mode))
            raise _Unsafe(f"{path} can be written by other users (mode {mode})")
    _private.add(key)


def _private_path(base: Path) -> None:
    """Makes the cache directory ``base`` and the parents it lacks (each `_private_dir`: mode
    0o700, ours), after checking the deepest parent that exists and those above it
    (`_check_parents`): the cache reads nothing below a directory that someone else may
    change."""
    chain = [base, *base.parents]
    top = next((p for p in chain if p.exists()), chain[-1])
    made = chain.index(top)  # how many directories to make below ``top``
    _check_parents(top if made else base.parent)
    for d in reversed(chain[: max(made, 1)]):
        _private_dir(d)


def _check_parents(path: Path) -> None:
    """Checks directory ``path`` and every directory above it as OpenSSH checks those above a
    key file (``StrictModes``, its ``safe_path``): each must belong to root or to this user, and
    group and others may not write it unless it is sticky (``/tmp``: others may add entries
    there but not rename or remove ours, and an entry they add is not ours, which the directory
    below fails). As ssh's, the walk stops at the user's home directory. Whoever may write a
    directory above the cache may put a directory of theirs in its place: `_Unsafe` then."""
    if not hasattr(os, "geteuid"):  # POSIX only, as `_private_dir`
        return
    uid, home = os.geteuid(), Path(os.path.realpath(os.path.expanduser("~")))
    for d in (path, *path.parents):
        st = os.stat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(d))
        if st.st_uid not in (0, uid):
            raise _Unsafe(
                f"{d}, above the cache directory, belongs to uid {st.st_uid}, neither root nor this "
                f"user (uid {uid})"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            mode = oct(stat.S_IMODE(st.st_mode))
            raise _Unsafe(f"{d}, above the cache directory, can be written by other users (mode {mode})")
        if d == home:
            break


def _private_dirs(top: Path, path: Path) -> None:
    """`_private_dir` for every directory below ``top`` down to ``path``."""
    d = top
    for part in path.relative_to(top).parts:
        d = d / part
        _private_dir(d)


def describe() -> str:
    """One line for ``numbaccum info``: the directory and whether the cache is on."""
    where = root()
    base = directory()
    if where is None:
        return f"{base} ({_state['why']})" if base is not None else _state["why"]
    return f"{base} (on; this version's kernels in {where.name})"


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# --- generated modules ------------------------------------------------------------------------


def source_file(source: str, name: str, key: str) -> str | None:
    """The path of a file holding ``source`` (a generated module), written once into the cache;
    ``None`` when the cache is off or the file cannot be written (then exec the source without a
    file: it compiles in memory). ``key`` is everything else the compiled code depends on (the
    formula's `code_digest`, the driver)."""
    where = root()
    if where is None:
        return None
    digest = hashlib.sha256(f"{key}\0{source}".encode()).hexdigest()[:24]
    safe = re.sub(r"[^A-Za-z0-9_]", "_", name)[:40]
    path = where / GENERATED / f"{safe}_{digest}.py"
    data = source.encode()
    try:
        if not path.exists():
            _write_once(path, data)
        if path.read_bytes() == data:
            return str(path)
    except OSError as e:
        _warn_once("write", f"numbaccum kernel cache: cannot write {path} ({e}); compiling in memory")
        return None
    return None  # another content under this name (never expected): do not trust it


def namespace(path: str | None, placeholder: str) -> dict[str, Any]:
    """The globals to exec a generated module in: with a cache file ``path``, those of a module
    registered in ``sys.modules`` (numba re-imports a cached function's module by name to rebuild
    its environment), named after the file; else a plain dict (``__file__`` the placeholder)."""
    if path is None:
        return {"__file__": placeholder}
    name = "_numbaccum_" + Path(path).stem
    with _lock:
        mod = sys.modules.get(name)
        if mod is None:
            mod = sys.modules[name] = types.ModuleType(name)
            mod.__file__ = path
    return mod.__dict__


def _write_once(path: Path, data: bytes) -> None:
    """Writes ``path`` whole or not at all (temporary file, fsync, link into place); a file that
    another process put there first is kept as it is."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".py")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if it exists: the first writer's file stays
        except FileExistsError:
            pass
        except OSError:  # no hard links here: replace, atomic too
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def code_digest(fn: Any) -> str | None:
    """A hash of what compiling ``fn`` depends on: its bytecode and constants, the names it
    reads and, recursively, the functions, formulas and plain values (numbers, strings, arrays)
    those names and its closure cells hold. ``None`` when it holds something else (then it is
    not cached on disk)."""
    h = hashlib.sha256()
    try:
        _digest(fn, h, set())
    except _Unhashable:
        return None
    return h.hexdigest()


class _Unhashable(Exception):
    pass


def _digest(v: Any, h: Any, seen: set[int]) -> None:
    if isinstance(v, (bool, int, float, complex, str, bytes, type(None))):
        h.update(f"{type(v).__name__}:{v!r};".encode())
    elif isinstance(v, (tuple, list, frozenset)):  # a Formula too (a NamedTuple)
        items = sorted(v, key=repr) if isinstance(v, frozenset) else v
        h.update(f"{type(v).__name__}[{len(v)}](".encode())
        for x in items:
            _digest(x, h, seen)
        h.update(b")")
    elif isinstance(v, dict):
        h.update(f"dict[{len(v)}](".encode())
        for k in sorted(v, key=repr):
            _digest(k, h, seen)
            _digest(v[k], h, seen)
        h.update(b")")
    elif isinstance(v, np.ndarray):
        h.update(f"array{v.dtype.str}{v.shape}".encode() + np.ascontiguousarray(v).tobytes())
    elif isinstance(v, (np.generic, np.dtype)):
        h.update(f"{type(v).__name__}:{v!r};".encode())
    elif isinstance(v, types.ModuleType):
        h.update(f"module:{v.__name__};".encode())
    elif hasattr(v, "py_func") and isinstance(v.py_func, types.FunctionType):  # a numba dispatcher
        h.update(b"jit:")
        _digest(v.py_func, h, seen)
    elif type(v).__name__ == "_Intrinsic" and isinstance(getattr(v, "_defn", None), types.FunctionType):
        h.update(b"intrinsic:")  # numba's @intrinsic: its typing function holds its code generator
        _digest(v._defn, h, seen)
    elif isinstance(v, types.FunctionType):
        if id(v) in seen:
            h.update(f"seen:{v.__qualname__};".encode())
            return
        seen.add(id(v))
        h.update(f"function:{v.__module__}.{v.__qualname__}(".encode())
        _digest_code(v.__code__, v.__globals__, h, seen)
        _digest(v.__defaults__, h, seen)
        for cell in v.__closure__ or ():
            _digest(cell.cell_contents, h, seen)
        h.update(b")")
    elif isinstance(v, type):  # a class named in the code (an exception raised, a dtype)
        h.update(f"class:{v.__module__}.{v.__qualname__};".encode())
    else:
        raise _Unhashable(type(v).__name__)


def _digest_code(code: types.CodeType, glb: dict, h: Any, seen: set[int]) -> None:
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_argcount)).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _digest_code(c, glb, h, seen)
        else:
            _digest(c, h, seen)
    for name in code.co_names:
        if name in glb:
            h.update(f"global {name}=".encode())
            _digest(glb[name], h, seen)


# --- identities: what numba names a compiled function after --------------------------------------

_IDENTITY = "__numbaccum_identity__"  # set on a function `identify` has named


def identify(fn: Any, *tags: str) -> Any:
    """``fn`` (a plain function, before numba first compiles it) named after what it computes:
    its ``__qualname__`` gets the ``tags`` (readable: the reduction kind, the driver variant) and
    the first 16 hex digits of its `code_digest`. Returns ``fn``; a second call changes nothing.

    numba names a compiled function's symbol after its module, its qualified name and a counter
    that starts again in every process, and links a cached kernel's callees by those names: two
    closures of one factory, compiled in two processes, could carry one name for two different
    codes, and a third process that loaded both ran one in place of the other. With the digest
    in the name, one name means one code. Call it on every function numba compiles on its own
    (not ``inline="always"``) that is cached or called by a cached kernel, and on the functions
    it calls first (their names are part of its digest). A function without a digest gets a
    random name: nothing it computes can be named, so nothing may share its name."""
    if getattr(fn, _IDENTITY, None):
        return fn
    digest = code_digest(fn)
    token = digest[:16] if digest else "u" + secrets.token_hex(8)
    suffix = "_".join([re.sub(r"\W", "_", t) for t in tags] + [token])
    fn.__qualname__ = f"{fn.__qualname__}__{suffix}"
    fn.__name__ = f"{fn.__name__}__{suffix}"
    setattr(fn, _IDENTITY, token)
    return fn


def identified(*tags: str) -> Any:
    """`identify` as a decorator (below numba's): ``@njit(...)`` over ``@identified("sumsq")``."""
    return lambda fn: identify(fn, *tags)


def _unique_ids() -> None:
    """Starts numba's per-process counter of function ids (part of every symbol name) at a random
    place, again in a forked child: a callee numba compiles for a cached kernel that `identify`
    does not reach (one of numba's own helpers, a parallel loop's body) then gets a name no
    other process gives to other code (numba#10486)."""
    from numba.core.bytecode import FunctionIdentity

    counter = getattr(FunctionIdentity, "_unique_ids", None)
    if isinstance(counter, itertools.count):
        FunctionIdentity._unique_ids = itertools.count(next(counter) + secrets.randbits(60))


def _after_fork_in_child() -> None:
    """A forked child's numba counter (`_unique_ids`) and lock (its copy of one another thread
    held at the fork stays held)."""
    _unique_ids()  # its lock: `_locks`


_unique_ids()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --- numba's cache, in our directory, with locks ------------------------------------------------


class Locator(_CacheLocator):
    """Numba's cache files of a package source (``kernels/<its folder>``) or of a generated
    module (``kernels/generated``), under this process's cache `root`."""

    def __init__(self, py_func: Any, py_file: str, where: Path) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        path = Path(py_file).resolve()
        if path.parent == where / GENERATED:
            sub = GENERATED
        else:
            rel = path.parent.relative_to(PACKAGE).as_posix()
            sub = "numbaccum" if rel == "." else "numbaccum/" + rel
        self._cache_path = str(where / "kernels" / sub)

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> Any:
        st = os.stat(self._py_file)
        return _file_hash(self._py_file, st.st_mtime_ns, st.st_size)

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> Locator | None:
        where = root()
        if where is None or not os.path.isfile(py_file):
            return None
        path = Path(py_file).resolve()
        if path.parent != where / GENERATED and PACKAGE not in path.parents:
            return None
        self = cls(py_func, py_file, where)
        try:
            _private_dirs(where, Path(self._cache_path))
        except _Unsafe as e:  # made by someone else since the probe: never read it
            _warn_once("unsafe", f"numbaccum kernel cache: {e}; those kernels compile in memory")
            return None
        except OSError:
            return None
        return self


@functools.lru_cache(maxsize=256)
def _file_hash(path: str, mtime_ns: int, size: int) -> bytes:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


class LockedCache:
    """Mixin for a numba ``Cache``: loads under a shared lock, saves under an exclusive one (the
    index is read, extended and written back); a failed load compiles, a failed save warns once."""

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Any:
        if fcntl is None:
            yield
            return
        path = getattr(getattr(self, "_cache_file", None), "_index_path", None)
        if path is None:
            yield
            return
        with open(path + ".lock", "ab") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _index_key(self, sig: Any, codegen: Any) -> Any:
        """Numba's key hashes a closure's cells pickled, which differs from process to process
        for cells holding jitted functions; `code_digest` hashes what they compute instead."""
        digest = code_digest(self._py_func)  # type: ignore[attr-defined]
        if digest is None:
            return super()._index_key(sig, codegen)  # type: ignore[misc]
        return (sig, codegen.magic_tuple(), ("numbaccum", digest))

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        try:
            with self._locked(exclusive=False):
                return super().load_overload(sig, target_context)  # type: ignore[misc]
        except Exception:  # a damaged or foreign entry: compile instead
            return None

    def save_overload(self, sig: Any, data: Any) -> None:
        try:
            with self._locked(exclusive=True):
                self._drop_unreadable_index()
                super().save_overload(sig, data)  # type: ignore[misc]
        except Exception as e:  # the kernel still runs; only the next process recompiles
            _warn_once("save", f"numbaccum kernel cache: a kernel could not be saved ({e!r})")

    def _drop_unreadable_index(self) -> None:
        """Removes an index that cannot be read (a torn write, a full disk, a damaged file):
        saving reads the index and extends it, so a damaged one would fail every later save and
        make every later process compile. Its data files are overwritten as the new index fills."""
        cache_file = getattr(self, "_cache_file", None)
        if cache_file is None:
            return
        try:
            cache_file._load_index()
        except Exception:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cache_file._index_path)


class _CpuImpl(CompileResultCacheImpl):
    # Any: numba's list is inferred as list[type[object]], classes constructed with no argument
    _locator_classes: list[Any] = [Locator]


class _CpuCache(LockedCache, FunctionCache):
    _impl_class = _CpuImpl


def named(dispatcher: Any) -> Any:
    """``dispatcher`` (numba's, before its first compile) with its function named by `identify`
    unless it was already (``@identified`` below the jit decorator adds readable tags)."""
    py_func = getattr(dispatcher, "py_func", None)
    if isinstance(py_func, types.FunctionType) and not getattr(py_func, _IDENTITY, None):
        identify(py_func)
        dispatcher.__qualname__, dispatcher.__name__ = py_func.__qualname__, py_func.__name__
    return dispatcher


def cached(dispatcher: Any, cache_class: Any = _CpuCache) -> Any:
    """``dispatcher`` (a numba ``njit`` function, before its first compile) `named` after what it
    computes, with its compiled code kept in the cache directory; unchanged but for the name when
    the cache is off. A function whose code cannot be hashed (`code_digest` is ``None``) is never
    cached: numba's own key of it would not say what it computes."""
    named(dispatcher)
    if root() is None or code_digest(dispatcher.py_func) is None:
        return dispatcher
    # No locator (a file outside the package and the cache): it compiles in memory.
    with contextlib.suppress(Exception):
        dispatcher._cache = cache_class(dispatcher.py_func)
    return dispatcher
