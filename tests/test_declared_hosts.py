"""The hand-planned optimizer stages of issue 43 declare a kept `numbaccum.fuse.Host`.

Adafactor, SM3, NovoGrad, DoG, prodigy/D-Adaptation, schedule-free and Hutchinson planned a
`Step` of closures on every call (their chains too). Now each declares once per state and
layout and a steady step only ticks the kept plan: no stage's ``plan`` runs, and the steady
step's Python calls into the package stay few (a ``sys.setprofile`` count, not a timing).
"""

from __future__ import annotations

import numpy as np
import pytest
from _testutil import package_calls, watch_declarations

import numbaccum as nba
from numbaccum.base import stage_of


def _hessian(params, v):
    return {k: 2.0 * np.asarray(x) for k, x in v.items()}


CASES = {
    "adafactor": lambda: nba.adafactor(1e-2, 2, momentum=0.9, weight_decay_rate=1e-3),
    "sm3": lambda: nba.sm3(0.1),
    "novograd": lambda: nba.novograd(1e-2, weight_decay=0.1),
    "dog": lambda: nba.scale_by_distance_over_gradients(global_scale=-0.5),
    "prodigy": lambda: nba.prodigy(),
    "dadapt_adamw": lambda: nba.dadapt_adamw(),
    "schedule_free_adamw": lambda: nba.schedule_free_adamw(1e-2),
    "schedule_free_sgd": lambda: nba.schedule_free_sgd(1e-2),
    "hutchinson": lambda: nba.hutchinson_estimator_diag_hessian(3),
}


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((8, 16)).astype(np.float32),
        "b": rng.standard_normal(16).astype(np.float32),
        "d": rng.standard_normal(4),
    }


def _stages(tx):
    stage = stage_of(tx)
    return list(getattr(stage, "stages", [stage]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_stage_declares_and_a_steady_step_plans_nothing(name, monkeypatch):
    tx = CASES[name]()
    params = _tree(1)
    extra = {"hvp_fn": _hessian} if name == "hutchinson" else {}
    state = tx.init(params)
    for k in range(2):  # both modes warm (their kernels compiled or loaded)
        state = nba.step_(tx, _tree(10 + k), state, params, **extra)
        _, state = tx.update(_tree(12 + k), state, params, **extra)

    watch_declarations(monkeypatch)  # a steady step declares nothing again
    state = nba.step_(tx, _tree(20), state, params, **extra)
    g = _tree(21)
    calls = package_calls(lambda: nba.step_(tx, g, state, params, **extra))
    assert calls < 400, calls  # adafactor's steady step_ made 611 when it planned each call
