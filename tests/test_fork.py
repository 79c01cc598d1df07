"""Forked processes (issue 42, item 7): ``multiprocessing``'s default start method on Linux up
to Python 3.13 is ``fork``, and numba's threading layers differ after one. Under GNU OpenMP
(``omp``, numba's default where TBB is absent) numba terminated every child that entered a
parallel region (SIGTERM), so a ``fork`` Pool whose workers stepped a big tree hung forever;
under ``workqueue`` a child forked while another thread was inside a guarded launch waited for
the inherited lock forever. A forked child now continues its parent's state with the parent's
bits, in every family of kernels (elementwise, reductions, Adafactor's and SM3's passes, inner
products, per-example sums): on one thread under GNU OpenMP (one warning that names ``spawn``),
in parallel under workqueue (and TBB, which numba restarts in a child).

Each layer runs tests/_fork_child.py in a fresh process, whose every wait has a deadline: a
regression is a failed assertion ("timeout"), never a hung test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 30  # seconds a child may take (under a second: it inherits its kernels compiled)

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")


def _omp_available() -> bool:
    try:
        from numba.np.ufunc import omppool  # noqa: F401
    except ImportError:
        return False
    return True


def _run(layer: str, tmp_path: Path, families: tuple[str, ...]) -> dict:
    """The report of tests/_fork_child.py under ``layer``, for its ``families`` of kernels (all
    when empty). It runs in a session of its own and writes to files, not pipes: a hung child it
    leaves behind can neither hold the test's pipes open nor outlive the test (the session is
    killed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMBA_THREADING_LAYER=layer)
    out, err = tmp_path / "report.json", tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "_fork_child.py"), str(DEADLINE), str(out), *families],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=600)  # its own kernels may compile (a cold cache)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 0, err.read_text()
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "layer",
    [
        pytest.param("omp", marks=pytest.mark.skipif(not _omp_available(), reason="numba has no omp here")),
        "workqueue",
    ],
)
def test_a_forked_child_continues_its_parents_state_with_the_parents_bits(layer, tmp_path):
    # Every family under GNU OpenMP, where each takes the serial drivers in a child; one where
    # the children run in parallel, as in the parent.
    r = _run(layer, tmp_path, () if layer == "omp" else ("adam",))
    assert r["layer"] == layer
    bits = r["parallel"]
    assert r["serial"] == bits  # the serial drivers the child may take give the parallel bits

    def check(child: dict, expected: dict) -> None:
        assert child.get("status") == 0, child  # not killed (SIGTERM: -15), not hung ("timeout")
        result = child["result"]
        assert result["bits"] == expected
        if layer == "omp":  # GNU OpenMP's threads are not in the child: one thread, said once
            assert result["parallel"] is False
            [(message, where)] = result["warnings"]
            assert "get_context('spawn')" in message and where == "_fork_child.py"  # the user's line
        else:  # workqueue starts its threads again in the child
            assert result["parallel"] is True and result["warnings"] == []

    check(r["child"], bits[0])
    check(r["child"]["result"]["grandchild"], bits[0])
    check(r["locks"], bits[0])  # forked while another thread held the launch and compile locks
    assert r["pool"] != "timeout", "a fork Pool's map hung"
    for worker, expected in zip(r["pool"], bits):
        check({"status": 0, "result": worker}, expected)
