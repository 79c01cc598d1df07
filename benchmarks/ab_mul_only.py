"""A/B in one process: a learning rate's pending factor read by the fused pass as ``x * mul``
(new: its ``div`` is 1) against ``(x / 1) * mul`` (old: a division per element, which bounds
Adam's pass on a CPU), alternated call by call, in cache and at GPT-2-small size; the params' bits
compared.

    PYTHONPATH=. python benchmarks/ab_mul_only.py [scale]
"""

import sys
import time

import numpy as np

sys.path.insert(0, "benchmarks")
from vs_torch import _shrink  # noqa: E402

import numbaccum as nb  # noqa: E402
from numbaccum import fuse  # noqa: E402
from numbaccum.bench import workloads  # noqa: E402

NEW = fuse._factor_kind
OPTIMIZERS = {
    "adamw": lambda: nb.adamw(1e-3, weight_decay=1e-2),
    "clip+adamw": lambda: nb.chain(nb.clip_by_global_norm(1.0), nb.adamw(1e-3, weight_decay=1e-2)),
    "sgd momentum": lambda: nb.sgd(1e-3, momentum=0.9),
}


def _old(factor):  # the old shape: every host factor read as (x / div) * mul
    kind = NEW(factor)
    return 2 if kind == 1 else kind


def main() -> None:
    scale = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
    sizes = (
        ("in cache (1M)", {"w": (1024, 1024)}, 200),
        (f"GPT-2-small x{scale:.2f}", _shrink(workloads.gpt2_small_shapes(), scale), 12),
    )
    for label, shapes, reps in sizes:
        n = workloads.count_params(shapes)
        for name, make in OPTIMIZERS.items():
            runs = {}
            for mode in ("new", "old"):
                p = nb.FlatTree.from_tree(workloads.make_tree(shapes, np.float32, seed=0))
                g = nb.FlatTree.from_tree(workloads.make_tree(shapes, np.float32, seed=1, scale=1e-2))
                tx = make()
                runs[mode] = [tx, p, g, tx.init(p)]
            times: dict = {m: [] for m in runs}
            for r in range(reps + 2):
                for mode, run in runs.items():
                    fuse._factor_kind = NEW if mode == "new" else _old
                    tx, p, g, state = run
                    t = time.perf_counter()
                    run[3] = nb.step_(tx, g, state, p)
                    if r >= 2:
                        times[mode].append(time.perf_counter() - t)
            fuse._factor_kind = NEW
            a, b = np.median(times["new"]), np.median(times["old"])
            same = all(np.array_equal(x, y) for x, y in zip(runs["new"][1].groups, runs["old"][1].groups))
            print(
                f"{label} {name}: new {1e9 * a / n:.3f} ns/param, old {1e9 * b / n:.3f}, "
                f"new/old {a / b:.3f}, same bits {same}"
            )


if __name__ == "__main__":
    main()
