"""The registry of public transformations (tests/registry.py) is complete, and every test that
loops over transformations reads it."""

from __future__ import annotations

import registry
import test_bitexact
import test_cuda
import test_fusion
import test_hostile

import numbaccum as nba


def test_every_public_name_is_a_case_or_exempt():
    names = set(nba.__all__)
    covered = registry.public_names()
    missing = sorted(names - covered - set(registry.EXEMPT) - set(registry.OWN_TESTS))
    assert not missing, f"public names in neither the registry nor its exemptions: {missing}"
    both = sorted(covered & set(registry.EXEMPT))
    assert not both, f"exempt, yet registered: {both}"
    stale = sorted((covered | set(registry.EXEMPT)) - names)
    assert not stale, f"registered or exempt, but not public: {stale}"


def test_every_case_builds_a_transformation_of_its_public_name():
    for name, case in registry.CASES.items():
        tx = case.make()
        assert callable(tx.init) and callable(tx.update), name
        assert case.public in nba.__all__, name


def test_the_cuda_tests_run_every_registered_transformation():
    on_device = {registry.CASES[n].public for n in test_cuda.TXS if n in registry.CASES}
    want = {c.public for c in registry.CASES.values() if c.cuda and not c.per_example}
    assert want <= on_device, sorted(want - on_device)
    for must in ("nadam", "identity", "inject_hyperparams"):  # missing before issue 22
        assert must in on_device


def test_the_fusion_pool_holds_every_fusable_stage():
    pooled = {registry.CASES[n].public for n in test_fusion.POOL if n in registry.CASES}
    want = {c.public for c in registry.CASES.values() if c.fusable}
    assert want <= pooled, sorted(want - pooled)
    for must in ("clip_norm", "normalize", "centralize", "adaptive_grad_clip", "clip_norm_by_ema"):
        assert must in pooled


def test_the_hostile_constructors_cover_every_public_transformation():
    covered = set(test_hostile.CONSTRUCTORS) | set(test_hostile.HOSTILE_EXEMPT)
    assert registry.public_names() <= covered, sorted(registry.public_names() - covered)


def test_every_exact_case_has_a_reference():
    for name, case in registry.CASES.items():
        assert not case.exact or case.reference is not None, name


def test_the_sample_is_of_registered_cases():
    assert set(registry.CASES) >= registry.SAMPLE, sorted(registry.SAMPLE - set(registry.CASES))
    assert registry.SAMPLE >= registry.DRIVERS, sorted(registry.DRIVERS - registry.SAMPLE)


def _parameters(test) -> list[tuple[tuple, list]]:
    """(values, marks) of each parameter set of ``test``'s one ``parametrize``."""
    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    return [(p.values, list(p.marks)) if hasattr(p, "marks") else (p, []) for p in mark.args[1]]


def test_the_readme_command_checks_every_case_against_its_reference():
    """`registry.sweep` leaves the Cases outside the SAMPLE of the dtype, path and wrapper sweeps
    to .ci/run's exhaustive step; each Case's own numbers stay in the README's command, where
    test_bitexact.py runs every Case that has a reference serially, unmarked."""
    runs = _parameters(test_bitexact.test_updates_and_state_bit_for_bit)
    runs += _parameters(test_bitexact.test_updates_and_state_close)
    by_default = {values[0] for values, marks in runs if values[1] == "serial" and not marks}
    assert by_default == set(registry.with_reference()), sorted(set(registry.with_reference()) - by_default)
    swept = _parameters(test_bitexact.test_step_bit_for_bit)
    exhaustive = {values[0] for values, marks in swept if [m.name for m in marks] == ["exhaustive"]}
    assert {values[0] for values, marks in swept if not marks} == set(registry.sampled(test_bitexact.EXACT))
    assert exhaustive == set(test_bitexact.EXACT) - set(registry.sampled(test_bitexact.EXACT))
