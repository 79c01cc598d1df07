"""The site's hooks (mkdocs.yml ``hooks:``): the version in the header, a summary table atop each
API page, and a link from every public name in a code span of the other pages to its entry.

Each is computed from the one place its facts live: the version from ``numbaccum.__version__``,
a summary from the first paragraph of the name's docstring, a formula from its row of the
transformations table (docs/reference/transformations.md), an entry from the ``::: numbaccum.X``
line of the API page that documents it (tests/test_site.py checks there is exactly one)."""

from __future__ import annotations

import inspect
import re
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
API_DIR = "reference/api/"
TABLE = ROOT / "docs" / "reference" / "transformations.md"
# ``::: numbaccum.adam`` or ``::: numbaccum.distributed.shard``: one entry of an API page
DIRECTIVE = re.compile(r"^::: (numbaccum(?:\.distributed|\.compat\.\w+)?)\.(\w+)\s*$", re.M)
MODULES = ("numbaccum", "numbaccum.distributed", "numbaccum.compat.torchzero", "numbaccum.compat.declearn")
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
CODE = re.compile(r"(?<!`)`[^`]+`(?!`)")
# a code span naming a public name: `adam`, `nba.adam(1e-3)`, `distributed.shard(tx)`, `MultiSteps.update`
CODE_NAME = re.compile(
    r"(?<!`)`(nba\.|numbaccum\.|distributed\.|numbaccum\.distributed\.)?([A-Za-z]\w*)([(.][^`]*)?`(?!`)"
)


def _import(module: str):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the checkout's package, as mkdocstrings' paths: ["."]
    return __import__(module, fromlist=["_"])


@cache
def public_names() -> dict[str, dict[str, object]]:
    """``{"numbaccum": {name: object}, "numbaccum.distributed": {...}, ...}`` (`MODULES`)."""
    out = {}
    for module in MODULES:
        mod = _import(module)
        out[module] = {name: getattr(mod, name) for name in mod.__all__}
    return out


def version() -> str:
    text = (ROOT / "numbaccum" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def summary(obj: object) -> str:
    """The first paragraph of ``obj``'s docstring, on one line, for a table cell."""
    doc = inspect.getdoc(obj) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.rstrip(":").replace("|", "\\|") + ("." if first.endswith(":") else "")


@cache
def formulas() -> dict[str, str]:
    """Each name's update formula, from its row of the transformations table (its third cell;
    a row naming several names gives each the row's formula)."""
    out = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if not line.startswith("| `") or len(cells) != 3:
            continue
        # the table's relative links lead from docs/reference/, an API page's from one below
        formula = re.sub(r"\]\((?![#/]|\w+://)", "](../", cells[2])
        for name in re.findall(r"`(?:nba\.)?([A-Za-z]\w*)", cells[0]):
            out.setdefault(name, formula)
    return out


def summary_table(markdown: str) -> str:
    """The table of an API page's entries: each name linked to its entry, its summary and,
    where the transformations table gives one, its update formula."""
    entries = DIRECTIVE.findall(markdown)
    with_formula = [(m, n) for m, n in entries if m == "numbaccum" and n in formulas()]
    head = ["| name | summary |" + (" update |" if with_formula else ""), "| --- | --- |"]
    head[1] += " --- |" if with_formula else ""
    rows = []
    for module, name in entries:
        row = f"| [`{name}`][{module}.{name}] | {summary(public_names()[module][name])} |"
        if with_formula:
            row += f" {formulas().get(name, '') if module == 'numbaccum' else ''} |"
        rows.append(row)
    return "\n".join(head + rows)


def with_summary_table(markdown: str) -> str:
    """The page with its summary table before its first section (or entry)."""
    first = re.search(r"^(## |::: )", markdown, re.M)
    at = first.start() if first else len(markdown)
    return markdown[:at] + summary_table(markdown) + "\n\n" + markdown[at:]


def _target(prefix: str | None, name: str) -> str | None:
    """The entry a code span names, or None (not a public name)."""
    names = public_names()
    if prefix in ("distributed.", "numbaccum.distributed."):
        return f"numbaccum.distributed.{name}" if name in names["numbaccum.distributed"] else None
    if name in names["numbaccum"]:
        return f"numbaccum.{name}"
    if prefix is None and name in names["numbaccum.distributed"]:
        return f"numbaccum.distributed.{name}"  # the MPI guide's `allreduce_mean`
    return None


def _in_link_or_heading(masked: str, start: int, end: int) -> bool:
    """Whether the code span at ``masked[start:end]`` is in a heading or in a link's text
    (``masked``: the text with every code span's content blanked, so that brackets inside code
    are not taken for a link's)."""
    if masked[masked.rfind("\n", 0, start) + 1 :].startswith("#"):
        return True
    before = masked[max(0, start - 400) : start]
    if before.rfind("[") <= before.rfind("]"):
        return False  # no bracket open before it
    return re.match(r"[^\[\]]*\][(\[]", masked[end : end + 400]) is not None


def _link_spans(text: str) -> str:
    masked = CODE.sub(lambda m: "`" + "x" * (len(m.group(0)) - 2) + "`", text)
    out, at = [], 0
    for m in CODE_NAME.finditer(text):
        target = _target(m.group(1), m.group(2))
        if target and not _in_link_or_heading(masked, m.start(), m.end()):
            out += [text[at : m.start()], f"[{m.group(0)}][{target}]"]
            at = m.end()
    return "".join(out + [text[at:]])


def with_links(markdown: str) -> str:
    """Every public name in a code span of prose or a table linked to its entry; code blocks,
    headings and links already written are left as they are."""
    out, at = [], 0
    for m in FENCE.finditer(markdown):
        out += [_link_spans(markdown[at : m.start()]), m.group(0)]
        at = m.end()
    return "".join(out + [_link_spans(markdown[at:])])


def _inline_html(cell: str) -> str:
    """A formula cell as HTML (its math marked for KaTeX as the page's is; its links as text)."""
    import markdown

    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell)
    md = markdown.Markdown(
        extensions=["pymdownx.arithmatex"], extension_configs={"pymdownx.arithmatex": {"generic": True}}
    )
    return re.sub(r"^<p>|</p>$", "", md.convert(text))


# an entry's heading and its signature, after which its update formula goes
ENTRY = re.compile(
    r'(<h3 id="numbaccum\.(\w+)".*?</h3>\s*<div class="doc-signature highlight">.*?</div>)', re.S
)


def with_formulas(html: str) -> str:
    """Each top-level entry with a row in the transformations table shows its formula under its
    signature (the docstrings write formulas in ASCII, for ``help()``)."""

    def insert(m: re.Match) -> str:
        cell = formulas().get(m.group(2))
        if cell is None:
            return m.group(1)
        return m.group(1) + f'\n<p class="numbaccum-update"><em>Update:</em> {_inline_html(cell)}</p>'

    return ENTRY.sub(insert, html)


def on_config(config, **kwargs):
    config.site_name = f"{config.site_name} {version()}"  # the header shows the version
    return config


def on_page_markdown(markdown, page, config, files, **kwargs):
    if page.file.src_uri.startswith(API_DIR) and DIRECTIVE.search(markdown):
        return with_summary_table(with_links(markdown))
    return with_links(markdown)


def on_page_content(html, page, config, files, **kwargs):
    return with_formulas(html) if page.file.src_uri.startswith(API_DIR) else html
