"""`numbaccum bench --plot FILE.png`: one grouped bar chart per device and workload.

Bars are the implementations, groups the operations. Workloads measured in bandwidth show the
fraction of the copy floor (higher is better); the per-call workload shows microseconds per call
on a log scale (lower is better). matplotlib comes with ``pip install "numbaccum[bench]"`` and is
imported only here.
"""

from __future__ import annotations

import math
from typing import Any

MISSING = "numbaccum bench --plot needs matplotlib: pip install 'numbaccum[bench]' or matplotlib"


def require_matplotlib() -> None:
    """Raises SystemExit with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise SystemExit(MISSING) from e


def _value(row: dict[str, Any], per_call: bool) -> float:
    if per_call:
        return row["median_s"] * 1e6
    frac = row["floor_fraction"]
    return math.nan if frac is None else frac


def plot(result: dict[str, Any], path: str) -> None:
    """Draws ``result`` (what `runner.run` returns) into the PNG file ``path``."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # a file, no display needed
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r["rows"]]
    fig, axes = plt.subplots(len(runs) or 1, 1, figsize=(11, 3.6 * max(len(runs), 1)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        per_call = run["per_call"]
        ops = list(dict.fromkeys(r["op"] for r in run["rows"]))
        impls = list(dict.fromkeys(r["impl"] for r in run["rows"]))
        by = {(r["op"], r["impl"]): _value(r, per_call) for r in run["rows"]}
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            xs = [i - 0.4 + (j + 0.5) * width for i in range(len(ops))]
            ax.bar(xs, [by.get((op, impl), math.nan) for op in ops], width, label=impl)
        ax.set_xticks(range(len(ops)))
        ax.set_xticklabels([op.replace(": ", ":\n") for op in ops], fontsize=8)
        if per_call:
            ax.set_yscale("log")
            ax.set_ylabel("us per call (lower is better)")
        else:
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
            ax.set_ylabel("fraction of copy floor\n(higher is better)")
        ax.set_title(
            f"{run['device']}: {run['workload']} ({run['n_params']:,} float32 params, "
            f"{run['n_leaves']} leaves)",
            fontsize=10,
        )
        ax.legend(fontsize=8, ncol=min(len(impls), 5))
    fig.suptitle(f"numbaccum bench, {result['date']}: {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
