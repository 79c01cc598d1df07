"""What a stage declares about itself, as data, for the code that walks transformations.

A stage class (or instance) declares:

- ``scope``: what one element of its output depends on, besides the step's scalars: that
  element alone (`ELEMENT`: AdamW, Lion, ``clip``), its leaf or the params' tree structure
  (`LEAF`: Adafactor's factored moments, LAMB's trust ratio, a mask or a label tree), or the
  whole tree (`TREE`: ``clip_by_global_norm``, ``apply_if_finite``). Not declared (None): not
  known, as of user code. A combinator declares the scope of its own bookkeeping; what it runs
  is its children's.
- ``children_at``: the name of the attribute that holds the stages it runs (a stage, a list of
  stages, or None); not declared: it runs none.
- ``joins_leaves``: whether its children see the leaves as one vector (``flatten``): a child's
  leaf is then the whole tree.

`numbaccum.sharded` derives from these which transformations a shard takes and how it cuts the
params.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ELEMENT", "LEAF", "TREE", "children", "scope"]

ELEMENT, LEAF, TREE = "element", "leaf", "tree"


def scope(stage: Any) -> str | None:
    """The scope ``stage`` declares (`ELEMENT`, `LEAF`, `TREE`), None where it declares none."""
    return getattr(stage, "scope", None)


def children(stage: Any) -> list:
    """The stages ``stage`` runs, in order (the attribute its ``children_at`` names)."""
    at = getattr(stage, "children_at", None)
    kids = getattr(stage, at) if at else None
    if kids is None:
        return []
    return list(kids) if isinstance(kids, (list, tuple)) else [kids]
