"""The test session's own settings (tests/conftest.py): what any run of the suite can rely on.

`test_this_session_is_reproducible_and_clean` holds in every session; the subprocess tests run
it in a child pytest with a hostile environment (a ``NUMBACCUM_FUSE=0`` left in the shell, a
shared cache directory) and with the explore profile.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import conftest
import pytest
from _testutil import require, thread_counts
from hypothesis import settings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_this_session_is_reproducible_and_clean(request):
    explore = os.environ.get("NUMBACCUM_EXPLORE", "") not in ("", "0")
    explore = explore or request.config.getoption("hypothesis_profile", None) == "explore"
    assert settings.default.derandomize is not explore, "the default profile must be derandomized"
    stray = sorted(
        n
        for n in os.environ
        if n.startswith("NUMBACCUM_") and n not in conftest.KEPT | {"NUMBACCUM_CACHE_DIR"}
    )
    assert not stray, f"NUMBACCUM_* variables reach the tests: {stray}"
    cache = os.environ["NUMBACCUM_CACHE_DIR"]
    assert cache == conftest.CACHE_DIR
    st = os.stat(cache)
    if hasattr(os, "getuid"):
        assert st.st_uid == os.getuid(), f"{cache} is not ours"
    assert not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH), f"{cache} is writable by others: {oct(st.st_mode)}"
    assert thread_counts() == (1, 2)


def _child(env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBACCUM_", "NUMBA_NUM_THREADS"))}
    env.update(env_extra)
    test = "tests/test_session.py::test_this_session_is_reproducible_and_clean"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_hostile_environment_does_not_reach_the_tests(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    r = _child({"NUMBACCUM_FUSE": "0", "NUMBACCUM_CACHE_DIR": str(shared), "NUMBA_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert not any(shared.iterdir()), "the session used the shared cache directory"


def test_the_explore_profile_draws_at_random():
    for env, args in (({"NUMBACCUM_EXPLORE": "1"}, ()), ({}, ("--hypothesis-profile", "explore"))):
        r = _child(env, *args)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert settings.get_profile("explore").derandomize is False
    assert settings.get_profile("repro").derandomize is True


def test_a_missing_test_dependency_fails_under_ci(monkeypatch):
    monkeypatch.setenv("NUMBACCUM_CI", "1")
    with pytest.raises(ImportError):
        require("numbaccum_no_such_module")
    monkeypatch.delenv("NUMBACCUM_CI")
    with pytest.raises(pytest.skip.Exception):
        require("numbaccum_no_such_module")


def test_a_skip_for_a_missing_module_is_recorded_for_the_extras_pass(tmp_path, monkeypatch):
    """.ci/run's second pass reruns, with the extras installed, exactly the tests that skipped for
    a missing module (``require``'s reason or importorskip's), and no other skip."""
    from types import SimpleNamespace

    log = tmp_path / "skipped"
    monkeypatch.setenv("NUMBACCUM_TEST_SKIPPED_LOG", str(log))
    try:
        require("numbaccum_no_such_module")
    except pytest.skip.Exception as e:
        ours = str(e)
    try:
        pytest.importorskip("numbaccum_no_such_module")
    except pytest.skip.Exception as e:
        theirs = str(e)
    for nodeid, reason in (("a::ours", ours), ("b::theirs", theirs), ("c::gpu", "no CUDA device")):
        report = SimpleNamespace(skipped=True, longrepr=("f.py", 1, f"Skipped: {reason}"), nodeid=nodeid)
        conftest._record_missing_module_skip(report)
    passed = SimpleNamespace(skipped=False, longrepr=None, nodeid="d::passed")
    conftest._record_missing_module_skip(passed)
    assert log.read_text().splitlines() == ["a::ours", "b::theirs"]
    assert "pip install numbaccum_no_such_module" in ours  # the reason says what to install
