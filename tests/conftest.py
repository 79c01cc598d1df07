"""Hypothesis draws new random trees on every run by hand (a bug hunt each time); under CI
(``NUMBACCUM_CI=1``, exported by .ci/run) the draws are derandomized, so whether a change lands
is decided by the code, not by the luck of the draw."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("NUMBACCUM_CI"):
    settings.load_profile("ci")
