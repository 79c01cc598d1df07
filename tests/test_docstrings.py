"""Every Example in a public name's docstring runs, and shows what it prints (issue 24, item 2:
the start of the docstring test; the documentation site will render these)."""

from __future__ import annotations

import doctest
import inspect

import pytest

import numbaccum as nba


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
    tests = doctest.DocTestFinder(recurse=False).find(EXAMPLES[name], name, globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result}"
