"""numbaccum.distributed from the outside: imports, errors without hangs, the example, `info`.

The collective's own tests are in tests/mpi (run on two ranks by .ci/run). Tests here that start
``mpiexec`` do so in a session of their own and kill it whole on a timeout, so a hang fails the
test instead of blocking CI (or leaving ranks spinning behind it).
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import numbaccum as nba
from numbaccum import _config

ROOT = Path(__file__).resolve().parent.parent
HAVE_MPI = shutil.which("mpiexec", path=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
try:
    import mpi4py  # noqa: F401
except ImportError:
    HAVE_MPI = None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="mpi4py and mpiexec are not installed")


def run_mpi(n, args, timeout):
    """``mpiexec -n n python args``: (returncode, stdout, stderr, seconds); fails on a timeout."""
    cmd = [HAVE_MPI, "-n", str(n), sys.executable, *args]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank: MPICH ranks busy-poll
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{out}\n{err}")
    return proc.returncode, out, err, time.monotonic() - start


def test_importing_numbaccum_never_imports_mpi4py():
    code = (
        "import sys, numbaccum, numbaccum.distributed as d, numpy as np; tx = numbaccum.ema(0.9);"
        "p = np.zeros(3); tx.update(p, tx.init(p)); print('mpi4py' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_without_mpi4py_the_error_says_what_to_install():
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"
        "from numbaccum.distributed import allreduce_mean\n"
        "try:\n    allreduce_mean()\nexcept ImportError as e:\n    print(e)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 'pip install "numbaccum[mpi]"' in r.stdout


@needs_mpi
def test_cuda_aware_follows_the_setting_else_asks_the_library(monkeypatch):
    from numbaccum import distributed as dist

    monkeypatch.setattr(_config, "MPI_CUDA_AWARE", "1")
    assert dist.cuda_aware() is True
    monkeypatch.setattr(_config, "MPI_CUDA_AWARE", "0")
    assert dist.cuda_aware() is False
    assert "staged through host memory" in dist.describe()
    monkeypatch.setattr(_config, "MPI_CUDA_AWARE", "auto")  # the library's MPIX_Query_cuda_support
    for says, want in ((1, True), (0, False), (None, False)):
        monkeypatch.setattr(dist.ctypes, "CDLL", lambda path, says=says: _FakeMpiLibrary(says))
        assert dist.cuda_aware() is want, says
    monkeypatch.setattr(_config, "MPI_CUDA_AWARE", "1")
    assert "passed to MPI directly" in dist.describe()


class _FakeMpiLibrary:
    """An MPI library whose ``MPIX_Query_cuda_support`` returns ``says`` (None: no such symbol)."""

    def __init__(self, says):
        self.says = says

    def __getattr__(self, name):
        if name != "MPIX_Query_cuda_support" or self.says is None:
            raise AttributeError(name)

        def query():
            return self.says

        return query


@needs_mpi
def test_info_says_how_mpi_moves_cuda_buffers():
    r = subprocess.run(
        [sys.executable, "-m", "numbaccum", "info"], capture_output=True, text=True, check=True
    )
    line = next(x for x in r.stdout.splitlines() if x.startswith("mpi: "))
    assert "mpi4py" in line and ("staged through host memory" in line or "CUDA-aware" in line)
    # the session's cache directory holds no saved calibration: the default, and it says so
    assert line.endswith(f"; buckets of {_config.MPI_BUCKET_BYTES_DEFAULT >> 20} MiB (default)")
    env = {**os.environ, "NUMBACCUM_MPI_BUCKET_BYTES": "65536"}
    r = subprocess.run([sys.executable, "-m", "numbaccum", "info"], capture_output=True, text=True, env=env)
    assert "buckets of 64 KiB (environment: NUMBACCUM_MPI_BUCKET_BYTES)" in r.stdout


@needs_mpi
def test_one_rank_installs_no_abort_hook():
    from numbaccum import distributed as dist

    before = sys.excepthook
    dist.allreduce_mean()
    assert sys.excepthook is before


RAISES = """
import sys
import time

import numpy as np
from mpi4py import MPI
import numbaccum as nba
from numbaccum.distributed import allreduce_mean

rank = MPI.COMM_WORLD.Get_rank()
params = {"w": np.zeros(4, np.float32)}
tx = nba.chain(allreduce_mean(), nba.sgd(0.1))
state = tx.init(params)
_, state = tx.update({"w": np.ones(4, np.float32)}, state)  # one good step
grads = {"w": np.ones(5 if rank == 1 else 4, np.float32)}  # rank 1 has a bug
if rank == 1:
    print(f"raising at {time.time()!r}", file=sys.stderr, flush=True)
_, state = tx.update(grads, state)  # rank 1 raises before the collective; rank 0 waits in it
print(f"rank {rank} went on", flush=True)
"""


@needs_mpi
def test_a_rank_raising_before_the_collective_ends_every_rank(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    rc, out, err, _ = run_mpi(2, [str(script)], timeout=300)  # past it: rank 0 hung (run_mpi fails)
    ended = time.time()
    assert rc != 0
    assert "updates['w']: shape (5,) does not match (4,)" in err
    assert "went on" not in out
    raised = float(err.split("raising at ")[1].split()[0])
    assert ended - raised < 30, f"the ranks ended {ended - raised:.0f} s after the error, not at once"


@needs_mpi
def test_data_parallel_example_runs_with_the_commands_in_its_docstring():
    doc = (ROOT / "examples" / "data_parallel.py").read_text()
    assert 'pip install ".[mpi]"' in doc and "mpiexec -n 2 python examples/data_parallel.py" in doc
    rc, out, err, _ = run_mpi(2, [str(ROOT / "examples" / "data_parallel.py"), "--steps", "200"], timeout=300)
    assert rc == 0, err
    assert "on 2 rank(s)" in out and "same parameters on every rank: True" in out
    final = float(out.split("final training loss: ")[1].split()[0])
    assert final < 0.6


@needs_mpi
def test_data_parallel_example_learns_on_one_rank():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import data_parallel
    finally:
        sys.path.remove(str(ROOT / "examples"))
    untrained = data_parallel.main(steps=0, log_every=0)
    trained = data_parallel.main(steps=400, log_every=0)
    assert trained < 0.6 * untrained


@needs_mpi
def test_allreduce_sum_and_mean_on_one_rank_check_their_buffers(monkeypatch):
    from mpi4py import MPI

    from numbaccum import distributed as dist

    flat = nba.FlatTree.from_tree({"a": np.arange(10, dtype=np.float32), "b": np.ones((2, 3))})
    monkeypatch.setattr(_config, "MPI_MAX_COUNT", 3)  # 4 and 2 messages, the last ones short
    out = dist.allreduce_sum_(flat, flat.zeros_like(), MPI.COMM_SELF)
    np.testing.assert_array_equal(out["a"], flat["a"])
    np.testing.assert_array_equal(out["b"], flat["b"])
    with pytest.raises(ValueError, match="layout, dtypes and device"):
        dist.allreduce_mean_(flat, flat.zeros_like(np.float64), MPI.COMM_SELF)
    with pytest.raises(TypeError, match="FlatTrees"):
        dist.allreduce_mean_(flat.tree, None, MPI.COMM_SELF)


def _distributed_examples():
    from numbaccum import distributed as dist

    return {n: getattr(dist, n) for n in dist.__all__ if ">>>" in (getattr(dist, n).__doc__ or "")}


def test_the_bucket_names_have_examples_and_full_docstrings():
    import inspect

    examples = _distributed_examples()
    for name in ("allreduce_sum_", "allreduce_mean_", "allreduce_mean", "calibrate", "Calibration"):
        assert name in examples, name
        doc = inspect.getdoc(examples[name])
        sections = ("Attributes:",) if name == "Calibration" else ("Args:", "Returns:", "Raises:")
        assert all(s in doc for s in sections), (name, sections)
        if name != "Calibration":
            params = inspect.signature(examples[name]).parameters
            assert all(f"    {p}:" in doc for p in params), name


@needs_mpi
@pytest.mark.parametrize("name", sorted(_distributed_examples()))
def test_distributed_docstring_example_runs(name, monkeypatch):
    import doctest

    from numbaccum import distributed as dist

    monkeypatch.setattr(dist, "_calibrated", [])  # an example's calibrate() stays in the example
    tests = doctest.DocTestFinder(recurse=False).find(getattr(dist, name), name, globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result}"
