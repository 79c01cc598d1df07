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


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.complex64])
def test_kept_dots_and_divisions_give_the_contracts_bits_and_follow_their_buffers(dtype):
    """`Reductions.dot` and `Reductions.divide_` (prodigy's and NovoGrad's kept calls) give the
    bits of `Ops.dot` and `Ops.slice_divide_`, read the buffers' current values, and are
    prepared again for new buffers in the same slot."""
    from numbaccum.backend import Reductions, ops_for, prepare_divide
    from numbaccum.contract import ONE, Factor
    from numbaccum.tables import segments

    rng = np.random.default_rng(4)
    table = segments([0, 3, 3, 40, 2100])
    x, y = (rng.standard_normal(2100).astype(dtype) for _ in range(2))
    if np.iscomplexobj(x):
        x = x + 1j * rng.standard_normal(2100).astype(dtype)
    ops, kept = ops_for(x), Reductions()
    divisors = np.array([0.5, 3.0, -0.25, 7.0])
    for step in range(3):
        if step == 1:
            x *= 3  # in place: the same buffer, new values
        if step == 2:
            x, y = (x * 0.5).astype(dtype), (y * 2).astype(dtype)  # new buffers in the same slot
        got = kept.dot("g", x, y)
        assert np.float64(got).tobytes() == np.float64(ops.dot(x, y)).tobytes()
        if np.iscomplexobj(x):
            continue
        for factor in (ONE, Factor(2.0, 3.0)):
            out, want = np.empty_like(x), np.empty_like(x)
            kept.call("g", prepare_divide, (out, x, table), factor, divisors.astype(dtype))
            ops.slice_divide_(want, x, factor, table, divisors.astype(dtype))
            assert out.tobytes() == want.tobytes()
        inplace, want = x.copy(), x.copy()
        kept.call("h", prepare_divide, (inplace, inplace, table), ONE, divisors.astype(dtype))
        ops.slice_divide_(want, want, ONE, table, divisors.astype(dtype))
        assert inplace.tobytes() == want.tobytes()


def _lbfgs_trees(kind: str, seed: int) -> dict:
    t = _tree(seed)
    if kind == "float32":
        del t["d"]
    elif kind == "float64":
        t = {"d": t["d"], "e": np.random.default_rng(seed).standard_normal(7)}
    elif kind == "nan":
        t["w"][0, 0] = np.nan
    return t


def _lbfgs_run(tx, kind: str, steps: int = 6) -> list[bytes]:
    """The bits of each update of ``steps`` (params moved by each), and of the last state."""
    import copy

    params, out = _lbfgs_trees(kind, 1), []
    state = tx.init(params)
    for k in range(steps):
        u, state = tx.update(_lbfgs_trees(kind, 10 + k), state, params)
        out.append(b"".join(np.asarray(u[n]).tobytes() for n in sorted(u)))
        params = {n: v + np.asarray(u[n]).astype(v.dtype) for n, v in params.items()}
        if k == 2:
            state = copy.deepcopy(state)  # a restored state: other buffers from here on
    return out


@pytest.mark.parametrize("kind", ["mixed", "float32", "float64", "nan"])
def test_lbfgs_compiled_step_gives_the_contract_calls_bits_and_follows_its_states(kind, monkeypatch):
    """L-BFGS's compiled step on a small host tree (`numbaccum.cpu.reduce.lbfgs_two_loop`) gives
    the bits of the contract's calls it replaces, for every memory size and scaling, and
    follows its state's buffers: a copied state, and two states on one transformation."""
    import numbaccum.cpu.reduce as engine
    import numbaccum.quasi_newton as qn

    makers = [lambda: nba.scale_by_lbfgs(1), lambda: nba.scale_by_lbfgs(3),
              lambda: nba.scale_by_lbfgs(2, scale_init_precond=False)]
    with monkeypatch.context() as m:
        m.setattr(qn, "_compiled_groups", lambda *a: None)  # the contract's calls
        want = [_lbfgs_run(make(), kind) for make in makers]
    ran = []
    two_loop = engine.lbfgs_two_loop
    monkeypatch.setattr(engine, "lbfgs_two_loop", lambda *a: ran.append(1) or two_loop(*a))
    for make, expected in zip(makers, want):
        assert _lbfgs_run(make(), kind) == expected
    assert len(ran) == 6 * len(makers)
    tx = makers[1]()  # two states on one transformation, their steps interleaved
    pa, pb = _lbfgs_trees(kind, 1), _lbfgs_trees(kind, 2)
    sa, sb = tx.init(pa), tx.init(pb)
    alone = nba.scale_by_lbfgs(3)
    sc = alone.init(_lbfgs_trees(kind, 2))
    for k in range(4):
        _, sa = tx.update(_lbfgs_trees(kind, 10 + k), sa, pa)
        ub, sb = tx.update(_lbfgs_trees(kind, 20 + k), sb, pb)
        uc, sc = alone.update(_lbfgs_trees(kind, 20 + k), sc, _lbfgs_trees(kind, 2))
        assert all(np.asarray(ub[n]).tobytes() == np.asarray(uc[n]).tobytes() for n in ub)


def test_lbfgs_memory_past_the_compiled_steps_takes_the_contract_calls(monkeypatch):
    """A memory larger than the compiled step takes (`quasi_newton._COMPILED_MEMORY`) runs the
    contract's calls: the compiled step would be a new numba type per memory size, and 1000
    slots compiled for minutes until a test worker died."""
    import numbaccum.cpu.reduce as engine
    import numbaccum.quasi_newton as qn

    ran = []
    two_loop = engine.lbfgs_two_loop
    monkeypatch.setattr(engine, "lbfgs_two_loop", lambda *a: ran.append(1) or two_loop(*a))
    big = _lbfgs_run(nba.scale_by_lbfgs(qn._COMPILED_MEMORY + 1), "float32")
    assert not ran and len(big) == 6
    _lbfgs_run(nba.scale_by_lbfgs(qn._COMPILED_MEMORY), "float32")
    assert ran  # (the largest it takes still compiles)
