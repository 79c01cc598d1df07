"""The peers timed beside numbaccum when they are installed: PyTorch's foreach ops and optax under
``jax.jit``, on the CPU or on a CUDA device. Each builder returns ``{operation: step}`` with
``step()`` doing one update of the same math as numbaccum's, or ``{}`` when the library (or its
GPU support) is missing. Imports happen here, inside the builders, never at ``import numbaccum``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from .baselines import B1, B2, DECAY, EPS, LR

Steps = dict[str, Callable[[], Any]]

FULL_MAX_NORM = 1.0  # the clip of the full step: MultiSteps(chain(clip_by_global_norm(1.0), adam))


def torch_available(device: str) -> bool:
    """Whether PyTorch is installed (and, for ``device="cuda"``, sees a GPU)."""
    try:
        import torch
    except ImportError:
        return False
    return device == "cpu" or bool(torch.cuda.is_available())


def torch_steps(
    params: list[np.ndarray], grads: list[np.ndarray], k: int, max_norm: float, device: str = "cpu"
) -> Steps:
    """``torch._foreach_*``, ``clip_grad_norm_(foreach=True)`` and ``Adam(foreach=True)``.

    On the CPU the gradient tensors share the NumPy buffers (no copies); on ``"cuda"`` they are
    copies on the device. ``multisteps``: mean accumulate with ``_foreach_lerp_``; every k-th step
    the full step clips the mean to ``FULL_MAX_NORM`` in place, runs Adam and zeroes it."""
    if not torch_available(device):
        return {}
    import torch

    def tensor(x: np.ndarray) -> Any:
        t = torch.from_numpy(x)
        return t if device == "cpu" else t.to(device)

    g = [tensor(x) for x in grads]
    acc = [torch.zeros_like(x) for x in g]
    ema = [torch.zeros_like(x) for x in g]
    p = [tensor(x.copy()).requires_grad_() for x in params]
    for t, a in zip(p, acc):
        t.grad = a
    adam = torch.optim.Adam(p, lr=LR, betas=(B1, B2), eps=EPS, foreach=True)
    clip_p = [torch.zeros_like(x).requires_grad_() for x in g]
    for t, x in zip(clip_p, g):
        t.grad = x.clone()
    box = {"n": 0, "count": 0}

    def multisteps() -> None:
        box["n"] += 1
        torch._foreach_lerp_(acc, g, 1.0 / box["n"])
        if box["n"] == k:
            torch.nn.utils.clip_grad_norm_(p, FULL_MAX_NORM, foreach=True)  # clips acc (p.grad)
            with torch.no_grad():
                adam.step()
            torch._foreach_zero_(acc)
            box["n"] = 0

    def ema_step() -> None:
        box["count"] += 1
        torch._foreach_lerp_(ema, g, 1 - DECAY)
        torch._foreach_div(ema, 1 - DECAY ** box["count"])

    def clip() -> None:
        torch.nn.utils.clip_grad_norm_(clip_p, max_norm, foreach=True)

    return {"multisteps": multisteps, "ema": ema_step, "clip": clip}


def _jax() -> Any:
    # XLA takes 75% of the GPU's memory up front by default, which would starve numbaccum and
    # PyTorch in the same process; it must be set before JAX starts.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    return jax


def optax_available(device: str) -> bool:
    """Whether JAX and optax are installed (and, for ``device="cuda"``, JAX sees a GPU)."""
    try:
        jax = _jax()
        import optax  # noqa: F401
    except ImportError:
        return False
    try:
        return bool(jax.devices("gpu" if device == "cuda" else "cpu"))
    except RuntimeError:  # no such backend
        return False


def optax_steps(
    params: list[np.ndarray], grads: list[np.ndarray], k: int, max_norm: float, device: str = "cpu"
) -> Steps:
    """optax's transformations under ``jax.jit`` with the state donated (updated in place), on
    the CPU or the GPU (placed explicitly: on a GPU machine JAX's default device is the GPU)."""
    if not optax_available(device):
        return {}
    jax = _jax()
    import optax

    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    g = [jax.device_put(x, dev) for x in grads]
    p = [jax.device_put(x, dev) for x in params]

    def stepper(tx: Any) -> Callable[[], Any]:
        box = {"state": tx.init(p)}
        update = jax.jit(tx.update, donate_argnums=(1,))

        def step() -> None:
            u, box["state"] = update(g, box["state"], p)
            jax.block_until_ready(u)

        return step

    full = optax.chain(optax.clip_by_global_norm(FULL_MAX_NORM), optax.adam(LR, B1, B2, EPS))
    return {
        "multisteps": stepper(optax.MultiSteps(full, k)),
        "ema": stepper(optax.ema(DECAY)),
        "clip": stepper(optax.clip_by_global_norm(max_norm)),
    }
