"""Issue 22, items 3 and 4: a state an update has advanced is refused, not silently reused, and
`step_` keeps `update`'s promises (one update of a state at a time; params of another dtype).

A state's buffers are updated in place, so the optax habit ``best = state`` (or keeping
yesterday's state to retry a step) used to compute with advanced buffers and old counters
without a word. Each case below ran silently on 7d5d46e."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _testutil import assert_tree_equal, snapshot

import numbaccum as nba
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


def _same_values(a, b) -> None:
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            _same_values(x, y)
    else:
        np.testing.assert_array_equal(a, b)


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
    _same_values(_values(state), kept)
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
        _same_values(_values(state), kept)
        _advance(tx, state, 1, True)  # the state is still current
