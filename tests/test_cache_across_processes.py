"""The kernel cache across processes: every kernel a process loads is the one it asked for.

numba names a compiled function after its module, its qualified name and a counter that starts
again in every process; kernels of one factory (the reduction engine's per-kind drivers) once
shared all three across processes, so a process that loaded two of them from the cache linked
one in place of the other and returned another reduction's numbers (issue 22, item 1). Here
five fresh processes share one empty cache directory, each runs the jobs of `_cache_child` (every
reduction kind, every formula, fused composites) in its own order, and every result is checked
against plain NumPy: three processes fill the cache a third each, two more load every kernel.
The README's test command runs every fourth job (21: each of the first three processes still
compiles reduction kinds, formulas and a composite, kernels of the engine's one factory among
them); .ci/run's exhaustive step every job (all 82 took two minutes of a cold run's CPU time).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import numbaccum

CHILD = Path(__file__).resolve().parent / "_cache_child.py"
PACKAGE_ROOT = Path(numbaccum.__file__).resolve().parent.parent  # the numbaccum under test


def _child(cache: Path, names: list[str]) -> dict:
    env = dict(os.environ, NUMBACCUM_CACHE_DIR=str(cache), PYTHONPATH=str(PACKAGE_ROOT))
    proc = subprocess.run(
        [sys.executable, str(CHILD), *names], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "stride", [4, pytest.param(1, marks=pytest.mark.exhaustive)], ids=["every_4th_job", "every_job"]
)
def test_processes_in_several_orders_over_one_cache_get_every_result_right(tmp_path, stride):
    cache = tmp_path / "cache"
    names = _names()[::stride]
    shuffled = list(names)
    random.Random(22).shuffle(shuffled)
    # The first three each compile a third of the kernels, starting with a different reduction
    # kind (numba numbers each process's functions from 1: three kernels of one factory under one
    # symbol name, before the fix); the last two load every kernel, in two other orders.
    orders = {f"jobs {k}::3, forward": names[k::3] for k in range(3)}
    orders["every job, shuffled"] = shuffled
    orders["every job, reversed"] = names[::-1]
    wrong, compiled = {}, {}
    for label, order in orders.items():
        res = _child(cache, order)
        assert res["ran"] == len(order)
        wrong.update({f"{label}: {k}": v for k, v in res["wrong"].items()})
        compiled[label] = res["compiled"]
    assert not wrong, "\n".join(f"{k}: {v}" for k, v in wrong.items())
    # The cache was used: the first three compiled, the last two loaded every cached kernel.
    assert all(compiled[f"jobs {k}::3, forward"] > 0 for k in range(3)), compiled
    assert compiled["every job, shuffled"] == compiled["every job, reversed"] == 0, compiled


def _names() -> list[str]:
    """Every job of the child, in its order (listed without a cache: nothing compiles)."""
    env = dict(os.environ, NUMBACCUM_CACHE_DIR="off", PYTHONPATH=str(PACKAGE_ROOT))
    out = subprocess.run(
        [sys.executable, str(CHILD), "--list"], env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])
