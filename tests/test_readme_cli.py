"""The README's code runs as written, its test command is CI's, and the CLI answers."""

import re
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
