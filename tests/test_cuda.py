"""The CUDA backend: the same transformations on device arrays agree with the CPU.

Runs on a real GPU, or in numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, which `.ci/run`
exports for a pass of its own, with 4 threads per block so that small inputs span many blocks).
Every test that needs CUDA carries the ``cuda`` marker (``needs_cuda``): tests/conftest.py
skips them where neither a GPU nor the simulator is available, and .ci/run's simulator pass
selects them all with ``-m cuda``.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import strategies as strat
from hypothesis import HealthCheck, given, settings
from registry import CASES, cases

import numbaccum as nba

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


needs_cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(SIM, reason="needs a real GPU, not the simulator")


def test_import_does_not_import_numba_cuda():
    code = (
        "import sys, numbaccum, numpy as np; tx = numbaccum.ema(0.9); p = np.zeros(3);"
        "tx.update(p, tx.init(p)); print('numba.cuda' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def dev(tree):
    from numba import cuda

    return nba.tree_map(lambda x: cuda.to_device(np.asarray(x)), tree)


def host(tree):
    return nba.tree_map(lambda x: np.asarray(x.copy_to_host() if hasattr(x, "copy_to_host") else x), tree)


def params(dtype=np.float32, n=7):
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, n)).astype(dtype),
        "b": rng.standard_normal(n).astype(dtype),
        "s": np.array(0.5, dtype),
        "e": np.zeros((0, 2), dtype),
    }


def grads(step, dtype=np.float32, n=7):
    rng = np.random.default_rng(100 + step)
    return nba.tree_map(lambda p: rng.standard_normal(p.shape).astype(dtype), params(dtype, n))


# Every transformation of the registry (tests/registry.py) that takes plain updates, and some
# compositions of its own.
TXS = {n: CASES[n].make for n in cases(cuda=True, per_example=False)}
TXS |= {
    "trace_nesterov9": lambda: nba.trace(0.9, nesterov=True),
    "multisteps_sgd_skip": lambda: nba.MultiSteps(
        nba.sgd(0.1, momentum=0.9), 2, use_grad_mean=False, should_skip_update_fn=nba.skip_not_finite
    ),
    "zero_nans_sgd": lambda: nba.chain(nba.zero_nans(), nba.sgd(0.1, momentum=0.5)),
    "multisteps_clip_adam": lambda: nba.MultiSteps(
        nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-2)), 2
    ),
    # masking: the kept leaves' runs of the flat buffers, on the device
    "adamw_like_masked_decay": lambda: nba.chain(
        nba.scale_by_adam(),
        nba.add_decayed_weights(1e-2, lambda p: nba.tree_map(lambda x: x.ndim > 1, p)),
        nba.scale(-0.1),
    ),
    "adamw_nesterov": lambda: nba.adamw(1e-2, weight_decay=0.1, nesterov=True),
    "rmsprop_centered_momentum_bc": lambda: nba.rmsprop(
        1e-2, centered=True, momentum=0.9, bias_correction=True
    ),
    "masked_trace_odd_sizes": lambda: nba.masked(
        nba.chain(nba.scale(2.0), nba.trace(0.9)), lambda p: nba.tree_map(lambda x: x.size % 2 == 1, p)
    ),
}


def close(a, b, dtype):
    # CUDA contracts a * b + c into fused multiply-adds: agreement within float32 rounding of the
    # operands, so where two terms nearly cancel the error is relative to the update's scale.
    rtol = 2e-6 if dtype == np.float32 else 1e-12
    scale = float(np.max(np.abs(b))) if np.size(b) else 0.0
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


# float32 for every transformation; float64 for the compositions (every formula's float64 kernel
# also runs on the random mixed-dtype trees below): the simulator's time is the CI's.
DEVICE_CASES = [(n, np.float32) for n in sorted(TXS)] + [
    (n, np.float64) for n in sorted(TXS) if n not in CASES
]


@needs_cuda
@pytest.mark.parametrize("name,dtype", DEVICE_CASES, ids=[f"{n}-{d.__name__}" for n, d in DEVICE_CASES])
def test_transformations_on_device_match_cpu(name, dtype):
    tx_cpu, tx_gpu = TXS[name](), TXS[name]()
    p = params(dtype)
    s_cpu, s_gpu = tx_cpu.init(p), tx_gpu.init(dev(p))
    assert s_gpu is not None
    launched = 0
    for step in range(4):
        g = grads(step, dtype)
        u_cpu, s_cpu = tx_cpu.update(g, s_cpu, p)
        g_dev, p_dev = dev(g), dev(p)
        before = _launches()
        u_gpu, s_gpu = tx_gpu.update(g_dev, s_gpu, p_dev)
        launched += _launches() - before
        assert_on_device(u_gpu, f"{name} step {step}")
        got = host(u_gpu)
        for a, b in zip(nba.tree_flatten(got)[0], nba.tree_flatten(u_cpu)[0]):
            assert a.dtype == b.dtype and a.shape == b.shape
            close(a, b, dtype)
    assert launched >= 1, f"{name}: no kernel ran on the device in 4 updates"


@needs_cuda
@pytest.mark.parametrize("variant", ["sps", "sps+"])
def test_polyak_on_device_matches_cpu(variant):
    """scale_by_polyak needs the objective's value at each update (the registry's tests pass
    none): polyak_sgd on the device against the host, values above and below ``f_min``."""
    tx_cpu, tx_gpu = (
        nba.polyak_sgd(0.5, f_min=0.2, variant=variant),
        nba.polyak_sgd(0.5, f_min=0.2, variant=variant),
    )
    p = params()
    s_cpu, s_gpu = tx_cpu.init(p), tx_gpu.init(dev(p))
    for step, value in enumerate((3.0, 0.1, np.float32(1.5))):
        g = grads(step)
        u_cpu, s_cpu = tx_cpu.update(g, s_cpu, p, value=value)
        u_gpu, s_gpu = tx_gpu.update(dev(g), s_gpu, dev(p), value=value)
        assert_on_device(u_gpu, f"polyak step {step}")
        for a, b in zip(nba.tree_flatten(host(u_gpu))[0], nba.tree_flatten(u_cpu)[0]):
            close(a, b, np.float32)


def assert_on_device(tree, msg=""):
    """Every leaf of ``tree`` (or of a FlatTree) is a CUDA device array, not a host copy."""
    tree = tree.tree if isinstance(tree, nba.FlatTree) else tree
    for leaf in nba.tree_flatten(tree)[0]:
        on_device = not isinstance(leaf, np.ndarray | np.generic) and hasattr(leaf, "copy_to_host")
        assert on_device, f"{msg}: a {type(leaf).__name__} came back, not a device array"


@needs_cuda
def test_flattree_on_device_round_trip_and_views():
    p = params()
    flat = nba.FlatTree.from_tree(dev(p))
    assert flat.device
    for a, b in zip(nba.tree_flatten(host(flat.tree))[0], nba.tree_flatten(p)[0]):
        np.testing.assert_array_equal(a, b)
    back = nba.to_host(flat)
    assert not back.device
    np.testing.assert_array_equal(back["w"], p["w"])
    again = nba.to_device(p)  # a plain tree in: the same tree of device arrays out
    assert isinstance(again, dict) and hasattr(again["b"], "copy_to_host")
    np.testing.assert_array_equal(host(again)["b"], p["b"])
    np.testing.assert_array_equal(nba.to_host(again)["w"], p["w"])


@needs_cuda
def test_global_norm_and_skip_on_device():
    p = params(np.float64)
    np.testing.assert_allclose(nba.global_norm(dev(p)), nba.global_norm(p), rtol=1e-14)
    for ord in (1, np.inf):
        np.testing.assert_allclose(nba.global_norm(dev(p), ord=ord), nba.global_norm(p, ord=ord), rtol=1e-14)
    bad = params(np.float64)
    bad["b"][2] = np.nan
    assert bool(nba.skip_not_finite(dev(bad), 0, None)[0])


def _launches():
    from numbaccum.cuda import driver

    return driver.LAUNCHES[0]


@needs_cuda
@pytest.mark.parametrize("name", ["trace", "ema", "multisteps_adam"])
def test_launches_per_update_do_not_grow_with_leaves(name):
    counts = []
    for n_leaves in (3, 30):
        rng = np.random.default_rng(n_leaves)
        p = {f"p{i:02d}": rng.standard_normal(5).astype(np.float32) for i in range(n_leaves)}
        pf, gf = nba.FlatTree.from_tree(dev(p)), nba.FlatTree.from_tree(dev(p))
        tx = TXS[name]()
        s = tx.init(pf)
        _, s = tx.update(gf, s, pf)  # first call allocates workspaces
        before = _launches()
        for _ in range(2):
            _, s = tx.update(gf, s, pf)
        counts.append(_launches() - before)
    assert counts[0] == counts[1]
    assert 2 <= counts[0] <= 2 * 3  # 1 to 3 launches per update here, never one per leaf


@needs_cuda
def test_a_fused_update_is_one_pre_pass_and_one_pass_per_group(monkeypatch):
    p = {"w": params()["w"], "d": params(np.float64)["b"]}  # two dtype groups
    pf = nba.FlatTree.from_tree(dev(p))
    gf = nba.FlatTree.from_tree(dev({"w": grads(0)["w"], "d": grads(0, np.float64)["b"]}))
    counts, outs = {}, {}
    for mode in ("1", "0"):
        monkeypatch.setenv("NUMBACCUM_FUSE", mode)
        tx = nba.chain(nba.clip_by_global_norm(0.5), nba.ema(0.9), nba.trace(0.9), nba.scale(-0.1))
        s = tx.update(gf, tx.init(pf))[1]
        before = _launches()
        u, s = tx.update(gf, s)
        counts[mode] = _launches() - before
        outs[mode] = host(u.tree)
    assert counts["1"] == 2 + 2  # the norm: one launch per group; then one fused pass per group
    assert counts["0"] == 2 + 3 * 2  # ema, trace, and the pending scale settled
    for k in p:
        close(outs["1"][k], outs["0"][k], p[k].dtype)


@needs_cuda
@pytest.mark.parametrize(
    "make",
    [
        lambda: nba.chain(nba.clip_by_global_norm(0.5), nba.adam(1e-2)),
        # After a stage that fuses nothing, the pending factor is settled in the apply's pass
        # (`fuse.apply_settled`): SM3's learning rate; a clip's factor, kept on the device.
        lambda: nba.sm3(0.3),
        lambda: nba.chain(nba.adafactor(0.3), nba.clip_by_global_norm(0.01)),
    ],
    ids=["clip_adam", "sm3", "adafactor_clip"],
)
def test_step_on_device_matches_update_then_apply(make):
    p = params()
    tx_a, tx_b = make(), make()
    pa, pb = nba.FlatTree.from_tree(dev(p)), nba.FlatTree.from_tree(dev(p))
    sa, sb = tx_a.init(pa), tx_b.init(pb)
    for step in range(3):
        g = dev(grads(step))
        sa = nba.step_(tx_a, g, sa, pa)
        u, sb = tx_b.update(g, sb, pb)
        nba.apply_updates_(pb, u)
    for a, b in zip(nba.tree_flatten(host(pa.tree))[0], nba.tree_flatten(host(pb.tree))[0]):
        close(a, b, np.float32)


@needs_cuda
def test_no_host_sync_in_trace_ema_clip_and_multisteps(monkeypatch):
    from numbaccum import arrays

    p = params()
    pf = nba.FlatTree.from_tree(dev(p))
    gf = nba.FlatTree.from_tree(dev(grads(0)))
    syncs = []
    array_type = type(pf.groups[0])
    real = array_type.copy_to_host
    monkeypatch.setattr(
        array_type, "copy_to_host", lambda self, *a, **k: syncs.append(1) or real(self, *a, **k)
    )
    monkeypatch.setattr(arrays, "to_host", lambda x: syncs.append(1))
    txs = (
        nba.trace(0.9),
        nba.ema(0.9),
        nba.MultiSteps(nba.adam(1e-3), 3),
        nba.clip_by_global_norm(1.0),
        nba.chain(nba.clip_by_global_norm(0.1), nba.ema(0.9)),
        nba.MultiSteps(nba.chain(nba.clip_by_global_norm(0.1), nba.adam(1e-3)), 2),  # emits too
    )
    for tx in txs:
        s = tx.init(pf)
        for _ in range(2):  # MultiSteps: two mini-steps, no emission
            _, s = tx.update(gf, s, pf)
    assert syncs == []


@needs_cuda
def test_host_arrays_into_a_device_state_name_the_leaf():
    tx = nba.ema(0.9)
    s = tx.init(dev(params()))
    with pytest.raises(TypeError, match=r"updates\['b'\]: a NumPy array"):
        tx.update(grads(0), s)


def test_broken_cuda_stack_gives_one_clear_error(monkeypatch):
    pytest.importorskip("numba.cuda")
    from numbaccum.cuda import device

    monkeypatch.setattr(device, "_checked", [])

    def broken(*args, **kwargs):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    from numba import cuda

    monkeypatch.setattr(cuda, "device_array", broken)
    with pytest.raises(RuntimeError, match=r"pip install 'numbaccum\[cuda\]'"):
        device.cuda_module()


@needs_cuda
@needs_gpu
@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_framework_arrays_in_same_type_out_zero_copy(framework):
    mod = pytest.importorskip(framework)
    p = params()
    conv = (lambda x: mod.as_tensor(x, device="cuda")) if framework == "torch" else mod.asarray
    to_np = (lambda x: x.cpu().numpy()) if framework == "torch" else mod.asnumpy
    tx_cpu, tx_gpu = nba.MultiSteps(nba.adam(1e-2), 2), nba.MultiSteps(nba.adam(1e-2), 2)
    s_cpu, s_gpu = tx_cpu.init(p), tx_gpu.init(nba.tree_map(conv, p))
    for step in range(4):
        g = grads(step)
        u_cpu, s_cpu = tx_cpu.update(g, s_cpu, p)
        u_gpu, s_gpu = tx_gpu.update(nba.tree_map(conv, g), s_gpu, nba.tree_map(conv, p))
        assert type(u_gpu["w"]).__module__.startswith(framework)
        for a, b in zip(nba.tree_flatten(u_gpu)[0], nba.tree_flatten(u_cpu)[0]):
            close(to_np(a), b, np.float32)
    # the returned arrays are views of the state's workspace, not copies
    ptr = u_gpu["w"].data_ptr() if framework == "torch" else u_gpu["w"].data.ptr
    u2, s_gpu = tx_gpu.update(nba.tree_map(conv, grads(9)), s_gpu, nba.tree_map(conv, p))
    u3, s_gpu = tx_gpu.update(nba.tree_map(conv, grads(10)), s_gpu, nba.tree_map(conv, p))
    ptr3 = u3["w"].data_ptr() if framework == "torch" else u3["w"].data.ptr
    assert ptr == ptr3


@needs_cuda
@needs_gpu
def test_torch_views_of_one_buffer_are_read_without_a_copy():
    """A tree of torch tensors that are consecutive views of one buffer per dtype (a FlatTree's
    ``tree_as('torch')``) is taken zero-copy with torch's cheap attributes; separate tensors,
    a permuted view and a wrong shape take the general path (packed, or a named error)."""
    torch = pytest.importorskip("torch")
    from numbaccum.flat import as_flat

    p = {**params(), "d": np.arange(4.0)}  # a float64 group too
    flat = nba.FlatTree.from_tree(dev(p))
    views = flat.tree_as("torch")
    got, copied, kind = as_flat(views, flat.layout, "updates")
    assert not copied and kind == "torch"
    for d, buf in got.buffers.items():
        assert buf.device_ctypes_pointer.value == flat.buffers[d].device_ctypes_pointer.value
    separate = nba.tree_map(lambda x: torch.as_tensor(x, device="cuda"), p)
    assert as_flat(separate, flat.layout, "updates")[1]  # packed
    clip = nba.clip_by_global_norm(1.0)  # stateless: the layout of its last call, checked cheaply
    for _ in range(2):
        u, _ = clip.update(views, clip.init(None))
        assert type(u["w"]).__module__.startswith("torch")
    tx_view, tx_sep = nba.ema(0.9), nba.ema(0.9)
    s_view, s_sep = tx_view.init(views), tx_sep.init(separate)
    for _ in range(2):
        u_view, s_view = tx_view.update(views, s_view, views)
        u_sep, s_sep = tx_sep.update(separate, s_sep, separate)
        for a, b in zip(nba.tree_flatten(u_view)[0], nba.tree_flatten(u_sep)[0]):
            assert type(a).__module__.startswith("torch")
            np.testing.assert_array_equal(a.cpu().numpy(), b.cpu().numpy())
    bad = dict(views, w=views["w"].t())  # a transposed view: another shape
    with pytest.raises(ValueError, match=r"updates\['w'\]"):
        tx_view.update(bad, s_view)


@needs_cuda
def test_nan_handling_on_device_matches_cpu():
    g = grads(0)
    g["b"][[1, 4]] = np.nan
    g["w"][0, 2] = np.inf
    for make in (nba.zero_nans, lambda: nba.apply_if_finite(nba.sgd(1.0), 1), lambda: nba.clip(0.3)):
        tx_cpu, tx_gpu = make(), make()
        u_cpu, s_cpu = tx_cpu.update(g, tx_cpu.init(params()), params())
        u_gpu, s_gpu = tx_gpu.update(dev(g), tx_gpu.init(dev(params())), dev(params()))
        for a, b in zip(nba.tree_flatten(host(u_gpu))[0], nba.tree_flatten(u_cpu)[0]):
            np.testing.assert_array_equal(a, b)


# --- per-example clipping and DP (numbaccum/privacy.py) -------------------------------------


def per_example_grads(dtype=np.float32, batch=5):
    rng = np.random.default_rng(21)
    g = {
        "w": rng.standard_normal((batch, 3, 7)).astype(dtype),
        "b": rng.standard_normal((batch, 7)).astype(dtype),
        "s": rng.standard_normal((batch,)).astype(np.float64),
        "e": np.zeros((batch, 0, 2), dtype),
    }
    g["w"][1, 0, 0] = np.nan  # example 1 is dropped (its norm is NaN)
    g["b"][3] *= 100  # example 3 is clipped hard
    return g


@needs_cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_per_example_clips_on_device_match_cpu(dtype):
    g = per_example_grads(dtype)
    sums_cpu, n_cpu = nba.per_example_global_norm_clip(g, 1.0)
    sums_gpu, n_gpu = nba.per_example_global_norm_clip(dev(g), 1.0)
    assert n_gpu == n_cpu == 5 and hasattr(sums_gpu["w"], "copy_to_host")
    for a, b in zip(nba.tree_flatten(host(sums_gpu))[0], nba.tree_flatten(sums_cpu)[0]):
        assert a.dtype == b.dtype and a.shape == b.shape
        close(a, b, dtype)
    for uniform in (True, False):
        l_cpu, c_cpu = nba.per_example_layer_norm_clip(g, 2.0, uniform)
        l_gpu, c_gpu = nba.per_example_layer_norm_clip(nba.FlatTree.from_tree(dev(g)), 2.0, uniform)
        assert isinstance(l_gpu, nba.FlatTree) and l_gpu.device and c_gpu == c_cpu
        for a, b in zip(nba.tree_flatten(host(l_gpu.tree))[0], nba.tree_flatten(l_cpu)[0]):
            close(a, b, dtype)


@needs_cuda
def test_per_example_norms_on_device_match_cpu():
    """Issue 15 item 4 on the device: the returned norms are host float64, and clipping from
    them gives the device's own clipped sum."""
    g = per_example_grads(np.float32)
    _, _, norms_cpu = nba.per_example_global_norm_clip(g, 1.0, return_norms=True)
    sums_gpu, n_gpu, norms_gpu = nba.per_example_global_norm_clip(dev(g), 1.0, return_norms=True)
    assert isinstance(norms_gpu, np.ndarray) and norms_gpu.dtype == np.float64
    np.testing.assert_allclose(norms_gpu, norms_cpu, rtol=1e-12, equal_nan=True)
    again, n_again = nba.per_example_clip_from_norms(dev(g), norms_gpu, 1.0)
    assert n_again == n_gpu and hasattr(again["w"], "copy_to_host")
    for a, b in zip(nba.tree_flatten(host(again))[0], nba.tree_flatten(host(sums_gpu))[0]):
        np.testing.assert_array_equal(a, b)


@needs_cuda
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_dpsgd_on_device_matches_cpu(momentum):
    p = {"w": np.zeros((3, 7), np.float32), "b": np.zeros(7, np.float32), "s": np.zeros((), np.float64)}
    tx_cpu, tx_gpu = (nba.dpsgd(0.1, 1.0, 0.5, seed=3, momentum=momentum) for _ in range(2))
    s_cpu, s_gpu = tx_cpu.init(p), tx_gpu.init(dev(p))
    for step in range(3):
        g = per_example_grads()
        g.pop("e")
        g["w"] += step
        u_cpu, s_cpu = tx_cpu.update(g, s_cpu, p)
        u_gpu, s_gpu = tx_gpu.update(dev(g), s_gpu, dev(p))
        for a, b in zip(nba.tree_flatten(host(u_gpu))[0], nba.tree_flatten(u_cpu)[0]):
            assert a.dtype == b.dtype and np.all(np.isfinite(a))
            close(a, b, a.dtype)  # the same host-drawn noise on both sides
    agg = nba.differentially_private_aggregate(1e3, 1e3, seed=0)  # noise beyond float16: saturates
    u, _ = agg.update(dev({"h": np.zeros((1, 64), np.float16)}), agg.init(None))
    assert np.max(np.abs(host(u)["h"])) == np.finfo(np.float16).max


# --- the same transformations on random trees (hypothesis), device against CPU ---------------


# The simulator runs each CUDA thread as a Python thread: a few examples per transformation.
EXAMPLES = int(os.environ.get("NUMBACCUM_CUDA_EXAMPLES", "5" if SIM else "25"))


@needs_cuda
@settings(deadline=None, max_examples=EXAMPLES, suppress_health_check=list(HealthCheck))
@given(data=strat.tree_sequences(min_steps=1, max_steps=3, big=False))  # the simulator: no 65k leaves
@pytest.mark.parametrize("name", sorted(TXS))
def test_transformations_on_random_trees_match_cpu(name, data):
    """Every transformation of TXS on hypothesis trees (mixed float32/float64, 0-d and size-0
    leaves): the device agrees with the CPU, which tests/test_reference_hypothesis.py holds to the
    NumPy reference."""
    p, steps = data
    tx_cpu, tx_gpu = TXS[name](), TXS[name]()
    s_cpu, s_gpu = tx_cpu.init(p), tx_gpu.init(dev(p))
    for g in steps:
        u_cpu, s_cpu = tx_cpu.update(g, s_cpu, p)
        u_gpu, s_gpu = tx_gpu.update(dev(g), s_gpu, dev(p))
        for a, b in zip(nba.tree_flatten(host(u_gpu))[0], nba.tree_flatten(u_cpu)[0]):
            assert a.dtype == b.dtype and a.shape == b.shape
            close(a, b, a.dtype)


@needs_cuda
@needs_gpu
def test_buffers_past_2_to_the_31_elements():
    """int64 indices everywhere: a float32 buffer of 2**31 + 3 elements (odd: the last element
    is the pair kernels' tail), through an accumulation, a scale and a norm."""
    from numba import cuda

    from numbaccum.backend import ops_for
    from numbaccum.contract import ONE, Factor

    n = 2**31 + 3
    acc, g = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
    ops = ops_for(acc)
    ops.fill_(acc, 1.0)
    ops.fill_(g, 3.0)
    ops.mean_accumulate_(acc, g, ONE, 2, False)  # 1 + (3 - 1) / 2 = 2.0
    ops.scale_(g, acc, Factor(4.0, 1.0))  # g = acc / 4 = 0.5
    for i in (0, 2**31 - 1, 2**31, n - 1):
        assert acc[i : i + 1].copy_to_host()[0] == 2.0, i
        assert g[i : i + 1].copy_to_host()[0] == 0.5, i
    assert ops.sumsq(acc) == 4.0 * n  # exact: integers below 2**53
    flat = nba.FlatTree.from_tree({"x": acc})
    assert nba.global_norm(flat, squared=True) == 4.0 * n
    del acc, g, flat


# --- history-based clippers (numbaccum/adaptive.py) -----------------------------------------


def _adaptive_txs():
    from numbaccum.adaptive import _value_ema_transformation

    return {
        "clip_norm_by_ema": lambda: nba.clip_norm_by_ema(beta=0.5),
        "normalize_by_ema_global": lambda: nba.normalize_by_ema(beta=0.5, tensorwise=False),
        "clip_value_by_ema": lambda: nba.clip_value_by_ema(beta=0.5, init=1.0),
        "clip_value_by_ema_inner_tfm": lambda: _value_ema_transformation(
            0.5, 0.0, inner=nba.scale(2.0), exp_avg_tfm=nba.scale(0.5)
        ),
        "clip_norm_growth": lambda: nba.clip_norm_growth(mul=1.2),
        "clip_value_growth": lambda: nba.clip_value_growth(add=0.5, mul=1.2),
    }


@needs_cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "name",
    [
        "clip_norm_by_ema",
        "normalize_by_ema_global",
        "clip_value_by_ema",
        "clip_value_by_ema_inner_tfm",
        "clip_norm_growth",
        "clip_value_growth",
    ],
)
def test_adaptive_on_device_match_cpu(name, dtype):
    make = _adaptive_txs()[name]
    tx_cpu, tx_gpu = make(), make()
    p = params(dtype)
    s_cpu, s_gpu = tx_cpu.init(p), tx_gpu.init(dev(p))
    for step in range(4):
        g = nba.tree_map(lambda x, k=step: x * dtype(1 + 2 * k), grads(step, dtype))
        if step == 2:  # a non-finite leaf: kept out of the histories (masked segment EMA)
            g["b"][3] = np.nan
        u_cpu, s_cpu = tx_cpu.update(g, s_cpu, p)
        u_gpu, s_gpu = tx_gpu.update(dev(g), s_gpu, dev(p))
        for a, b in zip(nba.tree_flatten(host(u_gpu))[0], nba.tree_flatten(u_cpu)[0]):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
            close(np.nan_to_num(a), np.nan_to_num(b), dtype)


@needs_cuda
def test_compat_faces_on_device_match_cpu():
    from numbaccum.compat import declearn as dl
    from numbaccum.compat import torchzero as tz

    g = {"a": np.array([3.0, 4.0]), "b": np.array([0.3, 0.4], np.float32), "c": np.zeros(2)}
    modules = (
        dl.L2Clipping(1.0),
        dl.L2GlobalClipping(1.0),
        dl.EWMAModule(0.5),
        dl.MomentumModule(0.5, nesterov=True),
        dl.GaussianNoiseModule(0.1, safe_mode=False, seed=0),  # host draws, added on the device
    )
    for m in modules:
        twin = type(m).from_config(m.get_config())
        for _ in range(2):
            out, want = m.run(dev(g)), twin.run(g)
            for k in g:
                assert hasattr(out[k], "copy_to_host") and out[k].dtype == g[k].dtype
                close(out[k].copy_to_host(), want[k], g[k].dtype)
    m, twin = tz.ClipNormByEMA(beta=0.5), tz.ClipNormByEMA(beta=0.5)
    for _ in range(2):
        m.step(dev(g))
        twin.step(g)
    again = tz.ClipNormByEMA(beta=0.5)
    again.load_state_dict(m.state_dict())  # a host state dict, loaded into a device state
    got, want = host(again.step(dev(g))), twin.step(g)
    for k in g:
        close(got[k], want[k], g[k].dtype)


# --- norm family (numbaccum/norms.py) -------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("block", [5, 16384])
def test_norms_on_device_match_cpu(monkeypatch, block):
    from numbaccum import _config, norms

    p = params(np.float64)
    p["c"] = np.random.default_rng(1).standard_normal((3, 2, 4))
    p["h"] = np.arange(-3, 6, dtype=np.float32)
    monkeypatch.setattr(_config, "CUDA_REDUCE_BLOCK", block)  # 5: long slices cut into items
    flat, flat_gpu = nba.FlatTree.from_tree(p), nba.FlatTree.from_tree(dev(p))
    for ord in (2, 1, 0, 3, 0.5, -1, np.inf, -np.inf, "mad", "std", "var", "sum"):
        a, b = norms.leaf_norms(flat_gpu, ord), norms.leaf_norms(flat, ord)
        np.testing.assert_allclose(a, b, rtol=1e-12, equal_nan=True, err_msg=str(ord))
        np.testing.assert_allclose(norms.tree_norm(flat_gpu, ord), norms.tree_norm(flat, ord), rtol=1e-12)
    for tx in (nba.clip_norm(0.3, ord=3, dim=(0, 2)), nba.centralize(dim=-1, inverse_dims=False)):
        u_cpu, _ = tx.update(p, tx.init(p))
        u_gpu, _ = tx.update(dev(p), tx.init(dev(p)))
        for a, b in zip(nba.tree_flatten(host(u_gpu))[0], nba.tree_flatten(u_cpu)[0]):
            close(a, b, b.dtype)


@needs_cuda
def test_per_slice_clip_and_normalize_keep_their_metrics_on_the_device(monkeypatch):
    """clip_norm / normalize with a p-norm compute each slice's factor on the device: no
    reduction comes to the host (the engine's host-returning `reduce` is never called), and the
    result matches the CPU, overflowed float64 rows included."""
    from numbaccum.cuda import reduce as cuda_reduce

    p = params(np.float64)
    p["c"] = np.random.default_rng(1).standard_normal((3, 2, 4))
    p["c"][0] *= 1e200  # overflows the plain sums of its slices
    p["h"] = np.arange(-3, 6, dtype=np.float32)
    txs = [
        nba.clip_norm(0.5, dim=0),
        nba.clip_norm(0.3, ord=3, dim=(0, 2)),
        nba.clip_norm(0.2, ord=np.inf),
        nba.normalize(2.0, ord=1, dim=-1),
    ]
    want = [tx.update(p, tx.init(p))[0] for tx in txs]

    def no_host_reduction(*args, **kwargs):
        raise AssertionError("a per-slice metric came to the host")

    monkeypatch.setattr(cuda_reduce, "reduce", no_host_reduction)
    for tx, w in zip(txs, want):
        u, _ = tx.update(dev(p), tx.init(dev(p)))
        for a, b in zip(nba.tree_flatten(host(u))[0], nba.tree_flatten(w)[0]):
            close(a, b, b.dtype)


@needs_cuda
def test_norm_functions_in_place_on_device():
    g = grads(0)
    g_gpu = dev(g)
    for fn, args in (
        (nba.clip_grad_norm_, (0.5,)),
        (nba.normalize_grads_, (2.0, 2, "global")),
        (nba.clip_grad_value_, (0.3,)),
    ):
        fn(g, *args)
        assert fn(g_gpu, *args) is g_gpu
        for a, b in zip(nba.tree_flatten(host(g_gpu))[0], nba.tree_flatten(g)[0]):
            close(a, b, np.float32)


@needs_cuda
def test_clip_records_its_norm_on_the_device_without_a_sync():
    p = params(np.float64)
    tx = nba.chain(nba.clip_by_global_norm(1.0), nba.sgd(0.1))
    s = tx.init(dev(p))
    _, s = tx.update(dev(p), s)
    rec = s[0]
    assert type(rec.norm).__name__ == "DeviceScalar" and type(rec.clipped).__name__ == "DeviceScalar"
    np.testing.assert_allclose(float(rec.norm), nba.global_norm(p), rtol=1e-14)
    assert bool(rec.clipped) is True
    st = nba.stats(s)
    assert float(st["clip_by_global_norm/norm"]) == float(rec.norm)
    # skip on the device: the policy checks on the host (a sync), zeros out
    bad = params(np.float64)
    bad["b"][0] = np.nan
    tx = nba.chain(nba.clip_by_global_norm(1.0, nonfinite="skip"), nba.adam(0.1))
    s = tx.init(dev(p))
    u, s = tx.update(dev(bad), s)
    assert all(np.all(host(x) == 0) for x in nba.tree_flatten(u)[0]) and bool(s[0].skipped)


@needs_cuda
def test_dp_accumulation_on_the_device_matches_the_host():
    p = params(np.float64)
    rng = np.random.default_rng(5)
    batch = {k: rng.standard_normal((6, *np.shape(v))) for k, v in p.items()}
    minis = [{k: v[i * 2 : (i + 1) * 2] for k, v in batch.items()} for i in range(3)]
    outs = []
    for put in (lambda t: t, dev):
        ms = nba.MultiSteps(nba.dpsgd(0.1, 1.0, 1.0, seed=3), 3)
        s = ms.init(put(p))
        for m in minis:
            u, s = ms.update(put(m), s)
        outs.append(host(u))
    for a, b in zip(nba.tree_flatten(outs[1])[0], nba.tree_flatten(outs[0])[0]):
        np.testing.assert_allclose(a, b, rtol=1e-13)
    # step_: the declared cycle adds the emitted update to the device params (the rest's pass)
    ms = nba.MultiSteps(nba.dpsgd(0.1, 1.0, 1.0, seed=3), 3)
    on = dev(p)
    s = ms.init(on)
    for m in minis:
        s = nba.step_(ms, dev(m), s, on)
    for a, b, x in zip(nba.tree_flatten(host(on))[0], nba.tree_flatten(p)[0], nba.tree_flatten(outs[0])[0]):
        np.testing.assert_allclose(a, b + x, rtol=1e-13)


# --- trees of separate CUDA arrays: packed and scattered over a table of their addresses ------


def _many_leaves(n_leaves, seed=0):
    """A tree of ``n_leaves`` float32 leaves of assorted sizes (some past one chunk of the
    pointer-table kernels, a 0-d and a size-0 one) and three float64 leaves."""
    from numbaccum.cuda import leaves

    rng = np.random.default_rng(seed)
    sizes = [1, 3, leaves.chunk() + 5, 17, 2 * leaves.chunk() + 1]
    tree = {f"f{i:03d}": rng.standard_normal(sizes[i % 5]).astype(np.float32) for i in range(n_leaves)}
    tree["scalar"] = np.array(rng.standard_normal(), np.float32)
    tree["empty"] = np.zeros((0, 3), np.float32)
    tree["d"] = [rng.standard_normal((2, 3)), rng.standard_normal(leaves.chunk() + 1), np.zeros(0)]
    return tree


@needs_cuda
@pytest.mark.parametrize("n_leaves", [3, 40])
def test_separate_device_leaves_pack_with_one_launch_per_group(n_leaves):
    from numbaccum import arrays
    from numbaccum.flat import as_flat

    p = _many_leaves(n_leaves)
    d = dev(p)
    layout = nba.FlatTree.from_tree(p).layout
    ptrs = arrays.device_pointers(d, layout)
    assert ptrs is not None and len(ptrs) == layout.num_leaves
    before = _launches()
    flat, copied, kind = as_flat(d, layout, "updates")
    assert copied and kind == "numba"
    assert _launches() - before == 2  # one launch per dtype group, whatever the number of leaves
    for a, b in zip(nba.tree_flatten(host(flat.tree))[0], nba.tree_flatten(p)[0]):
        np.testing.assert_array_equal(a, b)
    # and back: apply_updates_ into separate arrays scatters with one launch per group too
    u = nba.tree_map(lambda x: np.full_like(x, 0.25), p)
    uf = nba.FlatTree.from_tree(dev(u))
    before = _launches()
    assert nba.apply_updates_(d, uf) is d
    assert _launches() - before == 2 + 2 + 2  # pack the params, add, scatter back
    for a, b, c in zip(nba.tree_flatten(host(d))[0], nba.tree_flatten(p)[0], nba.tree_flatten(u)[0]):
        np.testing.assert_array_equal(a, b + c)


@needs_cuda
def test_separate_device_leaves_through_update_step_and_assign_match_cpu():
    p = _many_leaves(12, seed=1)
    g = [_many_leaves(12, seed=10 + i) for i in range(3)]
    tx_cpu = nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-2, weight_decay=0.1))
    tx_gpu = nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-2, weight_decay=0.1))
    tx_step = nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-2, weight_decay=0.1))
    p_cpu, p_gpu, p_step = nba.tree_map(np.copy, p), dev(p), dev(p)
    s_cpu, s_gpu, s_step = tx_cpu.init(p_cpu), tx_gpu.init(p_gpu), tx_step.init(p_step)
    for gi in g:
        u_cpu, s_cpu = tx_cpu.update(gi, s_cpu, p_cpu)
        nba.apply_updates_(p_cpu, u_cpu)
        u_gpu, s_gpu = tx_gpu.update(dev(gi), s_gpu, p_gpu)
        nba.apply_updates_(p_gpu, u_gpu)
        s_step = nba.step_(tx_step, dev(gi), s_step, p_step)
    for a, b, c in zip(*(nba.tree_flatten(host(t))[0] for t in (p_gpu, p_step, p_cpu))):
        close(a, c, a.dtype)
        close(b, c, b.dtype)
    # FlatTree.assign_ from separate arrays: one launch per group, the values in place
    flat = nba.FlatTree.from_tree(dev(p))
    before = _launches()
    flat.assign_(dev(g[0]))
    assert _launches() - before == 2
    for a, b in zip(nba.tree_flatten(host(flat.tree))[0], nba.tree_flatten(g[0])[0]):
        np.testing.assert_array_equal(a, b)


@needs_cuda
def test_separate_leaves_of_several_dtypes_in_one_stored_group():
    """A layout that stores float16 and float64 leaves in one float32 group (`from_tree(...,
    dtype=)`): one launch per leaf dtype, each cast on the store, and back."""
    rng = np.random.default_rng(3)
    p = {"h": rng.standard_normal(300).astype(np.float16), "d": rng.standard_normal((4, 70))}
    p["h0"] = np.array(np.float16(2))
    flat = nba.FlatTree.from_tree(dev(p), dtype=np.float32)
    assert flat.group_dtypes == (np.dtype(np.float32),)
    new = {"h": (p["h"] * 2).astype(np.float16), "d": p["d"] * 3, "h0": np.array(np.float16(-1))}
    before = _launches()
    flat.assign_(dev(new))
    assert _launches() - before == 2  # the float16 leaves, then the float64 leaf
    for k in new:
        np.testing.assert_array_equal(host(flat.tree)[k], new[k].astype(np.float32))
    from numbaccum.apply import scatter_back

    out = dev(nba.tree_map(np.zeros_like, p))
    scatter_back(flat, out, "params")
    for k in new:
        got = host(out)[k]
        assert got.dtype == p[k].dtype
        np.testing.assert_array_equal(got, new[k].astype(np.float32).astype(p[k].dtype))


@needs_cuda
def test_device_leaves_that_cannot_take_the_pointer_table_take_the_named_path():
    from numba import cuda

    from numbaccum import arrays

    p = params()
    layout = nba.FlatTree.from_tree(p).layout
    d = dev(p)
    strided = dict(d, w=cuda.to_device(np.asfortranarray(p["w"])))  # same shape, not C-contiguous
    assert arrays.device_pointers(strided, layout) is None
    tx = nba.ema(0.9)
    s = tx.init(d)
    with pytest.raises(ValueError, match=r"updates\['w'\]: a non-contiguous CUDA array"):
        tx.update(strided, s)
    assert arrays.device_pointers(dict(d, b=d["w"]), layout) is None  # a wrong shape
    with pytest.raises(ValueError, match=r"updates\['b'\]: shape \(3, 7\)"):
        tx.update(dict(d, b=d["w"]), s)
    assert arrays.device_pointers(dict(d, b=p["b"]), layout) is None  # a NumPy array among them
    assert arrays.device_pointers(p, layout) is None


def _ptx_compiler(module: str):
    """``(compile, numba.types, module)``: ``compile(fn, sig)`` builds ``fn`` to PTX for sm_80
    where NVVM and numba-cuda can (no GPU needed); the test skips in the simulator, which runs
    the Python source, and where a first build of one of the module's kernels fails (no NVVM,
    or a numba-cuda build that wants a CUDA driver)."""
    if SIM:
        pytest.skip("the simulator runs the Python source")
    cuda = pytest.importorskip("numba.cuda")
    import importlib

    from numba import types

    def compile(fn, sig):
        return cuda.compile_ptx(fn, sig, cc=(8, 0))[0]

    try:
        mod = importlib.import_module(module)
        if module.endswith("leaves"):
            probe = mod._kernel("pack", np.dtype(np.float32)).py_func
            i64 = types.int64
            compile(probe, (types.float32[::1], i64[::1], i64[:, ::1], i64[:, ::1], i64))
        else:
            compile(mod._pnorm_factors.py_func, _pnorm_sig(types, types.float32))
    except Exception as e:
        pytest.skip(f"no NVVM or no CUDA driver here: {e}")
    return compile, types, mod


def _pnorm_sig(types, x):
    """The argument types of `numbaccum.cuda.reduce._pnorm_factors` for a buffer of ``x``."""
    f8, i8, b = types.float64, types.int64, types.boolean
    return (f8[::1], i8[::1], i8[::1], x[::1], i8[:, ::1], b, f8, b, f8, f8, f8, f8[::1])


def test_pointer_table_kernels_compile_for_the_device():
    """The kernels' device build (the address cast is an LLVM intrinsic, which the simulator
    does not run): compiled to PTX for every leaf and storage dtype, where NVVM is installed
    (numba-cuda with the CUDA toolkit's wheels; no GPU needed)."""
    compile, types, leaves = _ptx_compiler("numbaccum.cuda.leaves")
    i64 = types.int64
    for direction in ("pack", "scatter"):
        for leaf_dtype in (np.float16, np.float32, np.float64):
            for flat in (types.float16, types.float32, types.float64):
                fn = leaves._kernel(direction, np.dtype(leaf_dtype)).py_func
                ptx = compile(fn, (flat[::1], i64[::1], i64[:, ::1], i64[:, ::1], i64))
                assert "cvta.to.global" in ptx  # the address is used as a global pointer
        for leaf_dtype, flat in ((np.complex64, types.complex64), (np.complex128, types.complex128)):
            fn = leaves._kernel(direction, np.dtype(leaf_dtype)).py_func
            assert "cvta.to.global" in compile(fn, (flat[::1], i64[::1], i64[:, ::1], i64[:, ::1], i64))


def test_norm_factor_kernel_compiles_for_the_device():
    """`numbaccum.cuda.reduce._pnorm_factors` (the norm family's per-slice factors on the
    device, `numbaccum.tables.pnorm_factor` compiled as a device function) builds to PTX for
    every buffer dtype, where NVVM is installed (no GPU needed)."""
    compile, types, cuda_reduce = _ptx_compiler("numbaccum.cuda.reduce")
    for x in (types.float16, types.float32, types.float64):
        assert "sqrt" in compile(cuda_reduce._pnorm_factors.py_func, _pnorm_sig(types, x))


@needs_cuda
def test_masked_with_every_leaf_masked_out_on_the_device():
    """The inner state of no leaves lives nowhere: the device updates must not be refused as
    "state.trace: it lives on the host" (found by the random trees of issue 22)."""
    p = {"e": np.zeros(0, np.float32), "w": np.arange(3, dtype=np.float32)}
    tx = nba.masked(nba.trace(0.9), {"e": False, "w": False})
    s = tx.init(dev(p))
    for _ in range(2):
        u, s = tx.update(dev(p), s, dev(p))
        assert_on_device(u, "masked")
        np.testing.assert_array_equal(host(u)["w"], p["w"])
