"""Every public name is documented as optax documents its own, and every Example runs.

A public function's docstring has a summary line, ``Args:`` naming each parameter of its
signature, ``Returns:``, ``References:`` and ``Examples:`` (a doctest, run here and showing what
it prints); a NamedTuple (a state) lists its fields under ``Attributes:``; another public class
has ``Args:`` or ``Attributes:`` and ``Examples:``; ``numbaccum.distributed``'s names too. The
documentation site renders these (docs/reference/api/, tests/test_site.py), and ``help()`` of a
public class shows its public methods only."""

from __future__ import annotations

import doctest
import inspect
import pydoc
import re
from pathlib import Path

import pytest

import numbaccum as nba
from numbaccum import distributed
from numbaccum.base import PROTOCOL

from _testutil import require_for


def _public_with_examples() -> dict[str, object]:
    out = {}
    for name in sorted(nba.__all__):
        obj = getattr(nba, name)
        doc = inspect.getdoc(obj) or ""
        if ">>>" in doc:
            out[name] = obj
    return out


EXAMPLES = _public_with_examples()


def test_the_names_issue_24_named_have_examples():
    assert {"adam", "adamw", "sgd", "chain", "apply_updates", "apply_updates_", "warmup"} <= set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_example_runs(name):
    require_for(inspect.getdoc(EXAMPLES[name]) or "")  # dp_epsilon's needs numbaccum[dp]
    tests = doctest.DocTestFinder(recurse=False).find(EXAMPLES[name], name, globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result}"


def _section(doc: str, name: str) -> str:
    """The body of section ``name`` of a Google-style docstring ("" if absent)."""
    m = re.search(rf"^{name}:\n((?:[ \t]+.*\n|\n)*)", doc + "\n", re.M)
    return m.group(1) if m else ""


def _parameters(obj: object) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj  # type: ignore[misc]
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in sig.parameters.values() if p.name != "self" and p.kind not in skip]


def _missing(obj: object) -> list[str]:
    doc = inspect.getdoc(obj) or ""
    missing = [] if doc.strip() and doc.splitlines()[0].strip() else ["a summary line"]
    if inspect.isclass(obj) and issubclass(obj, tuple) and hasattr(obj, "_fields"):
        attrs = _section(doc, "Attributes")
        return missing + [
            f"Attributes: {f}" for f in obj._fields if not re.search(rf"^\s+{f}\b", attrs, re.M)
        ]
    if inspect.isclass(obj):
        if not (_section(doc, "Args") or _section(doc, "Attributes")):
            missing.append("Args: or Attributes:")
        return missing + ([] if ">>>" in _section(doc, "Examples") else ["Examples: (a doctest)"])
    args = _section(doc, "Args")
    missing += [f"Args: {p}" for p in _parameters(obj) if not re.search(rf"^\s+\**{p}\b", args, re.M)]
    for part in ("Returns", "References"):
        if not _section(doc, part).strip():
            missing.append(f"{part}:")
    return missing + ([] if ">>>" in _section(doc, "Examples") else ["Examples: (a doctest)"])


# numbaccum's names and numbaccum.distributed's (importing it imports no mpi4py; their examples
# run in tests/test_distributed.py, on one rank)
PUBLIC = [("numbaccum", n) for n in sorted(nba.__all__)] + [
    ("numbaccum.distributed", n) for n in sorted(distributed.__all__)
]


@pytest.mark.parametrize("module,name", PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_every_public_name_is_documented_in_full(module, name):
    obj = getattr(nba if module == "numbaccum" else distributed, name)
    if inspect.ismodule(obj):
        pytest.skip("a module: its names are documented one by one")
    assert not _missing(obj), f"{module}.{name}'s docstring lacks: {_missing(obj)}"


def test_help_of_a_public_class_shows_its_public_methods_only():
    text = pydoc.render_doc(nba.MultiSteps, renderer=pydoc.plaintext)
    for name in ("init", "update", "has_updated", "gradient_transformation"):
        assert f"{name}(" in text
    for name in PROTOCOL:  # the runner's protocol of a stage
        assert not re.search(rf"\b{name}\(", text), f"help(MultiSteps) shows {name}"
    site = (Path(__file__).resolve().parent.parent / "mkdocs.yml").read_text()
    hidden = re.search(r'"!\^\((.*)\)\$"', site).group(1).split("|")  # the API reference's filter
    assert sorted(hidden) == sorted(PROTOCOL)
