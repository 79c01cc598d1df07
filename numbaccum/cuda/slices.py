"""Slice-wise reductions and scalings on CUDA, by their transitional kernel names: the twin of
`numbaccum.cpu.slices`, over the CUDA reduction engine (`numbaccum.cuda.reduce`)."""

from __future__ import annotations

import numpy as np

from ..tables import as_table
from . import reduce as _engine

__all__ = [
    "slice_apply_",
    "slice_maxabs",
    "slice_minabs",
    "slice_nnz",
    "slice_sum",
    "slice_sumabs",
    "slice_sumpow",
    "slice_sumsq",
]

_NONE = np.zeros(0, np.float64)


def slice_sumsq(x, rows, centers):
    """Per slice ``s`` of the table: sum((x - centers[s]) ** 2) in float64 (``centers`` empty:
    no centring). Slices of inactive leaves are 0."""
    if centers is not None and centers.size:
        return _engine.reduce("csumsq", x, as_table(rows), centers)
    return _engine.reduce("sumsq", x, as_table(rows))


def slice_sumabs(x, rows):
    """Per slice: sum(|x|) in float64."""
    return _engine.reduce("sumabs", x, as_table(rows))


def slice_sumpow(x, rows, p):
    """Per slice: sum(|x| ** p) in float64 (|0| ** p is inf for a negative p)."""
    return _engine.reduce("sumpow", x, as_table(rows), None, p)


def slice_sum(x, rows):
    """Per slice: sum(x) (signed) in float64."""
    return _engine.reduce("sum", x, as_table(rows))


def slice_nnz(x, rows):
    """Per slice: the number of non-zero elements (NaN counts), as float64."""
    return _engine.reduce("nnz", x, as_table(rows))


def slice_maxabs(x, rows):
    """Per slice: max(|x|) (0 if empty, NaN if any element is NaN)."""
    return _engine.reduce("maxabs", x, as_table(rows))


def slice_minabs(x, rows):
    """Per slice: min(|x|) (+inf if empty, NaN if any element is NaN)."""
    return _engine.reduce("minabs", x, as_table(rows))


def slice_apply_(out, x, rows, centers, factors):
    """out = (x - centers[s]) * factors[s] over every slice ``s`` (empty ``centers``: 0; empty
    ``factors``: 1), computed in float64. Inactive leaves are copied (skipped when ``out`` is
    ``x``)."""
    _engine.apply_(
        out, x, as_table(rows), _NONE if centers is None else centers, _NONE if factors is None else factors
    )


KERNELS = (
    "slice_sumsq",
    "slice_sumabs",
    "slice_sumpow",
    "slice_sum",
    "slice_nnz",
    "slice_maxabs",
    "slice_minabs",
    "slice_apply_",
)
