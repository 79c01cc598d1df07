"""The examples (examples/, the site's gallery) run and compute what their pages say.

Each test calls the script's ``main`` (smaller than the gallery's run where that keeps the point)
and checks its numbers. A script that needs scikit-learn, SciPy or dp-accounting skips without it
(and runs in CI's extras pass); the site's build runs every script as ``__main__``, figures and
all (docs/hooks/gallery.py, tests/test_site.py)."""

import runpy
import sys
from pathlib import Path

import numpy as np
from _testutil import require

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# tested elsewhere: on one rank in tests/test_distributed.py, on the ranks in tests/mpi/
ELSEWHERE = {"data_parallel"}


def _load(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def test_every_example_is_tested_here_or_elsewhere():
    tested = {
        name.removeprefix("test_").split("_example")[0] for name in globals() if name.startswith("test_")
    }
    assert {p.stem for p in EXAMPLES.glob("*.py")} - ELSEWHERE <= tested


def test_mlp_example_trains():
    mlp = _load("mlp")
    untrained = mlp.main(steps=0)
    trained = mlp.main(steps=400)
    assert trained < 0.6 * untrained


def test_mlp_example_runs_as_a_script(capsys):
    runpy.run_path(str(EXAMPLES / "mlp.py"), run_name="__main__")
    assert "final training loss" in capsys.readouterr().out


def test_sklearn_mlp_example_matches_mlpclassifier(capsys):
    require("sklearn")
    history = _load("sklearn_mlp").main(epochs=12)
    # the same model and optimizer: both learn the digits, to within a few test images
    assert min(history["accuracy"][-1], history["sk_accuracy"][-1]) > 0.93
    assert abs(history["accuracy"][-1] - history["sk_accuracy"][-1]) < 0.04
    assert history["loss"][-1] < 0.1 * history["loss"][0]
    assert 0.7 < history["loss"][-1] / history["sk_loss"][-1] < 1.4  # the same training loss, nearly
    # one Adam step per 4 mini-batches of 8: 179 whole mini-batches an epoch
    assert "Adam steps taken: 537 (one per 4 mini-batches of 8)" in capsys.readouterr().out


def test_classifier_ema_example_learns_and_its_average_is_smoother():
    history = _load("classifier_ema").main(steps=800, log_every=0)
    assert history["accuracy"][-1] > 0.9 and history["ema_accuracy"][-1] > 0.9
    late = slice(len(history["step"]) // 2, None)  # past the warm-up, the average's lag
    jitter = {k: np.abs(np.diff(history[k][late])).sum() for k in ("loss", "ema_loss")}
    assert jitter["ema_loss"] < 0.5 * jitter["loss"], jitter


def test_complex_filter_example_ends_at_least_squares():
    history = _load("complex_filter").main(log_every=0)
    w = history["w"]
    assert w.dtype == np.complex64
    assert np.max(np.abs(w - history["w_ls"])) < 2e-3
    assert history["loss"][-1] < 1.01 * history["ls_loss"]
    assert np.max(np.abs(w - history["h"])) < 5e-3  # and so near the channel (30 dB of noise)


def test_dp_sgd_example_spends_less_privacy_with_more_noise():
    require("dp_accounting")
    results = _load("dp_sgd").main(epochs=2, noise_multipliers=(1.0, 4.0))
    low, high = results[1.0], results[4.0]
    for run in (low, high):
        assert run["epsilon"][0] < run["epsilon"][1]  # privacy spent grows with the steps
        assert run["pld"] <= run["epsilon"][-1]  # PLD accounting is the tighter
        assert run["accuracy"][-1] > 0.8
    assert high["epsilon"][-1] < 0.25 * low["epsilon"][-1]
    assert results["non-private"][-1] > 0.85  # the labels are 10% flipped: 0.9 at best


def test_lbfgs_rosenbrock_example_matches_scipy():
    require("scipy")
    results = _load("lbfgs_rosenbrock").main()
    assert len(results) == 4
    for (problem, _solver), r in results.items():
        assert np.max(np.abs(r["x"] - 1)) < 1e-6 and r["value"] < 1e-12, problem
        other = results[problem, "SciPy L-BFGS-B"]
        assert abs(r["iterations"] - other["iterations"]) <= 0.1 * other["iterations"], problem
