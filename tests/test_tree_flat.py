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
        ({"a": [1, 2]}, r"tree\['a'\]\[0\]: dtype int64", TypeError),  # Python ints: integers
        (
            {"a": {"b": object()}},
            r"tree\['a'\]\['b'\]: expected an array .* or a float, got object",
            TypeError,
        ),
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


# --- leaves people have (issue 24, item 4) --------------------------------------------------------


def _host_leaves_people_have() -> dict:
    """Gradients as they come: Python and NumPy scalars, and arrays NumPy reads without a copy."""
    out = {"python float": 0.25, "numpy scalar": np.float32(0.25)}
    try:
        import jax.numpy as jnp

        out["jax array"] = jnp.full((3,), 0.25, jnp.float32)
    except ImportError:
        pass
    try:
        import torch

        out["torch cpu tensor"] = torch.full((3,), 0.25)
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("kind", sorted(_host_leaves_people_have()))
def test_gradients_may_be_any_leaf_numpy_reads(kind):
    """What optax takes as a gradient leaf, update and step_ take: the same numbers as the NumPy
    array of it gives, and NumPy arrays back."""
    g = _host_leaves_people_have()[kind]
    as_numpy = np.asarray(g)
    params = {"x": np.ones(as_numpy.shape, as_numpy.dtype)}
    tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-2))
    u, _ = tx.update({"x": g}, tx.init(params), params)
    want, _ = tx.update({"x": as_numpy}, tx.init(params), params)
    assert type(u["x"]) is np.ndarray
    np.testing.assert_array_equal(u["x"], want["x"])
    p = {"x": params["x"].copy()}
    nba.step_(tx, {"x": g}, tx.init(p), p)
    np.testing.assert_array_equal(p["x"], params["x"] + want["x"])


@pytest.mark.parametrize("kind", sorted(_host_leaves_people_have()))
def test_params_that_cannot_change_in_place_point_to_apply_updates(kind):
    """step_ and apply_updates_ write the params in place: a scalar or a JAX array cannot be, so
    they refuse it (naming the leaf, pointing to apply_updates) before anything is written, where
    writing into a converted copy would change nothing without a word."""
    leaf = _host_leaves_people_have()[kind]
    params = {"x": leaf, "w": np.ones(2, np.float32)}
    grads = {"x": np.asarray(leaf) * 0 + 1, "w": np.ones(2, np.float32)}
    tx = nba.sgd(0.1)
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"params\['x'\]: cannot be changed in place.*apply_updates"):
        nba.step_(tx, grads, state, params)
    with pytest.raises(TypeError, match=r"params\['x'\]: cannot be changed in place.*apply_updates"):
        nba.apply_updates_(params, grads)
    np.testing.assert_array_equal(params["w"], np.ones(2, np.float32))  # nothing written
    new = nba.apply_updates(params, tx.update(grads, state, params)[0])
    np.testing.assert_allclose(np.asarray(new["x"]), np.asarray(leaf) - 0.1, rtol=1e-6)


class _Sub(np.ndarray):
    pass


def _host_trees():
    """Trees against the layout of ``{"a": (2, 3) float32, "b": (4,) float32}``, and the same
    for a list, a tuple and a lone array: each kind of difference `host_leaves` must see."""
    import collections

    a, b = np.ones((2, 3), np.float32), np.zeros(4, np.float32)
    base = {"a": a, "b": b}
    yield base, base, True
    yield base, collections.OrderedDict(base), True  # a dict subclass: the walk decides
    yield base, collections.defaultdict(lambda: a, {"a": a}), False
    yield base, {"a": a}, False
    yield base, {"a": a, "c": b}, False
    yield base, {"a": a, "b": b, "c": b}, False
    yield base, {"a": a.T.copy(), "b": b}, False  # same size, other shape
    yield base, {"a": a.astype(np.float64), "b": b}, False
    yield base, {"a": a.astype(">f4"), "b": b}, False  # float32 in the other byte order
    yield base, {"a": a.view(_Sub), "b": b}, False  # a subclass of ndarray
    yield base, {"a": a, "b": list(b)}, False
    yield base, {"a": a, "b": {"c": b}}, False
    yield base, [a, b], False
    yield [a, b], [a, b], True
    yield [a, b], (a, b), False
    yield [a, b], [a], False
    yield [a, b], [b, a], False
    yield (a, b), (a, b), True
    yield (a, b), [a, b], False
    yield a, a, True
    yield a, a.T.copy(), False
    yield a, np.float32(1.0), False
    yield {"x": [a, {"y": b}]}, {"x": [a, {"y": b}]}, True  # nested: the walk itself
    yield {"x": [a, {"y": b}]}, {"x": [a, {"y": a}]}, False


@pytest.mark.parametrize("case", list(range(len(list(_host_trees())))))
def test_host_leaves_written_for_the_layout_answers_as_the_walk(case):
    """`host_leaves` runs a function written for the layout (one dict, list or tuple of arrays,
    or one array): its answer is the general walk's on every kind of difference."""
    from numbaccum.flat import _walked_leaves, host_leaves

    like, tree, ok = list(_host_trees())[case]
    layout = nba.FlatTree.from_tree(like).layout
    fast, walked = host_leaves(tree, layout), _walked_leaves(tree, layout)
    assert (fast is not None) is ok
    assert (walked is not None) is ok
    if ok:
        assert all(x is y for x, y in zip(fast, walked))
        assert len(fast) == layout.num_leaves
