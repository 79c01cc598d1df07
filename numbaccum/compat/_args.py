"""Argument checks of the compat faces: a bad value raises TypeError or ValueError naming the
argument, as the core's constructors do (their checks are internal, and compat uses only the
public names of numbaccum: tests/test_imports.py)."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


def real(value: Any, name: str) -> float:
    """``value`` as a float when it is a real number: a Python or NumPy int or float, or a 0-d
    array of one (not a bool, a string or None); TypeError naming ``name`` otherwise."""
    if not isinstance(value, (bool, np.bool_, str, bytes)) and hasattr(value, "__float__"):
        if isinstance(value, numbers.Real):
            return float(value)
        try:
            arr = np.asarray(value)
        except Exception:  # a CUDA tensor: not a host number
            arr = None
        if arr is not None and arr.ndim == 0 and arr.dtype.kind in "iuf":
            return float(arr)
    raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r:.40}")


def non_negative(value: Any, name: str) -> float:
    """A real number ``>= 0`` (NaN refused); ValueError or TypeError naming ``name``."""
    v = real(value, name)
    if not v >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return v
