"""The package's layers, checked from its sources: what may import what.

Every module of ``numbaccum`` is parsed with `ast` (nothing is imported), every ``import`` and
``from ... import`` is resolved to the module it loads, and the rules below are checked on that
graph. Imports inside functions count like module-level ones (they run too; a lazy import hides a
cycle, it does not remove it); only ``if TYPE_CHECKING:`` blocks are skipped. The layers, bottom
up:

    tree -> layout -> arrays -> flat -> (contract, backend) -> transformations -> __init__
                                           backend -> cpu/, cuda/ (loaded lazily)

And ``compat/`` is written as a user would write it: only public names of numbaccum (rule e).

Each rule is checked per importing module, so a new offender fails even while a known one is
marked as expected to fail.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "numbaccum"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
BACKENDS = ("numbaccum.cpu", "numbaccum.cuda")
# Frameworks whose arrays we interoperate with: only the interop module (and the CUDA backend,
# the CLI and the benchmarks) may import them, and never while ``import numbaccum`` runs.
FRAMEWORKS = ("numba.cuda", "torch", "cupy", "jax")


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module (a module of the package, or an external dotted name)
    line: int
    lazy: bool  # inside a function


def _within(name: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def _sources() -> dict[str, tuple[Path, bool]]:
    return {name: (p, pkg) for p in sorted(ROOT.rglob("*.py")) for name, pkg in [_module_name(p)]}


SOURCES = _sources()
MODULES = sorted(SOURCES)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, lazy: bool = False):
    """(import node, lazy) for every import under ``node``, skipping ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, lazy
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from _imports(ast.Module(body=child.orelse, type_ignores=[]), lazy)
        else:
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _imports(child, inner)


def _edges(mod: str) -> list[Edge]:
    path, is_pkg = SOURCES[mod]
    tree = ast.parse(path.read_text(), str(path))
    here = mod if is_pkg else mod.rpartition(".")[0]
    out = []
    for node, lazy in _imports(tree):
        if isinstance(node, ast.Import):
            out += [Edge(mod, a.name, node.lineno, lazy) for a in node.names]
            continue
        if node.level:
            base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for a in node.names:
            sub = f"{target}.{a.name}"
            # ``from pkg import mod`` loads the submodule; ``from mod import name`` the module. Outside
            # the package we cannot tell, so the longer name is kept (``from numba import cuda`` is
            # numba.cuda; ``from numpy import float32`` is still within numpy).
            inside = _within(target, PACKAGE)
            out.append(Edge(mod, sub if sub in SOURCES or not inside else target, node.lineno, lazy))
    return out


EDGES = {m: _edges(m) for m in MODULES}


def _show(edges: list[Edge]) -> str:
    return "; ".join(
        dict.fromkeys(
            f"{e.src}:{e.line} imports {e.dst}{' (in a function)' if e.lazy else ''}" for e in edges
        )
    )


# Known offenders: (rule, module) -> why. Each would be an expected failure (not strict), so the
# rule keeps failing for any other module. None today.
PENDING: dict[tuple[str, str], str] = {}


def _params(rule: str, modules: list[str]):
    return [
        pytest.param(m, marks=pytest.mark.xfail(reason=PENDING[(rule, m)], strict=False))
        if (rule, m) in PENDING
        else m
        for m in modules
    ]


# --- (a) no import cycles --------------------------------------------------------------------


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), plus self-imports."""
    graph = {m: sorted({e.dst for e in EDGES[m] if e.dst in SOURCES and e.dst != m}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for m in MODULES:
        if m not in index:
            visit(m)
    return found


def _cycle_members() -> dict[str, list[str]]:
    return {m: comp for comp in _cycles() for m in comp}


@pytest.mark.parametrize("mod", _params("cycle", MODULES))
def test_no_import_cycle_through(mod):
    comp = _cycle_members().get(mod)
    if comp:
        inner = [e for m in comp for e in EDGES[m] if e.dst in comp]
        pytest.fail(f"{mod} is on an import cycle among {comp}: {_show(inner)}")


def test_cycle_detection_sees_lazy_imports():
    """The detector itself: a function-level import closing a loop is a cycle."""
    saved = dict(EDGES)
    try:
        EDGES["numbaccum.tree"] = [
            *saved["numbaccum.tree"],
            Edge("numbaccum.tree", "numbaccum.flat", 1, True),
        ]
        assert any({"numbaccum.tree", "numbaccum.flat"} <= set(c) for c in _cycles())
    finally:
        EDGES.clear()
        EDGES.update(saved)


# --- (b) only the dispatch layer, the CLI and the benchmarks reach the backends ----------------

# backend.py picks a driver; cli/bench report on and time the CUDA backend. Everything else reaches
# kernels through `backend.ops_for` (transformations never import cpu/ or cuda/).
MAY_IMPORT_BACKENDS = ("numbaccum.backend", "numbaccum.cli", "numbaccum.bench")


@pytest.mark.parametrize("mod", _params("backends", MODULES))
def test_only_the_dispatch_layer_imports_cpu_or_cuda(mod):
    if _within(mod, MAY_IMPORT_BACKENDS):
        return
    own = next((b for b in BACKENDS if _within(mod, b)), None)
    bad = [e for e in EDGES[mod] if _within(e.dst, BACKENDS) and not (own and _within(e.dst, own))]
    # A backend may use its own modules, never the other backend's: shared formats live outside both.
    assert not bad, _show(bad)


# --- (c) the lower layers know nothing of CUDA, frameworks or backends ------------------------

# The whole set of package modules each lower layer may import (besides numpy and the stdlib).
LOWER = {
    "numbaccum._locks": set(),  # the locks a forked child gets free
    "numbaccum._marks": set(),  # a storage's generation and busy marks
    "numbaccum._loans": {"numbaccum.arrays"},  # what the caller holds of a buffer
    "numbaccum.tree": set(),
    "numbaccum.layout": {"numbaccum.tree", "numbaccum._locks"},
    "numbaccum.arrays": {"numbaccum.tree", "numbaccum.layout"},
    "numbaccum.flat": {
        "numbaccum.tree",
        "numbaccum.layout",
        "numbaccum.arrays",
        "numbaccum.backend",  # fill and copy kernels, through ops_for
        "numbaccum.contract",
        "numbaccum._marks",  # held while it is pickled or copied
        "numbaccum._loans",  # a workspace the caller holds is not written again
    },
}


@pytest.mark.parametrize("mod", _params("lower", sorted(LOWER)))
def test_lower_layers_import_only_what_is_below_them(mod):
    inside = [e for e in EDGES[mod] if _within(e.dst, PACKAGE) and e.dst != PACKAGE]
    bad = [e for e in inside if e.dst not in LOWER[mod]]
    assert not bad, _show(bad)
    if mod == "numbaccum.arrays":  # the interop module: frameworks only inside functions
        bad = [e for e in EDGES[mod] if _within(e.dst, FRAMEWORKS) and not e.lazy]
    else:  # storage and structure: not at all (arrays.py does it for them)
        bad = [e for e in EDGES[mod] if _within(e.dst, (*FRAMEWORKS, "numba"))]
    assert not bad, _show(bad)


# Array interop lives in one module: nobody else imports numba.cuda, torch or CuPy, except the CUDA
# backend itself and the CLI and benchmarks (which describe and time the device).
MAY_IMPORT_FRAMEWORKS = ("numbaccum.arrays", "numbaccum.cuda", "numbaccum.cli", "numbaccum.bench")


@pytest.mark.parametrize("mod", _params("frameworks", MODULES))
def test_only_the_interop_module_imports_array_frameworks(mod):
    if _within(mod, MAY_IMPORT_FRAMEWORKS):
        return
    bad = [e for e in EDGES[mod] if _within(e.dst, FRAMEWORKS)]
    assert not bad, _show(bad)


# A name is imported from the module that defines it, never through a module that merely imports it
# (so moving a name cannot leave a silent re-export behind, and a reader finds it where it is
# imported from). Package ``__init__`` modules are the public faces and may re-export.
HOMES = tuple(m for m, (_, is_pkg) in SOURCES.items() if not is_pkg)


def _defined(mod: str) -> set[str]:
    """The names a module binds at top level itself (def, class, assignment), not by importing."""
    names: set[str] = set()
    todo = list(ast.parse(SOURCES[mod][0].read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):  # conditional definitions
            todo += [n for f in ("body", "orelse", "finalbody") for n in getattr(node, f, [])]
            todo += [n for h in getattr(node, "handlers", []) for n in h.body]
    return names


@pytest.mark.parametrize("mod", _params("home", MODULES))
def test_names_are_imported_from_their_home(mod):
    path, is_pkg = SOURCES[mod]
    here = mod if is_pkg else mod.rpartition(".")[0]
    bad = []
    for node, _ in _imports(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = here.split(".")[: len(here.split(".")) - (node.level - 1)] if node.level else []
        target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
        if target in HOMES:
            defined = _defined(target)
            bad += [
                f"{mod}:{node.lineno} imports {a.name} from {target}, which does not define it"
                for a in node.names
                if a.name != "*" and a.name not in defined
            ]
    assert not bad, "; ".join(bad)


# --- (d) import numbaccum loads no CUDA ------------------------------------------------------


def _loaded_by_import() -> set[str]:
    """The package modules ``import numbaccum`` loads: module-level imports from the root."""
    seen, todo = set(), [PACKAGE]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += [e.dst for e in EDGES[m] if not e.lazy and e.dst in SOURCES]
    return seen


@pytest.mark.parametrize("mod", _params("eager", MODULES))
def test_import_numbaccum_loads_no_framework_statically(mod):
    """What ``import numbaccum`` runs imports no CUDA backend and no array framework at module level."""
    if mod not in _loaded_by_import():
        return
    bad = [e for e in EDGES[mod] if not e.lazy and (_within(e.dst, FRAMEWORKS + BACKENDS[1:]))]
    assert not bad, _show(bad)


def test_import_numbaccum_does_not_import_numba_cuda():
    """``import numbaccum`` and the storage layer on NumPy trees load no CUDA and no framework.
    (No kernel runs here, which would cost a compile; tests/test_cuda.py runs an update.)"""
    code = (
        "import sys, numpy as np, numbaccum as nba\n"
        "from numbaccum.flat import as_flat\n"
        "p = {'a': np.zeros(3, np.float32), 'b': [np.ones((2, 2))]}\n"
        "flat = nba.FlatTree.from_tree(p)\n"
        "assert as_flat(flat.tree, flat.layout, 'p')[1] is False\n"
        "assert as_flat(p, flat.layout, 'p')[1] is True\n"
        "flat.tree_as('numpy')\n"
        "print(sorted(m for m in sys.modules if m == 'numba.cuda' or m.startswith(('numba.cuda.',"
        " 'numbaccum.cuda', 'torch', 'cupy', 'jax'))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout


# --- (e) compat/ is a user of the public API ----------------------------------------------------

# The faces of other libraries are written as a user would write them: from numbaccum they import
# only public names (what a module's ``__all__`` lists, from a module whose dotted name has no
# ``_`` part; a package's public submodules too) and read no other attribute of a module they
# imported. Their own modules (``numbaccum.compat.*``) are theirs to share.
COMPAT = "numbaccum.compat"
PENDING[("compat", "numbaccum.compat.torchzero")] = (
    "torchzero's inner and exp_avg_tfm (ClipNormByEMA, NormalizeByEMA, ClipValueByEMA) scale another "
    "transformation's output by the statistics of the module's input: the public clip_norm_by_ema, "
    "normalize_by_ema and clip_value_by_ema have no such argument (adaptive._ema_norm_transformation, "
    "adaptive._value_ema_transformation)"
)


def _exports(mod: str) -> set[str]:
    """The public names of a package module, read from its source: its ``__all__`` and, for a
    package, its submodules whose names do not start with ``_``."""
    path, is_pkg = SOURCES[mod]
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            names |= set(ast.literal_eval(node.value))
    if is_pkg:
        names |= {m.rpartition(".")[2] for m in SOURCES if m.rpartition(".")[0] == mod}
    return {n for n in names if not n.startswith("_")}


def _private(mod: str) -> bool:
    return any(part.startswith("_") for part in mod.split("."))


def _public_use(mod: str, source: str) -> list[str]:
    """What module ``mod`` (its ``source``) uses of numbaccum beyond its public names: imports of
    a private module or of a name its module does not export, and attributes read off an imported
    numbaccum module that it does not export. ``numbaccum.compat``'s own modules are free."""
    here = mod if SOURCES.get(mod, (None, False))[1] else mod.rpartition(".")[0]
    tree = ast.parse(source)
    bad: list[str] = []
    modules: dict[str, str] = {}  # local name -> numbaccum module it holds

    def check(target: str, names: list[ast.alias], line: int) -> None:
        if not _within(target, PACKAGE) or _within(target, COMPAT):
            return
        if _private(target) or target not in SOURCES:
            bad.append(f"{mod}:{line} imports from {target}, which is not public")
            return
        public = _exports(target)
        for a in names:
            sub = f"{target}.{a.name}"
            if a.name not in public:
                bad.append(f"{mod}:{line} imports {a.name} from {target}, which does not export it")
            elif sub in SOURCES:
                modules[a.asname or a.name] = sub

    for node, _ in _imports(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _within(a.name, PACKAGE) and not _within(a.name, COMPAT):
                    if _private(a.name):
                        bad.append(f"{mod}:{node.lineno} imports {a.name}, which is not public")
                    elif a.asname:
                        modules[a.asname] = a.name
                    else:
                        modules[a.name.split(".")[0]] = PACKAGE
            continue
        base = here.split(".")[: len(here.split(".")) - (node.level - 1)] if node.level else []
        target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
        check(target, node.names, node.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            held, name = modules[node.value.id], f"{node.value.id}.{node.attr}"
            if node.attr not in _exports(held):
                bad.append(f"{mod}:{node.lineno} reads {name}, which {held} does not export")
    return bad


@pytest.mark.parametrize("mod", _params("compat", [m for m in MODULES if _within(m, COMPAT)]))
def test_compat_uses_only_public_names(mod):
    bad = _public_use(mod, SOURCES[mod][0].read_text())
    assert not bad, "; ".join(bad)


def test_public_use_detector_sees_private_names():
    """The detector itself, on a module that reaches past the public names in each way it can."""
    source = (
        "import numbaccum as nba\n"
        "from .. import chain, backend\n"
        "from ..base import Stage\n"
        "from .._checks import real\n"
        "from ..adaptive import _divide_leaves\n"
        "from ._state import to_plain\n"
        "def f():\n"
        "    from ..flat import layout_and_device\n"
        "    return nba._config, backend.ops_for, backend._gpu_ops, nba.adam\n"
    )
    bad = _public_use("numbaccum.compat.declearn", source)
    assert len(bad) == 6, bad
    wanted = ("Stage", "numbaccum._checks", "_divide_leaves", "layout_and_device", "nba._config", "_gpu_ops")
    for what in wanted:
        assert any(what in b for b in bad), (what, bad)
