"""The gallery (mkdocs.yml ``hooks:``): each script of examples/ run when the site is built, and
shown on a page of its own with its code, what it printed and the figures it drew.

One source: a page is made from its script alone. The title is the first line of the script's
docstring, the text the rest of it (Markdown), the code the script without its docstring. Each
script runs in a process of its own, as ``python examples/NAME.py`` would, with matplotlib's Agg
backend; every figure still open at its end is saved as a PNG next to its page. A script that
fails (a non-zero exit), or prints a Python warning, fails the build (``--strict`` for the
warning): no page shows a traceback. The scripts in `NOT_RUN` are shown with the reason instead of
an output. Every script of examples/ must be in the nav's Gallery section, and each page there
must have its script (strict mkdocs reports a nav entry without a page).
"""

from __future__ import annotations

import ast
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GALLERY = "gallery/"  # the pages' folder in the site
INDEX = GALLERY + "index.md"
TABLE_MARKER = "<!-- gallery table -->"  # where the index page gets its table of the examples
# the scripts shown but not run at build time, and where they run instead
NOT_RUN = {
    "data_parallel": (
        "This one runs on MPI ranks (`mpiexec`), so it is not run when the site is built: CI runs "
        "it on 2 ranks in its MPI pass (`tests/mpi/test_mpi_examples.py`), and on 2 ranks again as the "
        "command above (`tests/test_distributed.py`)."
    ),
}
# each script's run: at most this many seconds (a hung example fails the build, it does not hang it)
TIMEOUT_S = 300
# the lines of a Python warning on stderr: ``path:line: SomeWarning: message``
WARNING_LINE = re.compile(r"^\S.*:\d+: \w*Warning: .*$", re.M)
log = logging.getLogger("mkdocs.hooks.gallery")

# Runs one script as __main__ (argv: script, folder for the figures): its own process, so that
# the examples share no state and a crash is the example's exit status.
RUNNER = """
import runpy, sys
script, figures = sys.argv[1], sys.argv[2]
sys.argv = [script]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))  # as `python script` has it
runpy.run_path(script, run_name="__main__")
sys.stdout.flush()
if "matplotlib.pyplot" in sys.modules:
    plt = sys.modules["matplotlib.pyplot"]
    for i, number in enumerate(plt.get_fignums()):
        plt.figure(number).savefig(f"{figures}/{i}.png", dpi=100)
"""


def examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*.py"))


def split_docstring(source: str) -> tuple[str, str, str]:
    """(the docstring's first line, the rest of it, the code after it) of a script."""
    module = ast.parse(source)
    doc = ast.get_docstring(module, clean=True)
    if not doc or not isinstance(module.body[0], ast.Expr):
        raise PluginError("a gallery script opens with a docstring: its title and what it shows")
    title, _, text = doc.partition("\n")
    code = "\n".join(source.splitlines()[module.body[0].end_lineno :]).strip("\n")
    return title.strip().rstrip("."), text.strip("\n"), code  # the text's indented blocks are code


def run(script: Path) -> tuple[str, list[bytes], float]:
    """(what ``script`` printed, its figures as PNG bytes, its wall time in seconds)."""
    env = {
        **os.environ,
        "MPLBACKEND": "Agg",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    with tempfile.TemporaryDirectory() as figures:
        started = time.perf_counter()
        try:
            r = subprocess.run(
                [sys.executable, "-c", RUNNER, str(script), figures],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as e:
            raise PluginError(f"gallery: examples/{script.name} ran past {TIMEOUT_S} s") from e
        took = time.perf_counter() - started
        if r.returncode != 0:
            raise PluginError(
                f"gallery: examples/{script.name} failed (exit status {r.returncode}):\n{r.stderr[-4000:]}"
            )
        for warning in WARNING_LINE.findall(r.stderr):
            log.warning(f"gallery: examples/{script.name} warned: {warning}")
        pngs = [p.read_bytes() for p in sorted(Path(figures).glob("*.png"), key=lambda p: int(p.stem))]
    return r.stdout, pngs, took


def page(script: Path, output: str | None, figures: int) -> str:
    """A script's page: its docstring, what it printed and drew (or why it did not run here), and
    its code."""
    title, text, code = split_docstring(script.read_text())
    parts = [f"# {title}", text]
    if output is None:
        parts.append(f'!!! note "Not run here"\n    {NOT_RUN[script.stem]}')
    else:
        parts.append(f"## Output\n\nWhat `python examples/{script.name}` printed when this site was built:")
        parts.append(f"```text\n{output.rstrip()}\n```" if output.strip() else "(nothing)")
        parts += [
            f"![Figure {i + 1} of examples/{script.name}]({script.stem}-{i + 1}.png)" for i in range(figures)
        ]
    parts.append(
        f"## The script\n\n`examples/{script.name}` ([download]({script.name})), after its docstring:"
    )
    parts.append(f"```python\n{code}\n```")
    return "\n\n".join(parts) + "\n"


def table(nav) -> str:
    """The examples in the nav's order: each linked to its page, with its title."""
    rows = ["| example | what it shows |", "| --- | --- |"]
    pages = [p.removeprefix(GALLERY).removesuffix(".md") for p in _nav_pages(nav)]
    for script in sorted(examples(), key=lambda s: pages.index(s.stem)):
        title = split_docstring(script.read_text())[0]
        rows.append(f"| [`{script.name}`]({script.stem}.md) | {title} |")
    return "\n".join(rows)


def _nav_pages(nav) -> list[str]:
    """The pages of the nav's Gallery section (mkdocs.yml)."""
    for item in nav or []:
        if isinstance(item, dict) and "Gallery" in item:
            return [next(iter(e.values())) if isinstance(e, dict) else e for e in item["Gallery"]]
    return []


def on_files(files, config, **kwargs):
    scripts = examples()
    listed = set(_nav_pages(config.nav))
    missing = [s.name for s in scripts if f"{GALLERY}{s.stem}.md" not in listed]
    if missing:
        raise PluginError(f"gallery: examples/{', examples/'.join(missing)} not in mkdocs.yml's Gallery nav")
    to_run = [s for s in scripts if s.stem not in NOT_RUN]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        results = dict(zip(to_run, pool.map(run, to_run)))
    times = ", ".join(f"{s.stem} {results[s][2]:.1f} s" for s in to_run)
    log.info(f"gallery: ran {len(to_run)} examples in {time.perf_counter() - started:.1f} s ({times})")
    for script in scripts:
        output, pngs, _ = results.get(script, (None, [], 0.0))
        files.append(
            File.generated(config, f"{GALLERY}{script.stem}.md", content=page(script, output, len(pngs)))
        )
        files.append(File.generated(config, f"{GALLERY}{script.name}", content=script.read_bytes()))
        for i, png in enumerate(pngs):
            files.append(File.generated(config, f"{GALLERY}{script.stem}-{i + 1}.png", content=png))
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    if page.file.src_uri != INDEX:
        return markdown
    if TABLE_MARKER not in markdown:
        raise PluginError(f"gallery: docs/{INDEX} has no {TABLE_MARKER!r} line for the examples' table")
    return markdown.replace(TABLE_MARKER, table(config.nav))
