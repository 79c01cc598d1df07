"""The on-disk kernel cache (`numbaccum._cache`), in fresh processes: an empty cache fills, a
filled one is used (nothing compiles), two processes fill one cache at once, an unwritable or
turned-off cache still runs, and ``numbaccum info`` says where the cache is.

Each test gives its processes a cache directory of its own (never the session's, see conftest).
The child counts numba's ``numba:compile`` events: a kernel loaded from the cache raises none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

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
    assert res["compiled"] > 0 and "numbaccum" not in err
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
