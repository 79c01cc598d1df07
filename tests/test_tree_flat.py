"""Trees and flat buffers: flatten/unflatten/map, FlatTree views, copies and errors."""

from typing import NamedTuple

import numpy as np
import pytest
import reference as ref
from hypothesis import given, settings
from strategies import trees

import numbaccum as nba


class Pair(NamedTuple):
    a: object
    b: object


def test_flatten_orders_dict_keys_and_keeps_containers():
    tree = {"b": [np.zeros(1), (np.ones(2),)], "a": Pair(np.full(3, 2.0), None)}
    leaves, td = nba.tree_flatten(tree)
    assert [x.size for x in leaves] == [3, 1, 2]
    back = nba.tree_unflatten(td, leaves)
    assert isinstance(back["a"], Pair) and back["a"].b is None
    assert isinstance(back["b"], list) and isinstance(back["b"][1], tuple)
    assert td.num_leaves == 3


def test_tree_map_names_first_differing_path():
    a = {"dense": {"w": np.zeros(2), "b": np.zeros(1)}}
    b = {"dense": {"w": np.zeros(2), "c": np.zeros(1)}}
    with pytest.raises(ValueError, match=r"\['dense'\]"):
        nba.tree_map(np.add, a, b)


@settings(deadline=None, max_examples=30)
@given(trees())
def test_flattree_round_trip_and_views(tree):
    flat = nba.FlatTree.from_tree(tree)
    np_leaves = ref.tree_leaves(tree)
    ours = nba.tree_flatten(flat.tree)[0]
    assert len(ours) == len(np_leaves)
    for x, y in zip(ours, np_leaves):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)
    # Leaves are views: writing through .tree changes the buffers.
    total = sum(b.size for b in flat.buffers.values())
    assert total == sum(x.size for x in np_leaves)
    for b in flat.buffers.values():
        b[...] = 7
    for x in nba.tree_flatten(flat.tree)[0]:
        assert np.all(x == 7)
    # One buffer per dtype, keyed by np.dtype.
    assert set(flat.buffers) == {x.dtype for x in np_leaves}


def test_flattree_dtype_copy_zeros_assign():
    tree = {"w": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.ones(2, np.float32)}
    flat = nba.FlatTree.from_tree(tree, dtype=np.float32)
    assert list(flat.buffers) == [np.dtype(np.float32)]
    assert flat["w"].dtype == np.float32 and flat["w"].shape == (2, 3)
    c = flat.copy()
    c["w"][0, 0] = 100
    assert flat["w"][0, 0] == 0
    z = flat.zeros_like()
    assert all(np.all(b == 0) for b in z.buffers.values())
    z.assign_({"w": np.full((2, 3), 5.0), "b": np.full(2, 3.0)})
    np.testing.assert_array_equal(z["w"], np.full((2, 3), 5.0))
    with pytest.raises(ValueError, match=r"\['w'\]"):
        z.assign_({"w": np.zeros((3, 2)), "b": np.zeros(2)})
    np.testing.assert_array_equal(z["w"], np.full((2, 3), 5.0))  # unchanged after the error


def test_single_leaf_flattree_is_array_like():
    flat = nba.FlatTree.from_tree(np.arange(3.0))
    np.testing.assert_array_equal(np.asarray(flat), [0, 1, 2])


@pytest.mark.parametrize(
    "tree, match, exc",
    [
        ({"a": [1.0, 2.0]}, r"tree\['a'\]\[0\]: expected a NumPy or CUDA array", TypeError),
        ({"a": np.arange(3)}, r"tree\['a'\]: dtype int64", TypeError),
        ({"a": "x"}, r"tree\['a'\]", TypeError),
    ],
)
def test_bad_leaves_name_their_path(tree, match, exc):
    with pytest.raises(exc, match=match):
        nba.FlatTree.from_tree(tree)


def test_float16_leaves_compute_in_float32_and_round_once():
    p = {"h": np.array([1.0, 2.0], np.float16)}
    tx = nba.ema(0.5, debias=False)
    s = tx.init(p)
    u, s = tx.update({"h": np.array([4.0, 8.0], np.float16)}, s)
    assert u["h"].dtype == np.float16
    np.testing.assert_array_equal(u["h"], [2.0, 4.0])
    np.testing.assert_array_equal(s.ema["h"], [2.0, 4.0])
