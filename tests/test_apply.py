"""`apply_updates` and `apply_updates_` (numbaccum.apply): the NumPy path that host trees of
float32/float64 params take gives the bits of the general path (pack, then the ``add_scaled_``
kernel per dtype group), which is recomputed here the way every call computed it before that path
existed; and whatever the general path refuses is still refused, naming the leaf, before anything
is written."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

import numbaccum as nba
from numbaccum import apply as apply_module
from numbaccum.backend import ops_for
from numbaccum.contract import ONE, Ops
from numbaccum.flat import FlatTree, as_flat

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
FLOATS = (F16, F32, F64)
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
SPECIAL = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 0.1, 1 / 3, 65504.0, 7e4, 6e-8, 1e-45]
SPECIAL += [3.4e38, -3.4e38, 1e39, 5e-324, 1e-310, 1e300, -1e300, 2.0**-149, 2.0**24 + 1]
# Leaf shapes: a 0-d leaf, empty ones, and sizes around NumPy's and the kernel's vector widths.
SHAPES = [(), (0,), (3, 0), (1,), (7,), (17,), (31, 2), (40,), (5, 13), (1023,)]


@pytest.fixture
def kernels(monkeypatch):
    """One entry per ``add_scaled_`` kernel call (the general path's) from here on."""
    seen: list[str] = []
    real = Ops.add_scaled_
    monkeypatch.setattr(
        Ops, "add_scaled_", lambda self, *args: seen.append("add_scaled") or real(self, *args)
    )
    return seen


def _values(rng, shape, dtype) -> np.ndarray:
    """Normal numbers over many scales, the special values, and raw random bits (subnormals,
    infinities and NaNs of every payload and sign)."""
    n = int(np.prod(shape))
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)
    pick = rng.random(n) < 0.3
    x[pick] = rng.choice(SPECIAL, int(pick.sum()))
    with np.errstate(all="ignore"):
        out = x.astype(dtype)
    raw = rng.random(n) < 0.1
    bits = rng.integers(0, np.iinfo(UINT[dtype.itemsize]).max, n, dtype=UINT[dtype.itemsize], endpoint=True)
    out[raw] = bits[raw].view(dtype)
    return out.reshape(shape)


def _tree(rng, dtypes) -> dict:
    """A nested tree with one leaf per shape of `SHAPES`, the dtypes taken in turn."""
    dts = itertools.cycle(dtypes)
    leaves = [_values(rng, s, next(dts)) for s in SHAPES]
    leaves = [x if i % 2 else x.copy() for i, x in enumerate(leaves)]  # own memory, or reshape views
    return {
        "a": leaves[0],
        "b": [leaves[1], (leaves[2], leaves[3])],
        "c": {f"x{i}": x for i, x in enumerate(leaves[4:])},
    }


def _like(rng, tree, dtypes) -> dict:
    """A tree of ``tree``'s structure and shapes with new values of ``dtypes`` (in turn)."""
    dts = itertools.cycle(dtypes)
    return nba.tree_map(lambda x: _values(rng, x.shape, next(dts)), tree)


def _optax_apply(params, updates) -> list[np.ndarray]:
    """The leaves of ``params + updates`` as optax defines them: each leaf added in the promoted
    dtype of the two, then cast to the param's dtype (one rounding). Writes nothing."""
    out = []
    with np.errstate(all="ignore"):
        for p, u in zip(_leaves(params), _leaves(updates)):
            wide = np.result_type(p.dtype, u.dtype)
            out.append(np.add(u.astype(wide), p.astype(wide)).astype(p.dtype))
    return out


def _leaves(tree) -> list[np.ndarray]:
    return nba.tree_flatten(tree.tree if isinstance(tree, FlatTree) else tree)[0]


def _assert_bits(got: list, want: list, params: list, updates: list) -> None:
    """Bit for bit, except where both operands are NaN: a NaN either way (which payload it
    carries is not specified, see numbaccum.apply)."""
    assert len(got) == len(want)
    for i, (g, w, p, u) in enumerate(zip(got, want, params, updates)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        with np.errstate(invalid="ignore"):  # a signalling NaN cast
            both = np.isnan(np.asarray(p, np.float64)) & np.isnan(np.asarray(u, np.float64))
        it = UINT[g.dtype.itemsize]
        gb, wb = np.ascontiguousarray(g).view(it), np.ascontiguousarray(w).view(it)
        bad = (gb != wb) & ~both
        assert not bad.any(), f"leaf {i}: {g[bad][:4]} != {w[bad][:4]} ({np.nonzero(bad)[0][:4]})"
        assert np.isnan(g[both]).all(), f"leaf {i}"


def _copy(tree):
    return nba.tree_map(lambda x: x.copy(), tree)


def _remember(params, updates) -> None:
    """Runs the general path once for this layout, as a training loop's first step does."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        nba.apply_updates(params, updates)


# --- the same bits --------------------------------------------------------------------------


MIXES = [(p, u) for p in FLOATS for u in FLOATS] + [((F32, F64), (F64, F32)), ((F16, F32, F64), (F64,))]


@pytest.mark.parametrize("pdt,udt", MIXES, ids=str)
def test_plain_trees_give_the_general_paths_bits(pdt, udt, kernels):
    rng = np.random.default_rng(MIXES.index((pdt, udt)))
    pdt, udt = (pdt if isinstance(pdt, tuple) else (pdt,)), (udt if isinstance(udt, tuple) else (udt,))
    params = _tree(rng, pdt)
    updates = _like(rng, params, udt)
    want = _optax_apply(params, updates)
    _remember(params, updates)
    kernels.clear()
    numpy_path = F16 not in pdt
    before = _copy(params)
    # The NumPy path's additions warn about nothing and raise nothing, as the kernel's; float16
    # params warn as before (as they are copied back), and casting updates may.
    with warnings.catch_warnings(), np.errstate(all="raise" if pdt == udt and numpy_path else "ignore"):
        warnings.simplefilter("error" if numpy_path else "ignore", RuntimeWarning)
        out = nba.apply_updates(params, updates)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(_leaves(params), _leaves(before)))
        assert nba.apply_updates_(params, updates) is params
    _assert_bits(_leaves(out), want, _leaves(before), _leaves(updates))
    _assert_bits(_leaves(params), want, _leaves(before), _leaves(updates))
    assert (not kernels) == numpy_path, kernels  # float16 params take the kernel, as before


@pytest.mark.parametrize(
    "pstore,ustore", [(F32, F32), (F64, F64), (F32, F64), (F64, F32), (F16, F32), (F32, F16)]
)
def test_flat_trees_of_one_layout_give_the_general_paths_bits(pstore, ustore, kernels):
    """FlatTrees of one layout whose storage dtypes may differ from it (as a state's
    accumulators do): the kernel computes in the wider dtype, NumPy's add too."""
    rng = np.random.default_rng(5)
    layout = FlatTree.from_tree(_tree(rng, (F32, F64))).layout
    params = FlatTree.empty(layout, pstore)
    updates = FlatTree.empty(layout, ustore)
    with np.errstate(all="ignore"):
        params.assign_(_like(rng, params.tree, (pstore,)))
        updates.assign_(_like(rng, updates.tree, (ustore,)))
    want = _optax_apply(params, updates)
    before = [x.copy() for x in _leaves(params)]
    kernels.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if F16 in (pstore, ustore) else "error", RuntimeWarning)
        out = nba.apply_updates(params, updates)
        assert isinstance(out, FlatTree) and out.layout is layout and out.group_dtypes == params.group_dtypes
        nba.apply_updates_(params, updates)
    _assert_bits(_leaves(out), want, before, _leaves(updates))
    _assert_bits(_leaves(params), want, before, _leaves(updates))
    assert (not kernels) == (F16 not in (pstore, ustore)), kernels


def test_updates_as_a_flat_tree_or_its_views_for_plain_params(kernels):
    rng = np.random.default_rng(11)
    params = _tree(rng, (F32, F64))
    updates = FlatTree.from_tree(_like(rng, params, (F64, F32)))  # another layout: cast as packed
    want = _optax_apply(params, updates)
    _remember(params, updates)
    kernels.clear()
    for given in (updates, updates.tree):
        p = _copy(params)
        with np.errstate(all="ignore"):  # the casts overflow and meet signalling NaNs, as before
            nba.apply_updates_(p, given)
            out = nba.apply_updates(params, given)
        _assert_bits(_leaves(p), want, _leaves(params), _leaves(updates))
        _assert_bits(_leaves(out), want, _leaves(params), _leaves(updates))
    assert not kernels


def test_the_tree_of_a_flat_tree_is_added_in_place(kernels):
    rng = np.random.default_rng(12)
    flat = FlatTree.from_tree(_tree(rng, (F32, F64)))
    params = flat.tree
    updates = _like(rng, params, (F32, F64))
    once = _optax_apply(params, updates)
    twice = _optax_apply(nba.tree_unflatten(nba.tree_flatten(params)[1], once), updates)
    before = [x.copy() for x in _leaves(params)]
    _remember(params, updates)
    kernels.clear()
    with np.errstate(all="ignore"):
        nba.apply_updates_(params, updates)
        _assert_bits(_leaves(flat), once, before, _leaves(updates))  # the FlatTree's own buffers
        nba.apply_updates_(params, FlatTree.from_tree(updates).tree)  # updates: another .tree
    assert not kernels
    _assert_bits(_leaves(flat), twice, once, _leaves(updates))


def test_the_new_tree_is_views_of_one_buffer_per_dtype_as_before():
    rng = np.random.default_rng(2)
    params = _tree(rng, (F32, F64))
    updates = _like(rng, params, (F32, F64))
    _remember(params, updates)
    out = nba.apply_updates(params, updates)
    layout = FlatTree.from_tree(params).layout
    assert as_flat(out, layout, "out")[1] is False  # each group's leaves back to back: no packing
    assert all(x is not p for x, p in zip(_leaves(out), _leaves(params)))


def test_aliased_leaves_read_every_update_before_writing_any(kernels):
    """Params whose leaves are one array twice, updates that are other params' arrays or views
    of them: the general path packs every leaf before it writes one, and so must the result."""
    rng = np.random.default_rng(3)
    x, y, z = (_values(rng, (6,), F32) for _ in range(3))
    big = _values(rng, (12,), F32)
    cases = [
        lambda: ({"a": x, "b": x}, {"a": y, "b": z}),  # one array twice: the last leaf's sum
        lambda: ({"a": x, "b": y}, {"a": y, "b": x}),  # each update is the other param
        lambda: ({"a": x, "b": y}, None),  # the params themselves
        lambda: ({"a": big[:6], "b": big[6:]}, {"a": big[6:], "b": big[:6]}),  # views of one array
        lambda: ({"a": big, "b": x}, {"a": z.repeat(2), "b": big[3:9]}),  # an update viewing a param
        lambda: (tree, {"a": tree["b"], "b": tree["a"]}),  # a FlatTree's .tree, its leaves swapped
        lambda: ({"a": x, "b": y}, {"a": other[:6], "b": other[6:]}),  # views of one other buffer
        lambda: ({"a": x, "b": y}, {"a": raw[:6], "b": raw[6:]}),  # ... whose owner is not an array
        lambda: ({"a": x, "b": big[:6]}, {"a": big[6:], "b": big[:6]}),  # ... a param's own buffer
    ]
    other = _values(rng, (12,), F32)
    raw = np.frombuffer(bytearray(other.tobytes()), F32)
    tree = FlatTree.from_tree({"a": x.copy(), "b": y.copy()}).tree
    for make in cases:
        params, updates = make()
        updates = params if updates is None else updates
        _remember(_copy(params), _copy(updates))
        want = _optax_apply(params, updates)
        snap = {k: v.copy() for k, v in params.items()}
        nba.apply_updates_(params, updates)
        if params["a"] is params["b"]:
            want = [want[1], want[1]]  # scattered back in leaf order: the last write stays
        np.testing.assert_array_equal(_leaves(params)[0], want[0])
        np.testing.assert_array_equal(_leaves(params)[1], want[1])
        for k, v in snap.items():  # restore the shared arrays for the next case
            params[k][...] = v


# --- errors: named, and nothing written -----------------------------------------------------


def _params_and_updates(rng):
    params = {"a": _values(rng, (4,), F32), "b": _values(rng, (3, 2), F64), "z": _values(rng, (5,), F32)}
    return params, _like(rng, params, (F32, F64))


@pytest.mark.parametrize("remembered", [False, True], ids=["new layout", "known layout"])
def test_a_bad_leaf_late_in_the_tree_changes_nothing(remembered):
    rng = np.random.default_rng(4)
    params, updates = _params_and_updates(rng)
    if remembered:
        _remember(params, updates)
    else:
        apply_module._recent = ()

    def readonly(p, u):
        p["z"].flags.writeable = False

    def scalar(p, u):
        p["z"], u["z"] = np.float32(1.0), u["z"][0]

    def shape(p, u):
        u["z"] = u["z"][:4]

    def missing(p, u):
        del u["z"]

    def ints(p, u):
        u["z"] = np.ones(5, np.int32)

    def python(p, u):
        u["z"] = [1.0] * 5

    def other_order(p, u):
        u["z"] = u["z"].astype(">f4")

    cases = [
        (readonly, TypeError, r"params\['z'\]: cannot be changed in place"),
        (scalar, TypeError, r"params\['z'\]: cannot be changed in place"),
        (shape, ValueError, r"updates\['z'\]"),
        (missing, ValueError, "updates"),
        (ints, TypeError, r"updates\['z'\]"),
        (python, (TypeError, ValueError), r"updates\['z'\]"),
        (other_order, TypeError, r"updates\['z'\]"),
    ]
    for spoil, error, match in cases:
        p, u = _copy(params), _copy(updates)
        spoil(p, u)
        before = _copy(p)
        with pytest.raises(error, match=match):
            nba.apply_updates_(p, u)
        for k in before:
            assert np.asarray(p[k]).tobytes() == np.asarray(before[k]).tobytes(), (spoil.__name__, k)
        if spoil is not scalar and spoil is not readonly:
            with pytest.raises(error, match=match):
                nba.apply_updates(p, u)


def test_a_read_only_flat_tree_is_refused_before_anything_is_written():
    """It raised numba's TypingError from inside the kernel before; now a TypeError, as a
    read-only leaf gives."""
    rng = np.random.default_rng(6)
    params, updates = _params_and_updates(rng)
    flat = FlatTree.from_tree(params)
    flat._mark_readonly()
    before = [g.copy() for g in flat.groups]
    for u in (FlatTree.from_tree(updates), updates):
        with pytest.raises(TypeError, match="read-only FlatTree"):
            nba.apply_updates_(flat, u)
        assert all(g.tobytes() == b.tobytes() for g, b in zip(flat.groups, before))
    out = nba.apply_updates(flat, FlatTree.from_tree(updates))  # out of place: allowed
    assert isinstance(out, FlatTree) and not out._readonly


def test_updates_wider_than_the_params_are_added_in_their_dtype_and_rounded_once():
    """optax's ``p + u`` then cast: float64 updates of float32 params are not cast first (no
    double rounding; an overflow is inf, under any error state, as the kernel's), on both paths,
    in place and not, for plain trees and FlatTrees."""
    cases = [
        (np.float16, np.float32, 1.0, 2.0**-11 + 2.0**-23),  # casting first would round to 1.0
        (np.float32, np.float64, 1.0, 2.0**-24 + 2.0**-50),
        (np.float16, np.float64, 1.0, 2.0**-11 + 2.0**-40),
        (np.float32, np.float64, 1.0, 1e300),  # overflows in the cast of the sum: inf
    ]
    for pdt, udt, p0, u0 in cases:
        params = {"a": np.full(3, p0, pdt), "b": np.full(2, p0, pdt)}
        updates = {"a": np.full(3, u0, udt), "b": np.full(2, u0, udt)}
        want = _optax_apply(params, updates)
        if u0 < 1e38:  # the point: casting the update first would round twice, to another value
            assert want[0][0] != np.asarray(u0, udt).astype(pdt) + np.asarray(p0, pdt)
        for remembered in (False, True):
            if remembered:
                _remember(params, updates)
            else:
                apply_module._recent = ()
            for form in ("dict", "flat"):
                p = _copy(params) if form == "dict" else FlatTree.from_tree(params)
                with np.errstate(all="raise"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # float16's copy back
                    out = nba.apply_updates(p, updates)
                    nba.apply_updates_(p, updates)
                _assert_bits(_leaves(out), want, _leaves(params), _leaves(updates))
                _assert_bits(_leaves(p), want, _leaves(params), _leaves(updates))


def test_additions_neither_raise_nor_warn_like_the_kernel():
    """The kernel's additions check no floating-point flags: an overflow or inf - inf under
    ``np.errstate(all='raise')`` gives inf and NaN, with no warning."""
    params = {"a": np.array([3e38, np.inf, 1.0], np.float32), "b": np.array([1e308, -np.inf])}
    updates = {"a": np.array([3e38, -np.inf, 1.0], np.float32), "b": np.array([1e308, np.inf])}
    _remember(params, updates)
    for call in (nba.apply_updates, nba.apply_updates_):
        with np.errstate(all="raise"), warnings.catch_warnings():
            warnings.simplefilter("error")
            out = call(params, updates)
        np.testing.assert_array_equal(out["a"], [np.inf, np.nan, 2.0])
        np.testing.assert_array_equal(out["b"], [np.inf, np.nan])


def test_none_is_an_empty_tree():
    assert nba.apply_updates(None, {"a": np.ones(2)}) is None
    assert nba.apply_updates_(None, {"a": np.ones(2)}) is None


def test_the_remembered_layouts_are_few_and_any_tree_still_works():
    rng = np.random.default_rng(9)
    for n in range(1, 12):
        p = {"w": _values(rng, (n,), F32)}
        u = {"w": np.ones(n, np.float32)}
        want = p["w"] + np.float32(1.0)
        nba.apply_updates_(p, u)
        np.testing.assert_array_equal(p["w"], want)
        assert len(apply_module._recent) <= apply_module._RECENT_LAYOUTS
    first = {"w": np.zeros(1, np.float32)}  # its layout was dropped long ago: the general path
    nba.apply_updates_(first, {"w": np.ones(1, np.float32)})
    assert first["w"][0] == 1.0


def test_flat_trees_whose_groups_overlap_take_the_kernel(kernels):
    """FlatTrees over one buffer, the updates' group a shifted view of the params': the kernel
    reads what its own loop wrote, NumPy would read a copy; the kernel's bits are kept."""
    layout = FlatTree.from_tree({"w": np.zeros(8)}).layout

    def flats():
        big = np.arange(10.0) ** 2
        return FlatTree(layout, [big[2:]], {F64: big[2:]}), FlatTree(layout, [big[:8]], {F64: big[:8]}), big

    p, u, big = flats()
    kernels.clear()
    nba.apply_updates_(p, u)
    assert kernels == ["add_scaled"]
    _, _, want = flats()
    ops_for(want).add_scaled_(want[2:], want[2:], ONE, want[:8], 1.0)
    assert big.tobytes() == want.tobytes()


@pytest.mark.cuda
def test_device_trees_keep_the_kernel_path():
    """A FlatTree on the device and a tree of CUDA arrays take the general path, as before
    (runs on a GPU or in numba's simulator)."""
    from numba import cuda

    rng = np.random.default_rng(8)
    params = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(4)}
    updates = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(4)}
    want = _optax_apply(params, updates)
    flat, uflat = nba.to_device(FlatTree.from_tree(params)), nba.to_device(FlatTree.from_tree(updates))
    out = nba.apply_updates(flat, uflat)
    assert isinstance(out, FlatTree) and out.device
    assert nba.apply_updates_(flat, uflat) is flat
    for got in (out, flat):
        _assert_bits(_leaves(nba.to_host(got)), want, _leaves(params), _leaves(updates))
    d = {k: cuda.to_device(v) for k, v in params.items()}
    nba.apply_updates_(d, {k: cuda.to_device(v) for k, v in updates.items()})
    _assert_bits([d["a"].copy_to_host(), d["b"].copy_to_host()], want, _leaves(params), _leaves(updates))
    flat._mark_readonly()
    with pytest.raises(TypeError, match="read-only FlatTree"):
        nba.apply_updates_(flat, uflat)


def test_the_docstring_examples_run():
    import doctest

    runner = doctest.DocTestRunner(verbose=False)
    for f in (nba.apply_updates, nba.apply_updates_):
        for test in doctest.DocTestFinder().find(f, f.__name__, globs={}):
            runner.run(test)
    assert runner.failures == 0 and runner.tries == 7
