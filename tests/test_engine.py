"""The one reduction engine (numbaccum/tables.py, cpu/reduce.py, cuda/reduce.py).

Every API that needs the global L2 norm takes the same sum of squares (`contract.tree_sumsq`):
`global_norm`, `norms.tree_norm(t, 2)`, ``clip_norm(..., dim='global')``, `clip_by_global_norm`
(on CUDA its factor never leaves the device) and `skip_large_updates` agree bit for bit. The
partials depend on the table only: the same bits for any thread count, and the same elements
give the same bits whichever table holds them.
"""

import math
import os
import textwrap

import numpy as np
import pytest
from _testutil import same_stdout_with_one_and_two_threads

import numbaccum as nba
from numbaccum import norms, tables
from numbaccum.backend import leaf_sumsq, ops_for, tree_sumsq
from numbaccum.contract import ONE, Factor
from numbaccum.formulas import clip_finish

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


needs_cuda = pytest.mark.cuda  # skipped without a GPU or the simulator (tests/conftest.py)


def issue_tree():
    """The tree of the issue: a 1,000,003-element and a 300x777 float32 leaf, seed 1."""
    rng = np.random.default_rng(1)
    return {
        "a": rng.standard_normal(1_000_003).astype(np.float32),
        "b": rng.standard_normal((300, 777)).astype(np.float32),
    }


def mixed_tree(seed=0, big=70_001):
    """float32 and float64 groups interleaved, a 0-d leaf, an empty leaf, a long leaf (several
    items) and many short ones (several slices per item)."""
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal(big).astype(np.float32),
        "b": rng.standard_normal((13, 7)),
        "c": np.float32(2.5),
        "d": np.zeros((0, 3), np.float32),
        "e": rng.standard_normal((5, 4, 3)).astype(np.float32) * 1e3,
        "f": np.array(-0.0),
    }


def norms_of_every_api(tree):
    """The squared global L2 norm as each API sees it."""
    flat = nba.FlatTree.from_tree(tree)
    sq = {
        "tree_sumsq": tree_sumsq(flat),
        "global_norm squared": nba.global_norm(tree, squared=True),
        "skip_large_updates": float(nba.skip_large_updates(tree, 0, None, 1e300)[1]["norm_squared"]),
        "leaf_sumsq": float(tables.sum_in_order(leaf_sumsq(flat))),
    }
    return sq


@pytest.mark.parametrize("make", [issue_tree, mixed_tree])
def test_global_norm_has_one_value_across_apis(make):
    tree = make()
    sq = norms_of_every_api(tree)
    want = sq["tree_sumsq"]
    for name, v in sq.items():
        assert v == want, name
    assert nba.global_norm(tree) == math.sqrt(want)
    assert norms.tree_norm(tree, 2) == math.sqrt(want)
    assert norms.tree_norm(tree, "l2") == math.sqrt(want)
    exact = sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in tree.values())
    assert want == pytest.approx(exact, rel=1e-12)


def test_issue_numbers_agree():
    t = issue_tree()
    assert nba.global_norm(t) == norms.tree_norm(t, 2)


@pytest.mark.parametrize("make", [issue_tree, mixed_tree])
def test_clippers_use_that_norm(make):
    tree = make()
    norm = nba.global_norm(tree)
    max_norm = norm / 3
    u1, _ = nba.clip_by_global_norm(max_norm).update(tree, None)
    tx = nba.clip_norm(max_norm, dim="global")
    u2, _ = tx.update(tree, tx.init(tree))
    for k in tree:
        x = np.asarray(tree[k])
        want = (x / x.dtype.type(norm)) * x.dtype.type(max_norm)  # the pending factor, in the leaf dtype
        np.testing.assert_array_equal(np.asarray(u1[k]), want, err_msg=k)
        np.testing.assert_array_equal(np.asarray(u2[k]), want, err_msg=k)


def test_clip_factor_contract_on_cpu():
    tree = mixed_tree(3)
    flat = nba.FlatTree.from_tree(tree)
    lay = flat.layout
    sums = np.zeros(3 * lay.num_leaves)  # [plain | rescued | scale] per leaf
    fac32, fac64 = np.zeros(2, np.float32), np.zeros(2)
    norm = nba.global_norm(tree)
    last = len(flat.groups) - 1
    for i, g in enumerate(flat.groups):
        table, members = tables.segments(lay.offsets[i]), lay.group_index[i]
        finish = (clip_finish, (1.0,))
        ops_for(g).global_norm_finish_(sums, g, table, members, i == last, *finish, fac32, fac64)
    np.testing.assert_array_equal(sums[: lay.num_leaves], leaf_sumsq(flat))
    assert tuple(fac64) == (norm, 1.0)
    assert tuple(fac32) == (np.float32(norm), 1.0)
    for i, g in enumerate(flat.groups):
        table, members = tables.segments(lay.offsets[i]), lay.group_index[i]
        finish = (clip_finish, (2 * norm,))
        ops_for(g).global_norm_finish_(sums, g, table, members, i == last, *finish, fac32, fac64)
    assert tuple(fac64) == (1.0, 1.0)


def _norm_and_scaled(norm, scalars):  # pragma: no cover - compiled by the backend
    """A finish of the caller's own: the norm, and ``scalars[0]`` times its square."""
    return norm, scalars[0] * (norm * norm)


def _finish_anything(tree, device):
    """`Ops.global_norm_finish_` of ``tree`` with a finish that is no transformation's: the
    engine runs what it is given. Returns the float64 and float32 values it wrote (host)."""
    from numbaccum.arrays import to_device, to_host

    flat = nba.FlatTree.from_tree(dev(tree) if device else tree)
    lay = flat.layout
    arrays = [np.zeros(3 * lay.num_leaves), np.zeros(1, np.float32), np.zeros(3)]
    sums, out32, out64 = [to_device(a) for a in arrays] if device else arrays
    last = len(flat.groups) - 1
    for i, g in enumerate(flat.groups):
        table, members = tables.segments(lay.offsets[i]), lay.group_index[i]
        ops_for(g).global_norm_finish_(
            sums, g, table, members, i == last, _norm_and_scaled, (3,), out32, out64
        )
    return (to_host(out64), to_host(out32)) if device else (out64, out32)


def test_global_norm_finish_runs_any_finish_on_cpu():
    tree = mixed_tree(4)
    norm = nba.global_norm(tree)
    out64, out32 = _finish_anything(tree, False)
    assert out64[0] == norm and out64[1] == 3.0 * (norm * norm)
    assert out64[2] == 0.0  # only as many values as the finish returns
    assert out32[0] == np.float32(norm)  # as many as the array holds


def test_same_elements_same_bits_in_any_table():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(300_017).astype(np.float32)
    offsets = np.array([0, 3, 70_000, 70_000, 200_000, 300_017], np.int64)
    ops = ops_for(x)
    per_seg = ops.slice_sumsq(x, tables.segments(offsets))
    for k in range(offsets.size - 1):
        seg = x[offsets[k] : offsets[k + 1]]
        assert per_seg[k] == ops.sumsq(seg), k
        assert per_seg[k] == ops.segment_sumsq(x, offsets)[k]
    # a per-example table (kept dim 0): each example's slice is the segment of its run
    batch, d = 4, 75_004
    ex = ops.slice_sumsq(x[: batch * d + 1], tables.examples(np.array([1, 1 + batch * d]), batch))
    for b in range(batch):
        assert ex[b] == ops.sumsq(x[1 + b * d : 1 + (b + 1) * d]), b


def test_kinds_match_numpy_on_strided_tables():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((6, 5, 7)).astype(np.float32)
    a[1, 2, 3] = 0.0
    x = a.ravel()
    ops = ops_for(x)
    # reduce dims (0, 2) keeping dim 1: two reduced runs (6 x 35 and 7 x 1), one kept (5 x 7)
    t = tables.slice_table([(0, [(5, 7)], [(6, 35), (7, 1)], True)])
    a64 = a.astype(np.float64)
    ref = np.moveaxis(a64, 1, 0).reshape(5, -1)
    np.testing.assert_allclose(ops.slice_sumsq(x, t), (ref**2).sum(1), rtol=1e-12)
    np.testing.assert_allclose(ops.slice_sumabs(x, t), np.abs(ref).sum(1), rtol=1e-12)
    np.testing.assert_allclose(ops.slice_sum(x, t), ref.sum(1), rtol=1e-12)
    np.testing.assert_allclose(ops.slice_sumpow(x, t, 3.0), (np.abs(ref) ** 3).sum(1), rtol=1e-12)
    np.testing.assert_array_equal(ops.slice_nnz(x, t), (ref != 0).sum(1))
    np.testing.assert_array_equal(ops.slice_maxabs(x, t), np.abs(ref).max(1))
    np.testing.assert_array_equal(ops.slice_minabs(x, t), np.abs(ref).min(1))
    c = ref.mean(1)
    np.testing.assert_allclose(ops.slice_sumsq(x, t, c), ((ref - c[:, None]) ** 2).sum(1), rtol=1e-12)
    out = np.empty_like(x)
    ops.slice_apply_(out, x, t, c, np.arange(1.0, 6.0))
    want = (ref - c[:, None]) * np.arange(1.0, 6.0)[:, None]
    got = np.moveaxis(out.reshape(6, 5, 7), 1, 0).reshape(5, -1)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_scalings_per_slice():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1000).astype(np.float32)
    offsets = np.array([0, 10, 10, 600, 1000], np.int64)
    ops = ops_for(x)
    div = np.array([2.0, 3.0, 5.0, 7.0], np.float32)
    out = np.empty_like(x)
    ops.segment_divide_(out, x, Factor(1.5, 0.5), offsets, div)
    want = np.concatenate(
        [
            ((x[a:b] / np.float32(1.5)) * np.float32(0.5)) / d
            for a, b, d in zip(offsets[:-1], offsets[1:], div)
        ]
    )
    np.testing.assert_array_equal(out, want)
    ema = np.ones_like(x)
    ops.segment_ema_update_(ema, x, ONE, offsets, np.array([1, 1, 0, 1], np.uint8), 0.1, 0.9)
    want = np.float32(0.1) * x + np.float32(0.9) * np.float32(1)
    want[10:600] = 1.0
    np.testing.assert_array_equal(ema, want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_edge_cases(dtype):
    ops = ops_for(np.zeros(1))
    empty = np.zeros(0, dtype)
    assert ops.sumsq(empty) == 0.0 and ops.maxabs(empty) == 0.0 and ops.count_nonfinite(empty) == 0
    assert nba.global_norm({"a": np.zeros((0,), dtype)}) == 0.0
    assert nba.global_norm({"a": dtype(3.0)}) == 3.0  # 0-d
    assert nba.global_norm({"a": dtype(3.0), "b": np.zeros((2, 0), dtype)}, squared=True) == 9.0
    x = np.array([1.0, -2.0, 2.0], dtype)
    assert ops.sumsq(x) == 9.0
    x[1] = np.nan
    assert math.isnan(ops.sumsq(x)) and math.isnan(nba.global_norm({"x": x}))
    assert math.isnan(norms.tree_norm({"x": x}, 2))
    assert math.isnan(ops.maxabs(x))
    assert ops.count_nonfinite(x) == 1
    x[1] = np.inf
    assert ops.sumsq(x) == math.inf and ops.count_nonfinite(x) == 1 and ops.maxabs(x) == math.inf
    assert norms_of_every_api({"x": x})["skip_large_updates"] == math.inf
    y = np.arange(1, 101, dtype=dtype)
    assert ops.sumsq(y) == float(np.sum(np.arange(1, 101, dtype=np.float64) ** 2))  # exact


SCRIPT = textwrap.dedent(
    """
    import numpy as np, numbaccum as nba
    from numbaccum import norms, tables
    from numbaccum.backend import ops_for
    rng = np.random.default_rng(7)
    tree = {"a": rng.standard_normal((1000, 1001)).astype(np.float32), "b": rng.standard_normal(3_000_001),
            "c": rng.standard_normal((64, 300)).astype(np.float32)}
    flat = nba.FlatTree.from_tree(tree)
    out = [nba.global_norm(tree), norms.tree_norm(tree, 2), norms.tree_norm(tree, 3)]
    out += [norms.tree_norm(tree, "std")]
    out += list(norms.leaf_norms(flat, 2))
    tx = nba.clip_norm(1.0, dim=0)
    u, _ = tx.update(tree, tx.init(tree))
    out += [float(np.sum(np.asarray(u["a"], np.float64)))]
    x = tree["c"].ravel()
    out += list(ops_for(x).slice_sumsq(x, tables.examples(np.array([0, x.size]), 64)))
    print(repr([float(v).hex() for v in out]))
    """
)


def test_same_bits_with_one_and_two_threads():
    same_stdout_with_one_and_two_threads(SCRIPT)


# --- CUDA (a real GPU or the simulator) -----------------------------------------------------


def dev(tree):
    from numba import cuda

    return {k: cuda.to_device(np.asarray(v)) for k, v in tree.items()}


@needs_cuda
def test_cuda_global_norm_finish_runs_any_finish():
    tree = mixed_tree(4, big=300)
    out64, out32 = _finish_anything(tree, True)
    norm = nba.global_norm(dev(tree))
    assert out64[0] == norm and out64[1] == 3.0 * (norm * norm) and out64[2] == 0.0
    assert out32[0] == np.float32(norm)


@needs_cuda
def test_cuda_global_norm_has_one_value_across_apis():
    tree = mixed_tree(1, big=300)
    d = dev(tree)
    flat = nba.FlatTree.from_tree(d)
    want = tree_sumsq(flat)
    assert nba.global_norm(d, squared=True) == want
    assert nba.global_norm(d) == math.sqrt(want)
    assert norms.tree_norm(flat, 2) == math.sqrt(want)
    assert float(nba.skip_large_updates(d, 0, None, 1e300)[1]["norm_squared"]) == want
    np.testing.assert_allclose(want, tree_sumsq(nba.FlatTree.from_tree(tree)), rtol=1e-12)
    # clip_by_global_norm: the norm and the factor stay on the device, with the same bits
    from numbaccum import clipping

    facs = clipping._device_factors(flat, 0.5)
    assert facs is not None
    fac64 = facs[np.dtype(np.float64)].copy_to_host()
    assert tuple(fac64) == (math.sqrt(want), 0.5, math.sqrt(want), 1.0)  # [div, mul, norm, clipped]
    norm = math.sqrt(want)
    u1, _ = nba.clip_by_global_norm(0.5).update(d, None)
    tx = nba.clip_norm(0.5, dim="global")
    u2, _ = tx.update(d, tx.init(d))
    for k in tree:
        a, b = np.asarray(u1[k].copy_to_host()), np.asarray(u2[k].copy_to_host())
        x = np.asarray(tree[k])
        want_u = (x / x.dtype.type(norm)) * x.dtype.type(0.5)
        np.testing.assert_array_equal(a, want_u, err_msg=k)
        np.testing.assert_array_equal(b, want_u, err_msg=k)


@needs_cuda
def test_cuda_engine_matches_numpy_and_is_deterministic():
    from numba import cuda

    rng = np.random.default_rng(6)
    a = rng.standard_normal((6, 5, 7)).astype(np.float32)
    x = cuda.to_device(a.ravel())
    ops = ops_for(x)
    t = tables.slice_table([(0, [(5, 7)], [(6, 35), (7, 1)], True)])
    ref = np.moveaxis(a.astype(np.float64), 1, 0).reshape(5, -1)
    got = ops.slice_sumsq(x, t)
    np.testing.assert_allclose(got, (ref**2).sum(1), rtol=1e-12)
    np.testing.assert_array_equal(ops.slice_sumsq(x, t), got)  # run after run
    np.testing.assert_array_equal(ops.slice_maxabs(x, t), np.abs(ref).max(1))
    np.testing.assert_array_equal(ops.slice_minabs(x, t), np.abs(ref).min(1))
    offsets = np.array([0, 3, 3, 100, 210], np.int64)
    div = np.array([2.0, 3.0, 5.0, 7.0], np.float32)
    out = cuda.device_array(210, np.float32)
    ops.segment_divide_(out, x, ONE, offsets, div)
    want = np.concatenate([a.ravel()[p:q] / d for p, q, d in zip(offsets[:-1], offsets[1:], div)])
    np.testing.assert_array_equal(out.copy_to_host(), want)
    assert ops.count_nonfinite(x) == 0


def test_a_prepared_sum_of_squares_reads_any_buffer_as_numbas_dispatch_would():
    """`cpu.reduce.prepared` calls the compiled function directly once it has run for a dtype:
    a buffer of another layout (strided, unaligned) or flags (read-only) than the first must
    still give the dispatcher's sums."""
    from numbaccum.cpu import reduce as cpu_reduce

    n = 1000
    table = tables.segments(np.array([0, 300, 1000]))
    run = cpu_reduce.prepared("sumsq", table)
    rng = np.random.default_rng(0)
    values = rng.standard_normal(n).astype(np.float32)
    strided = np.zeros(2 * n, np.float32)[::2]
    strided[:] = values
    unaligned = np.zeros(4 * n + 1, np.uint8)[1:].view(np.float32)
    unaligned[:] = values
    read_only = values.copy()
    read_only.flags.writeable = False
    want = cpu_reduce.reduce("sumsq", values, table)
    for x in (values, strided, unaligned, read_only, values):
        np.testing.assert_array_equal(run(x), want)
