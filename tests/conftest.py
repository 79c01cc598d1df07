"""The test session's settings: reproducible draws, a clean environment, a kernel cache of its own.

Hypothesis: the default profile (``repro``) is derandomized, so the same code gives the same
verdict on every machine and every run (the README's test command must not fail for a newcomer
by the luck of the draw). ``NUMBACCUM_EXPLORE=1`` or ``--hypothesis-profile explore`` draws new
random examples on every run instead (a bug hunt); ``NUMBACCUM_HYPOTHESIS_EXAMPLES`` raises the
example count of the reference tests. ``ci`` is ``repro`` by its old name (.ci/run).

Environment: every ``NUMBACCUM_*`` variable is cleared for the session (a ``NUMBACCUM_FUSE=0``
left in a shell must not change what the suite tests), except those that configure the test run
itself (`KEPT`). Tests that need a knob set it themselves (monkeypatch).

Threads: ``NUMBA_NUM_THREADS`` is raised to 2 where it is lower, so that the thread-count tests
compare 1 and 2 threads on every machine (`_testutil.THREAD_COUNTS`).

Optional dependencies: a test that needs one the ``test`` extra does not bring (optax, JAX,
dp-accounting, mpi4py) skips without it, naming the extra (``_testutil.require``), except under
``NUMBACCUM_CI``, where it fails. ``NUMBACCUM_TEST_SKIPPED_LOG`` names a file to which the session
appends the node id of every test (or module) skipped for a missing module: ``.ci/run`` runs the
README's command in a virtualenv with the ``test`` extra only, then those tests again with the
extras installed and ``NUMBACCUM_CI=1``.

Selection: pyproject's addopts deselect the tests marked ``exhaustive`` (the sweeps: every
registry Case in a second dtype or path, ``registry.sweep``), so that the README's command runs in
about ten minutes; ``-m exhaustive`` runs them (.ci/run's step after it), and any ``-m`` given
replaces addopts' (``-m cuda``: every cuda test).

Kernel cache: the session gets a fresh private directory (mode 0700) in the temporary folder,
removed at the end; the processes the tests start inherit it. ``.ci/run`` passes one directory
for all its passes through ``NUMBACCUM_CACHE_DIR`` with ``NUMBACCUM_CI=1``; a developer who wants
warm kernels between runs names a private directory in ``NUMBACCUM_TEST_CACHE_DIR``.
"""

import os
import re
import shutil
import tempfile

import pytest
from hypothesis import settings

# The variables that configure the test run (the CUDA simulator pass sets the thread knobs; they
# are read when numbaccum is imported, after this file).
KEPT = {
    "NUMBACCUM_CI",
    "NUMBACCUM_EXPLORE",
    "NUMBACCUM_HYPOTHESIS_EXAMPLES",
    "NUMBACCUM_CUDA_EXAMPLES",
    "NUMBACCUM_CUDA_THREADS",
    "NUMBACCUM_CUDA_MAX_BLOCKS",
    "NUMBACCUM_TEST_CACHE_DIR",
    "NUMBACCUM_TEST_SKIPPED_LOG",
}

settings.register_profile("repro", derandomize=True, print_blob=True)
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("explore" if os.environ.get("NUMBACCUM_EXPLORE", "") not in ("", "0") else "repro")


def _session_cache_dir() -> tuple[str, bool]:
    """(the kernel cache directory of this session, whether the session made it)."""
    if os.environ.get("NUMBACCUM_CI") and os.environ.get("NUMBACCUM_CACHE_DIR"):
        return os.environ["NUMBACCUM_CACHE_DIR"], False
    if os.environ.get("NUMBACCUM_TEST_CACHE_DIR"):
        return os.environ["NUMBACCUM_TEST_CACHE_DIR"], False
    return tempfile.mkdtemp(prefix="numbaccum-tests-"), True  # mkdtemp: mode 0700, ours


def _clean_environment() -> None:
    cache = os.environ.get("NUMBACCUM_CACHE_DIR")
    for name in [n for n in os.environ if n.startswith("NUMBACCUM_") and n not in KEPT]:
        del os.environ[name]
    if cache is not None:
        os.environ["NUMBACCUM_CACHE_DIR"] = cache  # _session_cache_dir decides whether it is kept


_clean_environment()
# The thread-count tests compare 1 and 2 threads in this process: numba allows at most
# NUMBA_NUM_THREADS, read when numba is imported (after this file), so make it at least 2.
if int(os.environ.get("NUMBA_NUM_THREADS") or os.cpu_count() or 1) < 2:
    os.environ["NUMBA_NUM_THREADS"] = "2"
CACHE_DIR, _MADE = _session_cache_dir()
os.environ["NUMBACCUM_CACHE_DIR"] = CACHE_DIR  # before numbaccum is imported (it reads it once)


def pytest_sessionfinish(session, exitstatus):
    if _MADE:
        shutil.rmtree(CACHE_DIR, ignore_errors=True)


# A skip for a missing module: pytest.importorskip's own reason, or `_testutil.require`'s.
_MISSING_MODULE = re.compile(r"could not import|optional dependency")


def _record_missing_module_skip(report) -> None:
    log = os.environ.get("NUMBACCUM_TEST_SKIPPED_LOG")
    if not (log and report.skipped) or not isinstance(report.longrepr, tuple):
        return
    if _MISSING_MODULE.search(str(report.longrepr[-1])):
        with open(log, "a") as f:  # one short line per write: O_APPEND keeps the workers' apart
            f.write(report.nodeid + "\n")


def pytest_runtest_logreport(report):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller sees every worker's reports
        _record_missing_module_skip(report)


def pytest_collectreport(report):  # a module that skips as a whole (importorskip at its top)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _record_missing_module_skip(report)


def _cuda_usable() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return True
    try:
        from numba import cuda

        return cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where there is neither a GPU nor the simulator (the marker is
    registered in pyproject.toml; .ci/run's simulator pass selects them with ``-m cuda``)."""
    gated = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not gated or _cuda_usable():
        return
    skip = pytest.mark.skip(reason="no CUDA device and not in the simulator (NUMBA_ENABLE_CUDASIM=1)")
    for item in gated:
        item.add_marker(skip)
