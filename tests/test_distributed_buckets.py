"""numbaccum.distributed's buckets without MPI: how a buffer is cut, which size is in use, and
how a saved calibration is read (a bad file is ignored with a warning, never an error).

The collective itself, `calibrate`, and the bits of bucketed sums are tested on every rank in
tests/mpi. Nothing here imports mpi4py: the MPI library's name is set by hand where a saved
calibration is compared with it.
"""

import json
import re
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbaccum import _config
from numbaccum import distributed as dist

LIBRARY = "Some MPI Version: 1.0"


@given(
    n=st.integers(0, 5000),
    itemsize=st.sampled_from([2, 4, 8, 16]),
    bucket_bytes=st.integers(1, 300),
    max_count=st.integers(1, 50),
)
def test_runs_cover_the_buffer_in_whole_elements_of_at_most_a_bucket(n, itemsize, bucket_bytes, max_count):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_config, "MPI_MAX_COUNT", max_count)
        runs = dist._runs(n, itemsize, bucket_bytes)
    # whole elements, rounded down; a bucket smaller than one element still sends one
    most = min(max(1, bucket_bytes // itemsize), max_count)
    assert [lo for lo, _ in runs] == [0, *(hi for _, hi in runs)][: len(runs)]  # contiguous, in order
    assert (runs[-1][1] if runs else 0) == n
    assert all(0 < hi - lo <= most for lo, hi in runs)
    assert all(hi - lo == most for lo, hi in runs[:-1])  # only the last one is short


def test_odd_bucket_sizes_round_down_to_whole_elements():
    assert dist._runs(5, 4, 13) == [(0, 3), (3, 5)]  # 13 bytes: three float32s
    assert dist._runs(3, 8, 3) == [(0, 1), (1, 2), (2, 3)]  # less than one float64: one
    assert dist._runs(0, 4, 1 << 20) == []


@pytest.fixture
def clean(monkeypatch, tmp_path):
    """No bucket size from the environment or a calibration; the cache directory (where a
    calibration is saved) is ``tmp_path``; the MPI library is `LIBRARY`."""
    monkeypatch.setattr(_config, "MPI_BUCKET_BYTES", None)
    monkeypatch.setattr(dist, "_calibrated", [])
    monkeypatch.setattr(dist, "_saved", {})
    monkeypatch.setattr(dist, "_library", lambda: LIBRARY)
    monkeypatch.setenv("NUMBACCUM_CACHE_DIR", str(tmp_path))
    return tmp_path / dist.CALIBRATION_FILE


def saved(path, **record):
    path.write_text(json.dumps({"bucket_bytes": 1 << 20, "library": LIBRARY, "ranks": 2, **record}))


def test_the_size_in_use_is_the_argument_then_the_environment_then_a_calibration(clean, monkeypatch):
    default = _config.MPI_BUCKET_BYTES_DEFAULT
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no file: the default, silently
        assert dist._bucket_in_use() == (default, "default")
    saved(clean, bucket_bytes=3 << 20, date="2026-11-27T10:00:00")
    monkeypatch.setattr(dist, "_saved", {})  # a new process: the file is read on first use
    assert dist._bucket_in_use() == (3 << 20, f"calibrated: {clean} (2 ranks, 2026-11-27T10:00:00)")
    monkeypatch.setattr(dist, "_calibrated", [dist._Bucket(5 << 20, "calibrate() in this process")])
    assert dist._bucket_in_use().nbytes == 5 << 20
    monkeypatch.setattr(_config, "MPI_BUCKET_BYTES", 7 << 20)
    assert dist._bucket_in_use() == (7 << 20, "environment: NUMBACCUM_MPI_BUCKET_BYTES")
    assert dist._bucket_in_use(9) == (9, "argument")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "cannot be read"),
        (b"\xff\xfe\x00", "cannot be read"),  # not UTF-8
        (b"[4194304]", "has no positive integer bucket_bytes"),
        (b'{"bucket_bytes": 0, "library": "Some MPI Version: 1.0"}', "has no positive integer"),
        (b'{"bucket_bytes": "4194304", "library": "Some MPI Version: 1.0"}', "has no positive integer"),
        (b'{"bucket_bytes": true, "library": "Some MPI Version: 1.0"}', "has no positive integer"),
        (b'{"bucket_bytes": 4096, "library": "Other MPI 2.0"}', "was measured with 'Other MPI 2.0'"),
    ],
)
def test_a_bad_saved_calibration_is_ignored_with_a_warning(clean, content, why):
    clean.write_bytes(content)
    with pytest.warns(RuntimeWarning, match=f"ignoring {re.escape(str(clean))}, which {why}"):
        bucket = dist._bucket_in_use()
    assert bucket == (_config.MPI_BUCKET_BYTES_DEFAULT, "default")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read once per process: one warning, not one per call
        assert dist._bucket_in_use().source == "default"


def test_a_directory_in_place_of_the_file_is_ignored_too(clean):
    clean.mkdir()
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        assert dist._bucket_in_use().source == "default"


def test_no_cache_directory_means_no_saved_calibration(clean, monkeypatch):
    monkeypatch.setenv("NUMBACCUM_CACHE_DIR", "off")
    assert dist._calibration_path() is None
    assert dist._bucket_in_use().source == "default"
    with pytest.raises(ValueError, match="save=<a path>"):
        dist._save_path(True)


@pytest.mark.parametrize(
    ("bad", "error"),
    [(0, ValueError), (-1, ValueError), (1.5, TypeError), ("4MB", TypeError), (True, TypeError)],
)
def test_a_bad_bucket_size_names_the_argument(bad, error):
    with pytest.raises(error, match="bucket_bytes must be"):
        dist._bucket_in_use(bad)


@pytest.mark.parametrize(
    ("raw", "value", "warns"),
    [
        ("8388608", 8388608, False),
        (" 12 ", 12, False),
        ("", None, False),
        ("0", None, True),
        ("4MB", None, True),
    ],
)
def test_the_environment_variable_is_a_positive_int_or_ignored(monkeypatch, raw, value, warns):
    monkeypatch.setenv("NUMBACCUM_MPI_BUCKET_BYTES", raw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _config._env_int("NUMBACCUM_MPI_BUCKET_BYTES", None) == value
    assert [str(w.message).endswith("is not a positive integer; ignored") for w in caught] == [True] * warns


def test_sizes_are_shown_in_the_largest_whole_unit():
    assert [dist._human(b) for b in (4 << 20, 3 << 10, 1000, (1 << 20) + 1024)] == [
        "4 MiB",
        "3 KiB",
        "1000 bytes",
        "1025 KiB",
    ]


def test_calibrate_checks_its_arguments_before_any_collective():
    class NoCollective:
        def __getattr__(self, name):
            raise AssertionError(f"{name} called")

    for kwargs, error, says in [
        ({"sizes": []}, ValueError, "at least one"),
        ({"sizes": "4MB"}, TypeError, "sizes must be a sequence"),
        ({"sizes": [1 << 20, 0]}, ValueError, r"sizes\[1\] must be >= 1"),
        ({"repeats": 0}, ValueError, "repeats"),
        ({"nbytes": 2.0}, TypeError, "nbytes"),
        ({"save": 3}, TypeError, "save"),
    ]:
        with pytest.raises(error, match=says):
            dist.calibrate(NoCollective(), **kwargs)


# --- issue 27, item 2: the clip's norm reduced piece by piece as the buckets arrive ------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("div", [1.0, 2.0, 3.0, 7.0])
@pytest.mark.parametrize("block", [None, 64])
def test_overlap_piecewise_sumsq_has_the_bits_of_the_settled_norm(monkeypatch, dtype, div, block):
    # `PiecewiseSumsq` over pieces ending anywhere (inside the engine's items and leaves) gives the
    # bits of `leaf_sumsq` over the updates divided and rounded (`Updates.settled`): n = 3 too.
    import numpy as np

    import numbaccum as nba
    from numbaccum.backend import PiecewiseSumsq, leaf_sumsq
    from numbaccum.contract import Factor
    from numbaccum.updates import Updates

    if block is not None:
        monkeypatch.setattr(_config, "REDUCE_BLOCK", block)
    rng = np.random.default_rng(0)
    tree = {
        "a": rng.standard_normal((30, 70)).astype(dtype),
        "b": rng.standard_normal(5).astype(dtype),
        "c": (rng.standard_normal(2001) * 1e-30).astype(dtype),
        "d": np.zeros(0, dtype),
    }
    flat = nba.FlatTree.from_tree(tree)
    want = leaf_sumsq(Updates(flat, False, Factor(div, 1.0)).into(flat.zeros_like()))
    x = flat.groups[0]
    piecewise = PiecewiseSumsq(flat.layout, 0, x)
    for step in (x.size, 1000, 77, 1):
        piecewise.start(div, 1.0)
        for hi in [*range(step, x.size, step), x.size]:
            piecewise.feed(x, hi, lambda: None)
        np.testing.assert_array_equal(piecewise.finish().view(np.int64), want.view(np.int64))


def test_overlap_sumsq_of_leaves_is_the_tree_norms_or_none_when_it_must_rescue():
    import numpy as np

    import numbaccum as nba
    from numbaccum.backend import leaf_sumsq, sumsq_of_leaves, tree_sumsq_scaled

    for tree in (
        {"w": np.arange(5.0, dtype=np.float32), "v": np.ones(3)},
        {"w": np.zeros(4, np.float32)},  # zero: the rescue's branch, nothing to rescue
        {"w": np.full(3, 1e200)},  # float64 past 1e154: rescued, so None
    ):
        flat = nba.FlatTree.from_tree(tree)
        s = sumsq_of_leaves(flat.layout, leaf_sumsq(flat))
        total, f = tree_sumsq_scaled(flat)
        if s is None:
            assert f != 1.0
        else:
            assert (s, 1.0) == (total, f)
