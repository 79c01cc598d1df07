"""The documentation site (mkdocs.yml, docs/): every public name on exactly one API page, each page
opening with its table, every name in the guides and the transformations table linked to its
entry, no private name in a signature, math typeset by the site's own KaTeX, no request leaving
the site, the version in the header, the changelog, the performance page's picture, the gallery
(every script of examples/ run by the build, with its code, output and figures); and, where a
Chromium is installed, the pages opened in it (math and images rendered, the console clean).

The site is built once per process with ``mkdocs build --strict`` (the docs extra), as CI builds it."""

from __future__ import annotations

import collections
import fcntl
import html
import inspect
import os
import re
import shutil
import subprocess
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import numbaccum as nba
from numbaccum import distributed
from numbaccum.compat import declearn, torchzero

from _testutil import require

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API_PAGES = sorted((DOCS / "reference" / "api").glob("*.md"))
DIRECTIVE = re.compile(r"^::: (numbaccum(?:\.distributed|\.compat\.\w+)?)\.(\w+)\s*$", re.M)
PUBLIC = {f"numbaccum.{n}" for n in nba.__all__} | {f"numbaccum.distributed.{n}" for n in distributed.__all__}
# the compat faces' own names (torchzero's in-place functions are numbaccum's, documented there)
COMPAT = {
    f"{mod.__name__}.{n}"
    for mod in (torchzero, declearn)
    for n in mod.__all__
    if getattr(nba, n, None) is not getattr(mod, n)
}
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))  # the gallery's scripts, a page each
GALLERY_PAGES = ["gallery"] + [f"gallery/{p.stem}" for p in EXAMPLES]
# the pages whose code spans name public names: the guides, concepts, migrating, the front page,
# the gallery (its pages' prose is their scripts' docstrings)
GUIDE_PAGES = (
    ["index", "concepts", "migrating"]
    + [f"guides/{p.stem}" for p in (DOCS / "guides").glob("*.md")]
    + GALLERY_PAGES
)


def _entries() -> dict[Path, list[str]]:
    return {page: [f"{m}.{n}" for m, n in DIRECTIVE.findall(page.read_text())] for page in API_PAGES}


def test_every_public_name_is_on_exactly_one_api_page():
    """A new public name without a page, a name on two pages, or an entry of a name that is no
    longer public fails here (the API pages list their entries one ``::: numbaccum.X`` a line);
    the compat page holds the compat faces' names, each once too."""
    found = collections.Counter(e for entries in _entries().values() for e in entries)
    assert len(API_PAGES) == 10, API_PAGES  # optax's categories (docs/reference/api.md)
    assert sorted(e for e, n in found.items() if n > 1) == []  # none twice
    assert sorted((PUBLIC | COMPAT) - set(found)) == []  # none lost
    assert sorted(set(found) - PUBLIC - COMPAT) == []  # none that is not public
    compat = _entries()[DOCS / "reference" / "api" / "compat.md"]
    assert set(compat) == COMPAT


def test_a_state_follows_the_transformation_it_belongs_to():
    """A state NamedTuple whose summary names its transformation (``State of `apply_if_finite```)
    is on that transformation's page, after it: not in a block of classes before `adam`."""
    for page, entries in _entries().items():
        for i, entry in enumerate(entries):
            module, name = entry.rsplit(".", 1)
            obj = getattr(sys.modules[module], name)
            if not (inspect.isclass(obj) and issubclass(obj, tuple)):
                continue
            first = (inspect.getdoc(obj) or "").split("\n\n")[0]
            owner = next((n for n in re.findall(r"`(\w+)`", first) if callable(getattr(nba, n, None))), None)
            if owner and not inspect.isclass(getattr(nba, owner)):
                assert f"numbaccum.{owner}" in entries[:i], (
                    f"{entry} ({page.name}) comes before or without {owner}"
                )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built as CI builds it (``--strict``: a broken link or reference fails), once per
    test session: pytest-xdist's workers share the parent of their temporary directories, and the
    first to get there builds the site under a lock while the others wait and read it (the build
    runs every example of the gallery: tens of seconds)."""
    require("mkdocs")
    require("mkdocstrings")
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out, done = shared / "site", shared / "site.built"
    with open(shared / "site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():  # a failed build leaves no mark: the next worker fails it again
            env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
            r = subprocess.run(
                [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
            )
            assert r.returncode == 0, r.stderr[-4000:]
            done.touch()
    return out


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html" if name != "index" else site / "index.html").read_text()


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def test_no_request_leaves_the_site(site):
    """Scripts, styles, fonts and images come from the site itself: no Google fonts
    (``theme.font: false``), no CDN for the math."""
    external = re.compile(r"^(https?:)?//", re.I)
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 15
    for page in pages:
        text = page.read_text()
        for tag, attr in (
            ("script", "src"),
            ("link", "href"),
            ("img", "src"),
            ("iframe", "src"),
            ("source", "src"),
        ):
            for m in re.finditer(rf"<{tag}\b[^>]*\b{attr}=[\"']([^\"']+)", text):
                if tag == "link" and re.search(r'rel="?(canonical|alternate)', m.group(0)):
                    continue  # not fetched
                assert not external.match(m.group(1)), f"{page.relative_to(site)} loads {m.group(1)}"
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, page
    for css in site.rglob("*.css"):
        for url in re.findall(r"(?:url\(|@import\s+)[\"']?([^\"')\s]+)", css.read_text()):
            assert not external.match(url), f"{css.relative_to(site)} loads {url}"


def test_math_is_typeset_by_the_site_s_own_katex(site):
    """The transformations table's formulas are math (arithmatex marks them, KaTeX typesets them
    in the browser), and the KaTeX script, stylesheet and fonts are the site's own files."""
    table = _page(site, "reference/transformations")
    assert len(re.findall(r'class="arithmatex"', table)) >= 150
    assert "$" not in _text(table.split("<table>", 1)[1].split("</table>", 1)[0]), "a $ left untypeset"
    for asset in (
        "assets/katex/katex.min.js",
        "assets/katex/katex.min.css",
        "assets/javascripts/katex-init.js",
    ):
        assert f'{asset}"' in table and (site / asset).stat().st_size > 0, asset
    fonts = re.findall(r"url\((fonts/[^)]+\.woff2)\)", (site / "assets/katex/katex.min.css").read_text())
    assert len(fonts) >= 19 and all((site / "assets/katex" / f).exists() for f in fonts)
    optimizers = _page(site, "reference/api/optimizers")  # the update column of the summary table
    assert len(re.findall(r'class="arithmatex"', optimizers.split("</table>", 1)[0])) >= 40
    # and each optimizer's entry, under its signature
    updates = re.findall(r'<p class="numbaccum-update">(.*?)</p>', optimizers, re.S)
    assert len(updates) >= 30 and all('class="arithmatex"' in u for u in updates)


def test_no_private_name_in_a_rendered_signature(site):
    """A default such as ``_HUTCHINSON`` or ``_decay_rate_pow`` names nothing a reader can find."""
    signatures = [  # in its own block, or in the entry's heading (without separate_signature)
        _text(s)
        for page in sorted((site / "reference").rglob("index.html"))
        for s in re.findall(
            r'<div class="doc-signature[^"]*">(.*?)</div>|<h\d id="numbaccum[\w.]*"[^>]*>(.*?)</h\d>',
            page.read_text(),
            re.S,
        )
        for s in s
        if "(" in _text(s)
    ]
    assert len(signatures) > 150
    private = [s for s in signatures if re.search(r"(?<![\w.])_[A-Za-z]\w*", s)]
    assert private == []


def test_each_api_page_opens_with_a_table_of_its_names(site):
    for page, entries in _entries().items():
        text = _page(site, f"reference/api/{page.stem}")
        table, rest = text.split('<div class="doc doc-object', 1)[0], text
        assert "<table>" in table, f"{page.name}: no summary table before its first entry"
        rows = re.findall(r"<tr>(.*?)</tr>", table.split("<table>", 1)[1].split("</table>", 1)[0], re.S)[1:]
        linked = [re.search(r'href="#([\w.]+)"', row).group(1) for row in rows]
        assert linked == entries, page.name
        for entry in entries:  # each anchor exists: the entry is rendered
            assert f'id="{entry}"' in rest, entry


def _unlinked_names(fragment: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(the code spans naming a public name that no link holds, the (name, href) of those that
    are linked) in an HTML fragment; code blocks and headings are not prose."""
    fragment = re.sub(r"<(pre|h[1-6])\b.*?</\1>", "", fragment, flags=re.S)
    linked = [
        (m.start(), m.end(), m.group(1))
        for m in re.finditer(r'<a [^>]*href="([^"]*)"[^>]*>.*?</a>', fragment, re.S)
    ]
    unlinked, links = [], []
    for m in re.finditer(r"<code>(.*?)</code>", fragment, re.S):
        span = re.match(
            r"(nba\.|numbaccum\.|distributed\.|numbaccum\.distributed\.)?([A-Za-z]\w*)(?:[(.].*)?$",
            _text(m.group(1)),
            re.S,
        )
        if not span:
            continue
        prefix, name = span.groups()
        dist = prefix in ("distributed.", "numbaccum.distributed.") or (
            not prefix and name not in nba.__all__ and name in distributed.__all__
        )
        if (name not in distributed.__all__) if dist else (name not in nba.__all__):
            continue
        holder = next((href for a, b, href in linked if a <= m.start() < b), None)
        entry = f"numbaccum.{'distributed.' if dist else ''}{name}"
        if holder is None:
            unlinked.append(entry)
        else:
            links.append((entry, holder))
    return unlinked, links


def test_every_name_in_the_guides_links_to_its_entry(site):
    """`nba.adam`, `MultiSteps(...)`, `distributed.shard` in a guide's prose or tables lead to
    their API entries (docs/hooks/site.py links them; a name written as a link keeps its own)."""
    count = 0
    for name in GUIDE_PAGES:
        unlinked, links = _unlinked_names(_page(site, name).split("<article", 1)[1])
        assert unlinked == [], f"{name}: {sorted(set(unlinked))}"
        wrong = [(e, h) for e, h in links if "/reference/api/" in h and not h.endswith(f"#{e}")]
        assert wrong == [], name
        count += len(links)
    assert count > 300


def test_every_row_of_the_transformations_table_links_to_its_entry(site):
    text = _page(site, "reference/transformations")
    rows = re.findall(r"<tr>(.*?)</tr>", text.split("<tbody>", 1)[1].split("</tbody>", 1)[0], re.S)
    assert len(rows) >= 100
    for row in rows:
        first = re.search(r"<td[^>]*>(.*?)</td>", row, re.S).group(1)
        unlinked, links = _unlinked_names(first)
        assert links and not unlinked, _text(first)
        assert all(href.endswith(f"#{entry}") for entry, href in links), _text(first)


def test_the_header_shows_the_version(site):
    header = re.search(r'<div class="md-header__topic">(.*?)</div>', _page(site, "index"), re.S).group(1)
    assert _text(header).split() == ["numbaccum", nba.__version__]


def test_the_changelog_page_is_changelog_md(site):
    """One source: docs/changelog.md includes CHANGELOG.md; every heading of it is on the page."""
    assert "CHANGELOG.md" in (DOCS / "changelog.md").read_text()
    page = _text(_page(site, "changelog"))
    for heading in re.findall(r"^#+ (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M):
        assert _text(re.sub(r"`([^`]*)`", r"\1", heading)) in page, heading


def test_the_performance_page_has_headings_and_the_bench_picture(site):
    text = _page(site, "performance")
    article = text.split("<article", 1)[1]
    assert len(re.findall(r"<h2\b", article)) >= 5
    images = re.findall(r'<img [^>]*src="([^"]+)"', article)
    assert images, "no picture"
    for src in images:
        assert (site / "performance" / src).resolve().stat().st_size > 10_000, src
    source = (DOCS / "performance.md").read_text()
    assert re.search(r"`numbaccum bench [^`]*--plot\s[^`]+\.png[^`]*`", source)  # how it was drawn
    assert re.search(r"20\d\d-\d\d-\d\d", source.split("![", 1)[0][-800:])  # and when


def _gallery_hook():
    """docs/hooks/gallery.py, imported as mkdocs imports it."""
    require("mkdocs")
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        import gallery
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    return gallery


def test_the_gallery_shows_every_example_with_its_code_output_and_figures(site):
    """Each script of examples/ has a page in the Gallery section, in the index's table: its
    docstring, what it printed (or why it was not run), each figure it drew as a PNG of the site,
    and its code, which the page offers for download byte for byte."""
    gallery = _gallery_hook()
    index = _page(site, "gallery").split("<article", 1)[1]
    assert len(EXAMPLES) >= 7
    for script in EXAMPLES:
        assert f'href="{script.stem}/"' in index, script.name  # the index's table links it
        text = _page(site, f"gallery/{script.stem}")
        article = text.split("<article", 1)[1].split("</article>", 1)[0]
        title, prose, code = gallery.split_docstring(script.read_text())
        assert _text(re.search(r"<h1\b.*?</h1>", article, re.S).group(0)).strip("¶ ") == title
        blocks = [_text(b) for b in re.findall(r"<pre\b.*?</pre>", article, re.S)]
        assert code.strip() in [b.strip() for b in blocks], f"{script.name}: its code is not on its page"
        served = site / "gallery" / script.name  # the download link's target: the script itself
        assert f'href="../{script.name}"' in article and served.read_bytes() == script.read_bytes()
        images = re.findall(r'<img [^>]*src="([^"]+)"', article)
        if script.stem in gallery.NOT_RUN:
            assert "Not run here" in article and "Output" not in _text(article), script.name
            assert images == []
            continue
        output = blocks[[i for i, b in enumerate(blocks) if b.strip() != code.strip()][0]]
        assert output.strip() and "Traceback" not in output, script.name
        assert len(images) == _FIGURES.get(f"gallery/{script.stem}", 0), (script.name, images)
        for src in images:
            png = (site / "gallery" / script.stem / src).resolve()
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, src


def test_a_failing_or_warning_example_fails_the_build(tmp_path, monkeypatch, caplog):
    """A script that raises stops the build with its traceback (no page shows one); a Python
    warning it prints is a build warning, which ``--strict`` makes an error."""
    gallery = _gallery_hook()
    from mkdocs.exceptions import PluginError

    broken = tmp_path / "broken.py"
    broken.write_text('"""Broken."""\n\nprint("half")\nraise ValueError("the example is broken")\n')
    with pytest.raises(
        PluginError, match=r"(?s)examples/broken.py failed.*ValueError: the example is broken"
    ):
        gallery.run(broken)
    warns = tmp_path / "warns.py"
    warns.write_text(
        '"""Warns."""\n\nimport warnings\n\nwarnings.warn("careful", UserWarning)\nprint("done")\n'
    )
    with caplog.at_level("WARNING", logger="mkdocs.hooks.gallery"):
        output, figures, _ = gallery.run(warns)
    assert output == "done\n" and figures == []
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "UserWarning: careful" in caplog.text
    # the nav must list every script: one missing stops the build before anything runs
    monkeypatch.setattr(gallery, "EXAMPLES", tmp_path)

    class Config:
        nav = [{"Gallery": ["gallery/index.md", {"Warns": "gallery/warns.md"}]}]

    with pytest.raises(PluginError, match=r"examples/broken.py not in mkdocs.yml's Gallery nav"):
        gallery.on_files([], Config())


# --- in a real browser --------------------------------------------------------------------------

# what a page must show once its scripts ran: each formula typeset, each image drawn, fonts loaded
_CHECK = """() => ({
  math: document.querySelectorAll('.arithmatex').length,
  typeset: document.querySelectorAll('.arithmatex .katex').length,
  errors: document.querySelectorAll('.katex-error').length,
  images: Array.from(document.images).map(i => [i.src, i.complete && i.naturalWidth > 0]),
  katexFont: document.fonts.check('16px KaTeX_Main'),
})"""
_TYPESET = """() => document.querySelectorAll('.arithmatex .katex').length
  === document.querySelectorAll('.arithmatex').length"""
# the gallery's pages that show a figure: those whose script draws one
_FIGURES = {f"gallery/{p.stem}": 1 for p in EXAMPLES if "plt.show()" in p.read_text()}
_BROWSER_PAGES = [
    "index",
    "reference/transformations",
    "reference/api/optimizers",
    "performance",
    "changelog",
    *GALLERY_PAGES,
]


def _chromium() -> str:
    """A Chromium to drive: ``NUMBACCUM_TEST_CHROMIUM``, the system's, or skip (naming how to get
    one; tests/conftest.py records the skip for CI's extras pass, where it fails instead)."""
    for candidate in (
        os.environ.get("NUMBACCUM_TEST_CHROMIUM"),
        "chromium",
        "chromium-browser",
        "google-chrome",
    ):
        found = candidate and shutil.which(candidate)
        if found:
            return found
    if os.environ.get("NUMBACCUM_CI"):
        pytest.fail("no Chromium for the site's browser test (.ci/run installs Debian's chromium)")
    pytest.skip("optional dependency chromium is not installed (Debian: apt-get install chromium)")


@pytest.fixture
def served(site):
    """The site over HTTP on the loopback (file:// would refuse the search worker)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_the_pages_render_in_a_headless_browser(served):
    """Each page loads with a clean console, no request leaving the site and none failing; its
    math typeset by KaTeX (with KaTeX's fonts) and its images drawn."""
    playwright = require("playwright.sync_api")
    executable = _chromium()
    problems = []
    with playwright.sync_playwright() as p:
        # the flags that keep Chromium from calling home on a machine without a network
        browser = p.chromium.launch(
            executable_path=executable,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
            ],
        )
        try:
            page = browser.new_page()
            page.on(
                "console",
                lambda m: m.type in ("error", "warning") and problems.append(f"console {m.type}: {m.text}"),
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))
            page.on("response", lambda r: r.status >= 400 and problems.append(f"{r.status}: {r.url}"))

            def route(r):
                if r.request.url.startswith(served):
                    return r.continue_()
                problems.append(f"left the site: {r.request.url}")
                return r.abort()

            page.route("**/*", route)
            for name in _BROWSER_PAGES:
                page.goto(served + ("" if name == "index" else name + "/"), wait_until="networkidle")
                if name in ("reference/transformations", "reference/api/optimizers"):
                    # KaTeX typesets once Material's page observable fires (later on a busy machine)
                    page.wait_for_function(_TYPESET, timeout=30_000)
                seen = page.evaluate(_CHECK)
                if name in ("reference/transformations", "reference/api/optimizers"):
                    assert seen["math"] > 40 and seen["typeset"] == seen["math"] and seen["errors"] == 0, (
                        name,
                        seen,
                    )
                    assert seen["katexFont"], f"{name}: KaTeX's fonts did not load"
                if name == "performance" or name in _FIGURES:
                    assert len(seen["images"]) >= _FIGURES.get(name, 1), (name, seen["images"])
                assert all(ok for _, ok in seen["images"]), (name, seen["images"])
        finally:
            browser.close()
    assert problems == []
