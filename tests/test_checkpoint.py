"""Checkpoints (save_state / load_state), pickle and deepcopy of states and FlatTrees.

Every state type is saved, loaded (with and without ``like``), pickled and deep-copied after a
few steps; the restored state and the original then continue side by side and must give the same
bits, step after step. The failure modes a long training run meets are covered too: a truncated
or corrupt file, a file of another program, a newer format, a mismatched ``like``, a crash in the
middle of a write.
"""

import builtins
import contextlib
import copy
import errno
import functools
import importlib
import json
import os
import pickle
import pkgutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from typing import Any, NamedTuple

import numpy as np
import pytest
import strategies as strat
from _testutil import assert_bits_equal, plain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numbaccum as nba
from numbaccum import checkpoint as ck
from numbaccum.compat import declearn as dl
from numbaccum.compat import torchzero as tz
from numbaccum.tree import short_repr

# params_tree() holds this NamedTuple of the tests; a file can only name registered classes.
nba.register_state_class(strat.Pair)

F16, F32, F64 = np.float16, np.float32, np.float64


def params_tree():
    rng = np.random.default_rng(0)
    return {
        "dense": {"w": rng.standard_normal((4, 3)).astype(F32), "b": rng.standard_normal(3).astype(F64)},
        "half": rng.standard_normal(5).astype(F16),
        "pair": strat.Pair(rng.standard_normal((2, 2)).astype(F32), None),
        "scalar": np.array(0.25, F32),
        "empty": np.zeros((0, 2), F32),
        "list": [rng.standard_normal(2).astype(F64)],
    }


def grads(step, batch=None):
    """Gradients of step ``step`` (per-example ones with a leading batch axis of ``batch``)."""
    rng = np.random.default_rng(1000 + step)

    def leaf(p):
        shape = p.shape if batch is None else (batch, *p.shape)
        g = rng.standard_normal(shape) * (3.0 if step % 3 == 0 else 0.5)
        if step == 4 and g.size:
            g.reshape(-1)[0] = np.nan  # a non-finite step: skip predicates and apply_if_finite act
        return g.astype(p.dtype)

    return nba.tree_map(leaf, params_tree())


def inner_pair():
    return [nba.scale(0.5), nba.trace(0.5)]


# name -> (factory of the transformation, per-example batch or None, whether update gets params)
CASES = {
    "trace": (lambda: nba.trace(0.9, nesterov=True), None, False),
    "ema": (lambda: nba.ema(0.9, accumulator_dtype=F64), None, False),
    "apply_every": (lambda: nba.apply_every(3), None, False),
    "multisteps_adam": (
        lambda: nba.MultiSteps(nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-3)), 3),
        None,
        False,
    ),
    "multisteps_skip_schedule": (
        lambda: nba.MultiSteps(
            nba.sgd(lambda c: 0.1 / (1 + c), momentum=0.9),
            lambda step: 2 + int(step) % 2,
            use_grad_mean=False,
            should_skip_update_fn=nba.skip_not_finite,
            accumulator_dtype=F64,
        ),
        None,
        True,
    ),
    "multisteps_skip_large": (
        lambda: nba.MultiSteps(
            nba.named_chain(("clip", nba.clip(1.0)), ("opt", nba.adam(1e-2))),
            2,
            should_skip_update_fn=functools.partial(nba.skip_large_updates, max_squared_norm=1e4),
        ),
        None,
        False,
    ),
    "multisteps_of_multisteps": (
        lambda: nba.MultiSteps(nba.MultiSteps(nba.ema(0.5), 2).gradient_transformation(), 2),
        None,
        False,
    ),
    "nested_chains": (
        lambda: nba.chain(
            nba.chain(nba.zero_nans(), nba.trace(0.5)),
            nba.named_chain(("decay", nba.add_decayed_weights(1e-2)), ("adam", nba.scale_by_adam())),
            nba.scale_by_learning_rate(lambda c: 1e-2 * 0.9**c),
        ),
        None,
        True,
    ),
    "apply_if_finite": (lambda: nba.apply_if_finite(nba.adam(1e-3), 2), None, False),
    "block_rms_normalize": (
        lambda: nba.chain(nba.clip_by_block_rms(0.5), nba.normalize_by_update_norm(), nba.ema(0.9)),
        None,
        False,
    ),
    "norm_family": (
        lambda: nba.chain(
            nba.centralize(), nba.clip_norm(1.0, dim=1), nba.normalize(2.0, ord="l1"), nba.trace(0.9)
        ),
        None,
        False,
    ),
    "adaptive_grad_clip": (lambda: nba.chain(nba.adaptive_grad_clip(0.1), nba.sgd(0.1, 0.9)), None, True),
    "distance_over_gradients": (
        lambda: nba.chain(nba.scale_by_distance_over_gradients(1e-3, param_dtype=F64), nba.trace(0.5)),
        None,
        True,
    ),
    "clip_norm_by_ema": (lambda: nba.clip_norm_by_ema(0.9), None, False),
    "normalize_by_ema_global": (lambda: nba.normalize_by_ema(0.5, tensorwise=False), None, False),
    "clip_value_by_ema": (lambda: nba.clip_value_by_ema(0.9, init=1.0), None, False),
    "clip_norm_growth": (lambda: nba.clip_norm_growth(add=0.1, ord="std"), None, False),
    "clip_value_growth": (lambda: nba.clip_value_growth(), None, False),
    "dp_aggregate": (lambda: nba.differentially_private_aggregate(1.0, 1.1, seed=3), 4, False),
    "dpsgd": (lambda: nba.dpsgd(0.1, 1.0, 1.1, seed=7, momentum=0.9, nesterov=True), 4, True),
    "dp_then_adam": (
        lambda: nba.chain(nba.differentially_private_aggregate(1.0, 0.5, seed=1), nba.adam(1e-3)),
        3,
        True,
    ),
    "torchzero_ClipNormByEMA_inner": (lambda: tz.ClipNormByEMA(beta=0.5, inner=inner_pair()), None, False),
    "torchzero_NormalizeByEMA": (lambda: tz.NormalizeByEMA(), None, False),
    "torchzero_ClipValueByEMA_tfm": (
        lambda: tz.ClipValueByEMA(inner=nba.trace(0.5), exp_avg_tfm=[nba.ema(0.5)]),
        None,
        False,
    ),
    "torchzero_ClipNormGrowth": (lambda: tz.ClipNormGrowth(tensorwise=False), None, False),
    "torchzero_ClipValueGrowth": (lambda: tz.ClipValueGrowth(add=1.0), None, False),
    "torchzero_ClipNorm": (lambda: tz.ClipNorm(1.0, dim=0), None, False),
}


def _restore_save_load(state, like, tmp_path):
    path = tmp_path / "state.npz"
    nba.save_state(path, state)
    return nba.load_state(path)


def _restore_save_load_like(state, like, tmp_path):
    path = tmp_path / "state.npz"
    nba.save_state(str(path), state)
    return nba.load_state(str(path), like=like)


RESTORES = {
    "save_load": _restore_save_load,
    "save_load_like": _restore_save_load_like,
    "pickle": lambda state, like, tmp_path: pickle.loads(pickle.dumps(state)),
    "deepcopy": lambda state, like, tmp_path: copy.deepcopy(state),
}


def run_steps(tx, state, steps, batch, with_params, copy_out=True):
    p = params_tree()
    outs = []
    for step in steps:
        u, state = tx.update(grads(step, batch), state, p if with_params else None)
        outs.append(plain(u) if copy_out else u)
    return outs, state


@pytest.mark.parametrize("restore", sorted(RESTORES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_continuing_from_a_restored_state_gives_the_same_bits(case, restore, tmp_path):
    make, batch, with_params = CASES[case]
    tx = make()
    state = tx.init(params_tree())
    _, state = run_steps(tx, state, range(5), batch, with_params)
    restored = RESTORES[restore](state, tx.init(params_tree()), tmp_path)
    assert_bits_equal(restored, state, "restored state")
    a, state = run_steps(tx, state, range(5, 12), batch, with_params)
    b, restored = run_steps(tx, restored, range(5, 12), batch, with_params)
    for step, (x, y) in enumerate(zip(a, b), 5):
        assert_bits_equal(y, x, f"updates of step {step}")
    assert_bits_equal(restored, state, "state after 7 more steps")


@pytest.mark.parametrize("restore", ["save_load", "pickle", "deepcopy"])
@pytest.mark.parametrize("module", ["EWMAModule", "MomentumModule"])
def test_declearn_states_continue_bit_identically(module, restore, tmp_path):
    cls = getattr(dl, module)
    m = cls(0.5) if module == "EWMAModule" else cls(0.9, nesterov=True)
    g = {k: v for k, v in grads(0)["dense"].items()}
    for _ in range(3):
        m.run(g)
    state = m._state
    restored = RESTORES[restore](state, None, tmp_path)
    tx = m._tx
    for step in range(3):
        g = grads(step)["dense"]
        x, state = tx.update(g, state)
        x = nba.tree_map(np.copy, x)
        y, restored = tx.update(g, restored)
        assert_bits_equal(y, x)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    drawn=strat.tree_sequences(min_steps=4, max_steps=6),
    which=st.sampled_from(["multisteps_adam", "ema", "clip_norm_growth", "clip_value_by_ema", "nested"]),
    cut=st.integers(1, 3),
)
def test_save_load_round_trips_any_tree(tmp_path_factory, drawn, which, cut):
    params, seq = drawn
    make = {
        "multisteps_adam": lambda: nba.MultiSteps(nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-3)), 2),
        "ema": lambda: nba.ema(0.9),
        "clip_norm_growth": lambda: nba.clip_norm_growth(),
        "clip_value_by_ema": lambda: nba.clip_value_by_ema(),
        "nested": lambda: nba.chain(nba.zero_nans(), nba.named_chain(("t", nba.trace(0.5)))),
    }[which]
    tx = make()
    state = tx.init(params)
    for g in seq[:cut]:
        _, state = tx.update(g, state)
    path = tmp_path_factory.mktemp("ck") / "s.npz"
    nba.save_state(path, state)
    loaded = nba.load_state(path, like=tx.init(params))
    for g in seq[cut:]:
        x, state = tx.update(g, state)
        x = nba.tree_map(np.copy, x)
        y, loaded = tx.update(g, loaded)
        assert_bits_equal(y, x)


def test_the_loaded_state_has_the_interned_layout_and_real_views(tmp_path):
    p = params_tree()
    tx = nba.chain(nba.trace(0.9), nba.ema(0.9))
    nba.save_state(tmp_path / "s.npz", tx.init(p))
    s = nba.load_state(tmp_path / "s.npz")
    assert s[0].trace.layout is nba.FlatTree.from_tree(p).layout
    assert s[0].trace.layout is s[1].ema.layout
    s[1].ema["dense"]["w"][...] = 3.0  # the leaf views alias the buffers
    assert np.count_nonzero(s[1].ema.buffers[np.dtype(F32)] == 3.0) == 12


def test_aliasing_within_a_state_is_kept(tmp_path):
    f = nba.FlatTree.from_tree({"a": np.ones(3)})
    arr = np.arange(3.0)
    nba.save_state(tmp_path / "s.npz", {"x": f, "y": (f, arr, arr)})
    s = nba.load_state(tmp_path / "s.npz")
    assert s["x"] is s["y"][0] and s["y"][1] is s["y"][2]


def test_scalars_and_arrays_keep_their_bits_types_and_flags(tmp_path):
    nan_payload = np.frombuffer(b"\x01\x00\xc0\x7f", F32)[0]
    ro = np.array([2**64 - 1, 5], np.uint64)
    ro.flags.writeable = False
    state = {
        "f16": np.float16(1.5),
        "nan": nan_payload,
        "c": np.complex128(1 + 2j),
        "i": np.int32(-7),
        "u": np.uint64(2**64 - 1),
        "b": np.bool_(True),
        "py": (1, 2.5, True, None, "text", float("-inf"), 10**30),
        "ro": ro,
        "zero_d": np.array(3.0),
        (1, "k"): [],
        7: {},
    }
    nba.save_state(tmp_path / "s.npz", state)
    s = nba.load_state(tmp_path / "s.npz")
    for k in ("f16", "c", "i", "u", "b"):
        assert type(s[k]) is type(state[k]) and s[k] == state[k]
    assert s["nan"].tobytes() == nan_payload.tobytes()
    assert s["py"] == state["py"] and type(s["py"][6]) is int
    assert not s["ro"].flags.writeable and s["ro"].tolist() == ro.tolist()
    assert s["zero_d"].shape == () and s["zero_d"].flags.writeable
    assert s[(1, "k")] == [] and s[7] == {}


# --- failure modes ----------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    tx = nba.MultiSteps(nba.adam(1e-3), 2)
    state = tx.init(params_tree())
    _, state = tx.update(grads(0), state)
    path = tmp_path / "ck.npz"
    nba.save_state(path, state)
    return path, tx, state


def test_every_truncation_of_a_checkpoint_raises_value_error(saved, tmp_path):
    path, _, _ = saved
    data = path.read_bytes()
    cut = tmp_path / "cut.npz"
    for n in sorted({*range(0, len(data), max(len(data) // 150, 1)), len(data) - 1, 1, 3, 4, 5}):
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match="empty|truncated or corrupt|not a numbaccum"):
            nba.load_state(cut)


def test_a_flipped_byte_in_the_data_raises_value_error(saved, tmp_path):
    path, _, _ = saved
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("a0.npy")
    # The last byte of the first array's data (past its local header and .npy header).
    with zipfile.ZipFile(path) as z:
        start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    data[start + info.compress_size - 1] ^= 0x40
    bad = tmp_path / "bad.npz"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        nba.load_state(bad)


def _header_only(blob):
    return lambda f: np.savez(f, numbaccum_checkpoint=blob)


OTHER_FILES = [
    (lambda f: np.savez(f, a=np.ones(3)), "another program"),
    (lambda f: np.save(f, np.ones(3)), "not an .npz"),
    (lambda f: f.write(b"step,loss\n1,0.5\n"), "not an .npz"),
    (lambda f: f.write(pickle.dumps({"evil": 1})), "not an .npz"),
    (_header_only(np.array([{"a": 1}], dtype=object)), "truncated or corrupt"),
    (_header_only(np.frombuffer(b"\xff\xfe", np.uint8)), "not UTF-8 JSON"),
    (_header_only(np.frombuffer(b"[1, 2]", np.uint8)), "another program"),
    (lambda f: f.write(b""), "empty"),
]


@pytest.mark.parametrize("content, reason", OTHER_FILES)
def test_a_file_of_another_program_raises_value_error(tmp_path, content, reason):
    path = tmp_path / "other.npz"
    with open(path, "wb") as f:
        content(f)
    with pytest.raises(ValueError, match=reason):
        nba.load_state(path)


def rewrite(path, change):
    """Rewrites a checkpoint with ``change(header)`` applied to its JSON header."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(arrays["numbaccum_checkpoint"].tobytes())
    change(header)
    arrays["numbaccum_checkpoint"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(path, **arrays)


def test_a_newer_format_version_raises_value_error(saved):
    path, _, _ = saved
    rewrite(path, lambda h: h.update(version=ck.VERSION + 1, numbaccum="9.0"))
    with pytest.raises(ValueError, match=r"newer numbaccum \(format version 2, numbaccum '9.0'\).*upgrade"):
        nba.load_state(path)


@pytest.mark.parametrize(
    "change",
    [
        lambda h: h.update(state=["nt", "os:system", [], []]),
        lambda h: h.update(state=["nt", "antigravity:Fly", [], []]),
        lambda h: h.update(state=["nt", "numbaccum:__class__", [], []]),
        lambda h: h.update(state=["array", 99, True]),
        lambda h: h.update(state=["np", "|O", 1]),
        lambda h: h.update(state=["np", "<i4", 2**40]),
        lambda h: h.update(state=["flat", 0, [0], False]),
        lambda h: h.update(state=["ref", 0]),
        lambda h: h.update(state="x" * 10),
        lambda h: h["layouts"][0].update(shapes=[[-1]] * len(h["layouts"][0]["shapes"])),
        lambda h: h["layouts"][0].update(dtypes=["<i8"] * len(h["layouts"][0]["dtypes"])),
        lambda h: h["arrays"][0].__setitem__(1, [10**6]),
        lambda h: h["arrays"][0].__setitem__(0, "|O"),
        lambda h: h.update(state=["list", [["list", []]] * 3 + [["nest"] * 3000]]),
    ],
)
def test_a_malformed_header_raises_value_error_and_imports_nothing(saved, change):
    path, _, _ = saved
    rewrite(path, change)
    with pytest.raises(ValueError):
        nba.load_state(path)
    assert "antigravity" not in sys.modules


def test_like_of_another_structure_shape_or_dtype_raises_value_error(saved):
    path, tx, _ = saved
    p = params_tree()
    other = dict(p, extra=np.ones(2, F32))
    mu = r"state.inner_opt_state\[0\].mu: the checkpoint does not match like: "
    with pytest.raises(ValueError, match=mu + r"params structure differs at params: .*missing \['extra'\]"):
        nba.load_state(path, like=tx.init(other))
    shape = mu + r"params\['dense'\]\['w'\]: shape \(4, 3\) in the file, \(3, 4\) expected"
    with pytest.raises(ValueError, match=shape):
        nba.load_state(path, like=tx.init(dict(p, dense={"w": np.ones((3, 4), F32), "b": p["dense"]["b"]})))
    with pytest.raises(ValueError, match=r"params\['half'\]: dtype float16 in the file, float32 expected"):
        nba.load_state(path, like=tx.init(dict(p, half=p["half"].astype(F32))))
    with pytest.raises(ValueError, match=r"state.acc_grads: .*storage dtypes"):
        nba.load_state(path, like=nba.MultiSteps(nba.adam(1e-3), 2, accumulator_dtype=F64).init(p))
    with pytest.raises(ValueError, match=r"inner_opt_state: .*expected TraceState, the file holds tuple"):
        nba.load_state(path, like=nba.MultiSteps(nba.trace(0.9), 2).init(p))
    with pytest.raises(ValueError, match=r"state: .*expected TraceState"):
        nba.load_state(path, like=nba.trace(0.9).init(p))
    with pytest.raises(ValueError, match=r"state.inner_opt_state: .*2 entries in the file, 1 expected"):
        nba.load_state(path, like=nba.MultiSteps(nba.chain(nba.adam(1e-3)), 2).init(p))
    loaded = nba.load_state(path, like=tx.init(p))  # the right like still loads
    assert isinstance(loaded, nba.MultiStepsState)


def test_like_of_another_history_shape_raises_value_error(tmp_path):
    p = params_tree()
    nba.save_state(tmp_path / "g.npz", nba.clip_norm_growth().init(p))
    why = r"state.prev_norm: .*float64 \(7,\) in the file, an array float64 \(\)"
    with pytest.raises(ValueError, match=why):
        nba.load_state(tmp_path / "g.npz", like=nba.clip_norm_growth(tensorwise=False).init(p))


def test_an_unsavable_state_raises_type_error_before_touching_the_file(saved):
    path, _, state = saved
    before = path.read_bytes()
    with pytest.raises(TypeError, match=r"state.skip_state\['fn'\]: cannot save a function"):
        nba.save_state(path, state._replace(skip_state={"fn": lambda: 0}))
    with pytest.raises(TypeError, match="cannot save an array of dtype object"):
        nba.save_state(path, (np.array([None]),))

    class Local(tuple):
        _fields = ()

    with pytest.raises(TypeError, match="inside a function"):
        nba.save_state(path, Local())
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == [path.name]  # no temporary file left behind


def test_a_crash_before_the_rename_leaves_the_previous_checkpoint(saved, monkeypatch):
    path, tx, state = saved
    before = path.read_bytes()
    _, state = tx.update(grads(1), state)

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        nba.save_state(path, state)
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(path.parent) == [path.name]
    assert isinstance(nba.load_state(path), nba.MultiStepsState)


def test_a_killed_writer_leaves_a_loadable_checkpoint(tmp_path):
    """SIGKILL a process while it rewrites a 48 MB checkpoint in a loop: whenever it dies, the
    file holds one complete checkpoint (the previous or the new one)."""
    path = tmp_path / "big.npz"
    script = textwrap.dedent(
        f"""
        import sys, numpy as np, numbaccum as nba
        tx = nba.ema(0.5)
        state = tx.init({{"w": np.zeros(6_000_000, np.float64)}})
        nba.save_state({str(path)!r}, state)
        print("ready", flush=True)
        g = {{"w": np.ones(6_000_000, np.float64)}}
        while True:
            _, state = tx.update(g, state)
            nba.save_state({str(path)!r}, state)
        """
    )
    for delay in (0.05, 0.2, 0.45):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(delay)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        state = nba.load_state(path)
        count = int(state.count)
        expected = 1.0 - 0.5**count
        assert np.all(state.ema["w"] == expected), count


# --- issue 42, item 8: what a checkpoint file may make load_state do, and what a save leaves --


def _peak_bytes(fn):
    """The peak of memory allocated (NumPy's included) while ``fn`` runs, and its error."""
    import tracemalloc

    tracemalloc.start()
    try:
        try:
            fn()
        except ValueError as e:
            error = e
        else:
            error = None
        return tracemalloc.get_traced_memory()[1], error
    finally:
        tracemalloc.stop()


def test_i42_item8_a_compressed_member_declaring_a_huge_array_is_refused_before_it_is_inflated(tmp_path):
    """A ~64 KB zip whose a0.npy deflates to 2**24 float32 zeros: load_state allocated the
    64 MB (the issue's 2**26 made it 512 MB) before it refused the file."""
    tx = nba.scale_by_adam()
    p = {"w": np.zeros(3, F32)}
    path = tmp_path / "bomb.npz"
    nba.save_state(path, tx.init(p))
    with np.load(path) as z:
        header = json.loads(z["numbaccum_checkpoint"].tobytes())
    n = 2**24
    header["arrays"][0] = ["<f4", [n]]
    header["layouts"][0]["shapes"] = [[n]]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        blob = np.frombuffer(json.dumps(header).encode(), np.uint8)
        with z.open("numbaccum_checkpoint.npy", "w") as f:
            np.lib.format.write_array(f, blob)
        with z.open("a0.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (n,)})
            chunk = bytes(2**20)
            for _ in range(n * 4 // len(chunk)):
                f.write(chunk)
    assert path.stat().st_size < 2**20
    for like in (None, tx.init(p)):
        peak, error = _peak_bytes(lambda: nba.load_state(path, like=like))
        assert error is not None and "compressed" in str(error), error
        assert peak < 4 * 2**20, peak


def test_i42_item8_like_is_checked_before_any_array_is_read(tmp_path):
    """A 16 MB checkpoint of another model, loaded with ``like``: every array was read (and
    copied into buffers) before the mismatch was found."""
    tx = nba.ema(0.9)
    path = tmp_path / "big.npz"
    nba.save_state(path, tx.init({"w": np.zeros(2_000_000, F64)}))
    like = tx.init({"w": np.zeros(10, F64)})
    peak, error = _peak_bytes(lambda: nba.load_state(path, like=like))
    assert error is not None and "does not match like" in str(error), error
    assert peak < path.stat().st_size // 8, peak


def test_i42_item8_a_header_making_two_buffers_one_is_refused_by_like(tmp_path):
    """A crafted header with adam's ``nu`` a reference to its ``mu``: with ``like`` it loaded,
    one buffer for both (every update then computes wrongly)."""
    tx = nba.scale_by_adam()
    p = {"w": np.zeros(3, F32)}
    path = tmp_path / "s.npz"
    nba.save_state(path, tx.init(p))

    def nu_is_mu(h):
        assert h["state"][2] == ["count", "mu", "nu"] and h["state"][3][1][0] == "flat"
        h["state"][3][2] = ["ref", 0]  # the first buffer met: mu

    rewrite(path, nu_is_mu)
    why = r"state.nu: the checkpoint does not match like: the file makes it the buffer of state.mu, like "
    with pytest.raises(ValueError, match=why + "a buffer of its own"):
        nba.load_state(path, like=tx.init(p))
    shared = tx.init(p)
    shared = shared._replace(nu=shared.mu)  # a like whose buffers are one takes such a file
    loaded = nba.load_state(path, like=shared)
    assert loaded.nu is loaded.mu


def test_i42_item8_a_new_checkpoint_gets_the_mode_open_would_give_it(tmp_path):
    """New files were made 0644 whatever the umask: saved weights readable by everyone."""
    state = nba.ema(0.9).init({"w": np.zeros(3, F32)})
    old = os.umask(0o077)
    try:
        nba.save_state(tmp_path / "private.npz", state)
        os.umask(0o027)
        nba.save_state(tmp_path / "group.npz", state)
    finally:
        os.umask(old)
    assert (tmp_path / "private.npz").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "group.npz").stat().st_mode & 0o777 == 0o640
    os.chmod(tmp_path / "private.npz", 0o604)
    nba.save_state(tmp_path / "private.npz", state)  # a file replaced keeps its mode, as open() does
    assert (tmp_path / "private.npz").stat().st_mode & 0o777 == 0o604


def _device_node(path):
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what /dev/null is
    except (PermissionError, AttributeError):
        pytest.skip("cannot make a device node here")


NOT_REGULAR_FILES = {
    "fifo": (lambda p: os.mkfifo(p), "a FIFO"),
    "directory": (os.mkdir, "a directory"),
    "device": (_device_node, "a character device"),
}


@pytest.mark.parametrize("kind", list(NOT_REGULAR_FILES))
def test_i42_item8_only_a_regular_file_is_replaced(tmp_path, kind):
    """save_state renamed its file over whatever was at the path: a FIFO, a device (as root,
    ``save_state("/dev/null", s)`` replaced the system's)."""
    make, what = NOT_REGULAR_FILES[kind]
    path = tmp_path / kind
    make(path)
    before = os.lstat(path)
    state = nba.ema(0.9).init({"w": np.zeros(3, F32)})
    with pytest.raises(OSError, match=f"{what} is there; save_state replaces a regular file only") as e:
        nba.save_state(path, state)
    assert e.value.filename == str(path)
    after = os.lstat(path)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino
    assert sorted(os.listdir(tmp_path)) == [kind]


def test_i42_item8_a_symbolic_link_is_followed_as_open_follows_it(tmp_path):
    """The rename replaced the link itself with a file, leaving its target as it was."""
    tx = nba.ema(0.9)
    p = {"w": np.zeros(3, F32)}
    real, link = tmp_path / "real.npz", tmp_path / "latest.npz"
    nba.save_state(real, tx.init(p))
    os.symlink("real.npz", link)
    _, state = tx.update({"w": np.ones(3, F32)}, tx.init(p))
    nba.save_state(link, state)
    assert os.path.islink(link) and int(nba.load_state(real).count) == 1
    assert sorted(os.listdir(tmp_path)) == ["latest.npz", "real.npz"]


def test_i42_item8_a_name_as_long_as_the_directory_allows_saves(tmp_path):
    """The temporary name was ``.NAME.XXXXXXXX.tmp``: a valid 254-character name failed."""
    name = "s" * 250 + ".npz"
    state = nba.ema(0.9).init({"w": np.zeros(3, F32)})
    nba.save_state(tmp_path / name, state)
    assert int(nba.load_state(tmp_path / name).count) == 0
    assert os.listdir(tmp_path) == [name]


def test_i42_item8_errors_name_the_callers_path_not_the_temporary_file(tmp_path, monkeypatch):
    state = nba.ema(0.9).init({"w": np.zeros(3, F32)})
    missing = tmp_path / "no-such-dir" / "s.npz"
    with pytest.raises(FileNotFoundError) as e:
        nba.save_state(missing, state)
    assert e.value.filename == str(missing) and ".tmp" not in str(e.value)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    path = tmp_path / "s.npz"
    with pytest.raises(OSError, match="No space left on device") as e:
        nba.save_state(path, state)
    assert e.value.filename == str(path) and ".tmp" not in str(e.value)
    assert os.listdir(tmp_path) == []


KILLED_SAVE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import numbaccum as nba

    def stuck(f, **arrays):  # writes a part of the file, then waits to be killed
        f.write(b"PK" + bytes(100_000))
        f.flush()
        print("writing", flush=True)
        sys.stdin.readline()

    np.savez = stuck
    nba.save_state(sys.argv[1], nba.ema(0.9).init({"w": np.zeros(3, np.float32)}))
    """
)


def test_i42_item8_the_next_save_removes_what_a_killed_save_left_never_what_one_writes(tmp_path):
    """A save killed mid-write left its temporary file forever. The next save of the same
    path removes it, but not the one a save in another process is writing meanwhile."""
    path = tmp_path / "s.npz"
    tx = nba.ema(0.9)
    state = tx.init({"w": np.zeros(3, F32)})
    nba.save_state(path, state)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        (theirs,) = set(os.listdir(tmp_path)) - {path.name}
        nba.save_state(path, state)  # while the other process writes: its file is left
        assert sorted(os.listdir(tmp_path)) == sorted([path.name, theirs])
    finally:
        proc.kill()
        proc.wait()
    _, state = tx.update({"w": np.ones(3, F32)}, state)
    nba.save_state(path, state)  # the killed save's file goes
    assert os.listdir(tmp_path) == [path.name]
    assert int(nba.load_state(path).count) == 1


def test_i42_item8_two_threads_saving_one_path_never_remove_each_others_file(tmp_path, monkeypatch):
    path = tmp_path / "s.npz"
    tx = nba.ema(0.9)
    first = tx.init({"w": np.zeros(3, F32)})
    second = tx.init({"w": np.ones(3, F32)})
    entered, release = threading.Event(), threading.Event()
    write = ck._write_npz

    def slow(f, arrays):
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            assert release.wait(30)
        write(f, arrays)

    monkeypatch.setattr(ck, "_write_npz", slow)
    errors: list = []

    def save():
        try:
            nba.save_state(path, first)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=save)
    t.start()
    try:
        assert entered.wait(30)
        nba.save_state(path, second)
        assert len(os.listdir(tmp_path)) == 2  # the other thread's file is still there
    finally:
        release.set()
        t.join(30)
    assert not errors, errors
    assert os.listdir(tmp_path) == [path.name]
    assert np.all(nba.load_state(path).ema["w"] == 0.0)  # the later rename wins


# --- a file names classes, it never imports them (issue 22, item 5) ---------------------------

# NamedTuple classes of numbaccum that no state holds (plans, specs, kernels): the only ones the
# registry may lack. A new class is a state class until it is listed here.
NOT_STATE_CLASSES = {
    "numbaccum.updates:Spec",
    "numbaccum.formulas:Formula",
    "numbaccum.tables:RowColumnPass",  # an axis pass's formulas (Adafactor's)
    "numbaccum.tables:AxesPass",  # (SM3's)
    "numbaccum.fuse:Later",
    "numbaccum.runner:Sub",
    "numbaccum.factored:_Axes",
    "numbaccum.factored:_Factoring",
    "numbaccum.masking:_Plan",
    "numbaccum.norms:_GroupSlices",
    "numbaccum.norms:_Slicing",
    "numbaccum.norms:_Target",
    "numbaccum.passes:Explanation",
    "numbaccum.passes:Pass",
    "numbaccum.quasi_newton:_Point",
    "numbaccum.lookahead:LookaheadParams",
    "numbaccum.distributed:Calibration",  # calibrate()'s answer
    "numbaccum.distributed:_Bucket",  # a bucket size and where it came from
}

# Names of real callables and modules a crafted file might try.
HOSTILE_CLASS_NAMES = [
    "numbaccum.__main__:X",
    "numbaccum.__main__:main",
    "numbaccum.cli:main",
    "numbaccum:__class__",
    "numbaccum:GradientTransformation",  # a NamedTuple of numbaccum, but not a state
    "numbaccum.checkpoint:_registered",
    "os:system",
    "builtins:eval",
    "builtins:__import__",
    "subprocess:Popen",
    "antigravity:Fly",
    "numpy:testing",  # numpy imports its submodules on attribute access
    "importlib:import_module",
    "strategies:Pair.__class__",
    ":",
    "",
]


def _is_namedtuple_class(obj):
    return isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields")


def test_every_namedtuple_class_of_numbaccum_is_registered_or_listed_as_not_a_state():
    found = set()
    for info in pkgutil.walk_packages(nba.__path__, "numbaccum."):
        if info.name == "numbaccum.__main__":  # importing it runs the command line
            continue
        module = importlib.import_module(info.name)
        found |= {
            obj
            for obj in vars(module).values()
            if _is_namedtuple_class(obj)
            and obj.__module__ == module.__name__
            and not issubclass(obj, nba.GradientTransformation)  # transformations (torchzero's too)
        }
    registered = set(ck._registry().values())
    missing = {f"{c.__module__}:{c.__qualname__}" for c in found - registered}
    assert missing == NOT_STATE_CLASSES, (
        f"not registered: {sorted(missing - NOT_STATE_CLASSES)}; "
        f"listed as no state but registered or gone: {sorted(NOT_STATE_CLASSES - missing)}"
    )
    assert {c for c in registered if c.__module__.startswith("numbaccum")} <= found | {strat.Pair}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_state_holds_only_registered_classes(case):
    make, _, _ = CASES[case]
    registered = set(ck._registry().values())
    state = make().init(params_tree())
    held = {type(x) for x in ck._walk(state) if ck._is_namedtuple(x)}
    assert held and held <= registered, held - registered


@contextlib.contextmanager
def nothing_imported():
    """Fails the test if the block calls ``importlib.import_module``, or ``__import__`` for
    numbaccum, a relative name or a module not imported yet (each such call is recorded and
    refused), or changes ``sys.modules``. (NumPy imports modules it has loaded already on each
    call, ``zipfile`` in ``np.load``, ``numpy._core._dtype`` to print a dtype: those pass.)"""
    calls = []
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def refuse(name, *args, **kwargs):
        calls.append(name)
        raise ImportError(f"the loader tried to import {name!r}")

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level or name not in sys.modules or name.partition(".")[0] == "numbaccum":
            return refuse(name)
        return real_import(name, globals, locals, fromlist, level)

    before = set(sys.modules)
    builtins.__import__, importlib.import_module = guarded_import, refuse
    try:
        yield
    finally:
        builtins.__import__, importlib.import_module = real_import, real_import_module
    assert not calls, f"imported {calls}"
    assert set(sys.modules) == before, sorted(set(sys.modules) ^ before)


def load_or_value_error(path):
    """load_state(path) under `nothing_imported`: (state, None) or (None, its ValueError); any
    other exception fails the test."""
    ck._registry()  # the first use of the registry imports numbaccum's own state modules
    with nothing_imported():
        try:
            return nba.load_state(path), None
        except ValueError as e:
            return None, e


@pytest.fixture
def pristine(saved):
    """A real checkpoint's path and its bytes (the file is rewritten by each example)."""
    path, _, _ = saved
    return path, path.read_bytes()


def _registered_only(state):
    for x in ck._walk(state):
        if ck._is_namedtuple(x):
            assert type(x) in set(ck._registry().values()), type(x)


def _wrap(node, wrappers):
    """``node`` nested in lists, tuples, dicts and registered NamedTuples, outermost last."""
    for w in wrappers:
        node = {
            "list": ["list", [["none"], node]],
            "tuple": ["tuple", [node]],
            "dict": ["dict", [[["str", "k"], node]]],
            "nt": ["nt", "numbaccum:MaskedState", ["inner_state"], [node]],
        }[w]
    return node


class_names = st.one_of(
    st.sampled_from(HOSTILE_CLASS_NAMES),
    st.from_regex(r"[a-z_][a-z0-9_.]{0,15}:[A-Za-z_][A-Za-z0-9_.]{0,15}", fullmatch=True),
    st.text(max_size=20),
).filter(lambda n: n not in ck._registry())
field_lists = st.lists(st.sampled_from(["a", "b", "count", "inner_state", "__class__"]), max_size=3)
wrappers = st.lists(st.sampled_from(["list", "tuple", "dict", "nt"]), max_size=6)


@pytest.mark.parametrize("name", HOSTILE_CLASS_NAMES)
def test_a_header_naming_a_real_callable_raises_value_error_and_imports_nothing(pristine, name):
    path, data = pristine
    rewrite(path, lambda h: h.update(state=["nt", name, [], []]))
    state, err = load_or_value_error(path)
    assert err is not None and short_repr(name) in str(err), err


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=class_names, fields=field_lists, nesting=wrappers, where=st.sampled_from(["state", "treedef"]))
def test_fuzzed_class_names_anywhere_raise_value_error_naming_them_and_import_nothing(
    pristine, name, fields, nesting, where
):
    path, data = pristine
    path.write_bytes(data)
    bad = ["nt", name, fields, [["leaf"] if where == "treedef" else ["none"] for _ in fields]]

    def change(h):
        if where == "state":
            h["state"] = _wrap(bad, nesting)
        else:  # the params' structure of a buffer's layout
            h["layouts"][0]["treedef"] = ["list", [bad]] if nesting else bad

    rewrite(path, change)
    state, err = load_or_value_error(path)
    assert err is not None, f"{name!r} loaded as {state!r}"
    assert short_repr(name) in str(err), err


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=20,
)


def _node_strategy():
    """Header nodes: well-formed tags with drawn arguments, random JSON, and random classes."""
    leaf = st.one_of(
        st.just(["none"]),
        st.tuples(st.just("int"), st.integers(-(2**70), 2**70)).map(list),
        st.tuples(st.just("float"), st.text(max_size=12)).map(list),
        st.tuples(
            st.just("np"), st.sampled_from(["<f4", "<i8", "|O", "<U3", "V2", "?", "x"]), json_values
        ).map(list),
        st.tuples(st.just("array"), st.integers(-2, 40), st.booleans()).map(list),
        st.tuples(st.sampled_from(["ref", "layout"]), st.integers(-2, 40)).map(list),
        st.tuples(
            st.just("flat"), st.integers(-1, 3), st.lists(st.integers(-1, 40), max_size=3), json_values
        ).map(list),
        json_values,
    )

    def compound(kids):
        names = st.sampled_from(sorted(ck._registry())) | class_names
        return st.one_of(
            st.tuples(st.sampled_from(["list", "tuple"]), st.lists(kids, max_size=4)).map(list),
            st.tuples(st.just("dict"), st.lists(st.tuples(leaf, kids).map(list), max_size=3)).map(list),
            st.tuples(st.just("nt"), names, field_lists, st.lists(kids, max_size=3)).map(list),
        )

    return st.recursive(leaf, compound, max_leaves=25)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(node=_node_strategy(), part=st.sampled_from(["state", "treedef", "layout", "arrays", "whole", "key"]))
def test_fuzzed_headers_load_or_raise_value_error_and_import_nothing(pristine, node, part):
    path, data = pristine
    path.write_bytes(data)

    def change(h):
        if part == "state":
            h["state"] = node
        elif part == "treedef":
            h["layouts"][0]["treedef"] = node
        elif part == "layout":
            h["layouts"][0] = node
        elif part == "arrays":
            h["arrays"] = node
        elif part == "whole":
            h.clear()
            h.update(format="numbaccum-state", version=1, arrays=node, layouts=node, state=node)
        else:
            del h[sorted(h)[len(str(node)) % len(h)]]

    rewrite(path, change)
    state, err = load_or_value_error(path)
    if err is None:
        _registered_only(state)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4)
)
def test_random_byte_flips_load_or_raise_value_error_and_import_nothing(pristine, flips):
    path, data = pristine
    bad = bytearray(data)
    for where, mask in flips:
        bad[int(where * len(bad))] ^= mask
    path.write_bytes(bytes(bad))
    state, err = load_or_value_error(path)
    if err is None:
        _registered_only(state)


def test_the_issue_example_a_header_naming_the_command_line_does_not_run_it(saved, tmp_path):
    """The crafted file of the issue, loaded in a fresh process: ValueError, and the process
    goes on (before, it imported ``numbaccum.__main__``, printed ``numbaccum info`` and exited)."""
    path, _, _ = saved
    rewrite(path, lambda h: h.update(state=["nt", "numbaccum.__main__:X", [], []]))
    script = textwrap.dedent(
        f"""
        import numbaccum as nba
        try:
            nba.load_state({str(path)!r})
        except ValueError as e:
            print("refused:", e)
        print("still here")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "numbaccum.__main__:X" in out.stdout
    assert out.stdout.rstrip().endswith("still here"), out.stdout


class UserState(NamedTuple):
    """The state class of a transformation a user wrote (registered by its test only)."""

    count: Any
    buffer: Any


def test_a_user_state_class_loads_once_registered_or_with_like(tmp_path):
    state = UserState(np.int32(3), nba.FlatTree.from_tree(params_tree()))
    nba.save_state(tmp_path / "u.npz", state)
    name = f"{__name__}:UserState"
    if name not in ck._registry():  # (a second run in one process has registered it)
        with pytest.raises(ValueError, match=f"'{name}' is not a state class.*register_state_class"):
            nba.load_state(tmp_path / "u.npz")
    assert type(nba.load_state(tmp_path / "u.npz", like=state)) is UserState  # like's classes
    assert nba.register_state_class(UserState) is UserState
    loaded = nba.load_state(tmp_path / "u.npz")
    assert type(loaded) is UserState and loaded.count == 3


def test_register_state_class_refuses_what_a_file_could_not_name():
    class Local(NamedTuple):
        x: int

    with pytest.raises(TypeError, match="inside a function"):
        nba.register_state_class(Local)
    for bad in (dict, tuple, os.system, Local(1)):
        with pytest.raises(TypeError, match="cls: expected a NamedTuple class"):
            nba.register_state_class(bad)
    assert "strategies:Pair" in ck._registry()


def _v1_state():
    """The state tests/data/checkpoint_v1.npz holds: ``save_state`` of this, run with the code of
    landed main 7d5d46e (format version 1, before the class registry)."""
    p = {k: v for k, v in params_tree().items() if k not in ("scalar", "empty")}
    tx = nba.chain(
        nba.clip_by_global_norm(1.0),
        nba.trace(0.9),
        nba.ema(0.5, accumulator_dtype=F64),
        nba.apply_if_finite(nba.scale_by_adam(), 2),
        nba.inject_hyperparams(nba.sgd)(learning_rate=0.1, momentum=0.9),
    )
    s = tx.init(p)
    for k in range(3):
        g = nba.tree_map(
            lambda x, k=k: ((k + 1.5) * (np.arange(x.size) - 2.0)).reshape(x.shape).astype(x.dtype), p
        )
        _, s = tx.update(g, s, p)
    return tx, p, s


def test_a_checkpoint_written_before_the_registry_still_loads():
    path = os.path.join(os.path.dirname(__file__), "data", "checkpoint_v1.npz")
    tx, p, state = _v1_state()
    assert_bits_equal(nba.load_state(path), state)
    assert_bits_equal(nba.load_state(path, like=tx.init(p)), state)


# --- pickle and deepcopy ----------------------------------------------------------------------


def test_the_issue_example_a_pickled_state_keeps_learning():
    g = {"w": np.ones(3, np.float32)}
    tx = nba.ema(0.5, debias=False)
    s = tx.init(g)
    _, s = tx.update(g, s)
    s2 = pickle.loads(pickle.dumps(s))
    s3 = copy.deepcopy(s)
    states = [s, s2, s3]
    for expected in (0.75, 0.875, 0.9375):
        for i, state in enumerate(states):
            u, states[i] = tx.update(g, state)
            assert np.all(u["w"] == expected)


def test_a_pickled_dpsgd_state_passes_the_layout_check():
    tx = nba.dpsgd(0.1, 1.0, 1.1, seed=0, momentum=0.9)
    p = params_tree()
    for restore in (lambda s: pickle.loads(pickle.dumps(s)), copy.deepcopy):
        s = tx.init(p)
        _, s = tx.update(grads(0, 4), s, p)
        r = restore(s)
        for step in range(1, 4):
            x, s = tx.update(grads(step, 4), s, p)
            x = nba.tree_map(np.copy, x)
            y, r = tx.update(grads(step, 4), r, p)
            assert_bits_equal(y, x)


def test_a_pickled_flat_tree_keeps_views_buffers_and_layout():
    f = nba.FlatTree.from_tree(params_tree())
    for g in (pickle.loads(pickle.dumps(f)), copy.deepcopy(f), f.copy()):
        assert g.layout is f.layout and g.group_dtypes == f.group_dtypes
        assert_bits_equal(g, f)
        g["dense"]["w"][...] = 7.0  # a leaf view writes into the buffers ...
        assert np.count_nonzero(g.buffers[np.dtype(F32)] == 7.0) == 12
        assert not np.any(f["dense"]["w"] == 7.0)  # ... of the copy only
        for d, buf in g.buffers.items():  # the groups are runs of the buffers
            assert any(np.shares_memory(buf, grp) for grp in g.groups if grp.dtype == d)


def test_a_pickled_read_only_flat_tree_stays_read_only():
    tx = nba.MultiSteps(nba.trace(0.9), 2)
    p = {"w": np.ones(3, F32)}
    zeros, _ = tx.update(p, tx.init(p))  # the read-only zeros of a non-emitting step
    for restored in (pickle.loads(pickle.dumps(zeros)), copy.deepcopy(nba.FlatTree.from_tree(zeros))):
        assert np.all(restored["w"] == 0)
    f = nba.FlatTree.from_tree(p)
    f._mark_readonly()
    for g in (pickle.loads(pickle.dumps(f)), copy.deepcopy(f)):
        with pytest.raises(ValueError):
            g["w"][0] = 1.0


def test_copy_copy_of_a_flat_tree_shares_its_storage():
    f = nba.FlatTree.from_tree({"w": np.ones(3, F32)})
    g = copy.copy(f)
    g["w"][0] = 5.0
    assert f["w"][0] == 5.0 and g.layout is f.layout


def test_a_pickled_layout_and_treedef_are_the_interned_ones():
    f = nba.FlatTree.from_tree(params_tree())
    assert pickle.loads(pickle.dumps(f.layout)) is f.layout
    assert copy.deepcopy(f.layout) is f.layout
    td = pickle.loads(pickle.dumps(f.treedef))
    assert td == f.treedef
    from numbaccum.tree import _LEAF_DEF

    assert td.children[0].children[0] is _LEAF_DEF


# --- CUDA (the simulator under CI) --------------------------------------------------------------

CUDA_SCRIPT = textwrap.dedent(
    """
    import copy, pickle, sys
    import numpy as np
    from numba import cuda
    import numbaccum as nba

    path = sys.argv[1]
    rng = np.random.default_rng(0)
    p = {"w": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(4)}
    gs = [nba.tree_map(lambda x: cuda.to_device(rng.standard_normal(x.shape).astype(x.dtype)), p)
          for _ in range(6)]
    dp = nba.to_device(p)
    tx = nba.MultiSteps(nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-2), nba.ema(0.9)), 2)
    state = tx.init(dp)
    for g in gs[:3]:
        _, state = tx.update(g, state)
    nba.save_state(path, state)
    loaded = nba.load_state(path)
    like = nba.load_state(path, like=tx.init(dp))
    on_host = nba.load_state(path, like=tx.init(p))
    assert loaded.acc_grads.device and like.acc_grads.device and not on_host.acc_grads.device
    others = [loaded, like, pickle.loads(pickle.dumps(state)), copy.deepcopy(state)]
    for g in gs[3:]:
        u, state = tx.update(g, state)
        u = {k: v.copy_to_host() for k, v in u.items()}
        for i, s in enumerate(others):
            v, others[i] = tx.update(g, s)
            for k in u:
                assert u[k].tobytes() == v[k].copy_to_host().tobytes(), (i, k)
    print("ok")
    """
)


def test_a_cuda_state_saves_from_and_loads_to_the_device_in_the_simulator(tmp_path):
    sim = {"NUMBA_ENABLE_CUDASIM": "1", "NUMBACCUM_CUDA_THREADS": "4", "NUMBACCUM_CUDA_MAX_BLOCKS": "8"}
    env = dict(os.environ, **sim)
    r = subprocess.run(
        [sys.executable, "-c", CUDA_SCRIPT, str(tmp_path / "cuda.npz")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
