"""An update is all or nothing against the callbacks it runs and against Ctrl-C (issue 42, items
3 and 4).

A callback that raises while the step runs (a line search's ``value_fn``, `snapshot`'s
``measure``, a user transformation), a ``KeyboardInterrupt`` included, leaves the state bit for
bit as it was, still current: a retry gives the bits of a run that never raised. A SIGINT
delivered anywhere inside an update either comes out of the call with the state as it was, or,
once the update has begun writing what cannot be restored, waits for it to return and arrives
right after: the sweeps below raise one at every line (every bytecode of the transaction's code)
an update runs, one run per point, and check both outcomes.
"""

from __future__ import annotations

import _signal
import dis
import signal
import sys
import threading
import traceback
from typing import Any

import numpy as np
import pytest
from test_all_or_nothing import assert_bitwise, snapshot

import numbaccum as nba
from numbaccum import _interrupts


def rosenbrock(p: Any) -> tuple[float, Any]:
    """Rosenbrock's function over two leaves of two dtypes (x: float64, y: float32)."""
    x = np.concatenate([p["x"], p["y"].astype(np.float64)])
    value = float(np.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2))
    g = np.zeros_like(x)
    g[:-1] = -400 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2 * (1 - x[:-1])
    g[1:] += 200 * (x[1:] - x[:-1] ** 2)
    return value, {"x": g[:2], "y": g[2:].astype(np.float32)}


def start_params() -> dict:
    return {"x": np.array([-1.2, 1.0]), "y": np.array([0.5], np.float32)}


class FailingOn:
    """``fn`` raising ``error`` on its ``at``-th call (counted from 1) and after, while armed."""

    def __init__(self, fn: Any, at: int, error: BaseException) -> None:
        self.fn, self.at, self.error, self.calls = fn, at, error, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls >= self.at:
            raise self.error
        return self.fn(*args, **kwargs)


LINESEARCHES = {
    "zoom": lambda: nba.lbfgs(memory_size=3),
    "backtracking": lambda: nba.lbfgs(
        memory_size=3, linesearch=nba.scale_by_backtracking_linesearch(max_backtracking_steps=15)
    ),
}


def _lbfgs_step(tx: Any, params: dict, state: Any, fn: Any, apply: bool) -> Any:
    value, grad = rosenbrock(params)
    if apply:
        return nba.step_(tx, grad, state, params, value=value, grad=grad, value_fn=fn)
    updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fn)
    nba.apply_updates_(params, updates)
    return state


@pytest.mark.parametrize("apply", [False, True], ids=["update", "step_"])
@pytest.mark.parametrize("error", [ValueError("objective failed"), KeyboardInterrupt()], ids=repr)
@pytest.mark.parametrize("name", sorted(LINESEARCHES))
def test_lbfgs_value_fn_raising_mid_step_changes_nothing(name, error, apply):
    """The line search's objective raises on each evaluation in turn of the step that evaluates
    it most (zoom: 3 times at step 5, backtracking: 4 at step 3): L-BFGS's memories, written by
    the chain's first stage before the search runs, are as they were, the params too, and the
    retry and every later step give the bits of a run that never raised (old code: the memories
    had advanced; the state differed from the first retried step on)."""
    clean_params, clean = start_params(), LINESEARCHES[name]()
    cstate = clean.init(clean_params)
    trajectory, evaluations = [], []
    for _ in range(7):
        counted = FailingOn(rosenbrock, 1 << 30, error)
        cstate = _lbfgs_step(clean, clean_params, cstate, counted, apply)
        trajectory.append((snapshot(cstate), {k: v.copy() for k, v in clean_params.items()}))
        evaluations.append(counted.calls)
    step = max(range(1, 6), key=lambda i: evaluations[i])  # the memories hold a pair from step 2 on
    assert evaluations[step] >= 3
    for at in range(1, evaluations[step] + 1):
        params, tx = start_params(), LINESEARCHES[name]()
        state = tx.init(params)
        for _ in range(step):
            state = _lbfgs_step(tx, params, state, rosenbrock, apply)
        before, params_before = snapshot(state), {k: v.copy() for k, v in params.items()}
        failing = FailingOn(rosenbrock, at, error)
        with pytest.raises(type(error)):
            _lbfgs_step(tx, params, state, failing, apply)
        assert failing.calls == at
        assert_bitwise(snapshot(state), before)
        assert_bitwise(params, params_before, "params")
        for i in range(step, 7):
            state = _lbfgs_step(tx, params, state, rosenbrock, apply)
            assert_bitwise(snapshot(state), trajectory[i][0], f"state after step {i + 1}")
            assert_bitwise(params, trajectory[i][1], f"params after step {i + 1}")


class Measure:
    """A `snapshot` measure (the global norm) that raises ``error`` while ``fail`` is set."""

    def __init__(self, error: BaseException) -> None:
        self.error, self.fail = error, False

    def __call__(self, updates: Any) -> Any:
        if self.fail:
            raise self.error
        return nba.global_norm(updates)


def _raising_in_a_chain(error: BaseException, build: Any) -> None:
    """`check_all_or_nothing` of the chain ``build(measure)``, whose callback (a `Measure`) raises
    ``error`` on the failing call."""
    from test_all_or_nothing import check_all_or_nothing

    measures = []

    def make() -> Any:
        measures.append(Measure(error))
        return build(measures[-1])

    def bad(tx: Any, state: Any) -> Any:
        measures[0].fail = True  # (the first transformation made is the one under test)
        try:
            return tx.update({"b": {"c": np.ones((2, 2))}, "w": np.ones(5, np.float32)}, state)
        finally:
            measures[0].fail = False

    check_all_or_nothing(make, bad, error=type(error))


@pytest.mark.parametrize("error", [ValueError("measure failed"), KeyboardInterrupt()], ids=repr)
def test_snapshot_measure_raising_changes_nothing(error):
    """`snapshot`'s measure raises after the chain's first stage wrote its trace: the trace is as
    it was and a retry gives a clean run's bits (old code: the trace advanced)."""

    def build(measure: Measure) -> Any:
        return nba.chain(nba.sgd(0.1, momentum=0.9), nba.snapshot("norm", measure), nba.adam(1e-2))

    _raising_in_a_chain(error, build)


@pytest.mark.parametrize("error", [ValueError("skip failed"), KeyboardInterrupt()], ids=repr)
def test_multisteps_skip_function_raising_in_a_chain_changes_nothing(error):
    """MultiSteps' own ``should_skip_update_fn`` raises after the chain's first stage wrote its
    trace: the trace is as it was, and a retry gives a clean run's bits (old code: it had
    advanced; the skip function was not known for user code)."""

    def build(measure: Measure) -> Any:
        def skip(updates: Any, gradient_step: Any, params: Any) -> Any:
            measure(updates)  # raises while the measure's ``fail`` is set; never skips
            return np.bool_(False), {}

        return nba.chain(nba.trace(0.9), nba.MultiSteps(nba.sgd(0.1), 2, should_skip_update_fn=skip))

    _raising_in_a_chain(error, build)


# --- SIGINT at every point of an update -------------------------------------------------------

PARAMS = {"b": np.arange(4, dtype=np.float64) / 3, "w": np.linspace(-1.0, 1.0, 5, dtype=np.float32)}

# Every bytecode of these modules is a point of the sweep (the transaction and the hold); every
# line of the runner and of the modules a sweep names; every stride-th line of the rest (the
# packing, the drivers, the tree helpers a user transformation calls).
OPCODES = {"numbaccum.transaction", "numbaccum._interrupts"}

# Where CPython handles a pending signal: after a call into C (a Python callee's own start is a
# "call" event), and at a backward jump. A Python function's return is not one (3.11 and later).
_CHECKS = ("CALL", "JUMP_BACKWARD")


_getsignal = _signal.getsignal  # (signal.getsignal converts to enums: microseconds an event)


def _in_numbaccum(name: str) -> bool:
    return name == "numbaccum" or name.startswith("numbaccum.")


class Sweep:
    """A ``sys.settrace`` hook that raises one SIGINT at the ``at``-th point of numbaccum's code,
    as a signal arriving there (`signal.raise_signal` runs its handler at once).

    Once the update has given SIGINT's handler back, its code up to the caller must hold no point
    where Python handles a signal (one arriving there is the caller's): the hook raises nothing
    there and records what runs in ``after`` instead (until its SIGINT is raised)."""

    def __init__(self, at: int, full: frozenset = frozenset(), stride: int = 8) -> None:
        self.at, self.full, self.stride = at, OPCODES | {"numbaccum.runner"} | full, stride
        self.seen, self.lines, self.held, self.after, self.where = 0, 0, False, [], None

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        name = frame.f_globals.get("__name__", "")
        if not _in_numbaccum(name):
            return None
        if self._released() and self.seen < self.at:
            self.after.append(f"call {frame.f_code.co_name}")
        frame.f_trace_opcodes = name in OPCODES
        return self._local

    def _released(self) -> bool:
        handler = _getsignal(signal.SIGINT)
        if handler is _interrupts._PROXY:
            handler = handler.func
        if handler is _interrupts._record:  # what a SIGINT arriving now would run
            self.held = True
            return False
        return self.held

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode" or (event == "line" and not frame.f_trace_opcodes):
            if self._released():
                if self.seen >= self.at:  # a SIGINT raised, on its way: a second one is forced
                    return self._local
                code = frame.f_code
                op = dis.opname[code.co_code[frame.f_lasti]] if event == "opcode" else "line"
                self.after.append(f"{op} in {code.co_name}")
                return self._local
            name = frame.f_globals["__name__"]
            if name not in self.full:
                self.lines += 1
                if self.lines % self.stride:
                    return self._local
            self.seen += 1
            if self.seen == self.at:
                code = frame.f_code
                op = dis.opname[code.co_code[frame.f_lasti]] if event == "opcode" else "line"
                self.where = f"{op} at {name}.{code.co_name}:{frame.f_lineno}"
                signal.raise_signal(signal.SIGINT)
        return self._local


def _landing() -> None:
    """The caller's first call after the update returned: a SIGINT held for it arrives by then."""


def _interrupted(sweep: Sweep, call: Any) -> tuple[list, bool]:
    """``call()`` under ``sweep``: (its result, if it returned; whether a KeyboardInterrupt came,
    from the call or right after it)."""
    box: list = []

    def traced() -> None:
        sys.settrace(sweep)
        try:
            box.append(call())
        finally:
            sys.settrace(None)

    try:
        traced()
        _landing()
    except KeyboardInterrupt:
        return box, True
    return box, False


@pytest.fixture
def default_sigint():
    """SIGINT raises KeyboardInterrupt (Python's default), in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    assert _idle(), "the handler was not given back"
    signal.signal(signal.SIGINT, old)


def _idle() -> bool:
    """Whether SIGINT's handler is Python's default again, or numbaccum's stand-in calling it."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is _interrupts._PROXY:
        return handler.func is signal.default_int_handler and _interrupts._HELD.handler is None
    return handler is signal.default_int_handler


def _user_negate() -> Any:
    """A user transformation: the updates negated, through numbaccum's tree_map."""
    return nba.GradientTransformation(
        lambda params: nba.EmptyState(), lambda u, s, params=None: (nba.tree_map(lambda x: -x, u), s)
    )


SWEPT = {
    # the hot path: a fused chain without user code, replayed (two dtype groups: two kernels each
    # pass), every line of its passes
    "fused": (
        lambda: nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-2)),
        frozenset({"numbaccum.base", "numbaccum.fuse", "numbaccum.declared", "numbaccum.clipping"}),
        8,
    ),
    # user code between stages that write their states before and after it: every line of the
    # chain's runs and of the rollback (the passes themselves are the fused sweep's)
    "user code": (
        lambda: nba.chain(nba.trace(0.9), _user_negate(), nba.trace(0.5)),
        frozenset({"numbaccum.base"}),
        32,
    ),
}


def _grads(i: int) -> dict:
    return nba.tree_map(lambda x: (x * ((i % 7) - 3.5) + 0.25 * (i % 3)).astype(x.dtype), PARAMS)


def _step(tx: Any, i: int, state: Any, params: dict | None) -> Any:
    """One update (``params`` None) or `step_`, returning what the caller keeps: (updates,
    state) or the state."""
    if params is None:
        return tx.update(_grads(i), state)
    return nba.step_(tx, _grads(i), state, params)


def _kept(out: Any, params: dict | None) -> Any:
    """A deep copy of a step's result (updates live in a workspace the next update rewrites)."""
    if params is None:
        return snapshot(out[1]), snapshot(nba.tree_map(np.array, out[0]))
    return snapshot(out), snapshot(params)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="before 3.11, a function's return handles signals")
@pytest.mark.parametrize(
    "name, apply",
    [("fused", False), ("fused", True), ("user code", False)],
    ids=["fused", "fused-step_", "user code"],
)
def test_sigint_at_every_point_of_an_update(name, apply, default_sigint):
    """One SIGINT at each point in turn of an update (each bytecode of the transaction, the hold
    and the runner, each line elsewhere), one step per point: either the KeyboardInterrupt comes
    out of the call and the state (and params) are bit for bit as they were, still current, the
    retry giving the bits of a clean run; or the update returns the clean run's bits and the
    KeyboardInterrupt arrives right after, before the caller's next call. Old code: the state
    advanced under a KeyboardInterrupt, and the next update accepted it."""
    make, full, stride = SWEPT[name]
    tx, clean = make(), make()
    params = {k: v.copy() for k, v in PARAMS.items()} if apply else None
    cparams = {k: v.copy() for k, v in PARAMS.items()} if apply else None
    state, cstate = tx.init(PARAMS), clean.init(PARAMS)
    for i in range(5):  # warm: the plans are kept, the step replays
        out, cout = _step(tx, i, state, params), _step(clean, i, cstate, cparams)
        state, cstate = (out, cout) if apply else (out[1], cout[1])
    at, i, outcomes = 1, 5, {"in the call": 0, "after it": 0}
    ends: list = []  # the points of the steps in a row that ended before point `at`
    while True:
        cout = _step(clean, i, cstate, cparams)
        expected, cstate = _kept(cout, cparams), cout if apply else cout[1]
        before, params_before = snapshot(state), snapshot(params)
        sweep = Sweep(at, full, stride)
        box, came = _interrupted(sweep, lambda: _step(tx, i, state, params))
        assert not [x for x in sweep.after if x.split()[0].startswith(_CHECKS) or x.startswith("call")], (
            f"point {at}: after the handler was given back, the update ran {sweep.after}"
        )
        if not came:  # past the last point: no SIGINT was raised
            assert box and sweep.seen < at, f"point {at} ({sweep.where}): a SIGINT was lost"
            assert_bitwise(_kept(box[0], params), expected, "the uninterrupted step")
            ends.append(sweep.seen)
            # Two in a row: the held update's steps write a workspace and its spare by turns, and
            # their kept calls are found by one test more or less, so steps alternate by a point.
            if len(ends) == 2:
                assert max(ends) == at - 1, f"steps of {ends} points, {at - 1} swept"
                break
            state, i = (box[0] if apply else box[0][1]), i + 1
            continue
        ends = []
        if box:  # the update completed; the SIGINT arrived after it returned
            outcomes["after it"] += 1
            out = box[0]
        else:  # it came out of the call: nothing changed, the state is current
            outcomes["in the call"] += 1
            assert_bitwise(snapshot(state), before, f"point {at} ({sweep.where}): the state")
            assert_bitwise(snapshot(params), params_before, f"point {at} ({sweep.where}): the params")
            out = _step(tx, i, state, params)
        assert_bitwise(_kept(out, params), expected, f"point {at} ({sweep.where}): the step's result")
        state = out if apply else out[1]
        at, i = at + 1, i + 1
    assert outcomes["in the call"] and outcomes["after it"], outcomes


class AtEveryLine(Sweep):
    """Raises a SIGINT at each line of the functions named in ``where`` (module.function), at
    most ``limit`` times."""

    def __init__(self, where: set, limit: int = 1 << 30) -> None:
        super().__init__(0)
        self.where, self.raised, self.limit = where, 0, limit

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        name = f"{frame.f_globals['__name__']}.{frame.f_code.co_name}"
        if event == "line" and name in self.where and self.raised < self.limit:
            self.raised += 1
            signal.raise_signal(signal.SIGINT)
        return self._local


def test_a_second_sigint_interrupts_at_once_and_the_state_is_refused(default_sigint):
    """A second SIGINT while the first waits (a long compile, a user who insists) is handled at
    once: the KeyboardInterrupt comes out of the update mid-pass, and the state, which may be
    torn, is refused from then on (a copy taken before is the way back)."""
    tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-2))
    state = tx.init(PARAMS)
    for i in range(3):
        _, state = tx.update(_grads(i), state)
    kept = nba.copy_state(state)
    sweep = AtEveryLine({"numbaccum.fuse._run_group"})
    box, came = _interrupted(sweep, lambda: tx.update(_grads(3), state))
    assert came and not box and sweep.raised == 2  # the first recorded, the second raised
    with pytest.raises(ValueError, match="stale"):
        tx.update(_grads(3), state)
    clean = tx.init(PARAMS)
    for i in range(3):
        _, clean = tx.update(_grads(i), clean)
    assert_bitwise(snapshot(tx.update(_grads(3), kept)[1]), snapshot(tx.update(_grads(3), clean)[1]))


def test_a_handler_of_your_own_runs_once_the_update_has_returned():
    """A SIGINT handler of the user's (one that sets a flag: a loop's "stop after this step") is
    called once the update has returned, the update complete, and is given back; in the user code
    an update runs, it is called at once."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    calls = []
    calls_handler = lambda signum, frame: calls.append(frame.f_code.co_name)  # noqa: E731
    old = signal.signal(signal.SIGINT, calls_handler)
    try:
        tx, clean = (nba.chain(nba.trace(0.9), _user_negate(), nba.adam(1e-2)) for _ in range(2))
        state, cstate = tx.init(PARAMS), clean.init(PARAMS)
        sweep = AtEveryLine({"numbaccum.fuse._run_group"}, limit=1)  # in a pass after the user's
        sys.settrace(sweep)
        try:
            u, state = tx.update(_grads(0), state)
            assert not calls, "held while the update ran"
        finally:
            sys.settrace(None)
        assert calls == [test_a_handler_of_your_own_runs_once_the_update_has_returned.__name__]
        assert_bitwise(snapshot(state), snapshot(clean.update(_grads(0), cstate)[1]))
        sweep = AtEveryLine({"numbaccum.tree.tree_map"})  # the user transformation's own calls
        sys.settrace(sweep)
        try:
            u, state = tx.update(_grads(1), state)
        finally:
            sys.settrace(None)
        assert sweep.raised and len(calls) == 1 + sweep.raised, "in user code: at once, each one"
        assert signal.getsignal(signal.SIGINT) is calls_handler, "a handler of your own comes back as it was"
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_handler_set_by_user_code_during_an_update_stays(default_sigint):
    """User code that sets a SIGINT handler of its own while an update holds SIGINT: the hold
    goes on with it (a SIGINT in a later pass reaches it after the update), and it is the one in
    place when the update returns (not the one from before the update)."""
    calls = []

    def installs(u: Any, s: Any, params: Any = None) -> Any:
        signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
        return u, s

    user = nba.GradientTransformation(lambda params: nba.EmptyState(), installs)
    tx = nba.chain(nba.trace(0.9), user, nba.adam(1e-2))
    state = tx.init(PARAMS)
    sweep = AtEveryLine({"numbaccum.fuse._run_group"}, limit=1)  # adam's pass, after the user's code
    sys.settrace(sweep)
    try:
        _, state = tx.update(_grads(0), state)
        assert not calls
    finally:
        sys.settrace(None)
    assert sweep.raised == 1 and calls == [signal.SIGINT]
    handler = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (for the fixture's check)
    assert handler is not signal.default_int_handler and handler is not _interrupts._record


def test_between_updates_sigint_is_python_default_handling(default_sigint):
    """Over Python's default handler, updates leave numbaccum's stand-in in place (retargeting it
    costs no system call): between updates it is the default handler, a KeyboardInterrupt with
    no numbaccum frame in its traceback; `signal.signal` with a handler of your own replaces it."""
    tx = nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-2))
    state = tx.init(PARAMS)
    for i in range(2):
        _, state = tx.update(_grads(i), state)
    assert _idle()
    with pytest.raises(KeyboardInterrupt) as caught:
        signal.raise_signal(signal.SIGINT)
    frames = [f.name for f in traceback.extract_tb(caught.value.__traceback__)]
    assert frames == [test_between_updates_sigint_is_python_default_handling.__name__], frames

    def mine(signum: int, frame: Any) -> None:
        pass

    signal.signal(signal.SIGINT, mine)
    _, state = tx.update(_grads(2), state)
    assert signal.getsignal(signal.SIGINT) is mine, "a handler of your own is given back after the update"
    signal.signal(signal.SIGINT, signal.default_int_handler)
