"""The on-disk kernel cache (`numbaccum._cache`), in fresh processes: an empty cache fills, a
filled one is used (nothing compiles), two processes fill one cache at once, an unwritable or
turned-off cache still runs, and ``numbaccum info`` says where the cache is. No two kernels of
different code share a name (issue 22, item 1; test_cache_across_processes.py runs them across
processes), a damaged index is replaced, and a directory someone else owns or may write is never
used (item 5).

Each test gives its processes a cache directory of its own (never the session's, see conftest).
The child counts numba's ``numba:compile`` events: a kernel loaded from the cache raises none.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import numbaccum as nba
from numbaccum import _cache
from numbaccum.formulas import Formula

ROOT = Path(__file__).resolve().parent.parent

# An ema step (the fill and ema kernels) and a formula made at run time, through the CPU driver.
CHILD = r"""
import json, sys
import numpy as np
from numba.core import event

compiled = []


class Count(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__qualname__)

    def on_end(self, ev):
        pass


event.register("numba:compile", Count())
import numbaccum as nba
from numbaccum.contract import Factor
from numbaccum.cpu import driver
from numbaccum.formulas import Formula

g = {"w": np.arange(5, dtype=np.float32)}
tx = nba.ema(0.5, debias=False)
u, s = tx.update(g, tx.init(g))


def make(m):
    def made_at_run_time(x, k):
        return x * k + m

    return made_at_run_time


f = Formula(make(float(sys.argv[1])), (), ("x",), ("out",), ("k",))
x = np.arange(4, dtype=np.float64)
out = np.empty_like(x)
driver.map_(f, Factor(), (x, out), (2.0,))
print(json.dumps({"ema": u["w"].tolist(), "made": out.tolist(), "compiled": len(compiled)}))
"""

EMA = [0.0, 0.5, 1.0, 1.5, 2.0]  # (1 - 0.5) * g from a zero EMA


def _env(cache: str | None, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    env.pop(_cache.ENV, None)
    if cache is not None:
        env[_cache.ENV] = cache
    return env


def _start(cache: str | None, mult: float = 1.0, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(mult)],
        env=_env(cache, **extra),
        cwd=extra.get("HOME", str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["ema"] == EMA
    return res, err


def _run(cache: str | None, mult: float = 1.0, **extra: str) -> tuple[dict, str]:
    return _result(_start(cache, mult, **extra))


def _files(path: Path) -> set[Path]:
    return {p for p in path.rglob("*") if p.is_file()}


def test_an_empty_cache_fills_and_the_next_process_compiles_nothing(tmp_path):
    first, _ = _run(str(tmp_path))
    assert first["made"] == [1.0, 3.0, 5.0, 7.0] and first["compiled"] > 0
    filled = _files(tmp_path)
    assert any(p.suffix == ".nbc" for p in filled) and any(p.parent.name == "generated" for p in filled)
    second, _ = _run(str(tmp_path))
    assert second == first | {"compiled": 0}
    assert _files(tmp_path) == filled  # loaded, nothing rewritten or added
    # A formula of the same name but other code gets kernels of its own, never the cached ones.
    other, _ = _run(str(tmp_path), mult=10.0)
    assert other["made"] == [10.0, 12.0, 14.0, 16.0] and other["compiled"] > 0


def test_two_processes_fill_an_empty_cache_at_once(tmp_path):
    procs = [_start(str(tmp_path)) for _ in range(2)]
    for p in procs:
        assert _result(p)[0]["made"] == [1.0, 3.0, 5.0, 7.0]
    assert not [p for p in _files(tmp_path) if ".tmp" in p.name]  # no temporary file left
    third, _ = _run(str(tmp_path))  # neither writer lost the other's entries
    assert third["compiled"] == 0


def test_an_unwritable_cache_runs_in_memory_with_one_warning(tmp_path):
    if os.geteuid() == 0:  # root writes through modes: a directory below a regular file instead
        (tmp_path / "file").write_text("")
        cache = tmp_path / "file" / "cache"
    else:
        cache = tmp_path / "ro"
        cache.mkdir()
        cache.chmod(0o555)
    try:
        res, err = _run(str(cache))
    finally:
        if cache.is_dir():
            cache.chmod(0o755)
    assert res["made"] == [1.0, 3.0, 5.0, 7.0] and res["compiled"] > 0
    assert err.count("cannot be written") == 1, err
    assert not cache.is_dir() or not _files(cache)


def test_a_turned_off_cache_writes_nothing(tmp_path, monkeypatch):
    for value in ("", "0", "off", " OFF ", "no"):
        monkeypatch.setenv(_cache.ENV, value)
        assert _cache.directory() is None
    home = tmp_path / "home"
    home.mkdir()
    res, err = _run("", HOME=str(home), XDG_CACHE_HOME=str(home / "xdg"))
    # no warning about the cache (the progress lines of the compiles may be there)
    assert res["compiled"] > 0 and "numbaccum kernel cache" not in err and "Warning" not in err, err
    assert not _files(home)  # not the user cache directory either


def test_describe_says_where_the_cache_is_and_whether_it_is_on(tmp_path):
    """What ``numbaccum info`` prints on its ``kernel cache:`` line (test_readme_cli runs info)."""

    def describe(cache: str | None, **extra: str) -> str:
        script = "from numbaccum import _cache; print(_cache.describe())"
        return subprocess.run(
            [sys.executable, "-c", script],
            env=_env(cache, **extra),
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    assert describe(str(tmp_path / "c")).startswith(f"{tmp_path / 'c'} (on;")
    assert describe("off").startswith("off")
    xdg = describe(None, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert xdg.startswith(f"{tmp_path / 'xdg' / 'numbaccum'} (on;")


# --- the key of a generated kernel (in this process) ----------------------------------------------


def _formula(src: str, **glb: object) -> Formula:
    ns: dict = {}
    exec(src, dict(glb), ns)
    return Formula(ns["f"], (), ("x",), ("out",), ())


def test_the_key_of_a_formula_is_its_code_and_declaration_not_its_name_or_identity():
    a = _formula("def f(x):\n    return x * 2\n")
    assert _cache.code_digest(a) == _cache.code_digest(_formula("def f(x):\n    return x * 2\n"))
    assert _cache.code_digest(a) != _cache.code_digest(_formula("def f(x):\n    return x * 3\n"))
    assert _cache.code_digest(a) != _cache.code_digest(a._replace(outputs=("y",)))
    # What the code reads counts too: a global, a called function, a closure cell.
    read = "def f(x):\n    return x * K\n"
    assert _cache.code_digest(_formula(read, K=2.0)) != _cache.code_digest(_formula(read, K=3.0))
    calls = "def f(x):\n    return g(x)\n"
    g2, g3 = _formula("def f(x):\n    return x * 2\n").fn, _formula("def f(x):\n    return x * 3\n").fn
    assert _cache.code_digest(_formula(calls, g=g2)) != _cache.code_digest(_formula(calls, g=g3))

    def closing(k):
        def f(x):
            return x * k

        return Formula(f, (), ("x",), ("out",), ())

    assert _cache.code_digest(closing(2.0)) == _cache.code_digest(closing(2.0))
    assert _cache.code_digest(closing(2.0)) != _cache.code_digest(closing(np.float32(2.0)))
    # Something it cannot hash by content: no disk cache for that formula (None), no wrong hit.
    assert _cache.code_digest(_formula(read, K=object())) is None


def _module_formula(module: str, src: str, **glb: object) -> Formula:
    """A formula ``f`` declared in a module of its own (as beside a stage, outside formulas.py)."""
    mod = types.ModuleType(module)
    vars(mod).update(glb)
    exec(src, vars(mod))
    return Formula(mod.f, (), ("x",), ("out",), ())


def test_a_formula_declared_in_another_module_has_an_identity_of_its_own():
    """A formula declared outside `numbaccum.formulas` is keyed by its module and name as well as
    its code, and by the helpers it imports by name (what its compiled self calls)."""
    src = "from numbaccum.formulas import maximum\ndef f(x):\n    return maximum(x, x)\n"
    a, a2, b = _module_formula("user_a", src), _module_formula("user_a", src), _module_formula("user_b", src)
    assert _cache.code_digest(a) == _cache.code_digest(a2)
    assert _cache.code_digest(a) != _cache.code_digest(b)
    other = _module_formula("user_a", "def f(x):\n    return maximum(x, x)\n", maximum=lambda x, y: x)
    assert _cache.code_digest(other) not in (None, _cache.code_digest(a))


# --- identities: one name, one code (issue 22, item 1) ------------------------------------------


def _is_dispatcher(v: object) -> bool:
    return isinstance(getattr(v, "py_func", None), types.FunctionType) and hasattr(v, "targetoptions")


def _reachable_dispatchers() -> list:
    """Every numba dispatcher reachable from numbaccum's modules: module and class attributes,
    dict, tuple and list values (`numbaccum.cpu.reduce.KINDS`), and, from a function, its closure
    cells and the globals its code reads, recursively; with the CPU drivers of every formula."""
    import numbaccum
    from numbaccum import formulas
    from numbaccum.cpu import driver

    for m in pkgutil.walk_packages(numbaccum.__path__, "numbaccum."):
        if not m.name.endswith("__main__"):  # the command line runs on import
            importlib.import_module(m.name)
    for f in formulas.registered().values():  # declared in formulas.py or beside their stages
        driver.compiled(f)  # generated and jitted, not compiled
    found, seen = [], set()

    def names(code: types.CodeType):
        yield from code.co_names
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                yield from names(c)

    def ours(v: object) -> bool:
        mod = getattr(v, "__module__", None) or ""
        return mod.startswith(("numbaccum", "_numbaccum_"))

    def visit(v: object) -> None:
        if id(v) in seen:
            return
        seen.add(id(v))
        if _is_dispatcher(v):
            found.append(v)
            visit(v.py_func)
        elif isinstance(v, types.FunctionType):
            for cell in v.__closure__ or ():
                visit(cell.cell_contents)
            for name in names(v.__code__):
                if name in v.__globals__:
                    visit(v.__globals__[name])
        elif isinstance(v, dict):
            for x in list(v.values()):
                visit(x)
        elif isinstance(v, (tuple, list)):
            for x in v:
                visit(x)
        elif isinstance(v, types.ModuleType) and v.__name__.startswith("numbaccum"):
            visit(vars(v))
        elif isinstance(v, type) and ours(v):
            visit(dict(vars(v)))

    for name, mod in list(sys.modules.items()):
        if name == "numbaccum" or name.startswith(("numbaccum.", "_numbaccum_")):
            visit(mod)
    return found


def _on_disk(d: object) -> bool:
    """Whether numba keeps ``d``'s compiled code in a cache directory."""
    return type(getattr(d, "_cache", None)).__name__ not in ("NullCache", "NoneType")


def test_no_two_kernels_of_different_code_share_a_name():
    """numba names a function's symbol after its module and qualified name (and a per-process
    counter), and links a cached kernel's callees by name: every function compiled on its own
    (not inlined) must have a name that only its code carries."""
    by_name: dict[tuple, set] = {}
    dispatchers = _reachable_dispatchers()
    from numbaccum.cpu.reduce import KINDS

    reached = {id(d) for d in dispatchers}
    assert all(id(d) in reached for pair, _ in KINDS.values() for d in pair)
    for d in dispatchers:
        options = {k: v for k, v in d.targetoptions.items() if k != "inline"}
        if d.targetoptions.get("inline") in ("always", True):
            continue  # inlined where it is called: no symbol of its own
        f = d.py_func
        key = (type(d).__name__, f.__module__, f.__qualname__)
        if key[0] == "CUDADispatcher" and not options.get("device") and not _on_disk(d):
            continue  # a CUDA kernel no other kernel calls, compiled in memory: no shared symbol
        digest = _cache.code_digest(f)
        assert digest is not None, key
        by_name.setdefault(key, set()).add((digest, repr(sorted(options.items()))))
    shared = [f"{'.'.join(k[1:])}: {len(v)} codes" for k, v in by_name.items() if len(v) > 1]
    assert not shared, "\n".join(shared)
    assert len(by_name) > 30  # the walk reached the engine, the drivers and the tables


def test_a_name_says_what_the_code_computes():
    def make(k):
        def f(x):
            return x * k

        return f

    a, a2 = _cache.identify(make(2.0), "two"), _cache.identify(make(2.0), "two")
    b = _cache.identify(make(3.0))
    assert a.__qualname__ != b.__qualname__ and a.__qualname__ == a2.__qualname__
    assert "two" in a.__qualname__ and _cache.code_digest(make(2.0))[:16] in a.__qualname__
    assert _cache.identify(a, "again").__qualname__ == a2.__qualname__  # named once


def test_numba_numbers_functions_differently_in_each_process_and_forked_child():
    """Callees that no name of ours reaches (numba's own helpers, a parallel loop's body) are
    named with numba's function counter: it starts at a random place in each process, so two
    processes never give one symbol name to two codes (numba#10486)."""
    script = (
        "import os, numba, numbaccum\n"
        "f = numba.njit(lambda x: x + 1)\n"
        "f(1)\n"
        "print(next(iter(f.overloads.values())).fndesc.mangled_name)\n"
        "if hasattr(os, 'fork'):\n"
        "    r, w = os.pipe()\n"
        "    if os.fork() == 0:\n"
        "        g = numba.njit(lambda x: x + 1)\n"
        "        g(1)\n"
        "        os.write(w, next(iter(g.overloads.values())).fndesc.mangled_name.encode())\n"
        "        os._exit(0)\n"
        "    h = numba.njit(lambda x: x + 1)\n"
        "    h(1)\n"
        "    print(next(iter(h.overloads.values())).fndesc.mangled_name)\n"
        "    os.close(w)\n"
        "    print(os.read(r, 1000).decode())\n"
    )

    def names() -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", script], env=_env("off"), capture_output=True, text=True, check=True
        ).stdout
        return out.split()

    first, second = names(), names()
    assert first[0] != second[0]
    if len(first) == 3:  # parent and forked child, after the fork
        assert first[1] != first[2]


# --- a damaged index is replaced, not kept ------------------------------------------------------


def test_a_damaged_index_is_replaced_by_the_next_process(tmp_path):
    first, _ = _run(str(tmp_path))
    indexes = [p for p in _files(tmp_path) if p.suffix == ".nbi"]
    assert indexes
    for p in indexes:
        p.write_bytes(b"not a pickle")
    second, err = _run(str(tmp_path))  # nothing loads: it compiles and writes new indexes
    assert second["compiled"] > 0 and "could not be saved" not in err, err
    assert all(p.read_bytes() != b"not a pickle" for p in indexes)
    third, err = _run(str(tmp_path))
    assert third == first | {"compiled": 0} and "numbaccum" not in err, err


# --- a directory someone else may write is never read (issue 22, item 5) ------------------------


def _describe(cache: str) -> str:
    script = "from numbaccum import _cache; print(_cache.describe())"
    return subprocess.run(
        [sys.executable, "-c", script], env=_env(cache), capture_output=True, text=True, check=True
    ).stdout


def _assert_not_used(cache: Path, made: Path, why: str) -> None:
    """A child with cache ``cache`` runs in memory, warns once (naming ``made`` and ``why``),
    writes nothing under ``made``, and `describe` says why the cache is off."""
    before = _files(made)
    res, err = _run(str(cache))
    assert res["made"] == [1.0, 3.0, 5.0, 7.0] and res["compiled"] > 0
    assert err.count("numbaccum kernel cache") == 1 and why in err and str(made) in err, err
    assert _files(made) == before
    said = _describe(str(cache))
    assert "off" in said and why in said and str(made) in said, said


def test_a_cache_directory_others_can_write_is_not_used(tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    _assert_not_used(cache, cache, "can be written by other users")


@pytest.mark.parametrize("sub", ["namespace", "kernels"])
def test_a_premade_subdirectory_others_can_write_is_not_used(tmp_path, sub):
    cache = tmp_path / "mine"
    cache.mkdir(mode=0o700)
    made = cache / _cache.tag()
    if sub == "kernels":  # below a namespace of ours: made by someone else, later
        made.mkdir(mode=0o700)
        made = made / "kernels"
    made.mkdir()
    made.chmod(0o777)
    if sub == "namespace":
        _assert_not_used(cache, made, "can be written by other users")
        return
    res, err = _run(str(cache))  # the namespace is used; none of its kernels are saved
    assert res["made"] == [1.0, 3.0, 5.0, 7.0] and res["compiled"] > 0
    assert err.count("can be written by other users") == 1 and str(made) in err, err
    assert not _files(made)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_a_premade_namespace_of_another_user_is_not_used(tmp_path):
    cache = tmp_path / "mine"
    cache.mkdir(mode=0o700)
    made = cache / _cache.tag()
    made.mkdir(mode=0o755)
    os.chown(made, 12345, 12345)
    _assert_not_used(cache, made, "belongs to uid 12345")


# --- the cache directory is one absolute path, below directories no one else may change ---------
# (issue 42, item 6)

# After a chdir, a step whose norm loads package kernels (the reduction engine's) from the cache.
CHDIR_CHILD = r"""
import os, sys
import numpy as np
import numbaccum as nba

os.chdir(sys.argv[1])
g = {"w": np.arange(5, dtype=np.float32)}
tx = nba.chain(nba.clip_by_global_norm(1.0), nba.sgd(1.0))
u, _ = tx.update(g, tx.init(g))
print(u["w"].tolist())
"""


class _Planted:
    """Unpickled, makes directory ``mark``: the proof that a planted index was read."""

    def __init__(self, mark: Path) -> None:
        self.mark = str(mark)

    def __reduce__(self):
        return os.mkdir, (self.mark,)


def test_a_relative_cache_directory_is_the_same_directory_after_a_chdir(tmp_path):
    """A relative ``NUMBACCUM_CACHE_DIR`` names the directory of the working directory when the
    process starts; after an ``os.chdir`` (a Hydra run directory) the same relative path below
    the new working directory holds an index pickle at every place the cache's own indexes sit,
    which must never be read (it was: the directories were checked once, by their relative
    names)."""
    session = Path(os.environ[_cache.ENV])  # the session's cache (conftest): warm, and ours
    assert _cache.root() is not None, _cache.describe()  # the session's directory passes the checks
    g = {"w": np.arange(5, dtype=np.float32)}
    tx = nba.chain(nba.clip_by_global_norm(1.0), nba.sgd(1.0))
    expected = tx.update(g, tx.init(g))[0]["w"].tolist()  # its kernels are in the session's cache
    elsewhere, mark = tmp_path / "elsewhere", tmp_path / "the-planted-index-was-read"
    planted = []
    for index in (session / _cache.tag()).rglob("*.nbi"):
        p = elsewhere / session.name / index.relative_to(session)
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        p.write_bytes(pickle.dumps(_Planted(mark)))
        planted.append(p)
    assert any("clip" in p.name or "sumsq" in p.name for p in planted), planted
    before = {p: p.read_bytes() for p in _files(elsewhere)}
    proc = subprocess.run(
        [sys.executable, "-c", CHDIR_CHILD, str(elsewhere)],
        env=_env(session.name),
        cwd=session.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected
    assert not mark.exists(), "a planted index below the new working directory was unpickled"
    assert {p: p.read_bytes() for p in _files(elsewhere)} == before  # nothing written there either
    assert "numbaccum kernel cache" not in proc.stderr, proc.stderr


def test_the_cache_directory_is_resolved_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(_cache.ENV, "relative-cache")
    first = _cache.directory()
    assert first == tmp_path.resolve() / "relative-cache"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert _cache.directory() == first


@pytest.mark.parametrize(
    ("mode", "used"),
    [(0o777, False), (0o775, False), (0o757, False), (0o1777, True), (0o755, True)],
)
def test_a_cache_below_a_directory_others_can_write_is_not_used_unless_it_is_sticky(tmp_path, mode, used):
    """As ssh checks the directories above a key: one that group or others may write (and that
    is not sticky, as ``/tmp`` is) could have the cache directory replaced by someone else's;
    the cache is then off, with one warning, and nothing is made below it."""
    parent = tmp_path / "parent"
    parent.mkdir()
    parent.chmod(mode)
    cache = parent / "below" / "cache"  # made by the cache, if at all
    said = _describe(str(cache))
    if used:
        assert said.startswith(f"{cache} (on;"), said
        assert (parent / "below").stat().st_mode & 0o777 == 0o700  # the parents it makes are private
        return
    assert f"{parent}, above the cache directory, can be written by other users" in said, said
    assert not (parent / "below").exists()


def test_a_cache_below_a_directory_others_can_write_runs_in_memory_and_reads_nothing(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    cache = parent / "mine"
    cache.mkdir(mode=0o700)
    (cache / _cache.tag()).mkdir(mode=0o700)  # someone's namespace, which must not be read
    parent.chmod(0o777)
    _assert_not_used(cache, parent, "above the cache directory, can be written by other users")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_a_cache_below_a_directory_of_another_user_is_not_used(tmp_path):
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, 12345, 12345)
    said = _describe(str(parent / "cache"))
    assert f"{parent}, above the cache directory, belongs to uid 12345" in said, said
    assert not (parent / "cache").exists()


def test_the_cache_makes_its_directories_private(tmp_path):
    cache = tmp_path / "new" / "cache"
    _run(str(cache))
    dirs = [cache, *(p for p in cache.rglob("*") if p.is_dir())]
    assert len(dirs) > 3
    assert all(d.stat().st_mode & 0o077 == 0 for d in dirs), [oct(d.stat().st_mode) for d in dirs]


def test_the_namespace_names_the_cache_format_so_an_older_cache_is_never_read():
    """issue 22 item 1: kernels of format 1 (named by source location) could be confused; their
    directories (``numba<version>-py<ver>-<hash>``) are never the namespace of this version."""
    from numbaccum import _cache

    assert _cache.FORMAT >= 2
    assert _cache.tag().startswith(f"v{_cache.FORMAT}-numba")


# --- a fused chain's composite calls formulas declared outside the package ----------------------

USER_MODULE = """
from numbaccum import formulas as F
from numbaccum.declared import Elementwise


@F.formula(inputs=("x",), outputs=("out",))
def user_cache_scaler(x):
    return x * {k}


class Scaler(Elementwise):
    formula, name = user_cache_scaler, "user_cache_scaler"

    def scalars(self, count, ct):
        return ()
"""

USER_CHILD = r"""
import json
import numpy as np
import numbaccum as nba
from user_cache_module import Scaler

g = {"w": np.arange(4, dtype=np.float32)}
tx = nba.chain(Scaler().transformation(), nba.scale(2.0))  # one fused pass: a composite
u, _ = tx.update(g, tx.init(g))
print(json.dumps({"u": u["w"].tolist()}))
"""


def test_a_composite_of_a_formula_edited_between_processes_runs_the_new_code(tmp_path):
    """The package hash in the cache's namespace sees numbaccum's own formulas, not a user's: the
    composite's key covers the code of every formula it calls, so the second process, whose
    formula was edited (same module, same name), compiles it again instead of loading the first
    process's kernel, which inlined the old code."""
    cache, src = tmp_path / "cache", tmp_path / "src"
    src.mkdir()
    results = []
    for k in (3.0, 5.0):
        (src / "user_cache_module.py").write_text(USER_MODULE.format(k=k))
        proc = subprocess.run(
            [sys.executable, "-c", USER_CHILD],
            env={**_env(str(cache)), "PYTHONPATH": f"{src}{os.pathsep}{ROOT}"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert results[0]["u"] == [0.0, 6.0, 12.0, 18.0]
    assert results[1]["u"] == [0.0, 10.0, 20.0, 30.0]
