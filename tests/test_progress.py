"""Progress on stderr while numba compiles numbaccum's kernels (numbaccum._progress, `warmup`).

No test here is timed: the clock the compiles are measured with is the test's own (each reading
a fixed step later than the last), so "a compile of two seconds" is one whatever the machine.
The kernels are real numba compiles of tiny functions made as numbaccum makes its generated
ones (exec'd source named ``<numbaccum ...>``), new in every test, so each compiles once.
"""

import itertools
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import numpy as np
import pytest

import numbaccum as nba
from numbaccum import _progress
from numbaccum.protocol import GradientTransformation

ROOT = Path(__file__).resolve().parent.parent


def _kernel(name: str = "plus_one", calls: str | None = None):
    """A new numba function of numbaccum's (as its generated modules are named); with ``calls``,
    one that calls the jitted ``calls`` function (its callee compiles inside it)."""
    ns: dict = {}
    body = f"{calls}(x) + 1" if calls else "x + 1"
    exec(compile(f"def {name}(x):\n    return {body}\n", "<numbaccum.test probe>", "exec"), ns)
    if calls:
        ns[calls] = _kernel(calls)
    return numba.njit(ns[name])


@pytest.fixture
def fresh(monkeypatch):
    """A process that has compiled nothing yet, whose compiles each take ``step`` seconds by the
    clock: ``fresh(step)``."""
    monkeypatch.setattr(_progress, "_tally", {"kernels": 0, "seconds": 0.0, "said": False})
    monkeypatch.delenv(_progress.ENV, raising=False)

    def clock_step(step: float) -> None:
        ticks = itertools.count(0.0, step)
        monkeypatch.setattr(_progress, "clock", lambda: next(ticks))

    return clock_step


def test_a_slow_compile_says_what_it_compiles_and_how_far_along(fresh, capsys):
    fresh(2.0)  # every compile takes 2 s: over the 1 s threshold at the first
    _kernel()(np.ones(3, np.float32))
    _kernel("outer", calls="inner")(np.ones(3, np.float64))  # its callee inside: one kernel
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("numbaccum: compiling kernels with numba (once: ")
    assert "NUMBACCUM_PROGRESS=0 silences this" in err[0]
    assert err[1:] == [
        "numbaccum: compiled numbaccum.test:probe.plus_one [float32] in 2.0 s; 1 kernels, 2.0 s so far",
        "numbaccum: compiled numbaccum.test:probe.outer [float64] in 2.0 s; 2 kernels, 4.0 s so far",
    ]


def test_the_header_says_where_the_kernels_are_kept(fresh, capsys):
    fresh(2.0)
    _kernel()(np.ones(3))
    header = capsys.readouterr().err.splitlines()[0]
    where = nba._cache.root()  # the session's cache (conftest), or None when it cannot be used
    assert (f"in {where.parent}" if where else "the kernel cache is off") in header


def test_compiles_under_a_second_together_say_nothing(fresh, capsys):
    fresh(0.3)
    for _ in range(3):  # 0.9 s in all
        _kernel()(np.ones(3))
    assert capsys.readouterr().err == ""
    assert _progress._tally["kernels"] == 3
    _kernel()(np.ones(3))  # 1.2 s: said from now on
    assert "4 kernels, 1.2 s so far" in capsys.readouterr().err


def test_a_users_own_numba_functions_are_none_of_its_business(fresh, capsys):
    fresh(5.0)
    numba.njit(lambda x: x + 1)(np.ones(3))  # defined in this test module, not numbaccum's
    assert capsys.readouterr().err == "" and _progress._tally["kernels"] == 0


def test_the_environment_and_a_task_silence_it(fresh, capsys, monkeypatch):
    fresh(2.0)
    monkeypatch.setenv(_progress.ENV, "0")
    _kernel()(np.ones(3))
    assert capsys.readouterr().err == ""
    with _progress.task("warmup", "a job", 1, True) as advance:  # True: said even so
        advance()
        _kernel()(np.ones(3))
    assert "[warmup 1/1] compiled" in capsys.readouterr().err
    monkeypatch.delenv(_progress.ENV)
    with _progress.task("warmup", "a job", 1, False) as advance:
        advance()
        _kernel()(np.ones(3))
    assert capsys.readouterr().err == ""


def test_quiet_says_nothing_of_the_compiles_inside(fresh, capsys):
    """What `numbaccum bench` runs under while its bar draws on a terminal."""
    fresh(2.0)
    with _progress.quiet():
        _kernel()(np.ones(3))
    assert capsys.readouterr().err == ""
    _kernel()(np.ones(3))
    assert "2 kernels, 4.0 s so far" in capsys.readouterr().err  # counted all the same


def _compiling_transformation() -> GradientTransformation:
    """A foreign transformation whose update compiles a kernel of numbaccum's at its first call."""
    kernel = _kernel()

    def update(updates, state, params=None):
        kernel(np.ones(2, np.float32))
        return updates, state

    return GradientTransformation(lambda params: (), update)


def test_warmup_names_its_step_and_says_when_it_is_done(fresh, capsys):
    fresh(2.0)
    params = {"w": np.zeros(3, np.float32), "b": np.zeros(2, np.float64)}
    assert nba.warmup(_compiling_transformation(), params) == ["cpu"]
    err = capsys.readouterr().err.splitlines()
    # two gradient sizes x (2 x the longest cycle, 1) steps; the kernel compiles in the first
    # (so may numbaccum's own, where the session's kernel cache lacks them)
    assert re.fullmatch(r"numbaccum: warmup of GradientTransformation on 2 leaves \(\w+, \w+; cpu\): 4 steps", err[1])
    assert "numbaccum: [warmup 1/4] compiled numbaccum.test:probe.plus_one [float32] in 2.0 s" in "\n".join(err)
    compiled = [line for line in err if line.startswith("numbaccum: [warmup ")]
    assert err[-1] == f"numbaccum: warmup done: {len(compiled)} kernels compiled in {2.0 * len(compiled):.1f} s"


def test_warmup_progress_false_says_nothing(fresh, capsys):
    fresh(2.0)
    nba.warmup(_compiling_transformation(), {"w": np.zeros(3, np.float32)}, progress=False)
    assert capsys.readouterr().err == ""


# A child process that compiles one kernel of numbaccum's into the kernel cache (a generated
# module, as the drivers write theirs), with every compile said (threshold 0).
_CACHED_KERNEL = textwrap.dedent(
    """
    import numpy as np
    from numba import njit
    from numbaccum import _cache, _progress

    _progress.THRESHOLD = 0.0
    source = "def plus_one(x):\\n    return x + 1\\n"
    path = _cache.source_file(source, "progress_probe", "test")
    ns = _cache.namespace(path, "<numbaccum.test probe>")
    exec(compile(source, ns["__file__"], "exec"), ns)
    print(_cache.cached(njit(ns["plus_one"]))(np.ones(3)).sum())
    """
)


def test_a_warm_kernel_cache_says_nothing(tmp_path):
    """The first process compiles the kernel and says so; the second loads it from the kernel
    cache, compiles nothing, and says nothing."""
    env = dict(os.environ, NUMBACCUM_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    runs = [
        subprocess.run(
            [sys.executable, "-c", _CACHED_KERNEL], env=env, capture_output=True, text=True, timeout=300
        )
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0 and r.stdout.strip() == "6.0", r.stderr
    assert "later processes load them from the kernel cache in" in runs[0].stderr
    assert "compiled progress_probe.plus_one [float64]" in runs[0].stderr
    assert runs[1].stderr == ""
