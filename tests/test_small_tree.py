"""The small-tree path: the cheap checks an update makes each step agree with the full ones.

A plain tree is checked by a walk beside the state's treedef (`leaves_if_structure`) and
whole-list comparisons of leaf types, shapes and dtypes (`host_leaves`); a stateless
transformation reuses its last layout when the tree still matches it; the CPU driver casts
scalars with a fast path for one dtype. Anything the fast path does not accept goes the full way,
so errors still name the leaf and leave the state unchanged.
"""

from collections import OrderedDict, defaultdict
from typing import NamedTuple

import numpy as np
import pytest
import reference as ref
from _testutil import assert_tree_close, assert_tree_equal
from hypothesis import given, settings
from strategies import trees

import numbaccum as nba
from numbaccum.flat import host_leaves
from numbaccum.tree import leaves_if_structure


class Pair(NamedTuple):
    a: object
    b: object


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@settings(deadline=None, max_examples=40)
@given(trees())
def test_structure_walk_gives_the_leaves_of_tree_flatten(tree):
    leaves, td = nba.tree_flatten(tree)
    assert _same_objects(leaves_if_structure(tree, td), leaves)
    layout = nba.FlatTree.from_tree(tree).layout
    assert _same_objects(host_leaves(tree, layout), leaves)
    # Any other structure is refused (the caller then names the difference).
    for other in ([tree], (tree,), {"x": tree}, Pair(tree, None)):
        assert leaves_if_structure(other, td) is None


def test_structure_walk_refuses_every_kind_of_difference():
    w = np.zeros(3, np.float32)
    tree = {"a": [w, (w, None)], "b": Pair(w, {"c": w})}
    td = nba.tree_flatten(tree)[1]
    assert leaves_if_structure(tree, td) is not None
    different = [
        {"a": [w, (w, None)]},  # a key missing
        {"a": [w, (w, None)], "b": Pair(w, {"c": w}), "z": w},  # a key too many
        {"a": [w, (w, None)], "x": Pair(w, {"c": w})},  # a key renamed
        {"a": (w, (w, None)), "b": Pair(w, {"c": w})},  # list -> tuple
        {"a": [w, [w, None]], "b": Pair(w, {"c": w})},  # tuple -> list
        {"a": [w, (w, w)], "b": Pair(w, {"c": w})},  # None -> leaf
        {"a": [w, (w, None)], "b": (w, {"c": w})},  # NamedTuple -> tuple
        {"a": [w, (w, None)], "b": Pair(w, w)},  # subtree -> leaf
        {"a": [w, (w, None)], "b": Pair(w, {"c": [w]})},  # leaf -> subtree
        {"a": [w, (w, None), w], "b": Pair(w, {"c": w})},  # a list longer
    ]
    for other in different:
        assert leaves_if_structure(other, td) is None, other
        assert nba.tree_flatten(other)[1] != td  # the full check agrees


def test_structure_walk_never_grows_a_defaultdict():
    td = nba.tree_flatten({"a": np.zeros(1), "b": np.zeros(1)})[1]
    dd = defaultdict(lambda: np.zeros(1), a=np.zeros(1), c=np.zeros(1))
    assert leaves_if_structure(dd, td) is None
    assert sorted(dd) == ["a", "c"]


def test_dict_subclasses_and_nested_flattrees_flatten_as_before():
    w = np.arange(3, dtype=np.float32)
    tree = {"a": w, "b": w + 1}
    td = nba.tree_flatten(tree)[1]
    assert _same_objects(leaves_if_structure(OrderedDict(b=tree["b"], a=w), td), [w, tree["b"]])
    # A FlatTree inside a tree flattens as its views: the walk hands it to the full path.
    inner = nba.FlatTree.from_tree({"x": w})
    outer_td = nba.tree_flatten({"p": {"x": w}})[1]
    assert leaves_if_structure({"p": inner}, outer_td) is None
    assert len(nba.tree_flatten({"p": inner})[0]) == 1


def test_host_leaves_refuses_other_shapes_dtypes_and_leaf_types():
    tree = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float64)}
    layout = nba.FlatTree.from_tree(tree).layout
    assert host_leaves(tree, layout) is not None
    assert host_leaves({"a": np.zeros((3, 2), np.float32), "b": tree["b"]}, layout) is None
    assert host_leaves({"a": np.zeros((2, 3), np.float64), "b": tree["b"]}, layout) is None
    assert host_leaves({"a": tree["a"], "b": list(tree["b"])}, layout) is None
    scalar_layout = nba.FlatTree.from_tree({"s": np.float32(1.0)}).layout
    assert host_leaves({"s": np.float32(2.0)}, scalar_layout) is None  # a NumPy scalar: full path


def test_a_plain_tree_that_no_longer_matches_is_named_and_the_state_kept():
    params = {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}
    tx = nba.ema(0.9)
    state = tx.init(params)
    _, state = tx.update(params, state)  # the fast path from now on
    before = nba.copy_state(state)
    bad_shape = {"w": np.ones((3, 2), np.float32), "b": np.ones(3, np.float32)}
    with pytest.raises(ValueError, match=r"updates\['w'\]: shape \(3, 2\) does not match \(2, 3\)"):
        tx.update(bad_shape, state)
    with pytest.raises(ValueError, match=r"updates: tree structure mismatch"):
        tx.update({"w": params["w"]}, state)
    with pytest.raises(TypeError, match=r"updates\['b'\]"):
        tx.update({"w": params["w"], "b": "abc"}, state)
    with pytest.raises(TypeError, match=r"updates\['b'\]: dtype int64"):
        tx.update({"w": params["w"], "b": np.ones(3, np.int64)}, state)
    assert int(state.count) == int(before.count) == 1
    assert_tree_equal(state.ema.tree, before.ema.tree)
    # Another float dtype of the same shape is still accepted and cast, as before.
    u, state = tx.update({"w": params["w"], "b": np.ones(3, np.float64)}, state)
    assert u["b"].dtype == np.float32


def test_stateless_transformation_follows_the_tree_it_is_given():
    tx = nba.scale(2.0)
    state = tx.init(None)
    a = {"x": np.arange(4, dtype=np.float32)}
    b = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "y": np.ones(2, np.float64)}
    for tree in (a, a, b, b, a, {"x": np.arange(4, dtype=np.float64)}):
        u, state = tx.update(tree, state)
        assert_tree_equal(u, ref.tree_map(lambda v: v * v.dtype.type(2), tree))
    with pytest.raises(TypeError, match=r"updates\['x'\]"):
        tx.update({"x": "not an array"}, state)


@settings(deadline=None, max_examples=25)
@given(trees())
def test_plain_tree_and_flat_tree_updates_agree(tree):
    """Plain trees are packed group by group (one NumPy call per dtype): same bits as a FlatTree,
    and as the reference, for 0-d, size-0 and mixed-dtype leaves."""
    for make in (lambda: nba.ema(0.9), lambda: nba.MultiSteps(nba.sgd(0.5), 2), lambda: nba.scale(-1.5)):
        tx = make()
        s_plain, s_flat = tx.init(tree), tx.init(nba.FlatTree.from_tree(tree))
        for _ in range(3):
            u_plain, s_plain = tx.update(tree, s_plain)
            u_flat, s_flat = tx.update(nba.FlatTree.from_tree(tree), s_flat)
            assert_tree_equal(u_plain, u_flat.tree)
    ema_ref = ref.ema(0.9)
    tx = nba.ema(0.9)
    s, rs = tx.init(tree), ema_ref.init(tree)
    for _ in range(2):
        u, s = tx.update(tree, s)
        ru, rs = ema_ref.update(tree, rs)
        assert_tree_equal(u, ru)


def test_packing_casts_into_a_layout_of_another_dtype():
    tree = {"a": np.array(1.5), "b": np.zeros((0, 2)), "c": np.arange(3, dtype=np.float32)}
    flat = nba.FlatTree.from_tree(tree, dtype=np.float32)
    assert flat.group_dtypes == (np.dtype(np.float32),)
    assert_tree_equal(flat.tree, ref.tree_map(lambda v: v.astype(np.float32), tree))
    flat.assign_(ref.tree_map(lambda v: v * 2, tree))
    assert_tree_equal(flat.tree, ref.tree_map(lambda v: (v * 2).astype(np.float32), tree))


def test_backend_casts_scalars_to_the_compute_dtype():
    from numbaccum.backend import ops_for
    from numbaccum.contract import Factor

    OPS = ops_for(np.zeros(1))
    x32 = np.linspace(-1, 1, 7, dtype=np.float32)
    out32 = np.empty_like(x32)
    OPS.scale_(out32, x32, Factor(3.0, 1.0))  # a Python float: rounded to float32 first
    np.testing.assert_array_equal(out32, x32 / np.float32(3.0))
    OPS.scale_(out32, x32, Factor(np.float64(3.0), True))  # NumPy scalars and bools too
    np.testing.assert_array_equal(out32, x32 / np.float32(3.0))
    x64 = x32.astype(np.float64)
    out64 = np.empty_like(x64)
    OPS.add_scaled_(out64, x64, Factor(), x32, 0.1)  # mixed: float64 compute
    np.testing.assert_array_equal(out64, x64 + 0.1 * x32.astype(np.float64))
    x16 = x32.astype(np.float16)
    out16 = np.empty_like(x16)
    OPS.scale_(out16, x16, Factor(3.0, 1.0))  # float16: through float32, rounded once
    np.testing.assert_array_equal(out16, (x16.astype(np.float32) / np.float32(3)).astype(np.float16))
    parts = OPS.segment_sumsq(x32, np.array([0, 3, 7], np.int64))
    assert_tree_close(
        list(parts),
        [float(np.sum(x32[:3].astype(np.float64) ** 2)), float(np.sum(x32[3:].astype(np.float64) ** 2))],
    )


def test_updates_factor_keeps_the_buffers_roles_and_composes():
    from numbaccum.contract import Factor
    from numbaccum.updates import Updates

    flat = nba.FlatTree.from_tree({"a": np.ones(3, np.float32)})
    scratch = flat.zeros_like
    u = Updates(flat, False, returnable=True, scratch=scratch)
    f = u.scaled(Factor(2.0, 3.0))
    assert (f.flat, f.owned, f.returnable, f.scratch) == (flat, False, True, scratch)
    assert (f.factor.div, f.factor.mul) == (2.0, 3.0)
    assert f.pending and not u.pending
    assert Updates(flat, True).returnable and not Updates(flat, False).returnable
    np.testing.assert_array_equal(f.settled().flat.tree["a"], np.full(3, 1.5, np.float32))
    # A second factor composes with the pending one (never drops it): (1 / 2 * 3) * 5.
    g = f.scaled(Factor(1.0, 5.0))
    np.testing.assert_array_equal(g.settled().flat.tree["a"], np.full(3, 7.5, np.float32))
    np.testing.assert_array_equal(flat.tree["a"], np.ones(3, np.float32))  # the input is untouched


class _Subclass(np.ndarray):
    pass


def test_host_leaves_of_flat_nodes_refuse_what_the_full_check_refuses():
    """The check of a single array and of a dict, list or tuple of arrays (read off the layout's
    data): every difference gives None, and the full path then names the leaf."""
    w, b = np.zeros((2, 3), np.float32), np.zeros(4, np.float64)
    sub = w.view(_Subclass)
    for tree, others in [
        (w, [np.zeros((3, 2), np.float32), w.astype(np.float64), w.astype(">f4"), sub, [w]]),
        (
            {"w": w, "b": b},
            [
                {"w": w, "x": b},  # a key renamed: the same length
                {"w": w},
                {"w": w, "b": b, "c": b},
                {"w": w, "b": b.astype(">f8")},  # an equal-looking dtype of another byte order
                {"w": w, "b": b.reshape(2, 2)},
                {"w": w, "b": list(b)},
                {"w": sub, "b": b},  # a subclass: the full path decides
                defaultdict(lambda: b, w=w, x=b),
            ],
        ),
        ([w, b], [(w, b), [w], [w, b, b], [b, w], [w, np.float64(1.0)]]),
        ((w, b), [[w, b], (w,), (b, w)]),
    ]:
        layout = nba.FlatTree.from_tree(tree).layout
        assert _same_objects(host_leaves(tree, layout), nba.tree_flatten(tree)[0])
        for other in others:
            assert host_leaves(other, layout) is None, other
    dd = defaultdict(lambda: b, w=w, x=b)
    host_leaves(dd, nba.FlatTree.from_tree({"w": w, "b": b}).layout)
    assert sorted(dd) == ["w", "x"]  # not grown


_MANY_LEAVES = """
import resource, numpy as np, numbaccum as nba
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
small = [np.zeros(3, np.float32)]
tx = nba.sgd(0.1)
tx.update(small, tx.init(small), small)  # compiled (or loaded) before the measure
params = [np.zeros(3, np.float32) for _ in range(100_000)]
grads = [np.ones(3, np.float32) for _ in range(100_000)]
tx = nba.sgd(0.1)
state = tx.init(params)
before = peak_mb()
_, state = tx.update(grads, state, params)
grown = peak_mb() - before
grads[77_777] = np.ones(4, np.float32)
try:
    tx.update(grads, state, params)
except ValueError as e:
    message = str(e)
print(round(grown), message)
"""


def test_a_tree_of_100k_leaves_is_checked_in_bounded_memory():
    """The per-leaf check of a flat node is data, not code written per leaf: the first update of
    100,000 leaves of 3 elements (1.2 MB of params) grew the peak RSS by 1.3 GB when a function
    was generated and compiled for the layout; a wrong leaf is still named by its path."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _MANY_LEAVES], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split(maxsplit=1)
    grown_mb, message = int(out[0]), out[1]
    assert grown_mb < 250, f"the first update grew the peak RSS by {grown_mb} MB"
    assert message.startswith("updates[77777]: shape (4,) does not match (3,)"), message
