"""Cold start: import time of numbaccum and the first step of a small optimizer, in this process.

Run it as a fresh process, once with an empty kernel cache and once with the cache it filled::

    NUMBACCUM_CACHE_DIR=$(mktemp -d) python benchmarks/cold_start.py   # cold, fills the cache
    NUMBACCUM_CACHE_DIR=<same dir> python benchmarks/cold_start.py     # warm

The first step is ``init`` plus one full emitting cycle (4 updates) of
``MultiSteps(chain(clip_by_global_norm(1.0), adamw(1e-3)), 4)`` on a tree of 3 float32 leaves.
Prints one JSON line: ``import_s`` and ``first_step_s`` (wall seconds), ``first_step_cpu_s`` (this
process's CPU seconds: on a shared machine the wall time also counts the other processes' turns).
"""

from __future__ import annotations

import json
import time

t0 = time.perf_counter()
import numpy as np  # noqa: E402

t1 = time.perf_counter()
import numbaccum as nba  # noqa: E402

t2, c2 = time.perf_counter(), time.process_time()
grads = {"w": np.full((4, 3), 0.5, np.float32), "b": np.ones(3, np.float32), "s": np.ones((), np.float32)}
tx = nba.MultiSteps(nba.chain(nba.clip_by_global_norm(1.0), nba.adamw(1e-3)), 4)
state = tx.init(grads)
for _ in range(4):
    updates, state = tx.update(grads, state, grads)  # the grads stand in for the params
t3, c3 = time.perf_counter(), time.process_time()
print(
    json.dumps(
        {
            "numpy_import_s": t1 - t0,
            "import_s": t2 - t1,
            "first_step_s": t3 - t2,
            "first_step_cpu_s": c3 - c2,
            "w0": float(updates["w"][0, 0]),
        }
    )
)
