"""A process that forks after its kernels ran in parallel (tests/test_fork.py runs it under each
threading layer, named by ``NUMBA_THREADING_LAYER``), and writes what its children computed to
the file ``argv[2]`` (JSON); ``argv[1]`` is the deadline of each wait, in seconds, and
``argv[3]``, if given, the families of kernels to run (comma-separated names of `FAMILIES`).

The parent steps trees big enough for the parallel drivers of every family of kernels (its
threading layer starts, its plans keep their prepared launches), then forks: a child (and its
own child) continues the parent's very states; a ``fork`` Pool of 2 continues them with two
seeds of gradients; a child forked while another thread holds numbaccum's locks (inside a
guarded kernel launch, compiling a formula) continues them and makes a new formula's drivers.
Every wait has a deadline, so that a child that hangs is reported (``"timeout"``) instead of
hanging the test. The parent's own continuations of those states (from copies, before the
forks, so that the children inherit every kernel compiled), with parallel regions on and off
(`_config.PARALLEL`), are the bits every child must give.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import warnings

import numba
import numpy as np

import numbaccum as nba
from numbaccum import _config, _locks
from numbaccum.cpu import driver, reduce
from numbaccum.formulas import Formula

N = _config.SERIAL_BELOW + 5  # the parallel drivers
DEADLINE = float(sys.argv[1])
ROWS, COLS = 256, 260  # a factored leaf past SERIAL_BELOW
EXAMPLES = 4  # per-example gradients of N elements: the per-example kernels' parallel drivers

# Every family of CPU kernels: elementwise formulas and the reduction engine (a clipped Adam),
# the factored pass (Adafactor), SM3's pass, inner products (L-BFGS without a line search), and
# the per-example sums (DP-SGD). name -> (transformation, params shapes, gradients per example).
FAMILIES = {
    "adam": (nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-2)), {"w": (N,), "b": (3, 4)}, False),
    "adafactor": (nba.adafactor(1e-2), {"w": (ROWS, COLS)}, False),
    "sm3": (nba.sm3(0.1), {"w": (ROWS, COLS)}, False),
    "lbfgs": (nba.lbfgs(0.1, linesearch=None), {"w": (N,)}, False),
    "dpsgd": (nba.dpsgd(0.1, 1.0, 1.0, seed=7), {"w": (N,)}, True),
}
if len(sys.argv) > 3:  # the families to run (a layer whose children run in parallel needs one)
    FAMILIES = {name: FAMILIES[name] for name in sys.argv[3].split(",")}


def grads(name: str, seed: int) -> dict:
    _, shapes, per_example = FAMILIES[name]
    rng = np.random.default_rng(seed)
    return {
        k: rng.normal(size=((EXAMPLES,) if per_example else ()) + shape).astype(np.float32)
        for k, shape in shapes.items()
    }


def steps(name: str, params: dict, state: object, seed: int, n: int = 2) -> tuple[dict, object]:
    tx = FAMILIES[name][0]
    for k in range(n):
        updates, state = tx.update(grads(name, seed + k), state, params)
        params = nba.apply_updates(params, updates)
    return params, state


def digest(params: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(np.ascontiguousarray(params[name]).tobytes())
    return h.hexdigest()


def started(name: str) -> tuple[dict, object]:
    """Two steps of family ``name`` from its first params: the layer starts, the plans are kept."""
    tx, shapes, _ = FAMILIES[name]
    params = {k: np.linspace(-1.0, 1.0, math.prod(s), dtype=np.float32).reshape(s) for k, s in shapes.items()}
    return steps(name, params, tx.init(params), seed=100)


STATES = {name: started(name) for name in FAMILIES}  # (params, state) at the forks
SAVED = copy.deepcopy(STATES)  # for the parent's own continuations


def continued(seed: int) -> dict:
    """What a process computes from the states it had at the fork (a child's copies of them),
    per family, with the numbaccum warnings it raised (message, file they point to) and whether
    its parallel regions are on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bits = {name: digest(steps(name, *STATES[name], seed)[0]) for name in FAMILIES}
    said = [(str(w.message), os.path.basename(w.filename)) for w in caught]
    said = [(message, where) for message, where in said if "numbaccum" in message]
    return {"bits": bits, "warnings": said, "parallel": _config.PARALLEL}


def in_child(fn) -> dict:
    """``fn()`` in a forked child: ``{"status": exit code, "result": what it returned}``, or
    ``{"status": "timeout"}`` (the child killed) past the deadline."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.close(r)
            os.write(w, json.dumps(fn()).encode())
            code = 0
        except BaseException:  # noqa: BLE001 - reported through the exit code and stderr
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + DEADLINE
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return {"status": "timeout"}
        time.sleep(0.01)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    return {"status": os.waitstatus_to_exitcode(status), "result": json.loads(data) if data else None}


def child_and_grandchild() -> dict:
    """A child that forks a child of its own before it continues: both continue the state."""
    grandchild = in_child(lambda: continued(0))
    return {**continued(0), "grandchild": grandchild}


def pool() -> object:
    workers = mp.get_context("fork").Pool(2)
    try:
        return workers.map_async(continued, [0, 1]).get(timeout=DEADLINE)
    except mp.TimeoutError:
        return "timeout"
    finally:
        workers.terminate()


def made_at_run_time(x, k):
    return x * k + 3.0


def with_locks_held() -> dict:
    """A child forked while another thread holds every lock numbaccum made (`numbaccum._locks`:
    inside a guarded kernel launch, compiling, interning a layout, filling a cache, saving): it
    continues the state, makes the drivers of formulas it has not seen, lays out a new tree
    through a new chain and saves a state."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with contextlib.ExitStack() as stack:
            for made in _locks._MADE:
                stack.enter_context(made)
            held.set()
            release.wait()

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait()

    def child() -> dict:
        out = continued(0)
        driver.compiled(Formula(made_at_run_time, (), ("x",), ("out",), ("k",)))
        reduce._kinds_for(np.zeros(2, np.complex128))
        tx = nba.chain(nba.clip_by_global_norm(0.5), nba.scale_by_adam(), nba.scale(-0.25))
        tree = {"u": np.ones(7, np.float32), "v": np.full((2, 3), 2.0)}  # a layout not seen before
        state = tx.init(tree)
        _, state = tx.update(tree, state)
        nba.save_state(os.path.join(os.path.dirname(sys.argv[2]), f"fork-{os.getpid()}.npz"), state)
        return out

    try:
        return in_child(child)
    finally:
        release.set()
        thread.join()


def parents_bits(seed: int, parallel: bool) -> dict:
    """The parent's continuations of the states (from copies), per family."""
    _config.PARALLEL = parallel
    try:
        return {name: digest(steps(name, *copy.deepcopy(SAVED[name]), seed)[0]) for name in FAMILIES}
    finally:
        _config.PARALLEL = True


report = {  # the parent's bits first: the children inherit its serial kernels, compiled
    "layer": numba.threading_layer(),
    "parallel": [parents_bits(s, True) for s in (0, 1)],
    "serial": [parents_bits(s, False) for s in (0, 1)],
}
report.update(child=in_child(child_and_grandchild), pool=pool(), locks=with_locks_held())
with open(sys.argv[2], "w") as f:
    json.dump(report, f)
