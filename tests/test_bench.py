"""`numbaccum bench`: the smoke run CI makes (structure, not timings), the CUDA path in the
simulator, the table and the plot, and the NumPy baseline doing the same math as numbaccum."""

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from _testutil import require

import numbaccum as nba
from numbaccum.bench import baselines, peers, plot, runner, worker, workloads

ROW_KEYS = {"op", "impl", "median_s", "min_s", "max_s", "calls", "gbs", "floor_fraction"}
RUN_KEYS = {"device", "workload", "n_params", "n_leaves", "per_call", "copy_floor_gbs", "rows"}
OPS = {
    "clip_by_global_norm",
    "MultiSteps mini-step",
    "full step: MultiSteps(chain(clip, adam)), emitting",
    "ema (debias)",
}


def _bench(args, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "numbaccum", "bench", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _check_run(run, device, workload):
    assert set(run) >= RUN_KEYS
    assert (run["device"], run["workload"]) == (device, workload)
    shapes = workloads.WORKLOADS[workload]()
    assert run["n_params"] == workloads.count_params(shapes)
    assert run["n_leaves"] == workloads.count_leaves(shapes)
    assert run["per_call"] == (workload == "tiny")
    assert {r["op"] for r in run["rows"]} == OPS
    for r in run["rows"]:
        assert set(r) >= ROW_KEYS
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"] and r["calls"] >= 1
        if run["per_call"]:
            assert r["gbs"] is None and r["floor_fraction"] is None
        else:
            assert r["gbs"] > 0 and r["floor_fraction"] == pytest.approx(r["gbs"] / run["copy_floor_gbs"])


def test_quick_smoke_run_writes_the_json(tmp_path):
    """What CI runs: ``numbaccum bench --quick --no-peers --json FILE`` (not a timed test)."""
    out = tmp_path / "bench.json"
    r = _bench(["--quick", "--no-peers", "--json", str(out)])
    result = json.loads(out.read_text())
    assert {"date", "machine", "python", "numpy", "numba", "numba_threads", "k", "runs"} <= set(result)
    assert [(x["device"], x["workload"]) for x in result["runs"]] == [("cpu", "many_small"), ("cpu", "tiny")]
    for run in result["runs"]:
        _check_run(run, "cpu", run["workload"])
        impls = {r["impl"] for r in run["rows"]}
        expected = {"numbaccum", "numpy"} | ({"numbaccum (plain tree)"} if run["per_call"] else set())
        assert impls == expected  # --no-peers: no torch, no optax
    many = result["runs"][0]
    assert many["copy_floor_gbs"] > 0
    # The table on stdout, the progress on stderr.
    assert "| MultiSteps mini-step | numbaccum |" in r.stdout and "median us" in r.stdout
    assert "[1/" in r.stderr and "cpu tiny: ema: numbaccum, numbaccum (plain tree), numpy" in r.stderr


def test_cuda_path_in_the_simulator(tmp_path):
    """``--device cuda`` on numba's simulator: the device FlatTree path, timed by wall clock."""
    out = tmp_path / "cuda.json"
    env = {"NUMBA_ENABLE_CUDASIM": "1", "NUMBACCUM_CUDA_THREADS": "4", "NUMBACCUM_CUDA_MAX_BLOCKS": "8"}
    r = _bench(["--device", "cuda", "--workload", "tiny", "--repeats", "2", "--json", str(out)], env)
    result = json.loads(out.read_text())
    assert result["gpu"] == "the numba CUDA simulator"
    (run,) = result["runs"]
    _check_run(run, "cuda", "tiny")
    assert {r["impl"] for r in run["rows"]} >= {"numbaccum"}
    assert "cuda -- tiny" in r.stdout


def test_device_cuda_without_a_gpu_says_so():
    from numbaccum.bench import gpu

    works, _, why = gpu.status()
    if works:
        pytest.skip("a CUDA device (or the simulator) works here")
    with pytest.raises(SystemExit, match="--device cuda: "):
        runner.main(["--device", "cuda", "--workload", "tiny", "--no-peers"])


def _result():
    rows = [
        dict(op=op, impl=impl, median_s=t, min_s=t, max_s=2 * t, calls=3, gbs=g, floor_fraction=f)
        for op, impl, t, g, f in [
            ("clip_by_global_norm", "numbaccum", 0.010, 12.0, 0.6),
            ("clip_by_global_norm", "numpy", 0.020, 6.0, 0.3),
            ("clip_by_global_norm", "torch foreach", 0.040, 3.0, 0.15),
            ("ema (debias)", "numbaccum", 0.005, 16.0, 0.8),
        ]
    ]
    tiny = [
        dict(
            op="ema (debias)",
            impl="numbaccum",
            median_s=7e-6,
            min_s=6e-6,
            max_s=9e-6,
            calls=5,
            gbs=None,
            floor_fraction=None,
        )
    ]
    common = dict(n_leaves=148, copy_floor_gbs=20.0)
    return {
        "date": "2026-01-01",
        "machine": "test machine",
        "gpu": None,
        "python": "3",
        "numpy": "2",
        "numba": "0",
        "numba_threads": 2,
        "threading_layer": "omp",
        "peers": {"torch": "2.0"},
        "k": 4,
        "runs": [
            dict(device="cpu", workload="gpt2_small", n_params=10**8, per_call=False, rows=rows, **common),
            dict(device="cpu", workload="tiny", n_params=100, per_call=True, rows=tiny, **common),
        ],
    }


def test_table_has_speedups_over_numpy_and_of_numbaccum_over_each_peer():
    table = runner.format_table(_result())
    # numbaccum's own row has no speed-up over itself, numpy's none over numpy (issue 24)
    assert "| clip_by_global_norm | numbaccum | 10 | 10-20 | 12.0 | 0.60 | 2.00x | - |" in table
    assert "| clip_by_global_norm | torch foreach | 40 | 40-80 | 3.0 | 0.15 | 0.50x | 4.00x |" in table
    assert "| ema (debias) | numbaccum | 5 | 5-10 | 16.0 | 0.80 | - | - |" in table  # no numpy row
    assert "median us" in table and "| ema (debias) | numbaccum | 7 | 6-9 | - | - | - | - |" in table
    assert "copy floor" in table and "torch 2.0" in table
    # every table says what its columns mean, a copy floor above 1.00 included
    assert table.count("vs numpy: the NumPy per-leaf version's median") == len(_result()["runs"])
    assert "above 1.00: faster than a copy through memory" in table


def test_plot_draws_a_png(tmp_path):
    require("matplotlib")
    path = tmp_path / "bench.png"
    plot.plot(_result(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _two_panels() -> dict:
    """`_result` with a second bandwidth panel where numpy is absent (torch foreach comes second
    there) and optax jit skipped MultiSteps (two rows) for the reason a budget gives."""
    result = _result()
    rows = [
        dict(op=op, impl=impl, median_s=t, min_s=t / 2, max_s=2 * t, calls=3, gbs=1.0, floor_fraction=f)
        for op, impl, t, f in [
            (runner.MINI, "numbaccum", 0.010, 0.8),
            (runner.MINI, "torch foreach", 0.020, 0.4),
            (runner.FULL, "numbaccum", 0.040, 0.5),
            (runner.FULL, "torch foreach", 0.080, 0.25),
        ]
    ]
    why = "its build and first call took 31.0 s of CPU time, over the budget of 10 s (--peer-budget)"
    skipped = [dict(op="multisteps", impl="optax jit", why=why)]
    result["runs"].insert(
        1,
        dict(device="cpu", workload="resnet50", n_params=25_557_032, n_leaves=161, per_call=False,
             copy_floor_gbs=20.0, rows=rows, skipped=skipped),
    )
    return result


def _bars(ax) -> dict:
    """{contender: (its colour, [(bar height, min-max line's low, high)])} of one panel."""
    from matplotlib.container import BarContainer, ErrorbarContainer

    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    lines = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    out = {}
    for bar, err in zip(bars, lines):
        segments = [s for s in err.lines[2][0].get_segments() if len(s)]  # none for a missing bar
        heights = [p.get_height() for p in bar.patches if np.isfinite(p.get_height())]
        assert len(segments) == len(heights)
        spans = [(h, min(s[0][1], s[1][1]), max(s[0][1], s[1][1])) for h, s in zip(heights, segments)]
        out[bar.get_label()] = ({tuple(p.get_facecolor()) for p in bar.patches}, spans)
    return out


def test_plot_one_colour_per_contender_min_max_lines_and_marked_skips():
    """Across panels a contender keeps its colour (before, each panel coloured its bars by their
    position: torch foreach took numpy's colour where numpy was absent); each bar has a line from
    its fastest call to its slowest (as a fraction of the floor, the fastest is the highest); a
    peer that skipped a row leaves a numbered mark there in its colour, the reason under the panel."""
    require("matplotlib")
    import matplotlib.pyplot as plt

    result = _two_panels()
    fig = plot.figure(result, runner.LABELS)
    try:
        axes = fig.axes
        assert len(axes) == 3
        panels = [_bars(ax) for ax in axes]
        colour = plot.colours(plot.contenders(result))
        assert len(set(colour.values())) == len(colour) == 4  # numbaccum, numpy, torch foreach, optax jit
        for bars in panels:
            for impl, (faces, _) in bars.items():
                assert faces == {tuple(colour[impl])}, impl
        legend = fig.legends[0]
        assert [t.get_text() for t in legend.get_texts()] == list(colour)
        # min-max lines: bandwidth (fraction * median / time) and per-call (us)
        first = dict(panels[0])
        assert first["numbaccum"][1][0] == pytest.approx((0.6, 0.3, 0.6))  # min_s = median: no higher
        assert panels[1]["torch foreach"][1][0] == pytest.approx((0.4, 0.2, 0.8))
        assert panels[2]["numbaccum"][1] == [pytest.approx((7.0, 6.0, 9.0))]
        # the skip: a mark on each of MultiSteps' two rows, in optax jit's colour, and the reason
        marks = [a for a in axes[1].texts if a.get_text().startswith(plot.SKIPPED)]
        assert [a.get_text() for a in marks] == ["skipped (1)", "skipped (2)"]
        assert all(tuple(a.get_color()) == tuple(colour["optax jit"]) for a in marks)
        reasons = axes[1].get_xlabel()
        assert f"(1) optax jit on {runner.MINI}: its build and first call took 31.0 s" in reasons
        assert f"(2) optax jit on {runner.FULL}: " in reasons
        assert not any(a.get_text().startswith(plot.SKIPPED) for a in axes[0].texts + axes[2].texts)
    finally:
        plt.close(fig)


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit, match=r"numbaccum\[bench\]"):
        plot.require_matplotlib()
    with pytest.raises(SystemExit, match=r"numbaccum\[bench\]"):
        runner.main(["--plot", "x.png", "--workload", "tiny"])  # before anything is timed


def test_progress_bar_on_a_terminal_and_lines_otherwise():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, plain = Tty(), io.StringIO()
    for stream in (tty, plain):
        bar = runner.Progress(4, stream)
        for i in range(4):
            bar.step(f"step {i}")
        bar.close()
    assert tty.getvalue().count("\r") == 4 and "[" + "#" * 24 + "] 4/4 " in tty.getvalue()
    assert re.search(r"\] 4/4 \d+\.\d s step 3", tty.getvalue())
    lines = plain.getvalue().splitlines()
    assert [re.sub(r", \d+\.\d s\]", "]", x) for x in lines] == [f"  [{i + 1}/4] step {i}" for i in range(4)]


@pytest.mark.parametrize("block", [None, 3])
def test_numpy_full_step_is_the_math_numbaccum_does(block):
    """The NumPy baseline of the full step, MultiSteps(chain(clip_by_global_norm(1.0), adam)),
    agrees with numbaccum's (so the benchmark compares the same work), clipping or not."""
    shapes = {"a": (4, 3), "b": (5,), "c": ()}
    params = workloads.make_tree(shapes, np.float32, seed=0)
    tx = nba.MultiSteps(nba.chain(nba.clip_by_global_norm(1.0), nba.adam(baselines.LR)), 2)
    state = tx.init(params)
    ref = baselines.NumpyMultiStepsAdam(workloads.leaves(params), k=2, max_norm=1.0)
    for step in range(8):
        scale = 1.0 if step < 4 else 1e-3  # the first cycles clip, the last ones do not
        grads = workloads.make_tree(shapes, np.float32, seed=step + 1, scale=scale)
        u, state = tx.update(grads, state, params)
        expected = ref.update(workloads.leaves(grads), block=block)
        for got, want in zip(workloads.leaves(u), expected):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


def test_from_json_reprints_an_earlier_run_without_timing(tmp_path, capsys):
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(_result()))
    assert runner.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == runner.format_table(_result()).strip()


def test_rows_stop_repeating_after_their_time_budget(monkeypatch):
    """A slow row takes at least 3 samples (2 MultiSteps cycles), then stops at ROW_SECONDS."""
    monkeypatch.setattr(runner, "ROW_SECONDS", 0.0)
    calls = []
    clock = lambda step: (step(), 1.0)[1]  # noqa: E731
    out = runner.measure(lambda: calls.append(1), "ema", clock, repeats=100, warmup=0)
    assert [len(v) for v in out.values()] == [3]
    out = runner.measure(lambda: None, "multisteps", clock, repeats=100, warmup=0)
    assert len(out[runner.FULL]) == 2 and len(out[runner.MINI]) == 2 * (runner.K - 1)


def test_contenders_of_a_row_are_timed_alternately():
    """A, B, C, A, B, C ... call by call; MultiSteps: a whole cycle each in turn."""
    calls = []
    clock = lambda step: (step(), 1.0)[1]  # noqa: E731
    contenders = [(lambda name=name: calls.append(name), clock) for name in "ABC"]
    out = runner.measure_alternating(contenders, "ema", repeats=3, warmup=1)
    assert calls == list("ABC") + list("ABC") * 3  # the warm-ups, then alternated calls
    assert [len(o[runner.LABELS["ema"][0]]) for o in out] == [3, 3, 3]
    calls.clear()
    out = runner.measure_alternating(contenders, "multisteps", repeats=runner.K * 2, warmup=0)
    assert calls == [c for _ in range(3) for c in "ABC" for _ in range(runner.K)]
    assert all(len(o[runner.FULL]) == 2 for o in out)


def test_peer_selection():
    """numbaccum and NumPy run in this process; the peers are chosen by name among the installed
    ones (they run in processes of their own)."""
    names = [i.name for i in runner.implementations("cpu", "tiny")]
    assert names == ["numbaccum", "numbaccum (plain tree)", "numpy"]
    to_run, missing = runner.peers_to_run("cpu", ["optax"])
    assert "torch" not in to_run and "torch" not in missing
    assert ("optax" in to_run) == peers.PEERS["optax"].installed() == ("optax" not in missing)
    assert runner.peers_to_run("cpu", False) == ({}, {})


# --- issue 22 item 7: a peer cannot hold the run; the run says what it does from the start ------

SLOW_PEER = """
import time

import numpy as np

def available(device):
    return True

def steps(params, grads, k, max_norm, device, ops):
    def slow():  # a compile that never ends, as optax's jit of 2000 leaves on a small machine
        t = time.perf_counter()
        while time.perf_counter() - t < 600:
            pass
    return {op: slow if op == "clip" else (lambda: None) for op in ops}

def hungry(params, grads, k, max_norm, device, ops):
    def grab():  # 600 MB, then nothing
        x = np.ones(150_000_000, np.float32)
        time.sleep(600)
    return {op: grab for op in ops}

def stuck(params, grads, k, max_norm, device, ops):
    return {op: (lambda: time.sleep(600)) if op == "multisteps" else (lambda: None) for op in ops}

def fast(params, grads, k, max_norm, device, ops):
    return {op: (lambda: None) for op in ops}
"""


@pytest.fixture
def fake_peers(tmp_path, monkeypatch):
    """Peers in the registry, importable by their processes: "slow" (its clip's first call
    computes for 600 s), "stuck" (its MultiSteps' first call sleeps for 600 s), "hungry" (takes
    600 MB), "fast" (every call does nothing), and "absent" (not installed)."""
    (tmp_path / "fake_bench_peer.py").write_text(textwrap.dedent(SLOW_PEER))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    entries = {
        "slow": peers.Peer("slow peer", (), "-", "fake_bench_peer:steps", "fake_bench_peer:available"),
        "stuck": peers.Peer("stuck peer", (), "-", "fake_bench_peer:stuck", "fake_bench_peer:available"),
        "hungry": peers.Peer("hungry peer", (), "-", "fake_bench_peer:hungry", "fake_bench_peer:available"),
        "fast": peers.Peer("fast peer", (), "-", "fake_bench_peer:fast", "fake_bench_peer:available"),
        "absent": peers.Peer("absent peer", ("no_such_module_x",), "pip install absent-peer", "-", "-"),
    }
    for name, entry in entries.items():
        monkeypatch.setitem(peers.PEERS, name, entry)
    return list(entries)


def test_a_peer_over_its_budget_is_skipped_with_a_note_and_the_run_completes(fake_peers):
    t = time.perf_counter()
    result = runner.run(
        ("tiny",),
        ("cpu",),
        runner.OPS,
        ["slow", "stuck", "fast", "absent"],
        {"tiny": 5},
        progress=False,
        budget_s=1.0,
    )
    assert time.perf_counter() - t < 300  # the slow calls take 600 s: they were not waited for
    (run,) = result["runs"]
    impls = {(r["op"], r["impl"]) for r in run["rows"]}
    assert not any(impl == "slow peer" for _, impl in impls)
    # The heaviest compile is timed last: a peer abandoned over it was timed on the others.
    assert {op for op, impl in impls if impl == "stuck peer"} == {"clip_by_global_norm", "ema (debias)"}
    for label in OPS:  # everyone else is timed on every row, alternately with the fast peer
        assert {(label, "numbaccum"), (label, "numpy"), (label, "fast peer")} <= impls
    # A peer's row says how long its build and first calls took; numbaccum's rows are as before.
    assert all((r["impl"] in ("fast peer", "stuck peer")) == ("first_call_s" in r) for r in run["rows"])
    notes = {(x["op"], x["impl"]): x["why"] for x in run["skipped"]}
    assert set(notes) == {
        ("clip", "slow peer"),
        ("multisteps", "slow peer"),
        ("ema", "slow peer"),
        ("multisteps", "stuck peer"),
    }
    # Computing: over 1 s of CPU time (or 6 s of wall time on a machine too busy to give it 1 s).
    assert re.fullmatch(
        r"its build .* of clip ran over (1 s \(of CPU time\)|6 s)", notes[("clip", "slow peer")]
    )
    assert notes[("ema", "slow peer")].startswith("not run")
    # Sleeping (no CPU time): over 6 s of wall time.
    why = "its build and first call (compile included) of multisteps ran over 6 s"
    assert notes[("multisteps", "stuck peer")] == why
    assert f"- stuck peer on multisteps: skipped: {why}" in runner.format_table(result)


def test_a_peer_that_would_take_the_run_past_its_memory_is_skipped(fake_peers):
    """The run's processes together stay under --max-memory: a peer that grows past what this
    process and the other peers leave it is abandoned (its 600 MB never all arrive)."""
    limit_gb = ((worker.resident_bytes(os.getpid()) or 0) + 300e6) / 1e9
    result = runner.run(
        ("tiny",),
        ("cpu",),
        ("ema",),
        ["hungry"],
        {"tiny": 3},
        progress=False,
        budget_s=30,
        max_memory_gb=limit_gb,
    )
    (run,) = result["runs"]
    assert [x["impl"] for x in run["skipped"]] == ["hungry peer"]
    assert re.fullmatch(r"its build .* of ema went over 0\.[1-3] GB", run["skipped"][0]["why"])


def test_the_run_says_what_will_run_and_shows_progress_before_any_slow_step(fake_peers, monkeypatch):
    """The plan (workloads, contenders, missing peers and how to install them) is on stderr before
    the copy floor is measured; a progress line names each phase before it begins."""
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("NUMBACCUM_PROGRESS", "0")  # no compile's line between the bench's own
    seen: dict[str, str] = {}

    def when(name, fn):
        def wrapped(*args, **kwargs):
            seen.setdefault(name, err.getvalue())
            return fn(*args, **kwargs)

        monkeypatch.setattr(runner, name, wrapped)

    when("copy_floor", lambda *a: 1.0)
    when("_trees", runner._trees)
    when("measure_alternating", runner.measure_alternating)
    runner.main(["--workload", "tiny", "--repeats", "3", "--peer", "fast", "--peer", "absent"])
    plan = seen["copy_floor"]
    assert "workloads: tiny (100 params in 10 leaves)" in plan
    assert "cpu: numbaccum, numbaccum (plain tree), numpy, fast peer" in plan
    assert "not installed: absent peer (absent): pip install absent-peer" in plan
    assert "over 10 s of CPU time or 60 s (--peer-budget), or that would take the run past 4 GB" in plan
    assert re.search(r"\[\d+\.\d s\] measuring the copy floor\n$", plan)
    assert seen["_trees"].endswith("cpu tiny: making the trees, and the peers' own (fast peer)\n")
    assert re.search(
        r"\[1/3, \d+\.\d s\] cpu tiny: clip: numbaccum, numbaccum \(plain tree\), numpy, fast peer\n$",
        seen["measure_alternating"],
    )
