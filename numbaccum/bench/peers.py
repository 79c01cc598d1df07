"""The peers timed beside numbaccum when they are installed: PyTorch's foreach ops on the CPU and
optax under ``jax.jit``. Each builder returns ``{operation: step}`` with ``step()`` doing one
update of the same math as numbaccum's, or ``{}`` when the library is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .baselines import B1, B2, DECAY, EPS, LR

Steps = dict[str, Callable[[], Any]]


def torch_steps(params: list[np.ndarray], grads: list[np.ndarray], k: int, max_norm: float) -> Steps:
    """``torch._foreach_*`` and ``clip_grad_norm_(foreach=True)`` on tensors that share the
    NumPy buffers (no copies)."""
    try:
        import torch
    except ImportError:
        return {}
    g = [torch.from_numpy(x) for x in grads]
    acc = [torch.zeros_like(x) for x in g]
    ema = [torch.zeros_like(x) for x in g]
    p = [torch.from_numpy(x.copy()).requires_grad_() for x in params]
    for t, a in zip(p, acc):
        t.grad = a
    adam = torch.optim.Adam(p, lr=LR, betas=(B1, B2), eps=EPS, foreach=True)
    clip_p = [torch.zeros_like(x).requires_grad_() for x in g]
    for t, x in zip(clip_p, g):
        t.grad = x.clone()
    box = {"n": 0, "count": 0}

    def multisteps() -> None:  # mean accumulate; every k-th step Adam on the mean, then reset
        box["n"] += 1
        torch._foreach_lerp_(acc, g, 1.0 / box["n"])
        if box["n"] == k:
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


def optax_steps(params: list[np.ndarray], grads: list[np.ndarray], k: int, max_norm: float) -> Steps:
    """optax's transformations under ``jax.jit`` with the state donated (updated in place)."""
    try:
        import jax
        import jax.numpy as jnp
        import optax
    except ImportError:
        return {}
    g = [jnp.asarray(x) for x in grads]
    p = [jnp.asarray(x) for x in params]

    def stepper(tx: Any) -> Callable[[], Any]:
        box = {"state": tx.init(p)}
        update = jax.jit(tx.update, donate_argnums=(1,))

        def step() -> None:
            u, box["state"] = update(g, box["state"], p)
            jax.block_until_ready(u)

        return step

    return {
        "multisteps": stepper(optax.MultiSteps(optax.adam(LR, B1, B2, EPS), k)),
        "ema": stepper(optax.ema(DECAY)),
        "clip": stepper(optax.clip_by_global_norm(max_norm)),
    }
