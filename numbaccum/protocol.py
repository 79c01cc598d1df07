"""optax's protocol types: what a transformation is, as a user of optax knows it.

A transformation is a pair of functions ``init(params) -> state`` and ``update(updates, state,
params=None, **extra_args) -> (updates, state)``. numbaccum's own transformations are such pairs
whose ``update`` is the bound method of a stage (`numbaccum.base.Stage`); any other pair (optax's,
a user's) can be chained with them and runs through its plain ``update``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["EmptyState", "GradientTransformation", "GradientTransformationExtraArgs", "state_class", "state_classes"]

_STATE_CLASSES: list[type] = []  # in definition order


def state_class(cls: type) -> type:
    """Marks a NamedTuple class of numbaccum's as one a state may hold, where it is defined
    (``@state_class`` over the class): `numbaccum.load_state` rebuilds the classes so marked
    by name (`state_classes`); a user's classes go through `numbaccum.register_state_class`."""
    _STATE_CLASSES.append(cls)
    return cls


def state_classes() -> tuple[type, ...]:
    """Every class marked with `state_class` in the modules imported so far."""
    return tuple(_STATE_CLASSES)


class GradientTransformation(NamedTuple):
    """optax's transformation: a pair of functions, ``init`` and ``update``.

    ``state = init(params)`` makes the initial state; ``updates, state = update(updates, state,
    params)`` transforms one step's updates. Any object with callable ``init`` and ``update`` can
    be chained with numbaccum's transformations; this NamedTuple is the plain way to make one of
    two functions (`chain` passes its ``update`` the params, but no extra keyword arguments).

    Attributes:
        init: ``init(params) -> state``, the initial state for a tree of params.
        update: ``update(updates, state, params=None) -> (updates, state)``, one step.
    """

    init: Callable[..., Any]
    update: Callable[..., Any]


class GradientTransformationExtraArgs(GradientTransformation):
    """A `GradientTransformation` whose ``update`` also accepts ``**extra_args`` (and may ignore them).

    Every numbaccum transformation is one; `with_extra_args_support` makes one of any pair.

    Attributes:
        init: ``init(params) -> state``, the initial state for a tree of params.
        update: ``update(updates, state, params=None, **extra_args) -> (updates, state)``, one step;
            the keyword arguments (e.g. ``value=loss`` for optax's ``reduce_on_plateau``, or what a
            stateful schedule of `inject_hyperparams` reads) reach every stage of a chain.
    """


@state_class
class EmptyState(NamedTuple):
    """The state of a stateless transformation: a NamedTuple with no fields (also named ClipState).

    ``EmptyState()`` is what ``init`` of a transformation that keeps nothing returns (`scale`,
    `clip`, ``scale_by_learning_rate`` with a constant rate, ...); ``ClipState`` is the same class,
    as in optax. It has no fields, hence no attributes.
    """
