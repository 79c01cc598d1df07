"""optax's protocol types: what a transformation is, as a user of optax knows it.

A transformation is a pair of functions ``init(params) -> state`` and ``update(updates, state,
params=None, **extra_args) -> (updates, state)``. numbaccum's own transformations are such pairs
whose ``update`` is the bound method of a stage (`numbaccum.base.Stage`); any other pair (optax's,
a user's) can be chained with them and runs through its plain ``update``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["EmptyState", "GradientTransformation", "GradientTransformationExtraArgs"]


class GradientTransformation(NamedTuple):
    """A pair of pure-looking functions ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``."""

    init: Callable[..., Any]
    update: Callable[..., Any]


class GradientTransformationExtraArgs(GradientTransformation):
    """A GradientTransformation whose ``update`` accepts (and may ignore) ``**extra_args``."""


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""
