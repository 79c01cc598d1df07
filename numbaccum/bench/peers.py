"""The peers timed beside numbaccum when they are installed: PyTorch's foreach ops and optax under
``jax.jit``, on the CPU or on a CUDA device. Each builder returns ``{operation: step}`` with
``step()`` doing one update of the same math as numbaccum's, or ``{}`` when the library (or its
GPU support) is missing. Imports happen here, inside the builders, never at ``import numbaccum``.

`PEERS` is the registry the runner reads: each peer runs in a process of its own (`worker`), so
its builder and availability check are named by import path, not passed as functions.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .baselines import B1, B2, DECAY, EPS, LR

Steps = dict[str, Callable[[], Any]]

FULL_MAX_NORM = 1.0  # the clip of the full step: MultiSteps(chain(clip_by_global_norm(1.0), adam))
ALL_OPS = ("clip", "multisteps", "ema")


@dataclass(frozen=True)
class Peer:
    """A library timed beside numbaccum.

    Attributes:
        label: the implementation's name in the table.
        modules: what must be importable for it to run (checked without importing them).
        install: how to install it, for the start of a run that lacks it.
        steps: ``"module:function"`` of its builder, called in the peer's process as
            ``function(params, grads, k, max_norm, device, ops)``.
        available: ``"module:function"`` taking the device, whether it runs there.
        warm: ``"module:function"`` taking the device, called as its process starts: it pays the
            library's one-time costs (lazy imports, its compiler's start) on a tiny tree, so that
            a row's budget measures the row.
        cuda_wall: on a GPU, time its calls by wall clock (its step blocks until ready) rather
            than between CUDA events.
    """

    label: str
    modules: tuple[str, ...]
    install: str
    steps: str
    available: str
    warm: str | None = None
    cuda_wall: bool = False

    def installed(self) -> bool:
        """Whether every module it needs can be found (without importing any: JAX and PyTorch
        take seconds and hundreds of MB to import, which the announcement must not wait for)."""
        return all(importlib.util.find_spec(m) is not None for m in self.modules)

    def version(self) -> str:
        """The installed versions of its distributions, e.g. ``"jax 0.10.2, optax 0.2.8"``."""
        out = []
        for m in self.modules:
            try:
                out.append(f"{m} {importlib.metadata.version(m)}")
            except importlib.metadata.PackageNotFoundError:
                out.append(m)
        return ", ".join(out)


PEERS: dict[str, Peer] = {
    "torch": Peer(
        "torch foreach",
        ("torch",),
        "pip install torch (the CPU build: --index-url https://download.pytorch.org/whl/cpu)",
        "numbaccum.bench.peers:torch_steps",
        "numbaccum.bench.peers:torch_available",
        "numbaccum.bench.peers:torch_warm",
    ),
    "optax": Peer(
        "optax jit",
        ("jax", "optax"),
        'pip install "numbaccum[bench]" (jax and optax)',
        "numbaccum.bench.peers:optax_steps",
        "numbaccum.bench.peers:optax_available",
        "numbaccum.bench.peers:optax_warm",
        cuda_wall=True,
    ),
}


def torch_available(device: str) -> bool:
    """Whether PyTorch is installed (and, for ``device="cuda"``, sees a GPU)."""
    try:
        import torch
    except ImportError:
        return False
    return device == "cpu" or bool(torch.cuda.is_available())


def torch_steps(
    params: list[np.ndarray],
    grads: list[np.ndarray],
    k: int,
    max_norm: float,
    device: str = "cpu",
    ops: Sequence[str] = ALL_OPS,
) -> Steps:
    """``torch._foreach_*``, ``clip_grad_norm_(foreach=True)`` and ``Adam(foreach=True)``.

    On the CPU the gradient tensors share the NumPy buffers (no copies); on ``"cuda"`` they are
    copies on the device. ``multisteps``: mean accumulate with ``_foreach_lerp_``; every k-th step
    the full step clips the mean to ``FULL_MAX_NORM`` in place, runs Adam and zeroes it. Only the
    steps of ``ops`` are built (a row holds the memory of its own operation only)."""
    if not torch_available(device):
        return {}
    import torch

    def tensor(x: np.ndarray) -> Any:
        t = torch.from_numpy(x)
        return t if device == "cpu" else t.to(device)

    g = [tensor(x) for x in grads]
    out: Steps = {}
    if "multisteps" in ops:
        out["multisteps"] = _torch_multisteps(torch, g, [tensor(x.copy()) for x in params], k)
    if "ema" in ops:
        ema = [torch.zeros_like(x) for x in g]
        box = {"count": 0}

        def ema_step() -> None:
            box["count"] += 1
            torch._foreach_lerp_(ema, g, 1 - DECAY)
            torch._foreach_div(ema, 1 - DECAY ** box["count"])

        out["ema"] = ema_step
    if "clip" in ops:
        clip_p = [torch.zeros_like(x).requires_grad_() for x in g]
        for t, x in zip(clip_p, g):
            t.grad = x.clone()
        out["clip"] = lambda: torch.nn.utils.clip_grad_norm_(clip_p, max_norm, foreach=True)
    return out


def torch_warm(device: str) -> None:
    """One step of each operation on a tree of one 2-element leaf: PyTorch's first optimizer step
    imports its compiler stack, seconds that belong to no row."""
    one = np.ones(2, np.float32)
    for step in torch_steps([one], [one], 1, 1.0, device).values():
        step()


def _torch_multisteps(torch: Any, g: list[Any], params: list[Any], k: int) -> Callable[[], None]:
    acc = [torch.zeros_like(x) for x in g]
    p = [x.requires_grad_() for x in params]
    for t, a in zip(p, acc):
        t.grad = a
    adam = torch.optim.Adam(p, lr=LR, betas=(B1, B2), eps=EPS, foreach=True)
    box = {"n": 0}

    def multisteps() -> None:
        box["n"] += 1
        torch._foreach_lerp_(acc, g, 1.0 / box["n"])
        if box["n"] == k:
            torch.nn.utils.clip_grad_norm_(p, FULL_MAX_NORM, foreach=True)  # clips acc (p.grad)
            with torch.no_grad():
                adam.step()
            torch._foreach_zero_(acc)
            box["n"] = 0

    return multisteps


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


def optax_warm(device: str) -> None:
    """One jitted step of each operation on a tree of one 2-element leaf: starts XLA's compiler."""
    one = np.ones(2, np.float32)
    for step in optax_steps([one], [one], 1, 1.0, device).values():
        step()


def optax_steps(
    params: list[np.ndarray],
    grads: list[np.ndarray],
    k: int,
    max_norm: float,
    device: str = "cpu",
    ops: Sequence[str] = ALL_OPS,
) -> Steps:
    """optax's transformations under ``jax.jit`` with the state donated (updated in place), on
    the CPU or the GPU (placed explicitly: on a GPU machine JAX's default device is the GPU).
    Only the steps of ``ops`` are built; each compiles on its first call."""
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
    txs = {
        "multisteps": lambda: optax.MultiSteps(full, k),
        "ema": lambda: optax.ema(DECAY),
        "clip": lambda: optax.clip_by_global_norm(max_norm),
    }
    return {op: stepper(txs[op]()) for op in ops}
