"""Issue 22, items 3 and 4: a state an update has advanced is refused, not silently reused, and
`step_` keeps `update`'s promises (one update of a state at a time; params of another dtype).

A state's buffers are updated in place, so the optax habit ``best = state`` (or keeping
yesterday's state to retry a step) used to compute with advanced buffers and old counters
without a word. Each case below ran silently on 7d5d46e."""

from __future__ import annotations

import copy
import pickle
import threading
import time

import numpy as np
import pytest
from _testutil import assert_bits_equal, assert_tree_equal, snapshot

import numbaccum as nba
from numbaccum import checkpoint
from numbaccum.protocol import GradientTransformation

P = {"w": np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}


def _grads(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in P.items()}


def _params() -> dict:
    return {k: v.copy() for k, v in P.items()}


def _values(state):
    """A state's values as plain nested lists of array copies (FlatTrees by their leaves)."""
    if isinstance(state, nba.FlatTree):
        return [np.array(x, copy=True) for x in state.leaves]
    if isinstance(state, dict):
        return [_values(state[k]) for k in sorted(state)]
    if isinstance(state, (tuple, list)):
        return [_values(x) for x in state]
    return np.array(state, copy=True)


MAKERS = {
    "trace": lambda: nba.trace(0.9),
    "adam": lambda: nba.adam(1e-2),
    "ema": lambda: nba.ema(0.9),
    "chain": lambda: nba.chain(nba.clip_by_global_norm(1.0), nba.trace(0.9), nba.scale(-0.1)),
    "multisteps": lambda: nba.MultiSteps(nba.chain(nba.trace(0.5), nba.adam(1e-2)), 2),
}


def _advance(tx, state, n: int, step: bool, params: dict | None = None):
    params = _params() if params is None else params
    for i in range(n):
        if step:
            state = nba.step_(tx, _grads(i), state, params)
        else:
            state = tx.update(_grads(i), state, params)[1]
    return state


@pytest.mark.parametrize("step", [False, True], ids=["update", "step_"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_item3_a_state_kept_from_before_is_refused(name, step):
    tx = MAKERS[name]()
    best = tx.init(_params())
    state = _advance(tx, best, 5, step)
    kept = _values(state)
    params = _params()
    with pytest.raises(ValueError, match=r"stale.*copy_state"):
        if step:
            nba.step_(tx, _grads(9), best, params)
        else:
            tx.update(_grads(9), best, params)
    assert_tree_equal(params, P)  # nothing written: params, and the current state's buffers
    assert_bits_equal(_values(state), kept)
    _advance(tx, state, 2, step)  # the current state goes on


@pytest.mark.parametrize("name", list(MAKERS))
def test_item3_yesterdays_state_is_refused_after_one_step(name):
    """Retrying a step that succeeded, from the state it was given."""
    tx = MAKERS[name]()
    yesterday = _advance(tx, tx.init(_params()), 3, False)
    tx.update(_grads(3), yesterday, _params())
    with pytest.raises(ValueError, match="stale"):
        tx.update(_grads(3), yesterday, _params())


def test_item3_a_stale_inner_state_is_refused():
    """A chain's (or MultiSteps') state put together from a current and an older part."""
    tx = nba.chain(nba.trace(0.9), nba.adam(1e-2))
    old = tx.init(_params())
    new = _advance(tx, old, 2, False)
    with pytest.raises(ValueError, match=r"state\.(mu|nu): .*stale"):
        tx.update(_grads(5), (new[0], old[1]), _params())
    ms = nba.MultiSteps(nba.adam(1e-2), 1)
    old = ms.init(_params())
    new = _advance(ms, old, 2, False)
    with pytest.raises(ValueError, match="stale"):
        ms.update(_grads(5), new._replace(inner_opt_state=old.inner_opt_state), _params())


def _trajectory(tx, state, start: int, n: int) -> list:
    out = []
    for i in range(start, start + n):
        u, state = tx.update(_grads(i), state, _params())
        out.append(snapshot(u))
    return out


@pytest.mark.parametrize("name", list(MAKERS))
def test_item3_copy_state_keeps_a_snapshot_that_updates_as_the_original_did(name):
    tx = MAKERS[name]()
    state = _advance(tx, tx.init(_params()), 2, False)
    best = nba.copy_state(state)
    ahead = _trajectory(tx, state, 2, 3)
    again = _trajectory(tx, best, 2, 3)  # the snapshot is current: it replays the same steps
    for a, b in zip(ahead, again):
        assert_tree_equal(a, b)


def test_item3_replace_of_the_current_state_works():
    tx = nba.scale_by_adam()
    state = _advance(tx, tx.init(_params()), 3, False)
    u, reset = tx.update(_grads(7), state._replace(count=np.int32(0)), _params())
    assert int(reset.count) == 1
    tx.update(_grads(8), reset, _params())  # and the state it returned goes on
    tr = nba.trace(0.9)
    s = _advance(tr, tr.init(_params()), 2, False)
    _advance(tr, nba.TraceState(trace=s.trace), 2, False)  # rebuilt from the current fields


def test_item3_a_loaded_checkpoint_is_current(tmp_path):
    tx = MAKERS["chain"]()
    state = _advance(tx, tx.init(_params()), 2, False)
    nba.save_state(tmp_path / "s.nbc", state)
    ahead = _trajectory(tx, state, 2, 3)
    loaded = nba.load_state(tmp_path / "s.nbc")
    again = _trajectory(tx, loaded, 2, 3)
    for a, b in zip(ahead, again):
        assert_tree_equal(a, b)


def test_item3_a_failed_update_leaves_the_state_it_was_given_current():
    tx = nba.chain(nba.clip_by_global_norm(1.0, nonfinite="raise"), nba.adam(1e-2))
    state = _advance(tx, tx.init(_params()), 2, False)
    nan = {k: np.full(v.shape, np.nan, np.float32) for k, v in P.items()}
    with pytest.raises(FloatingPointError):
        tx.update(nan, state, _params())
    with pytest.raises(ValueError, match="updates"):
        tx.update({"w": P["w"]}, state)
    _advance(tx, state, 2, False)  # not refused as stale


@pytest.mark.parametrize(
    "make",
    [
        lambda: nba.chain(nba.clip_by_global_norm(1.0, nonfinite="skip"), nba.trace(0.9), nba.adam(1e-2)),
        lambda: nba.apply_if_finite(nba.chain(nba.trace(0.9), nba.adam(1e-2)), 5),
        lambda: nba.MultiSteps(nba.adam(1e-2), 2, should_skip_update_fn=nba.skip_not_finite),
        lambda: nba.MultiSteps(nba.chain(nba.clip_by_global_norm(1.0, nonfinite="skip"), nba.adam(1e-2)), 1),
        lambda: nba.masked(nba.adam(1e-2), {"w": True, "b": False}),
        lambda: nba.inject_hyperparams(nba.adam)(learning_rate=1e-2),
    ],
    ids=["chain_skip", "apply_if_finite", "multisteps_skip_fn", "multisteps_inner_skip", "masked", "inject"],
)
@pytest.mark.parametrize("step", [False, True], ids=["update", "step_"])
def test_item3_steps_that_keep_a_state_never_make_it_stale(make, step):
    """Skipped steps return (part of) the state they were given: it stays current; and a state
    from before the steps is still refused."""
    tx = make()
    first = state = tx.init(_params())
    params = _params()
    nan = {k: np.full(v.shape, np.nan, np.float32) for k, v in P.items()}
    for i in range(6):
        g = nan if i in (1, 2, 4) else _grads(i)
        if step:
            state = nba.step_(tx, g, state, params)
        else:
            state = tx.update(g, state, params)[1]
    with pytest.raises(ValueError, match="stale"):
        tx.update(_grads(0), first, _params())


# --- item 4: step_ keeps update's promises ---------------------------------------------------


class _Blocking:
    """A user transformation that waits inside its update until released: two updates of one
    state then overlap for sure."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def tx(self) -> GradientTransformation:
        def update(u, s, params=None):
            self.entered.set()
            assert self.release.wait(30)
            return u, s

        return GradientTransformation(lambda p: nba.EmptyState(), update)


@pytest.mark.parametrize("first", [False, True], ids=["user_last", "user_first"])
@pytest.mark.parametrize("step", [False, True], ids=["update", "step_"])
def test_item4_two_threads_on_one_state_raise_in_update_and_step(step, first):
    block = _Blocking()
    parts = [nba.trace(0.9), nba.scale(-0.1)]
    tx = nba.chain(block.tx(), *parts) if first else nba.chain(*parts, block.tx())
    state = tx.init(_params())
    p1, p2 = _params(), _params()
    errors: list = []

    def call(params):
        try:
            if step:
                nba.step_(tx, _grads(0), state, params)
            else:
                tx.update(_grads(0), state, params)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=call, args=(p1,))
    t.start()
    assert block.entered.wait(30)
    with pytest.raises(RuntimeError, match="another update of this state is running"):
        if step:
            nba.step_(tx, _grads(1), state, p2)
        else:
            tx.update(_grads(1), state, p2)
    assert_tree_equal(p2, P)  # the refused call wrote nothing
    block.release.set()
    t.join(30)
    assert not errors, errors


def test_item4_params_of_another_dtype_give_the_same_error_from_update_and_step():
    """A state made for float32 params, used with float64 ones: `step_` rounded the params to
    float32, `update` + `apply_updates_` did not. Both now refuse, naming the leaf."""
    for tx in (nba.adam(1e-2), nba.chain(nba.trace(0.9), nba.add_decayed_weights(1e-2), nba.scale(-0.1))):
        state = _advance(tx, tx.init(_params()), 2, False)
        kept = _values(state)
        p64 = {k: v.astype(np.float64) + 1e-9 for k, v in P.items()}
        before = snapshot(p64)
        messages = []
        for call in (lambda: tx.update(_grads(3), state, p64), lambda: nba.step_(tx, _grads(3), state, p64)):
            with pytest.raises(TypeError, match=r"params\['b'\]: dtype float64 does not match float32") as e:
                call()
            messages.append(str(e.value))
        assert messages[0] == messages[1]
        assert_tree_equal(p64, before)
        assert_bits_equal(_values(state), kept)
        _advance(tx, state, 1, True)  # the state is still current


# --- issue 42, items 1 and 5: a state is stale or current everywhere, and read whole -----------
#
# save_state + load_state, copy_state, pickle and copy.deepcopy accepted a consumed state and
# gave back one every later update took (its latest buffers with its old counters), and
# save_state read the buffers while an update on another thread wrote them.


def _save(state, tmp_path):
    nba.save_state(tmp_path / "s.npz", state)
    return nba.load_state(tmp_path / "s.npz")


DOORS = {
    "save_state": _save,
    "copy_state": lambda state, tmp_path: nba.copy_state(state),
    "pickle": lambda state, tmp_path: pickle.loads(pickle.dumps(state)),
    "deepcopy": lambda state, tmp_path: copy.deepcopy(state),
}


def _reason(e) -> str:
    """An error's message without the path it starts with (``state.nu: ``)."""
    return str(e.value).split(": ", 1)[1]


@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize("name", list(MAKERS))
def test_i42_item1_a_stale_state_is_refused_by_every_copy_as_update_refuses_it(name, door, tmp_path):
    tx = MAKERS[name]()
    best = _advance(tx, tx.init(_params()), 1, False)
    state = _advance(tx, best, 2, False)
    with pytest.raises(ValueError, match="stale") as by_update:
        tx.update(_grads(9), best, _params())
    with pytest.raises(ValueError, match="stale") as e:
        DOORS[door](best, tmp_path)
    assert _reason(e) == _reason(by_update)
    assert list(tmp_path.iterdir()) == []  # nothing written
    # The current state goes through, and what comes back is current: it continues as the
    # state itself does.
    again = DOORS[door](state, tmp_path)
    for a, b in zip(_trajectory(tx, state, 3, 2), _trajectory(tx, again, 3, 2)):
        assert_tree_equal(a, b)


def test_i42_item1_the_issue_example_best_is_kept_by_a_copy_not_by_a_name(tmp_path):
    """``best = state; ...; save_state("best.npz", best)``: the resumed step gave -0.14695 (the
    buffers of step 2 with the count of step 1) where the real step-1 state gives -0.1."""
    tx = nba.adam(0.1)
    params = {"w": np.zeros(3, np.float32)}
    g = {"w": np.ones(3, np.float32)}
    state = nba.step_(tx, g, tx.init(params), params)
    best, kept = state, nba.copy_state(state)
    state = nba.step_(tx, g, state, params)
    with pytest.raises(ValueError, match="stale"):
        nba.save_state(tmp_path / "best.npz", best)
    nba.save_state(tmp_path / "best.npz", kept)
    resumed = nba.load_state(tmp_path / "best.npz", like=tx.init(params))
    np.testing.assert_allclose(tx.update(g, resumed)[0]["w"], -0.1, rtol=1e-4)  # eps: -0.099999


def test_i42_item1_a_shallow_copy_of_a_stale_buffer_is_stale():
    """``copy.copy`` of a FlatTree is the same buffer: it made a new generation over the
    advanced storage, which an update took as current."""
    tx = nba.scale_by_adam()
    old = tx.init(_params())
    new = _advance(tx, old, 1, False)
    with pytest.raises(ValueError, match="stale"):
        tx.update(_grads(3), old._replace(nu=copy.copy(old.nu)), _params())
    _advance(tx, new._replace(nu=copy.copy(new.nu)), 1, False)  # of the current one: current


def test_i42_item1_copies_of_a_state_holding_one_buffer_twice_hold_one_copy(tmp_path):
    """A state and its renewal are two FlatTrees over one storage: a checkpoint, `copy_state`
    and deepcopy keep them one (pickle keeps one object one)."""
    tx = nba.trace(0.9)
    state = _advance(tx, tx.init(_params()), 1, False)
    twice = {"a": state.trace, "b": copy.copy(state.trace)}
    for name in ("save_state", "copy_state", "deepcopy"):
        again = DOORS[name](twice, tmp_path)
        assert again["a"] is again["b"], name
        assert again["a"] is not state.trace


@pytest.mark.parametrize("door", list(DOORS))
def test_i42_item5_a_state_whose_update_runs_is_refused_by_every_copy_as_by_update(door, tmp_path):
    """An update blocked in a user transformation after adam wrote its buffers: a copy then
    held the advanced buffers with the old count (save_state wrote it, and it loaded)."""
    block = _Blocking()
    tx = nba.chain(nba.adam(1e-2), block.tx())
    state = tx.init(_params())
    errors: list = []

    def run():
        try:
            tx.update(_grads(0), state, _params())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert block.entered.wait(30)
        with pytest.raises(RuntimeError) as by_update:
            tx.update(_grads(1), state, _params())
        with pytest.raises(RuntimeError) as e:
            DOORS[door](state, tmp_path)
        assert str(e.value) == str(by_update.value)
    finally:
        block.release.set()
        t.join(30)
    assert not errors, errors
    assert list(tmp_path.iterdir()) == []


def test_i42_item5_an_update_waits_for_a_save_of_its_state(tmp_path, monkeypatch):
    tx = nba.adam(1e-2)
    state = _advance(tx, tx.init(_params()), 2, False)
    before = _values(state)
    entered, release = threading.Event(), threading.Event()
    write = checkpoint._write_npz

    def slow_write(f, arrays):
        entered.set()
        assert release.wait(30)
        write(f, arrays)

    monkeypatch.setattr(checkpoint, "_write_npz", slow_write)
    out: dict = {}

    def call(key, fn, *args):
        try:
            out[key] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported below
            out[key] = e

    saver = threading.Thread(target=call, args=("save", nba.save_state, tmp_path / "s.npz", state))
    saver.start()
    assert entered.wait(30)
    updater = threading.Thread(target=call, args=("update", tx.update, _grads(2), state, _params()))
    updater.start()
    updater.join(0.5)  # it waits for the save (it used to run, and the save wrote its buffers)
    release.set()
    saver.join(30)
    updater.join(30)
    assert out["save"] is None, out["save"]
    assert_bits_equal(_values(nba.load_state(tmp_path / "s.npz")), before)
    assert int(out["update"][1][0].count) == 3


def test_i42_item5_saves_racing_updates_write_no_torn_checkpoint(tmp_path):
    """One thread updates a state, another saves whatever state is current: each save is
    refused (stale, busy) or writes one whole state. ``apply_every`` of ones holds its count in
    every element of its sum; the old code wrote a third to two thirds of them torn."""
    tx = nba.apply_every(2**31 - 1)
    g = {"w": np.ones(200_000, np.float64)}
    tx.update(g, tx.init(g))  # compiled before the race
    box = [tx.init(g)]
    done = threading.Event()

    def updates():
        try:
            for _ in range(60):
                box[0] = tx.update(g, box[0])[1]
                time.sleep(0.002)  # lets a save find the state between two updates
        finally:
            done.set()

    path = tmp_path / "s.npz"
    written, torn = 0, []
    t = threading.Thread(target=updates)
    t.start()
    try:
        while not done.is_set() or not written:
            try:
                nba.save_state(path, box[0])
            except (ValueError, RuntimeError) as e:  # consumed meanwhile, or being updated
                assert "stale" in str(e) or "another update" in str(e)
                continue
            written += 1
            s = nba.load_state(path)
            if not np.all(s.grad_acc["w"] == float(s.count)):
                torn.append(int(s.count))
    finally:
        t.join(60)
    assert not torn, f"{len(torn)} of {written} checkpoints torn (counts {torn})"
