"""Issue 12, items 6 and 7: constructor gaps and small things a user hits, each test named after
the item it fixes."""

import json
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import numbaccum as nba
from numbaccum.bench import runner
from numbaccum.compat import declearn as dl
from numbaccum.compat import torchzero as tz

BAD_NUMBERS = [None, "0.9x", "0.5", 1j, [0.9], True, object()]

# constructor -> {argument: a call that passes the value for that argument}
NUMERIC_ARGS = {
    "trace": {"decay": lambda v: nba.trace(v)},
    "ema": {"decay": lambda v: nba.ema(v)},
    "scale": {"step_size": lambda v: nba.scale(v)},
    "scale_by_learning_rate": {"learning_rate": lambda v: nba.scale_by_learning_rate(v)},
    "add_decayed_weights": {"weight_decay": lambda v: nba.add_decayed_weights(v)},
    "sgd": {"learning_rate": lambda v: nba.sgd(v), "momentum": lambda v: nba.sgd(0.1, momentum=v)},
    "scale_by_adam": {
        "b1": lambda v: nba.scale_by_adam(b1=v),
        "b2": lambda v: nba.scale_by_adam(b2=v),
        "eps": lambda v: nba.scale_by_adam(eps=v),
        "eps_root": lambda v: nba.scale_by_adam(eps_root=v),
    },
    "adam": {"learning_rate": lambda v: nba.adam(v), "b1": lambda v: nba.adam(1e-3, b1=v)},
    "clip": {"max_delta": lambda v: nba.clip(v)},
    "clip_by_block_rms": {"threshold": lambda v: nba.clip_by_block_rms(v)},
    "clip_by_global_norm": {"max_norm": lambda v: nba.clip_by_global_norm(v)},
    "normalize_by_update_norm": {
        "scale_factor": lambda v: nba.normalize_by_update_norm(v),
        "eps": lambda v: nba.normalize_by_update_norm(eps=v),
    },
    "apply_if_finite": {"max_consecutive_errors": lambda v: nba.apply_if_finite(nba.scale(1.0), v)},
    "apply_every": {"k": lambda v: nba.apply_every(v)},
    "MultiSteps": {"every_k_schedule": lambda v: nba.MultiSteps(nba.scale(1.0), v)},
    "adaptive_grad_clip": {
        "clipping": lambda v: nba.adaptive_grad_clip(v),
        "eps": lambda v: nba.adaptive_grad_clip(0.1, eps=v),
    },
    "clip_norm": {"max_norm": lambda v: nba.clip_norm(v)},
    "normalize": {"norm_value": lambda v: nba.normalize(v)},
    "clip_norm_by_ema": {
        "beta": lambda v: nba.clip_norm_by_ema(v),
        "max_ema_growth": lambda v: nba.clip_norm_by_ema(max_ema_growth=v) if v is not None else 1 / 0,
        "init": lambda v: nba.clip_norm_by_ema(init=v),
        "min_norm": lambda v: nba.clip_norm_by_ema(min_norm=v),
    },
    "clip_value_by_ema": {
        "beta": lambda v: nba.clip_value_by_ema(v),
        "init": lambda v: nba.clip_value_by_ema(init=v),
    },
    "clip_norm_growth": {
        "mul": lambda v: nba.clip_norm_growth(mul=v) if v is not None else 1 / 0,
        "add": lambda v: nba.clip_norm_growth(add=v) if v is not None else 1 / 0,
    },
    "clip_value_growth": {
        "max_decay": lambda v: nba.clip_value_growth(max_decay=v) if v is not None else 1 / 0
    },
    "differentially_private_aggregate": {
        "l2_norm_clip": lambda v: nba.differentially_private_aggregate(v, 1.0, 0),
        "noise_multiplier": lambda v: nba.differentially_private_aggregate(1.0, v, 0),
        "seed": lambda v: nba.differentially_private_aggregate(1.0, 1.0, v),
    },
    "dpsgd": {
        "learning_rate": lambda v: nba.dpsgd(v, 1.0, 1.0, 0),
        "momentum": lambda v: nba.dpsgd(0.1, 1.0, 1.0, 0, momentum=v),
    },
    "ClipValue": {"value": lambda v: tz.ClipValue(v)},
    "ClipNorm": {"max_norm": lambda v: tz.ClipNorm(v)},
    "L2Clipping": {"max_norm": lambda v: dl.L2Clipping(v)},
    "GaussianNoiseModule": {"std": lambda v: dl.GaussianNoiseModule(v)},
}
CASES = [(c, a, v) for c, args in NUMERIC_ARGS.items() for a in args for v in BAD_NUMBERS]


def _callable_ok(constructor, arg, value):
    """A callable is a schedule where the argument takes one."""
    return callable(value) and arg in ("learning_rate", "every_k_schedule")


@pytest.mark.parametrize("constructor, arg, value", CASES, ids=[f"{c}-{a}-{v!r:.8}" for c, a, v in CASES])
def test_item6_bad_hyperparameters_name_the_argument(constructor, arg, value):
    if value is None and arg in ("max_ema_growth", "mul", "add", "max_decay", "momentum"):
        pytest.skip("None is a documented value of this argument")
    with pytest.raises((TypeError, ValueError), match=arg):
        NUMERIC_ARGS[constructor][arg](value)


def test_item6_negative_adaptive_grad_clip_is_refused():
    with pytest.raises(ValueError, match="clipping must be >= 0"):
        nba.adaptive_grad_clip(-1.0)


@pytest.mark.parametrize("threshold", [-1.0, float("nan")])
def test_item6_clip_by_block_rms_negative_or_nan_threshold_is_refused(threshold):
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        nba.clip_by_block_rms(threshold)


@pytest.mark.parametrize("bad", [None, "adam", 3, nba.adam])
def test_item6_a_non_transformation_raises_type_error_naming_the_argument(bad):
    with pytest.raises(TypeError, match="opt must be a GradientTransformation"):
        nba.MultiSteps(bad, 2)
    with pytest.raises(TypeError, match="inner must be a GradientTransformation"):
        nba.apply_if_finite(bad, 2)
    with pytest.raises(TypeError, match=r"chain: transforms\[1\] must be a GradientTransformation"):
        nba.chain(nba.scale(1.0), bad)
    with pytest.raises(TypeError, match=r"named_chain: transforms\[0\] \('a'\) must be"):
        nba.named_chain(("a", bad))
    with pytest.raises(TypeError, match="tx must be a GradientTransformation"):
        nba.with_extra_args_support(bad)
    with pytest.raises(TypeError, match="should_skip_update_fn must be callable"):
        nba.MultiSteps(nba.scale(1.0), 2, should_skip_update_fn="skip")


def test_item6_named_chain_entries_must_be_pairs():
    with pytest.raises(TypeError, match=r"transforms\[0\] must be a \(name, transformation\) pair"):
        nba.named_chain(nba.scale(1.0))


def test_item6_torchzero_clip_value_names_value():
    with pytest.raises(ValueError, match="^value must be >= 0"):
        tz.ClipValue(-1)


@pytest.mark.parametrize("k", [2.7, True, "3", np.float64(2.0), None])
def test_item6_every_k_schedule_callable_result_follows_the_constant_rule(k):
    params = {"w": np.ones(3, np.float32)}
    tx = nba.MultiSteps(nba.scale(1.0), lambda step: k)
    state = tx.init(params)
    before = np.array(state.acc_grads["w"])
    with pytest.raises(TypeError, match=r"every_k_schedule returned .* at gradient_step 0: .*must be an int"):
        tx.update(params, state)
    assert np.array_equal(state.acc_grads["w"], before)  # nothing written
    with pytest.raises(TypeError, match="every_k_schedule must be an int"):
        nba.MultiSteps(nba.scale(1.0), k if k is not None else "x")


def test_item6_every_k_schedule_callable_may_return_numpy_ints():
    params = {"w": np.ones(3, np.float32)}
    tx = nba.MultiSteps(nba.scale(1.0), lambda step: np.array(2, np.int64))
    state = tx.init(params)
    for _ in range(2):
        _, state = tx.update(params, state)
    assert tx.has_updated(state)


def test_item6_k_beyond_int32_is_refused():
    big = 2**40
    with pytest.raises(ValueError, match="every_k_schedule must be <= 2147483647"):
        nba.MultiSteps(nba.scale(1.0), big)
    with pytest.raises(ValueError, match="k must be <= 2147483647"):
        nba.apply_every(big)
    tx = nba.MultiSteps(nba.scale(1.0), lambda step: big)
    p = {"w": np.ones(2)}
    with pytest.raises(ValueError, match="every_k_schedule returned 1099511627776"):
        tx.update(p, tx.init(p))


def test_item6_the_largest_k_still_counts_and_emits():
    k = np.iinfo(np.int32).max
    p = {"w": np.ones(2)}
    tx = nba.MultiSteps(nba.scale(1.0), k)
    state = tx.init(p)._replace(mini_step=np.int32(k - 2))
    _, state = tx.update(p, state)
    assert int(state.mini_step) == k - 1 and not tx.has_updated(state)
    _, state = tx.update(p, state)
    assert tx.has_updated(state)
    every = nba.apply_every(k)
    s = every.init(p)._replace(count=np.int32(k - 1))
    u, s = every.update(p, s)
    assert np.all(u["w"] != 0) and int(s.count) == 0


# --- item 7 -----------------------------------------------------------------------------------


def _bench_from_json(tmp_path, content):
    path = tmp_path / "run.json"
    path.write_bytes(content)
    return subprocess.run(
        [sys.executable, "-m", "numbaccum", "bench", "--from-json", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )


GOOD_RUN = {
    "date": "2026-11-23",
    "machine": "a machine",
    "python": "3.12",
    "numpy": "2.4",
    "numba": "0.68",
    "numba_threads": 2,
    "threading_layer": "omp",
    "peers": {},
    "runs": [
        {
            "device": "cpu",
            "workload": "tiny",
            "n_params": 100,
            "n_leaves": 10,
            "per_call": True,
            "copy_floor_gbs": None,
            "rows": [
                {
                    "op": "ema",
                    "impl": "numbaccum",
                    "median_s": 1e-5,
                    "min_s": 1e-5,
                    "max_s": 2e-5,
                    "gbs": None,
                    "floor_fraction": None,
                }
            ],
        }
    ],
}


def _nest(depth):
    return ("[" * depth + "]" * depth).encode()


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"\xff\xfe\x00garbage", "not the JSON"),
        (b"{not json", "not the JSON"),
        (_nest(100_000), "not the JSON"),
        (b"[]", "not a JSON object"),
        (json.dumps({"date": "x"}).encode(), "has no 'machine'"),
        (json.dumps(dict(GOOD_RUN, runs=[{"device": "cpu"}])).encode(), r"runs\[0\] has no 'workload'"),
        (json.dumps(dict(GOOD_RUN, numba_threads="2")).encode(), "'numba_threads' is a str"),
        (json.dumps(dict(GOOD_RUN, peers=[1])).encode(), "'peers' is not a dict"),
    ],
)
def test_item7_bench_from_json_on_a_bad_file_prints_a_clear_error(tmp_path, content, reason):
    r = _bench_from_json(tmp_path, content)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and r.stderr.startswith("numbaccum bench --from-json: ")
    assert len(r.stderr) < 1000
    import re

    assert re.search(reason, r.stderr), r.stderr


def test_item7_bench_from_json_prints_no_ansi_escapes_from_the_file(tmp_path):
    evil = dict(
        GOOD_RUN, machine="box \x1b[2J\x1b[31mred\x07", runs=[dict(GOOD_RUN["runs"][0], workload="t\x1b]0;x")]
    )
    r = _bench_from_json(tmp_path, json.dumps(evil).encode())
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    assert "box ?[2J?[31mred?" in r.stdout
    r = _bench_from_json(tmp_path, b"\x1b[31m")  # nor in the error
    assert r.returncode == 2 and "\x1b" not in r.stderr


def test_item7_bench_from_json_reads_a_missing_file_clearly(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "numbaccum", "bench", "--from-json", str(tmp_path / "nope.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "cannot read it" in r.stderr and "Traceback" not in r.stderr


def test_item7_bench_from_json_accepts_its_own_results():
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for name in ("2026-11-23-cpu-bench-small.json", "2026-11-23-h100-numbaccum-bench-cuda-gpt2-small.json"):
        if (results / name).exists():
            assert "numbaccum bench --" in runner.format_table(runner.load_result(str(results / name)))


@pytest.mark.parametrize("value", ["abc", "0", "-4", "100", "2048", "\x1b[31m"])
def test_item7_bad_cuda_threads_env_does_not_break_import(value):
    code = "import numbaccum, numbaccum._config as c; print(c.CUDA_THREADS)"
    env = {"NUMBACCUM_CUDA_THREADS": value, "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "256"
    assert "NUMBACCUM_CUDA_THREADS" in r.stderr and "using 256" in r.stderr


def test_item7_good_cuda_threads_env_is_used():
    code = "import numbaccum._config as c; print(c.CUDA_THREADS, c.CUDA_MAX_BLOCKS)"
    env = {"NUMBACCUM_CUDA_THREADS": "64", "NUMBACCUM_CUDA_MAX_BLOCKS": "x", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.stdout.split() == ["64", str(132 * 16)] and "NUMBACCUM_CUDA_MAX_BLOCKS" in r.stderr


def test_item7_error_messages_do_not_repeat_a_1mb_dict_key():
    key = "k" * (1 << 20)
    params = {key: np.ones(3, np.float32), "b": np.ones(2, np.float32)}
    tx = nba.trace(0.9)
    state = tx.init(params)
    attempts = [
        lambda: tx.update({key: np.ones(4, np.float32), "b": np.ones(2, np.float32)}, state),  # shape
        lambda: tx.update({key: np.ones(3, np.float32)}, state),  # structure
        lambda: tx.update({key: "x", "b": np.ones(2, np.float32)}, state),  # leaf type
        lambda: tx.update({key: {"x": np.ones(3, np.float32)}, "b": np.ones(2, np.float32)}, state),
        lambda: nba.FlatTree.from_tree(params).assign_({key: np.ones(5, np.float32), "b": np.ones(2)}),
        lambda: nba.tree_flatten({key: 1, 2: 3}),  # unsortable keys
    ]
    for attempt in attempts:
        with pytest.raises((TypeError, ValueError)) as e:
            attempt()
        msg = str(e.value)
        assert len(msg) < 1000, msg[:300]
        assert key[:200] not in msg or "chars>" in msg  # where the key is shown, it says what was cut
    with pytest.raises(ValueError, match=r"updates\['kkkk.*chars>.*kkkk'\]: shape \(4,\) does not match"):
        attempts[0]()


def test_item7_clip_norm_on_an_empty_leaf_with_many_slices_allocates_nothing_big():
    x = np.empty((0, 2**31))
    tracemalloc.start()
    try:
        for tx in (
            nba.clip_norm(1, dim=0, min_size=0),
            nba.normalize(1.0, dim=0, min_size=0),
            nba.centralize(dim=1, min_size=0),
        ):
            u, _ = tx.update({"x": x}, tx.init({"x": x}))
            assert u["x"].shape == x.shape
        nba.clip_grad_norm_({"x": x}, 1.0, dim=0, min_size=0)
        nba.normalize_grads_([x], 1.0, dim=0, min_size=0)
        agc = nba.adaptive_grad_clip(0.1)
        agc.update({"x": x}, agc.init({"x": x}), {"x": x})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 << 20, peak
