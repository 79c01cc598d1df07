"""Checks of constructor arguments: a bad value raises TypeError/ValueError naming the argument.

``float("0.9x")`` says ``could not convert string to float: '0.9x'`` and ``float(None)`` names no
argument either; a transformation given ``None`` or ``'adam'`` would fail on ``.init`` with an
AttributeError. These helpers turn such values into errors that say which argument is wrong.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .layout import is_float
from .tree import short_repr

INT32_MAX = int(np.iinfo(np.int32).max)


def real(value: Any, name: str) -> float:
    """``value`` as a float when it is a real number (a Python or NumPy int or float, or a 0-d
    array of one); TypeError naming ``name`` for anything else (bools, strings, None, complex
    numbers, lists)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a real number, got a bool {value!r}")
    if isinstance(value, numbers.Real):
        return float(value)
    if _real_0d(value):  # a 0-d array of NumPy, JAX or PyTorch (optax users pass jnp scalars)
        return float(value)
    raise TypeError(f"{name} must be a real number, got {type(value).__name__} {short_repr(value, 40)}")


def _real_0d(value: Any) -> bool:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return False
    arr = _host_array(value)
    return arr is not None and arr.ndim == 0 and _real_dtype(arr.dtype)


def _host_array(value: Any) -> np.ndarray | None:
    try:
        return np.asarray(value)
    except Exception:  # e.g. a CUDA tensor: not a host number
        return None


def _real_dtype(dt: np.dtype) -> bool:
    """An int or float dtype, bfloat16 too (ml_dtypes' kind is ``'V'``); not bool or complex."""
    return dt.kind in "iuf" or is_float(dt)


def real_scalar(value: Any, name: str, what: str, size_one: bool = False) -> float:
    """An objective's value as a float: one real number of any int or float dtype (a Python or
    NumPy number, a 0-d array of NumPy or JAX; bfloat16 too, as optax takes a loss in any float
    dtype). ``size_one``: an array of one element of any shape as well. TypeError naming
    ``name`` (``what``: its role, for the message) for anything else: a bool, a string, None, a
    complex number, several numbers."""
    arr = None if isinstance(value, (bool, np.bool_)) else _host_array(value)
    if arr is not None and size_one and arr.size == 1:
        arr = arr.reshape(())
    if arr is None or arr.ndim != 0 or not _real_dtype(arr.dtype):
        raise TypeError(f"{name} must be a real scalar ({what}), got {short_repr(value, 60)}")
    return float(arr)


def non_negative(value: Any, name: str) -> float:
    """A real number ``>= 0`` (NaN rejected); ValueError or TypeError naming ``name``."""
    v = real(value, name)
    if not v >= 0:  # NaN too
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return v


def integer(value: Any, name: str, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``: a Python or NumPy integer, or a 0-d integer
    array (not a bool, a float or a string: ``2.7`` is not silently truncated)."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {short_repr(value, 40)}")
    v = int(value)
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {v}")
    return v


def flag(value: Any, name: str) -> bool:
    """``value`` as a bool: a Python or NumPy bool (or a 0-d bool array), or the ints 0 and 1;
    TypeError naming ``name`` for anything else. ``bool(value)`` would take the string
    ``"False"`` as True and fail on an array with a message that names nothing."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind == "b":
        value = value[()]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {short_repr(value, 40)}")


def scheduled(schedule: Any, count: Any, name: str) -> float:
    """``schedule(count)`` as a float; TypeError naming ``name`` and the step when the schedule
    returns something other than a real number (None, a string, an array of several values)."""
    value = schedule(count)
    if type(value) is float:  # (`real`'s answer, inline: the library's schedules give floats)
        return value
    try:
        return real(value, name)
    except TypeError as e:
        shown = short_repr(value, 40)
        raise TypeError(f"{name} (a schedule) returned {shown} at step {int(count)}: {e}") from None


def transformation(tx: Any, name: str) -> Any:
    """``tx`` when it has callable ``init`` and ``update``; TypeError naming ``name`` otherwise."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{name} must be a GradientTransformation (with init and update), got "
            f"{type(tx).__name__} {short_repr(tx, 40)}"
        )
    return tx


def real_or_schedule(value: Any, name: str) -> Any:
    """A callable (a schedule of the step count) as it is, else ``value`` as a real number."""
    return value if callable(value) else real(value, name)


def wrong_state(expected: str, state: Any, error: type[Exception] = TypeError) -> Exception:
    """The error for a ``state`` that is not the one a transformation made: names what was
    expected and what came, and says what probably happened: no ``init`` at all (``None``), or
    the state of another transformation (raise it: ``raise wrong_state(...)``)."""
    got = type(state).__name__
    if state is None:
        hint = "; did you call init? (state = tx.init(params), then pass the state each update returns)"
    elif isinstance(state, (tuple, dict)) or hasattr(state, "_fields"):
        hint = "; is it another transformation's state? (each transformation's init makes its own)"
    else:
        hint = ""
    return error(f"state: expected {expected}, got {got}{hint}")
