"""The README's code runs as written, its test command is CI's, and the CLI answers."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from _testutil import require_for

from numbaccum import _cache

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").rglob("*.md"))
BLOCKS = [  # a block on CUDA arrays runs where the cuda tests do (a GPU, or the simulator pass)
    pytest.param(
        block, id=f"{path.relative_to(ROOT)}:{i}", marks=[pytest.mark.cuda] if "cuda" in block else []
    )
    for path in [ROOT / "README.md", *DOCS]
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))
]


@pytest.mark.parametrize("block", BLOCKS)
def test_python_blocks_of_the_readme_and_the_docs_run(block):
    # numbaccum.distributed (one rank: COMM_WORLD of this process) needs numbaccum[mpi], a block
    # beside optax numbaccum[parity], dp_epsilon numbaccum[dp]: skipped without them, except in CI
    require_for(block)
    exec(compile(block, "README.md", "exec"), {})


def test_readme_commands_are_the_ones_ci_and_users_run():
    bash = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert [b.strip() for b in bash] == [
        "pip install . && numbaccum bench",
        'pip install -e ".[test]" && python -m pytest -q -n 2',
    ]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    # CI runs the README's test command verbatim, as a line of its own, in a virtualenv that
    # nothing was installed into before it (the line before it upgrades pip, the one before
    # that makes the virtualenv): what a newcomer runs is what CI runs.
    at = ci.index(bash[1].strip())
    assert ci[at - 1] == "python -m pip install -q --upgrade pip"
    assert ci[at - 3].startswith("python3 -m venv --clear .venv-ci") and ci[at - 2] == ". .venv-ci/bin/activate"
    assert not any("pip install" in line for line in ci[: at - 1] if not line.startswith("#"))
    # then the extras, and the tests the first pass skipped for want of them, under NUMBACCUM_CI
    rest = "\n".join(ci[at + 1 :])
    assert 'pip install -q -e ".[test,mpi,parity,docs,dp,bench]"' in rest and "export NUMBACCUM_CI=1" in rest
    assert '"${EXTRAS_TESTS[@]}"' in rest
    assert 'mpiexec -n 2 "${MPI_PYTEST[@]}"' in rest
    assert "mkdocs build --strict" in rest
    mpi = (ROOT / "docs" / "guides" / "mpi.md").read_text()
    assert 'pip install ".[mpi]"\nmpiexec -n 2 python examples/data_parallel.py' in mpi


# What each pytest line of .ci/run selects, on a file of one test of each kind: the README's
# command leaves the exhaustive sweeps out, the step after it runs just those, the extras' pass
# the node ids of both, the simulator pass every cuda test, exhaustive or not.
KINDS = {
    "plain": "",
    "sweep": "@pytest.mark.exhaustive\n",
    "cuda": "@pytest.mark.cuda\n",
    "cuda_sweep": "@pytest.mark.cuda\n@pytest.mark.exhaustive\n",
}
EXTRAS_PASS = (
    'python -m pytest -q -n 2 -p no:cacheprovider -m "exhaustive or not exhaustive" "${EXTRAS_TESTS[@]}"'
)
SELECTS = {  # a line of .ci/run -> the kinds it runs
    'pip install -e ".[test]" && python -m pytest -q -n 2': {"plain", "cuda"},
    "python -m pytest -q -n 2 -m exhaustive": {"sweep", "cuda_sweep"},
    EXTRAS_PASS: set(KINDS),
    "python -m pytest -q -n 2 -m cuda": {"cuda", "cuda_sweep"},  # the simulator pass
}


def _selected(line: str, tmp_path: Path) -> set[str]:
    """The kinds of `KINDS` that ``line``'s pytest arguments select, in a child pytest with this
    project's pyproject.toml (its addopts and markers) and no conftest."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    tests = "".join(f"{marks}def test_{kind}():\n    pass\n\n\n" for kind, marks in KINDS.items())
    (tmp_path / "test_kinds.py").write_text("import pytest\n\n\n" + tests)
    args = shlex.split(line.split("&&")[-1])
    args = args[args.index("pytest") + 1 :]
    del args[args.index("-n") : args.index("-n") + 2]  # no workers needed to collect
    # the extras' node ids: the file; one -q (a second lists files, not tests)
    args = [a for a in args if a not in ("${EXTRAS_TESTS[@]}", "-q")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    r = subprocess.run(
        [*collect, *args, "test_kinds.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return set(re.findall(r"^test_kinds\.py::test_(\w+)$", r.stdout, re.M))


def test_the_readme_command_leaves_the_exhaustive_sweeps_to_a_step_that_ci_runs(pytestconfig, tmp_path):
    """The README's command runs in about ten minutes because pyproject's addopts deselect the
    tests marked ``exhaustive`` (a registered marker); .ci/run runs those right after it, in the
    same virtualenv and under the same skip log, and its later passes select them too (pytest
    keeps the last ``-m``: each line's own replaces addopts')."""
    assert any(m.startswith("exhaustive:") for m in pytestconfig.getini("markers"))
    addopts = pytestconfig.getini("addopts")
    assert addopts[addopts.index("-m") + 1] == "not exhaustive", addopts
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    lines = [line for line in ci if not line.lstrip().startswith("#")]
    at = lines.index(next(iter(SELECTS)))
    assert lines[at + 1] == "python -m pytest -q -n 2 -m exhaustive"  # the step right after it
    assert lines[at + 2] == "unset NUMBACCUM_TEST_SKIPPED_LOG"  # ... still logging its skips
    for line, kinds in SELECTS.items():
        assert line in lines, f".ci/run has no line {line!r}"
        assert _selected(line, tmp_path) == kinds, line
    # .ci/run's MPI lines run tests/mpi with addopts' -m: an exhaustive test there would never run
    for path in (ROOT / "tests" / "mpi").rglob("*.py"):
        assert "exhaustive" not in path.read_text(), f"{path}: .ci/run's MPI passes deselect exhaustive tests"
    assert "python -m pytest -q -n 2 -m exhaustive" in README


def test_every_docs_page_is_in_the_site_and_the_readme_works_on_an_index_page():
    """The README is also the package's page on an index (pyproject's ``readme``), where a
    relative link leads nowhere: it links only to absolute addresses, and names the manual's
    pages by their paths in the repository and the source distribution, each of which exists."""
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS:
        assert str(page.relative_to(ROOT / "docs")) in nav, f"{page} is not in mkdocs.yml's nav"
    for target in re.findall(r"\]\(([^)]*)\)", README) + re.findall(r"""(?:href|src)=["']([^"']*)""", README):
        assert "://" in target, f"README links to {target!r}, which breaks on a package index page"
    named = re.findall(r"`((?:docs|examples|benchmarks)/[\w./-]+|CHANGELOG\.md)`", README)
    assert len(named) >= 17, named  # the table of the manual's pages
    for path in named:
        assert (ROOT / path).exists(), f"README names {path}, which does not exist"
    assert len(README.splitlines()) <= 250  # the front page; the manual is the site


def test_cli_info():
    r = subprocess.run(
        [sys.executable, "-m", "numbaccum", "info"], capture_output=True, text=True, check=True
    )
    assert "numbaccum" in r.stdout and "threads" in r.stdout
    where = _cache.directory()  # the session's, set by conftest (None: turned off)
    assert f"kernel cache: {where} (on;" in r.stdout if where else "kernel cache: off" in r.stdout


def test_cli_bench_tiny_smoke(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "numbaccum",
            "bench",
            "--workload",
            "tiny",
            "--repeats",
            "4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "MultiSteps mini-step" in r.stdout and out.exists()
    assert f"raw numbers: {out}" in r.stderr  # where it wrote them


def test_cli_version_is_the_packages_one_source():
    """``numbaccum --version`` prints ``numbaccum.__version__``, which is also the version the
    package is built with (pyproject's ``dynamic``), so the two cannot drift apart."""
    import numbaccum

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    r = subprocess.run(
        [sys.executable, "-m", "numbaccum", "--version"], capture_output=True, text=True, check=True
    )
    assert r.stdout.strip() == f"numbaccum {numbaccum.__version__}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "numbaccum.__version__"}
    assert (ROOT / "numbaccum" / "py.typed").exists()
    assert project["tool"]["setuptools"]["package-data"]["numbaccum"] == ["py.typed"]


@pytest.mark.parametrize("args", [["--help"], ["info", "--help"], ["bench", "--help"]])
def test_cli_help_names_only_files_that_exist(args):
    """A help text that points to a document points to one the repository has."""
    r = subprocess.run([sys.executable, "-m", "numbaccum", *args], capture_output=True, text=True, check=True)
    named = set(re.findall(r"\b([\w./-]+\.md)\b", r.stdout))
    assert all((ROOT / n).exists() for n in named), named
