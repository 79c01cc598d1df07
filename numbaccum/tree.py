"""Parameter trees: flatten, unflatten and map, with leaf paths for error messages.

A tree is a nest of ``dict`` (keys visited in sorted order, as JAX does), ``list``, ``tuple``,
``NamedTuple`` and ``None`` (an empty subtree); anything else is a leaf. A `FlatTree` is also
accepted and flattens as its ``.tree``.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TreeDef", "tree_flatten", "tree_unflatten", "tree_map", "format_path"]

# Node kinds. A NamedTuple keeps its class so that unflatten rebuilds it.
_LEAF, _NONE, _DICT, _LIST, _TUPLE, _NAMEDTUPLE = "leaf", "none", "dict", "list", "tuple", "nt"


@dataclass(frozen=True)
class TreeDef:
    """The structure of a tree without its leaves; hashable and comparable."""

    kind: str
    meta: Any  # dict keys (sorted tuple) or NamedTuple class; None otherwise
    children: tuple[TreeDef, ...]
    num_leaves: int

    def __repr__(self) -> str:
        return f"TreeDef({_describe(self)}, num_leaves={self.num_leaves})"

    def __reduce__(self) -> Any:
        # The leaf and None defs are singletons that fast paths compare with `is`.
        return (_treedef, (self.kind, self.meta, self.children, self.num_leaves))


def _describe(td: TreeDef) -> str:
    if td.kind == _LEAF:
        return "*"
    if td.kind == _NONE:
        return "None"
    inner = ", ".join(_describe(c) for c in td.children)
    if td.kind == _DICT:
        return "{" + ", ".join(f"{short_repr(k)}: {_describe(c)}" for k, c in zip(td.meta, td.children)) + "}"
    if td.kind == _LIST:
        return f"[{inner}]"
    if td.kind == _TUPLE:
        return f"({inner}{',' if len(td.children) == 1 else ''})"
    return f"{td.meta.__name__}({inner})"


_LEAF_DEF = TreeDef(_LEAF, None, (), 1)
_NONE_DEF = TreeDef(_NONE, None, (), 0)


def _treedef(kind: str, meta: Any, children: tuple, num_leaves: int) -> TreeDef:
    """A TreeDef as unpickled: the leaf and None singletons for those kinds."""
    if kind == _LEAF:
        return _LEAF_DEF
    if kind == _NONE:
        return _NONE_DEF
    return TreeDef(kind, meta, tuple(children), num_leaves)


# Error messages show keys and structures cut to this many characters: a 1 MB dict key must not
# make a 1 MB message.
_REPR_LIMIT = 80


def short_repr(x: Any, limit: int = _REPR_LIMIT) -> str:
    """``repr(x)``, its middle cut out when it is longer than ``limit`` characters."""
    r = repr(x)
    if len(r) <= limit:
        return r
    half = max((limit - 20) // 2, 1)
    return f"{r[:half]}...<{len(r) - 2 * half} chars>...{r[-half:]}"


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _children(node: Any) -> tuple[str, Any, list[tuple[Any, Any]]] | None:
    """Returns (kind, meta, [(key, child), ...]) for an inner node, None for a leaf."""
    if node is None:
        return _NONE, None, []
    if isinstance(node, dict):
        try:
            keys = tuple(sorted(node))
        except TypeError as e:
            raise TypeError(f"dict keys must be sortable, got {short_repr(list(node), 200)}") from e
        return _DICT, keys, list(zip(keys, map(node.__getitem__, keys)))  # (maps: no frame per node)
    fields: Any = getattr(type(node), "_fields", _MISSING) if isinstance(node, tuple) else _MISSING
    if fields is not _MISSING:  # a NamedTuple (`_is_namedtuple`, inline: every node asks)
        return _NAMEDTUPLE, type(node), [(f, getattr(node, f)) for f in fields]
    if isinstance(node, list):
        return _LIST, None, list(enumerate(node))
    if isinstance(node, tuple):
        return _TUPLE, None, list(enumerate(node))
    tree = getattr(node, "__numbaccum_tree__", None)  # FlatTree: flatten its views
    if tree is not None:
        return _children(tree())
    return None


def format_path(path: Sequence[Any], root: str = "tree") -> str:
    """Formats a key path the way a user would index it, e.g. ``params['dense']['w']``."""
    out = [root]
    for k in path:
        out.append(f".{k}" if isinstance(k, _Attr) else f"[{short_repr(k)}]")
    return "".join(out)


class _Attr(str):
    """A NamedTuple field name in a path (printed as ``.field``)."""


def _flatten(node: Any, path: tuple, leaves: list, paths: list | None) -> TreeDef:
    spec = None if type(node) is np.ndarray else _children(node)  # (an array: a leaf)
    if spec is None:
        leaves.append(node)
        if paths is not None:
            paths.append(path)
        return _LEAF_DEF
    kind, meta, items = spec
    if kind == _NONE:
        return _NONE_DEF
    if kind == _NAMEDTUPLE:
        items = [(_Attr(k), v) for k, v in items]
    built = []  # loops, not generators: every call that derives a layout walks a tree
    n = 0
    for k, v in items:
        if type(v) is np.ndarray:  # the common leaf, without a call of its own
            leaves.append(v)
            if paths is not None:
                paths.append(path + (k,))
            built.append(_LEAF_DEF)
            n += 1
            continue
        c = _flatten(v, path + (k,), leaves, paths)
        built.append(c)
        n += c.num_leaves
    return TreeDef(kind, meta, tuple(built), n)


def tree_flatten(tree: Any) -> tuple[list[Any], TreeDef]:
    """Flattens a tree into its leaves (depth first, dict keys sorted) and its structure.

    Walks the nest depth first: a dict's values in the order of its sorted keys (as JAX does),
    a list's, tuple's or NamedTuple's items in order; None is an empty subtree (no leaf), and
    anything else (an array, a number) is a leaf. A `FlatTree` flattens as its ``.tree`` (views
    of its buffers). ``tree_unflatten(treedef, leaves)`` is the inverse.

    Args:
        tree: a nest of dict, list, tuple, NamedTuple and None; anything else is a leaf.

    Returns:
        ``(leaves, treedef)`` with ``tree_unflatten(treedef, leaves)`` rebuilding the tree; the
            treedef is hashable and compares equal for trees of the same structure.

    Raises:
        TypeError: a dict's keys cannot be sorted (e.g. int and str keys mixed).

    References:
        jax.tree_util.tree_flatten (without custom node types or ``is_leaf``).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> leaves, treedef = nba.tree_flatten({"w": np.ones(2), "b": (np.zeros(1), None)})
        >>> [x.tolist() for x in leaves]  # "b" before "w"; None holds no leaf
        [[0.0], [1.0, 1.0]]
        >>> treedef
        TreeDef({'b': (*, None), 'w': *}, num_leaves=2)
    """
    if type(tree) is dict and tree:  # the common tree, one dict of arrays: no walk
        try:
            keys = tuple(sorted(tree))
        except TypeError:
            keys = ()  # `_children` raises the error
        values = list(map(tree.__getitem__, keys))
        if keys and list(map(type, values)).count(np.ndarray) == len(values):
            return values, TreeDef(_DICT, keys, (_LEAF_DEF,) * len(keys), len(keys))
    leaves: list[Any] = []
    return leaves, _flatten(tree, (), leaves, None)


def tree_flatten_with_path(tree: Any) -> tuple[list[Any], list[tuple], TreeDef]:
    """Like `tree_flatten`, also returning each leaf's key path."""
    leaves: list[Any] = []
    paths: list[tuple] = []
    td = _flatten(tree, (), leaves, paths)
    return leaves, paths, td


def leaves_if_structure(tree: Any, treedef: TreeDef) -> list[Any] | None:
    """The leaves of ``tree`` (in `tree_flatten` order) if its structure is ``treedef``, else None.

    A walk of the tree beside ``treedef`` that builds no TreeDef and no paths: the cheap check an
    update makes every step. On None, the caller takes the path that names the difference."""
    leaves: list[Any] = []
    return leaves if _match(tree, treedef, leaves) else None


def _match(node: Any, td: TreeDef, leaves: list) -> bool:
    kind = td.kind
    children: Sequence[Any]
    if kind == _LEAF:
        if type(node) is np.ndarray or _children(node) is None:
            leaves.append(node)
            return True
        return False
    if kind == _DICT:
        # Same size and every expected key present: the same key set. get(), not [], so that a
        # defaultdict does not grow a missing key.
        if not isinstance(node, dict) or len(node) != len(td.meta):
            return False
        children = [node.get(k, _MISSING) for k in td.meta]
    elif kind == _LIST:
        if not isinstance(node, list) or len(node) != len(td.children):
            return False
        children = node
    elif kind == _TUPLE:
        if not isinstance(node, tuple) or _is_namedtuple(node) or len(node) != len(td.children):
            return False
        children = node
    elif kind == _NAMEDTUPLE:
        if type(node) is not td.meta:
            return False
        children = node
    else:
        return node is None
    n = len(children)
    if td.children.count(_LEAF_DEF) == n and [type(c) for c in children].count(np.ndarray) == n:
        leaves.extend(children)  # a node whose children are all NumPy leaves: no call per leaf
        return True
    for child, ctd in zip(children, td.children):
        if ctd is _LEAF_DEF and type(child) is np.ndarray:  # the common leaf, without a call
            leaves.append(child)
        elif child is _MISSING or not _match(child, ctd, leaves):
            return False
    return True


_MISSING = object()


def leaf_paths(treedef: TreeDef) -> list[tuple]:
    """The key path of every leaf of ``treedef``, in leaf order."""
    out: list[tuple] = []

    def walk(td: TreeDef, path: tuple) -> None:
        if td.kind == _LEAF:
            out.append(path)
        elif td.kind == _DICT:
            for k, c in zip(td.meta, td.children):
                walk(c, path + (k,))
        elif td.kind == _NAMEDTUPLE:
            for k, c in zip(td.meta._fields, td.children):
                walk(c, path + (_Attr(k),))
        else:
            for i, c in enumerate(td.children):
                walk(c, path + (i,))

    walk(treedef, ())
    return out


def tree_unflatten(treedef: TreeDef, leaves: Sequence[Any]) -> Any:
    """Rebuilds a tree of structure ``treedef`` from ``leaves`` (in `tree_flatten` order).

    The inverse of `tree_flatten`: ``tree_unflatten(treedef, leaves)`` puts the ``i``-th leaf
    where the ``i``-th leaf of the flattened tree was, rebuilding dicts (keys in sorted order),
    lists, tuples, NamedTuples (of their class) and None. The leaves can be anything.

    Args:
        treedef: a structure, as `tree_flatten` returns it.
        leaves: one value per leaf of ``treedef``, in `tree_flatten` order.

    Returns:
        The tree of structure ``treedef`` holding ``leaves``.

    Raises:
        ValueError: ``leaves`` has not ``treedef.num_leaves`` values.

    References:
        jax.tree_util.tree_unflatten.

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> leaves, treedef = nba.tree_flatten({"w": np.ones(2), "b": (np.zeros(1), None)})
        >>> nba.tree_unflatten(treedef, [1.0, 2.0])
        {'b': (1.0, None), 'w': 2.0}
    """
    leaves = list(leaves)
    if len(leaves) != treedef.num_leaves:
        raise ValueError(f"treedef has {treedef.num_leaves} leaves, got {len(leaves)}")
    keys = leaf_dict_keys(treedef)
    if keys is not None:
        return dict(zip(keys, leaves))  # a dict of leaves (a returned update's, often)
    return _built(treedef, iter(leaves))


def leaf_dict_keys(td: TreeDef) -> tuple | None:
    """The keys of a structure that is one dict of leaves (`tree_unflatten` then builds the
    dict at once; a caller that rebuilds it every step asks once), else None."""
    if td.kind == _DICT and all(map(operator.is_, td.children, itertools.repeat(_LEAF_DEF))):
        return td.meta  # type: ignore[no-any-return]
    return None


def dict_children(td: TreeDef) -> tuple | None:
    """For a NamedTuple, tuple or list each of whose children is one dict of leaves (lookahead's
    pair of trees): ``(make, keys)``, ``make(children)`` rebuilding the node from its children
    and ``keys`` each child's (`leaf_dict_keys`), so that a caller rebuilding it every step
    makes its dicts at once; else None (`tree_unflatten`'s walk)."""
    if td.kind not in (_NAMEDTUPLE, _TUPLE, _LIST) or not td.children:
        return None
    keys = tuple(leaf_dict_keys(c) for c in td.children)
    if any(k is None for k in keys):
        return None
    make: Any = tuple if td.kind == _TUPLE else list
    if td.kind == _NAMEDTUPLE:
        make = lambda kids: td.meta(*kids)  # noqa: E731
    return make, keys


def _built(td: TreeDef, it: Iterator[Any]) -> Any:
    """`tree_unflatten`'s walk: a module function, not a closure over itself, whose reference
    cycle would keep the leaves alive until the cyclic collector runs (and a returned update
    held, `numbaccum._loans`)."""
    if td.kind == _LEAF:
        return next(it)
    if td.kind == _NONE:
        return None
    kids = [_built(c, it) for c in td.children]
    if td.kind == _DICT:
        return dict(zip(td.meta, kids))
    if td.kind == _LIST:
        return kids
    if td.kind == _TUPLE:
        return tuple(kids)
    return td.meta(*kids)


def first_difference(a: TreeDef, b: TreeDef) -> tuple[tuple, str]:
    """Path and description of the first place where two structures differ."""

    def walk(x: TreeDef, y: TreeDef, path: tuple) -> tuple[tuple, str] | None:
        if x.kind != y.kind or (x.kind == _NAMEDTUPLE and x.meta is not y.meta):
            return path, f"expected {_cut(_describe(x))}, got {_cut(_describe(y))}"
        if x.kind == _DICT and x.meta != y.meta:
            missing = sorted(set(x.meta) - set(y.meta), key=repr)
            extra = sorted(set(y.meta) - set(x.meta), key=repr)
            return path, f"dict keys differ (missing {_keys(missing)}, unexpected {_keys(extra)})"
        if len(x.children) != len(y.children):
            return path, f"expected {len(x.children)} children, got {len(y.children)}"
        keys: Sequence[Any]
        if x.kind == _DICT:
            keys = x.meta
        elif x.kind == _NAMEDTUPLE:
            keys = [_Attr(f) for f in x.meta._fields]
        else:
            keys = range(len(x.children))
        for k, cx, cy in zip(keys, x.children, y.children):
            found = walk(cx, cy, path + (k,))
            if found is not None:
                return found
        return None

    found = walk(a, b, ())
    return found if found is not None else ((), "structures are equal")


def _cut(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters (a structure's description can be a whole tree)."""
    return text if len(text) <= limit else f"{text[: limit - 30]}...<{len(text) - limit + 30} chars>"


def _keys(keys: list) -> str:
    """A list of dict keys for a message: each cut, at most five of them."""
    shown = ", ".join(short_repr(k) for k in keys[:5])
    return f"[{shown}{', ...' if len(keys) > 5 else ''}]"


def check_same_structure(expected: TreeDef, got: TreeDef, name: str) -> None:
    """Raises ValueError naming the first differing path when two structures differ."""
    if expected != got:
        path, why = first_difference(expected, got)
        raise ValueError(f"{format_path(path, name)}: tree structure mismatch: {why}")


def tree_map(f: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Applies ``f`` leaf by leaf to ``tree`` and trees of the same structure in ``rest``.

    ``out_i = f(x_i, r1_i, r2_i, ...)`` for the ``i``-th leaf ``x_i`` of ``tree`` and the
    ``i``-th leaves of the trees in ``rest``, rebuilt with the structure of ``tree``
    (`tree_flatten`, then `tree_unflatten`).

    Args:
        f: a function of ``1 + len(rest)`` leaves.
        tree: the tree whose structure the result has.
        *rest: trees of the same structure as ``tree``.

    Returns:
        A new tree of ``tree``'s structure holding ``f``'s results.

    Raises:
        ValueError: a tree in ``rest`` has another structure (names the first differing path).
        TypeError: a dict's keys cannot be sorted.

    References:
        jax.tree_util.tree_map (without ``is_leaf``).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.array([1.0, 2.0]), "b": np.array([0.5])}
        >>> grads = {"w": np.array([1.0, -1.0]), "b": np.array([2.0])}
        >>> new = nba.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        >>> [round(float(x), 4) for x in new["w"]], [round(float(x), 4) for x in new["b"]]
        ([0.9, 2.1], [0.3])
    """
    leaves, td = tree_flatten(tree)
    others = []
    for i, r in enumerate(rest):
        r_leaves, r_td = tree_flatten(r)
        check_same_structure(td, r_td, f"rest[{i}]")
        others.append(r_leaves)
    return tree_unflatten(td, [f(*xs) for xs in zip(leaves, *others)])


def broadcast_prefix(prefix: Any, treedef: TreeDef, name: str = "prefix") -> list[Any]:
    """The value of ``prefix`` for each leaf of ``treedef``, in leaf order: ``prefix`` is a tree
    with the structure of ``treedef`` down to some depth, a leaf of it standing for the whole
    subtree below (optax's "a prefix of the params tree", as for a mask).

    Raises:
        ValueError: ``prefix`` is not a prefix of ``treedef`` (names the first differing path).
    """
    out: list[Any] = []

    def walk(node: Any, td: TreeDef, path: tuple) -> None:
        spec = _children(node)
        if spec is None:
            out.extend([node] * td.num_leaves)
            return
        kind, meta, items = spec
        if td.kind == _LEAF or kind != td.kind or (kind == _NAMEDTUPLE and meta is not td.meta):
            why = f"expected {_cut(_describe(td))}, got {_cut(short_repr(node, 200))}"
            raise ValueError(f"{format_path(path, name)}: not a prefix of the tree's structure: {why}")
        if kind == _DICT and meta != td.meta:
            missing = sorted(set(td.meta) - set(meta), key=repr)
            extra = sorted(set(meta) - set(td.meta), key=repr)
            why = f"missing {_keys(missing)}, unexpected {_keys(extra)}"
            raise ValueError(f"{format_path(path, name)}: dict keys differ ({why})")
        if len(items) != len(td.children):
            raise ValueError(
                f"{format_path(path, name)}: expected {len(td.children)} children, got {len(items)}"
            )
        for (k, child), ctd in zip(items, td.children):
            walk(child, ctd, path + ((_Attr(k),) if kind == _NAMEDTUPLE else (k,)))

    walk(prefix, treedef, ())
    return out
