"""Compile the kernels ahead of the first training step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _config, arrays
from .layout import check_float_dtype


def _transformations() -> list[Any]:
    from . import accumulation, clipping, optimizers, scaling
    from .base import chain

    return [
        accumulation.trace(0.9, nesterov=True),
        accumulation.trace(0.9),
        accumulation.ema(0.9),
        accumulation.apply_every(2),
        accumulation.MultiSteps(chain(clipping.clip_by_global_norm(1.0), optimizers.adam(1e-3)), 2),
        accumulation.MultiSteps(
            optimizers.sgd(0.1), 2, use_grad_mean=False, should_skip_update_fn=accumulation.skip_not_finite
        ),
        chain(
            clipping.clip(1.0), clipping.zero_nans(), scaling.add_decayed_weights(1e-4), scaling.scale(-1.0)
        ),
        clipping.clip_by_block_rms(1.0),
        clipping.normalize_by_update_norm(),
        clipping.apply_if_finite(optimizers.sgd(0.1), 1),
    ]


def warmup(dtypes: Sequence[Any] = ("float32", "float64"), backend: str = "auto") -> list[str]:
    """Compiles the kernels behind the common transformations for ``dtypes``, so the first real
    step does not pay numba's compile time (about 2 s per kernel family on a small machine).

    Each transformation runs two steps on a small tree (the serial kernels) and on a tree above
    the parallel threshold (the parallel ones), on the CPU and, with ``backend`` "cuda" or "auto"
    on a machine with a working CUDA device, on the GPU.

    Returns:
        The backends that were warmed up (``["cpu"]`` or ``["cpu", "cuda"]``).

    Raises:
        ValueError: ``backend`` is not "auto", "cpu" or "cuda".
        TypeError: a dtype is not float16, float32 or float64.
    """
    if backend not in ("auto", "cpu", "cuda"):
        raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', got {backend!r}")
    dts = [check_float_dtype(d, "dtypes") for d in dtypes]
    done = ["cpu"]
    targets = [False]
    if backend == "cuda" or (backend == "auto" and arrays.cuda_available()):
        targets.append(True)
        done.append("cuda")
    for on_gpu in targets:
        for dt in dts:
            for n in (8, _config.SERIAL_BELOW + 1):
                tree = {"a": np.ones(n, dt), "b": np.full((2, 3), 0.5, dt)}
                if on_gpu:
                    from .flat import to_device

                    tree = to_device(tree)
                for tx in _transformations():
                    state = tx.init(tree)
                    for _ in range(2):
                        _, state = tx.update(tree, state, tree)
    return done
