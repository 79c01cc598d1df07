"""A training loop after ``warmup(tx, params)`` in a process with the kernel cache off: prints the
functions numba compiled during the loop (none, when warmup compiled the plan's kernels), the
slowest step and how long warmup took (tests/test_semantics.py)."""

import json
import time

import numpy as np
from numba.core import event

import numbaccum as nba

compiled = []


class Count(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__qualname__)

    def on_end(self, ev):
        pass


rng = np.random.default_rng(0)
params = {
    "w1": rng.standard_normal((32, 64)).astype(np.float32),
    "b1": np.zeros(64, np.float32),
    "w2": rng.standard_normal((64, 10)),
    "b2": np.zeros(10),
}
tx = nba.MultiSteps(
    nba.chain(
        nba.clip_by_global_norm(1.0), nba.adamw(1e-3, mask={"w1": True, "b1": False, "w2": True, "b2": False})
    ),
    4,
)
t = time.perf_counter()
nba.warmup(tx, params)
warm_s = time.perf_counter() - t
event.register("numba:compile", Count())
state = tx.init(params)
worst = 0.0
for i in range(12):
    g = {
        k: rng.standard_normal(v.shape).astype(v.dtype) * (10.0 if i % 3 == 0 else 1e-3)
        for k, v in params.items()
    }
    t = time.perf_counter()
    if i % 2:
        state = nba.step_(tx, g, state, params)
    else:
        u, state = tx.update(g, state, params)
        nba.apply_updates_(params, u)
    worst = max(worst, time.perf_counter() - t)
print(json.dumps({"compiled_after_warmup": compiled, "worst_step_ms": worst * 1e3, "warmup_s": warm_s}))
