"""The registry of public transformations (tests/registry.py) is complete, and every test that
loops over transformations reads it."""

from __future__ import annotations

import registry
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
