"""Hypothesis draws new random trees on every run by hand (a bug hunt each time); under CI
(``NUMBACCUM_CI=1``, exported by .ci/run) the draws are derandomized, so whether a change lands
is decided by the code, not by the luck of the draw.

One kernel cache for the session: the tests start many processes (the CLI, the benchmarks, MPI
ranks, the README's examples), each of which would compile the same kernels again. Unless
``NUMBACCUM_CACHE_DIR`` is set (``.ci/run`` sets it; ``off`` turns the cache off), this process
and every process it starts share one directory in the temporary folder, kept between runs (its
kernels are keyed by the package's sources, so an edit never loads a stale one). The tests of the
cache itself give their processes directories of their own.
"""

import os
import tempfile

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("NUMBACCUM_CI"):
    settings.load_profile("ci")

if "NUMBACCUM_CACHE_DIR" not in os.environ:  # before numbaccum is imported (it reads it once)
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    os.environ["NUMBACCUM_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"numbaccum-tests-{user}")
