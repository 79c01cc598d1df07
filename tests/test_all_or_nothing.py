"""All or nothing: an update that raises leaves every buffer and counter of the state exactly as it
was, and a retry then gives the same bits as a run that never failed (issue 11, item 5).

Each case runs a few good steps, makes one call fail, checks a deep copy of the state taken before
that call against the state bit for bit, then retries and compares every later output and the
final state with a clean run of a fresh transformation.
"""

from typing import Any

import numpy as np
import pytest

import numbaccum as nba
from numbaccum.flat import FlatTree

PARAMS = {
    "b": {"c": np.arange(4, dtype=np.float64).reshape(2, 2) / 3},
    "w": np.linspace(-1.0, 1.0, 5, dtype=np.float32),
}
OTHER = {"w": np.ones(7, np.float32)}  # another tree: its states do not fit PARAMS


def grads(i: int) -> Any:
    return nba.tree_map(lambda x: (x * (i + 1) + 0.25 * i).astype(x.dtype), PARAMS)


def snapshot(state: Any) -> Any:
    """A deep copy of a state as NumPy arrays (FlatTree buffers, counters, nested structure)."""
    if isinstance(state, FlatTree):
        return (
            "FlatTree",
            [np.array(b if not state.device else b.copy_to_host()) for b in state.buffers.values()],
        )
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in sorted(state.items())}
    if isinstance(state, tuple):
        return (type(state).__name__, [snapshot(v) for v in state])
    if isinstance(state, (np.ndarray, np.generic)):
        return np.array(state)
    return state


def assert_bitwise(a: Any, b: Any, where: str = "state") -> None:
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), f"{where}: {a} != {b}"
    else:
        assert a == b, where


def copy_out(u: Any) -> Any:
    return snapshot(u.tree if isinstance(u, FlatTree) else nba.tree_map(np.array, u))


class Flaky:
    """A schedule (learning rate or every_k) that raises while ``fail`` is set."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.fail = False

    def __call__(self, count: Any) -> Any:
        if self.fail:
            raise RuntimeError("schedule failed")
        return self.value


def check_all_or_nothing(make, bad, steps_before=2, steps_after=3, params=None, error=Exception, match=None):
    """``make()`` builds the transformation (and anything ``bad`` needs); ``bad(tx, state)`` is a
    call that must raise ``error``. Good calls pass ``params``."""
    tx = make()
    state = tx.init(PARAMS)
    outs = []
    for i in range(steps_before):
        u, state = tx.update(grads(i), state, params)
        outs.append(copy_out(u))
    before = snapshot(state)
    with pytest.raises(error, match=match):
        bad(tx, state)
    assert_bitwise(snapshot(state), before)
    for i in range(steps_before, steps_before + steps_after):
        u, state = tx.update(grads(i), state, params)
        outs.append(copy_out(u))
    clean = make()
    cstate = clean.init(PARAMS)
    couts = []
    for i in range(steps_before + steps_after):
        u, cstate = clean.update(grads(i), cstate, params)
        couts.append(copy_out(u))
    assert_bitwise(outs, couts, "updates")
    assert_bitwise(snapshot(state), snapshot(cstate))


# --- chain and named_chain ------------------------------------------------------------------


def test_chain_later_stage_without_params_leaves_the_trace():
    """The issue's example: trace stays at zeros when add_decayed_weights raises."""
    tx = nba.chain(nba.trace(0.9), nba.add_decayed_weights(1e-4))
    state = tx.init({"w": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="needs params"):
        tx.update({"w": np.ones(3, np.float32)}, state)
    np.testing.assert_array_equal(state[0].trace.tree["w"], np.zeros(3, np.float32))
    check_all_or_nothing(
        lambda: nba.chain(nba.trace(0.9), nba.ema(0.5), nba.add_decayed_weights(1e-4)),
        lambda tx, s: tx.update(grads(9), s),
        params=PARAMS,
        error=ValueError,
        match="needs params",
    )


def test_named_chain_later_stage_without_params():
    def make():
        return nba.named_chain(
            ("momentum", nba.trace(0.9, nesterov=True)),
            ("avg", nba.ema(0.8)),
            ("wd", nba.add_decayed_weights(1e-3)),
        )

    check_all_or_nothing(make, lambda tx, s: tx.update(grads(9), s), params=PARAMS, error=ValueError)


def test_named_chain_state_with_a_missing_name():
    def make():
        return nba.named_chain(("momentum", nba.trace(0.9)), ("avg", nba.ema(0.8)))

    check_all_or_nothing(
        make, lambda tx, s: tx.update(grads(9), {"momentum": s["momentum"]}), error=ValueError, match="keys"
    )


def test_chain_with_a_wrong_state_of_a_later_stage():
    def make():
        return nba.chain(nba.trace(0.9), nba.ema(0.9))

    # another type at state[1]
    check_all_or_nothing(make, lambda tx, s: tx.update(grads(9), (s[0], s[0])), error=TypeError)
    # the right type, built for another tree
    other = nba.ema(0.9).init(OTHER)
    check_all_or_nothing(make, lambda tx, s: tx.update(grads(9), (s[0], other)), error=ValueError)
    # too few states
    check_all_or_nothing(make, lambda tx, s: tx.update(grads(9), s[:1]), error=ValueError, match="chain of 2")


def test_chain_with_a_state_of_another_tree():
    def make():
        return nba.chain(nba.clip_by_global_norm(1.0), nba.trace(0.9), nba.ema(0.9))

    # the updates are of another tree than the state
    check_all_or_nothing(make, lambda tx, s: tx.update(OTHER, s), error=ValueError)
    # a whole state of another tree, next to the right one (the original is left alone too)
    theirs = make().init(OTHER)
    theirs_before = snapshot(theirs)
    check_all_or_nothing(make, lambda tx, s: tx.update(grads(9), (s[0], s[1], theirs[2])), error=ValueError)
    assert_bitwise(snapshot(theirs), theirs_before)


def test_chain_params_of_another_tree():
    def make():
        return nba.chain(nba.trace(0.9), nba.add_decayed_weights(1e-4))

    check_all_or_nothing(make, lambda tx, s: tx.update(grads(9), s, OTHER), params=PARAMS, error=ValueError)


# --- optimizers with schedules --------------------------------------------------------------


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_sgd_with_a_schedule_that_raises(momentum):
    lr = Flaky(0.1)

    def make():
        lr.fail = False
        return nba.sgd(lr, momentum=momentum)

    def bad(tx, s):
        lr.fail = True
        try:
            return tx.update(grads(9), s)
        finally:
            lr.fail = False

    check_all_or_nothing(make, bad, error=RuntimeError, match="schedule failed")


def test_adam_with_a_schedule_that_raises():
    lr = Flaky(1e-2)

    def bad(tx, s):
        lr.fail = True
        try:
            return tx.update(grads(9), s)
        finally:
            lr.fail = False

    check_all_or_nothing(lambda: nba.adam(lr), bad, error=RuntimeError)
    # the same in a chain after stateful stages
    check_all_or_nothing(lambda: nba.chain(nba.trace(0.5), nba.adam(lr)), bad, error=RuntimeError)


def test_adam_with_a_wrong_learning_rate_state():
    def make():
        return nba.adam(lambda count: 1e-3)

    check_all_or_nothing(make, lambda tx, s: tx.update(grads(9), (s[0], nba.EmptyState())), error=TypeError)
    check_all_or_nothing(make, lambda tx, s: tx.update(grads(9), s[:1]), error=ValueError)


# --- MultiSteps -----------------------------------------------------------------------------


@pytest.mark.parametrize("use_grad_mean", [True, False])
def test_multisteps_inner_failure_on_an_emitting_step(use_grad_mean):
    """The inner chain needs params only when it runs: the emitting step without them raises,
    before the gradient is added (a retry counts it once)."""

    def make():
        inner = nba.chain(nba.trace(0.9), nba.add_decayed_weights(1e-4), nba.scale(-0.1))
        return nba.MultiSteps(inner, 3, use_grad_mean=use_grad_mean)

    check_all_or_nothing(make, lambda tx, s: tx.update(grads(9), s), params=PARAMS, error=ValueError)


def test_multisteps_inner_schedule_failure_on_an_emitting_step():
    lr = Flaky(0.5)

    def make():
        return nba.MultiSteps(nba.adam(lr), 3)

    def bad(tx, s):
        lr.fail = True
        try:
            return tx.update(grads(9), s)
        finally:
            lr.fail = False

    # two mini-steps before: the failing one emits
    check_all_or_nothing(make, bad, steps_before=2, error=RuntimeError)
    # a non-emitting step never calls the inner schedule
    tx = make()
    s = tx.init(PARAMS)
    lr.fail = True
    try:
        _, s = tx.update(grads(0), s)
    finally:
        lr.fail = False
    assert int(s.mini_step) == 1


@pytest.mark.parametrize("steps_before", [0, 1, 2])
def test_multisteps_every_k_schedule_that_raises(steps_before):
    k = Flaky(2)

    def make():
        return nba.MultiSteps(nba.sgd(0.1, momentum=0.9), k)

    def bad(tx, s):
        k.fail = True
        try:
            return tx.update(grads(9), s)
        finally:
            k.fail = False

    check_all_or_nothing(make, bad, steps_before=steps_before, error=RuntimeError)


def test_multisteps_every_k_schedule_below_one():
    k = Flaky(2)

    def make():
        k.value = 2
        return nba.MultiSteps(nba.sgd(0.1, momentum=0.9), k)

    def bad(tx, s):
        k.value = 0
        try:
            return tx.update(grads(9), s)
        finally:
            k.value = 2

    check_all_or_nothing(make, bad, steps_before=1, error=ValueError, match="every_k_schedule")


def test_multisteps_user_skip_predicate_that_raises():
    calls = {"fail": False}

    def skip(updates, gradient_step, params):
        if calls["fail"]:
            raise RuntimeError("predicate failed")
        return np.bool_(False), {"ok": np.bool_(True)}

    def bad(tx, s):
        calls["fail"] = True
        try:
            return tx.update(grads(9), s)
        finally:
            calls["fail"] = False

    check_all_or_nothing(
        lambda: nba.MultiSteps(nba.sgd(0.1), 2, should_skip_update_fn=skip),
        bad,
        steps_before=1,
        error=RuntimeError,
    )


def test_multisteps_in_a_chain_after_stateful_stages():
    def make():
        inner = nba.chain(nba.ema(0.9), nba.add_decayed_weights(1e-4))
        return nba.chain(nba.trace(0.5), nba.MultiSteps(inner, 2))

    check_all_or_nothing(
        make, lambda tx, s: tx.update(grads(9), s), steps_before=1, params=PARAMS, error=ValueError
    )


def test_multisteps_state_of_another_tree():
    def make():
        return nba.MultiSteps(nba.adam(1e-2), 2)

    theirs = make().init(OTHER)
    # one mini-step before: the failing call emits, so the inner state is checked
    check_all_or_nothing(
        make,
        lambda tx, s: tx.update(grads(9), s._replace(inner_opt_state=theirs.inner_opt_state)),
        steps_before=1,
        error=ValueError,
    )


# --- WP4b: apply_if_finite, dpsgd, the declearn Pipeline ------------------------------------


def _nan_grads(i: int) -> Any:
    g = grads(i)
    g["w"][1] = np.nan
    return g


@pytest.mark.parametrize("nonfinite", [False, True])
def test_apply_if_finite_of_a_chain_whose_inner_fails(nonfinite):
    """The inner chain is planned on every call, finite or not: its failure leaves the streak
    counters and the inner states as they were."""

    def make():
        inner = nba.chain(nba.trace(0.9), nba.ema(0.5), nba.add_decayed_weights(1e-4))
        return nba.apply_if_finite(inner, 2)

    bad_grads = _nan_grads(9) if nonfinite else grads(9)
    check_all_or_nothing(
        make, lambda tx, s: tx.update(bad_grads, s), params=PARAMS, error=ValueError, match="needs params"
    )


def test_apply_if_finite_with_an_inner_schedule_that_raises():
    lr = Flaky(0.1)

    def make():
        lr.fail = False
        return nba.apply_if_finite(nba.chain(nba.clip_by_global_norm(1.0), nba.sgd(lr, momentum=0.9)), 1)

    def bad(tx, s):
        lr.fail = True
        try:
            tx.update(_nan_grads(9), s)
        finally:
            lr.fail = False

    check_all_or_nothing(make, bad, error=RuntimeError, match="schedule failed")


# --- inject_hyperparams (declared: its tick computes the values, finds the inner plan) ----


@pytest.mark.parametrize("step", [False, True], ids=["update", "step_"])
def test_inject_hyperparams_with_a_schedule_that_raises(step):
    """In a chain between stateful stages: the schedule raises in the tick, before the trace
    before it or the inner momentum writes; a retry goes on with a clean run's bits."""
    lr = Flaky(0.1)

    def make():
        lr.fail = False
        inner = nba.inject_hyperparams(nba.sgd)(learning_rate=lr, momentum=0.9)
        return nba.chain(nba.trace(0.5), inner, nba.ema(0.9))

    def bad(tx, s):
        lr.fail = True
        try:
            if step:
                nba.step_(tx, grads(9), s, nba.tree_map(np.copy, PARAMS))
            else:
                tx.update(grads(9), s)
        finally:
            lr.fail = False

    check_all_or_nothing(make, bad, error=RuntimeError, match="schedule failed")


@pytest.mark.parametrize("value", [1.5, "0.9", np.full(2, 0.9)], ids=["refused", "a string", "an array"])
def test_inject_hyperparams_with_a_bad_value_in_the_state(value):
    """A value the factory refuses (adam's b1 outside [0, 1]), or no number at all: raised in the
    tick, after a step with another value was declared; nothing written, and once the value is
    good again the state goes on (the clean run never saw the bad one)."""
    box: list = []

    def make():
        return nba.chain(nba.trace(0.5), nba.inject_hyperparams(nba.adam)(learning_rate=1e-2))

    def bad(tx, s):
        box.append(s[1].hyperparams["b1"])
        s[1].hyperparams["b1"] = value
        try:
            tx.update(grads(9), s)
        finally:
            s[1].hyperparams["b1"] = box.pop()

    check_all_or_nothing(make, bad, error=(ValueError, TypeError))


def test_inject_hyperparams_with_an_inner_state_of_another_tree():
    def make():
        return nba.inject_hyperparams(nba.adam)(learning_rate=1e-2)

    theirs = make().init(OTHER)
    check_all_or_nothing(
        make, lambda tx, s: tx.update(grads(9), s._replace(inner_state=theirs.inner_state)), error=ValueError
    )
    check_all_or_nothing(make, lambda tx, s: tx.update(grads(9), s.inner_state), error=TypeError)


def test_apply_if_finite_with_an_inner_state_of_another_tree():
    def make():
        return nba.apply_if_finite(nba.chain(nba.trace(0.9), nba.clip_norm_by_ema()), 3)

    theirs = make().init(OTHER)
    theirs_before = snapshot(theirs)
    check_all_or_nothing(
        make, lambda tx, s: tx.update(grads(9), s._replace(inner_state=theirs.inner_state)), error=ValueError
    )
    assert_bitwise(snapshot(theirs), theirs_before)


def per_example(i: int, batch: int = 3) -> Any:
    """Per-example gradients of PARAMS (batch on axis 0)."""
    rng = np.random.default_rng(i)
    return nba.tree_map(lambda x: rng.standard_normal((batch, *x.shape)).astype(x.dtype), PARAMS)


def check_per_example(make, bad, steps_before=2, steps_after=2, error=Exception, match=None):
    """`check_all_or_nothing` for a transformation fed per-example gradients."""
    tx = make()
    state = tx.init(PARAMS)
    outs = []
    for i in range(steps_before):
        u, state = tx.update(per_example(i), state, PARAMS)
        outs.append(copy_out(u))
    before = snapshot(state)
    with pytest.raises(error, match=match):
        bad(tx, state)
    assert_bitwise(snapshot(state), before)
    for i in range(steps_before, steps_before + steps_after):
        u, state = tx.update(per_example(i), state, PARAMS)
        outs.append(copy_out(u))
    clean = make()
    cstate = clean.init(PARAMS)
    couts = []
    for i in range(steps_before + steps_after):
        u, cstate = clean.update(per_example(i), cstate, PARAMS)
        couts.append(copy_out(u))
    assert_bitwise(outs, couts, "updates")
    assert_bitwise(snapshot(state), snapshot(cstate))


def test_dpsgd_with_a_learning_rate_schedule_that_raises():
    """The noise key does not advance and the trace is not written when a later stage fails."""
    lr = Flaky(0.05)

    def make():
        lr.fail = False
        return nba.dpsgd(lr, 1.0, 0.5, seed=3, momentum=0.9)

    def bad(tx, s):
        lr.fail = True
        try:
            tx.update(per_example(9), s, PARAMS)
        finally:
            lr.fail = False

    check_per_example(make, bad, error=RuntimeError, match="schedule failed")


def test_dpsgd_with_bad_input_for_a_later_stage():
    def make():
        return nba.dpsgd(0.1, 1.0, 0.5, seed=4, momentum=0.9)

    theirs = make().init(OTHER)
    # a trace built for another tree
    check_per_example(
        make, lambda tx, s: tx.update(per_example(9), (s[0], theirs[1], s[2])), error=ValueError
    )
    # per-example gradients of another tree (the trace does not fit their layout)
    other = {"w": np.ones((3, 7), np.float32)}
    check_per_example(make, lambda tx, s: tx.update(other, s, PARAMS), error=ValueError)
    # params of another tree
    check_per_example(make, lambda tx, s: tx.update(per_example(9), s, OTHER), error=ValueError)
    # a wrong state for the learning rate schedule
    check_per_example(
        lambda: nba.dpsgd(lambda count: 0.1 / (1 + count), 1.0, 0.5, seed=4),
        lambda tx, s: tx.update(per_example(9), (s[0], s[1], s[1])),
        error=TypeError,
    )


def test_chain_of_dp_aggregate_and_a_later_stage_that_fails():
    def make():
        return nba.chain(
            nba.differentially_private_aggregate(1.0, 0.7, seed=5),
            nba.trace(0.5),
            nba.add_decayed_weights(0.1),
        )

    check_per_example(
        make, lambda tx, s: tx.update(per_example(9), s), error=ValueError, match="needs params"
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: nba.clip_norm_by_ema(0.9),
        lambda: nba.normalize_by_ema(0.9, tensorwise=False),
        lambda: nba.clip_value_by_ema(0.9),
        lambda: nba.clip_norm_growth(add=0.1),
        lambda: nba.clip_value_growth(mul=2.0),
    ],
    ids=[
        "clip_norm_by_ema",
        "normalize_by_ema",
        "clip_value_by_ema",
        "clip_norm_growth",
        "clip_value_growth",
    ],
)
def test_adaptive_clipper_given_a_state_of_another_tree(make):
    """Alone, and as the later stage of a chain after a stateful one."""

    def chained():
        return nba.chain(nba.trace(0.9), make())

    bigger = {"w": np.ones(7, np.float32), "x": np.ones(2), "y": np.ones((2, 2), np.float32)}
    theirs = make().init(bigger)
    theirs_before = snapshot(theirs)
    check_all_or_nothing(make, lambda tx, s: tx.update(grads(9), theirs), error=ValueError)
    check_all_or_nothing(chained, lambda tx, s: tx.update(grads(9), (s[0], theirs)), error=ValueError)
    assert_bitwise(snapshot(theirs), theirs_before)


def test_adaptive_clipper_whose_inner_transformation_fails():
    from numbaccum.compat.torchzero import ClipNormByEMA, ClipValueByEMA

    def make_norm():
        return ClipNormByEMA(inner=[nba.trace(0.9), nba.add_decayed_weights(1e-3)])

    def make_value():
        return ClipValueByEMA(inner=nba.trace(0.5), exp_avg_tfm=nba.add_decayed_weights(1e-3))

    for make in (make_norm, make_value):
        check_all_or_nothing(
            make, lambda tx, s: tx.update(grads(9), s), params=PARAMS, error=ValueError, match="needs params"
        )


def _pipeline_modules():
    from numbaccum.compat import declearn as dl

    momentum = dl.MomentumModule(0.9)
    noise = dl.GaussianNoiseModule(0.1, safe_mode=False, seed=7)
    clip = dl.L2Clipping(0.5)
    ewma = dl.EWMAModule(0.8)
    return momentum, noise, clip, ewma


def _declearn_grads(i: int) -> dict:
    g = grads(i)
    return {"w": g["w"], "c": g["b"]["c"]}


def test_declearn_pipeline_whose_later_module_fails():
    """The later module (an EWMA whose state was built for other gradients) fails in the plan:
    the momentum's velocity, the noise generator and the EWMA are left as they were."""
    from numbaccum.compat import declearn as dl

    def run(fail: bool) -> tuple[list, list]:
        momentum, noise, clip, ewma = _pipeline_modules()
        pipe = dl.Pipeline([momentum, noise, clip, ewma])
        outs = [snapshot(pipe.run(_declearn_grads(i))) for i in range(2)]
        if fail:
            ewma.set_state({"state": 0.0})
            ewma.run({"x": np.ones(3, np.float32)})  # now its state is for other gradients
            before = snapshot(pipe.get_state()), noise._rng.bit_generator.state
            with pytest.raises(ValueError):
                pipe.run(_declearn_grads(2))
            assert_bitwise(snapshot(pipe.get_state()), before[0], "pipeline state")
            assert noise._rng.bit_generator.state == before[1]
            ewma.set_state({"state": 0.0})
        else:
            ewma.set_state({"state": 0.0})
        outs += [snapshot(pipe.run(_declearn_grads(i))) for i in range(2, 4)]
        return outs, snapshot(pipe.get_state())

    failed, clean = run(True), run(False)
    assert_bitwise(failed[0], clean[0], "updates")
    assert_bitwise(failed[1], clean[1], "pipeline state")


def test_declearn_pipeline_with_a_pending_state_that_does_not_fit():
    from numbaccum.compat import declearn as dl

    momentum, noise, clip, ewma = _pipeline_modules()
    momentum.run(_declearn_grads(0))
    velocity = snapshot(momentum.get_state())
    ewma.set_state({"state": {"x": np.ones(3)}})  # checked against the first gradients it sees
    pipe = dl.Pipeline([momentum, clip, ewma])
    with pytest.raises(ValueError, match="state"):
        pipe.run(_declearn_grads(1))
    assert_bitwise(snapshot(momentum.get_state()), velocity, "velocity")
    assert ewma.get_state()["state"]["x"].shape == (3,)  # still pending, not half loaded
