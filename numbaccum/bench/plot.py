"""`numbaccum bench --plot FILE.png`: one grouped bar chart per device and workload.

Bars are the implementations, groups the operations. Workloads measured in bandwidth show the
fraction of the copy floor (higher is better); the per-call workload shows microseconds per call
on a log scale (lower is better). Each bar's line runs from its fastest call to its slowest (the
table's min-max). Each contender has one colour in every panel (one legend for the figure), and a
peer that skipped a row (over its budget, its process gone) leaves a mark in its place, numbered,
with the reason under the panel. matplotlib comes with ``pip install "numbaccum[bench]"`` and is
imported only here.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

MISSING = "numbaccum bench --plot needs matplotlib: pip install 'numbaccum[bench]' or matplotlib"
SKIPPED = "skipped"  # the mark's text, numbered: "skipped (1)"


def require_matplotlib() -> None:
    """Raises SystemExit with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise SystemExit(MISSING) from e


def _bar(row: dict[str, Any], per_call: bool) -> tuple[float, float, float]:
    """(value, lowest, highest) of a row as drawn: microseconds per call, or the fraction of the
    copy floor, which is inverse to the time (the fastest call is the highest fraction)."""
    if per_call:
        return row["median_s"] * 1e6, row["min_s"] * 1e6, row["max_s"] * 1e6
    frac = row["floor_fraction"]
    if frac is None:
        return math.nan, math.nan, math.nan
    return frac, frac * row["median_s"] / row["max_s"], frac * row["median_s"] / row["min_s"]


def contenders(result: dict[str, Any]) -> list[str]:
    """Every implementation of the run, timed or skipped anywhere, in the order first met."""
    names: dict[str, None] = {}
    for run in result["runs"]:
        names.update(dict.fromkeys(r["impl"] for r in run["rows"]))
        names.update(dict.fromkeys(x["impl"] for x in run.get("skipped", [])))
    return list(names)


def colours(names: list[str]) -> dict[str, Any]:
    """One colour per contender, for the whole figure (matplotlib's tab10, tab20 beyond ten)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def _skipped_rows(run: dict[str, Any], labels: dict[str, tuple[str, ...]]) -> list[tuple[str, str, str]]:
    """(row label, contender, why) of each row a contender skipped: a skip is noted per operation
    (``multisteps``), which may be several rows (its mini-step and its emitting step)."""
    return [(op, x["impl"], x["why"]) for x in run.get("skipped", []) for op in labels.get(x["op"], (x["op"],))]


def figure(result: dict[str, Any], labels: dict[str, tuple[str, ...]] | None = None) -> Any:
    """The figure of ``result`` (what `runner.run` returns), one panel per device and workload;
    ``labels``: the rows of each operation a skip names (`runner.LABELS`)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # a file, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = labels or {}
    runs = [r for r in result["runs"] if r["rows"] or r.get("skipped")]
    names = contenders(result)
    colour = colours(names)
    notes = [_skipped_rows(run, labels) for run in runs]
    heights = [3.6 + 0.16 * len(n) for n in notes]  # room for each panel's reasons
    top = 0.7  # inches above the panels: the title, then the legend
    total = (sum(heights) if runs else 3.6) + top
    fig, axes = plt.subplots(
        len(runs) or 1,
        1,
        figsize=(11, total),
        squeeze=False,
        gridspec_kw={"height_ratios": heights} if runs else None,
    )
    for ax, run, skipped in zip(axes[:, 0], runs, notes):
        _panel(ax, run, skipped, [n for n in names if _in(run, n)], colour)
    fig.suptitle(f"numbaccum bench, {result['date']}: {result['machine']}", fontsize=9, y=1 - 0.05 / total)
    fig.legend(
        handles=[Patch(facecolor=colour[n], label=n) for n in names],
        loc="upper center",
        bbox_to_anchor=(0.5, 1 - 0.25 / total),
        ncol=min(len(names), 6) or 1,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - top / total))
    return fig


def _in(run: dict[str, Any], name: str) -> bool:
    return any(r["impl"] == name for r in run["rows"]) or any(x["impl"] == name for x in run.get("skipped", []))


def _panel(
    ax: Any, run: dict[str, Any], skipped: list[tuple[str, str, str]], impls: list[str], colour: dict
) -> None:
    """One device and workload: a group of bars per operation, one slot per contender (a bar
    with its min-max line, a numbered mark where it skipped the row), the reasons underneath."""
    per_call = run["per_call"]
    ops = list(dict.fromkeys([r["op"] for r in run["rows"]] + [op for op, _, _ in skipped]))
    by = {(r["op"], r["impl"]): _bar(r, per_call) for r in run["rows"]}
    width = 0.8 / max(len(impls), 1)
    for j, impl in enumerate(impls):
        xs = [i - 0.4 + (j + 0.5) * width for i in range(len(ops))]
        value, low, high = zip(*(by.get((op, impl), (math.nan,) * 3) for op in ops))
        ax.bar(xs, value, width, color=colour[impl], label=impl)
        ax.errorbar(
            xs,
            value,
            yerr=[[v - lo for v, lo in zip(value, low)], [hi - v for v, hi in zip(value, high)]],
            fmt="none",
            ecolor="black",
            elinewidth=0.8,
            capsize=2,
        )
    reasons = []
    for k, (op, impl, why) in enumerate(skipped, 1):
        x = ops.index(op) - 0.4 + (impls.index(impl) + 0.5) * width
        ax.annotate(
            f"{SKIPPED} ({k})",
            xy=(x, 0.03),
            xycoords=("data", "axes fraction"),
            rotation=90,
            ha="center",
            va="bottom",
            fontsize=7,
            color=colour[impl],
            bbox={"boxstyle": "square,pad=0.2", "facecolor": "white", "edgecolor": colour[impl], "linestyle": "--"},
        )
        reasons.append(textwrap.shorten(f"({k}) {impl} on {op}: {why}", 170, placeholder=" ..."))
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
        f"{run['n_leaves']} leaves); lines: min-max",
        fontsize=10,
    )
    if reasons:
        ax.set_xlabel("\n".join(reasons), fontsize=7, loc="left")


def plot(result: dict[str, Any], path: str, labels: dict[str, tuple[str, ...]] | None = None) -> None:
    """Draws ``result`` (what `runner.run` returns) into the PNG file ``path`` (`figure`)."""
    fig = figure(result, labels)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
