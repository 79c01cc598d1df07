"""The package as an index would publish it: the source distribution runs its own tests, the
changelog names the version, and the cuda extras bring a CUDA toolkit."""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import numbaccum

ROOT = Path(__file__).resolve().parent.parent

# Tests that read files beside the package (the README, the docs, CI's script, the site's
# configuration, checkpoints in tests/data, saved bench results, the changelog), run from the
# unpacked sdist: collection alone imports the test modules but reads none of those.
FROM_THE_SDIST = (
    "test_readme_commands_are_the_ones_ci_and_users_run",
    "test_every_docs_page_is_in_the_site_and_the_readme_works_on_an_index_page",
    "test_a_checkpoint_written_before_the_registry_still_loads",
    "test_item7_bench_from_json_accepts_its_own_results",
    "test_the_changelog_has_a_section_for_this_version",
)
# What a checkout holds that is no source: never copied into the tree the sdist is built from.
NOT_SOURCES = (".git", ".venv*", "*.egg-info", "build", "dist", "site", "__pycache__", ".*_cache", ".hypothesis")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _version(name: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version(name))[:3])
    except importlib.metadata.PackageNotFoundError:
        return None


def _require_build_requirements() -> None:
    """pyproject's ``[build-system] requires`` installed here (the test calls the backend in
    this environment, offline); skips naming the test extra otherwise (fails under CI)."""
    for req in _pyproject()["build-system"]["requires"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([\d.]+)", req)
        assert m, f"{req!r}: this test reads only 'name>=version' requirements"
        have, need = _version(m[1]), tuple(int(x) for x in m[2].split("."))
        if have is None or have < need:
            why = f"optional dependency {req} is not installed (pip install 'numbaccum[test]')"
            if os.environ.get("NUMBACCUM_CI"):
                pytest.fail(why)
            pytest.skip(why)


def _build_sdist(tmp_path: Path) -> Path:
    """The sdist of a copy of the checkout (the backend reads MANIFEST.in and would also take the
    files an old SOURCES.txt lists, or, with setuptools-scm, every file git tracks: the copy has
    neither), unpacked; returns its top directory."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    backend = _pyproject()["build-system"]["build-backend"]
    code = f"import sys, {backend} as b; print(b.build_sdist(sys.argv[1]))"
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "dist")],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    name = r.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / "dist" / name) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # 3.12, and backports
        tar.extractall(tmp_path / "unpacked", **safe)
    (top,) = (tmp_path / "unpacked").iterdir()
    return top


def _files(top: Path, under: str) -> set[str]:
    return {
        p.relative_to(top).as_posix()
        for p in (top / under).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_the_sdist_carries_what_its_tests_need_and_they_run_from_it(tmp_path):
    """``pytest`` collects the whole suite from the unpacked sdist (the test helpers, tests/data,
    the docs and examples are in it: before MANIFEST.in, 39 modules failed to import), and the
    tests that read files beside the package pass there."""
    _require_build_requirements()
    top = _build_sdist(tmp_path)
    for under in ("tests", "docs", "examples"):
        missing = _files(tmp_path / "src", under) - _files(top, under)
        assert not missing, f"the sdist lacks {sorted(missing)[:10]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("NUMBACCUM_TEST_SKIPPED_LOG", None)  # the inner run's skips are not this session's
    env["PYTHONPATH"] = str(top)  # the sdist's numbaccum, not this checkout's
    env["NUMBACCUM_TEST_CACHE_DIR"] = os.environ["NUMBACCUM_CACHE_DIR"]  # this session's kernels
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", " or ".join(FROM_THE_SDIST)],
        cwd=top,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail  # a module that fails to import fails the run (collection error)
    assert re.search(rf"\b{len(FROM_THE_SDIST)} passed\b", r.stdout), tail


def test_the_changelog_has_a_section_for_this_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(numbaccum.__version__)}\b", changelog, re.M), (
        f"CHANGELOG.md has no '## {numbaccum.__version__}' section"
    )


def test_the_cuda_extras_bring_a_cuda_toolkit_and_the_gpu_guide_says_which():
    """numba-cuda alone needs a CUDA toolkit on the machine (a driver-only machine cannot compile
    kernels); its ``cu12`` / ``cu13`` extras bring the toolkit's wheels (NVVM, NVRTC, the runtime).
    ``numbaccum[cuda]`` is CUDA 12's, ``numbaccum[cuda13]`` CUDA 13's, with the same pins."""
    extras = _pyproject()["project"]["optional-dependencies"]

    def numba_cuda(extra: str) -> str:
        (req,) = [r for r in extras[extra] if r.startswith("numba-cuda")]
        return req

    assert re.fullmatch(r"numba-cuda\[cu12\]>=[\d.]+", numba_cuda("cuda")), extras["cuda"]
    assert numba_cuda("cuda13") == numba_cuda("cuda").replace("[cu12]", "[cu13]")
    assert [r for r in extras["cuda13"] if not r.startswith("numba-cuda")] == [
        r for r in extras["cuda"] if not r.startswith("numba-cuda")
    ]
    guide = (ROOT / "docs" / "guides" / "gpus.md").read_text()
    assert 'pip install "numbaccum[cuda]"' in guide and 'pip install "numbaccum[cuda13]"' in guide
    assert "NUMBA_ENABLE_CUDASIM=1" in guide  # how to try the GPU path without a GPU


def _release(version: str) -> tuple[int, ...]:
    """``2.0.0`` and ``2.0`` as the same release."""
    parts = [int(x) for x in version.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_ci_tests_the_oldest_numpy_and_numba_the_package_claims():
    """.ci/run's oldest pass installs exactly the minimums of pyproject's dependencies (a raised
    minimum moves the pass with it; a pass on anything newer would vouch for nothing) into a
    virtualenv of its own, and runs tests there."""
    deps = {}
    for req in _pyproject()["project"]["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([\d.]+)", req)
        assert m, f"{req!r}: a dependency is 'name>=minimum' (the oldest pass installs the minimum)"
        deps[m[1]] = _release(m[2])
    ci = (ROOT / ".ci" / "run").read_text()
    (install,) = re.findall(r"^\.venv-oldest/bin/python -m pip install .*==.*$", ci, re.M)
    pins = {name: _release(v) for name, v in re.findall(r'"([A-Za-z0-9_.-]+)==([\d.]+)"', install)}
    assert pins == deps, f"{install!r} does not pin pyproject's minimums {deps}"
    assert '-e ".[test]"' in install  # the test extra, nothing else that could lift numpy or numba
    assert re.search(r"^python3 -m venv --clear \.venv-oldest$", ci, re.M)
    assert re.search(r"^\.venv-oldest/bin/python -m pytest .*tests/", ci, re.M)


def test_ci_type_checks_the_package_with_the_pinned_mypy():
    """The package ships py.typed: .ci/run runs mypy over it, with the mypy the typecheck extra
    pins (what `numbaccum[dev]` installs too)."""
    extras = _pyproject()["project"]["optional-dependencies"]
    (mypy,) = extras["typecheck"]
    assert re.fullmatch(r"mypy==[\d.]+", mypy), mypy
    assert any(r.startswith("numbaccum[") and "typecheck" in r for r in extras["dev"]), extras["dev"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[typecheck]"' in ci
    assert re.search(r"^mypy .*numbaccum$", ci, re.M)
    assert _pyproject()["tool"]["mypy"]["files"] == ["numbaccum"]
