"""Compile the kernels ahead of the first training step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _config, _progress, arrays
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


def warmup(
    tx: Any = None,
    params: Any = None,
    *,
    dtypes: Sequence[Any] = ("float32", "float64"),
    backend: str = "auto",
    progress: bool | None = None,
) -> list[str]:
    """Compiles kernels ahead of the first training step, so that no step stalls on numba's
    compiler (about 2 s per kernel family on a small machine; with an empty kernel cache, the
    first emitting step of a ``MultiSteps`` loop would otherwise take seconds).

    ``warmup(tx, params)`` compiles exactly what ``tx`` runs on a tree like ``params``: its
    plan, through ``update`` then ``apply_updates_`` and through ``step_``, a whole cycle of every
    accumulation in it (the emitting step included), with gradients a clip leaves alone and
    gradients it scales. It runs on copies: nothing of the caller's changes.

    ``warmup(dtypes=..., backend=...)`` (no transformation) compiles the kernels behind the common
    transformations for ``dtypes``: each runs two steps on a small tree (the serial kernels) and
    on a tree above the parallel threshold (the parallel ones), on the CPU and, with ``backend``
    "cuda" or "auto" on a machine with a working CUDA device, on the GPU.

    With an empty kernel cache this takes seconds (8-18 s for the README's loop on a small
    machine); once its compiles have taken a second, each says on stderr what it compiled and
    which of warmup's steps it is at (``numbaccum: [warmup 3/8] compiled ...``), and the end
    says how many kernels were compiled in how long. Kernels loaded from the cache say nothing.

    Args:
        tx: the transformation the loop will run (or None).
        params: the parameters it will run on (their tree, shapes and dtypes; host or CUDA).
        dtypes: without ``tx``, the dtypes to compile for.
        backend: without ``tx``, "auto", "cpu" or "cuda".
        progress: whether to say on stderr what is compiling: None, unless the environment
            variable ``NUMBACCUM_PROGRESS`` is ``0``; False, never; True, always.

    Returns:
        The backends that were warmed up (``["cpu"]``, ``["cuda"]`` or ``["cpu", "cuda"]``).

    Raises:
        ValueError: ``backend`` is not "auto", "cpu" or "cuda".
        TypeError: a dtype is not float16, bfloat16, float32 or float64; ``tx`` without ``params``;
            ``params`` with a ``tx`` that is not a transformation; or what
            ``tx.init``/``tx.update`` raise on ``params``.

    References:
        JAX's ahead-of-time compilation, ``jax.jit(f).lower(*args).compile()``; numba's eager
        compilation (explicit signatures) and on-disk cache (``cache=True``).

    Examples:
        >>> import numpy as np, numbaccum as nba
        >>> params = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
        >>> tx = nba.MultiSteps(nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-3)), 4)
        >>> nba.warmup(tx, params)
        ['cpu']
    """
    if tx is not None and not (hasattr(tx, "init") and hasattr(tx, "update")):
        if params is not None:  # warmup(x, params) with an x that is not a transformation
            raise TypeError(
                f"warmup(tx, params): tx must be a transformation (with init and update), got "
                f"{type(tx).__name__}"
            )
        dtypes, tx = tx, None  # warmup(dtypes): the first argument was once the dtypes
    if tx is not None:
        if params is None:
            raise TypeError("warmup(tx, params): params is needed (the tree the loop runs on)")
        return _warm_plan(tx, params, progress)
    if backend not in ("auto", "cpu", "cuda"):
        raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', got {backend!r}")
    dts = [check_float_dtype(d, "dtypes") for d in dtypes]
    done = ["cpu"]
    targets = [False]
    if backend == "cuda" or (backend == "auto" and arrays.cuda_available()):
        targets.append(True)
        done.append("cuda")
    txs = _transformations()
    what = f"the common kernels ({', '.join(d.name for d in dts)}; {', '.join(done)})"
    with _progress.task("warmup", what, len(targets) * len(dts) * 2 * len(txs), progress) as advance:
        for on_gpu in targets:
            for dt in dts:
                for n in (8, _config.SERIAL_BELOW + 1):
                    tree = {"a": np.ones(n, dt), "b": np.full((2, 3), 0.5, dt)}
                    if on_gpu:
                        from .flat import to_device

                        tree = to_device(tree)
                    for tx in txs:
                        state = tx.init(tree)
                        for _ in range(2):
                            _, state = tx.update(tree, state, tree)
                        advance()
    return done


def _warm_plan(tx: Any, params: Any, progress: bool | None) -> list[str]:
    """`warmup` of ``tx`` on copies of ``params``: update + apply_updates_ and step_, a whole
    accumulation cycle (twice the longest in it) with small gradients, then with large ones
    (each such update and step one step of its `_progress.task`)."""
    from .apply import apply_updates_
    from .flat import FlatTree, layout_and_device
    from .passes import step_

    layout, device = layout_and_device(params, "params")
    tx = tx.gradient_transformation() if hasattr(tx, "gradient_transformation") else tx
    steps = 2 * _longest_cycle(tx)
    where = "cuda" if device else "cpu"
    groups = ", ".join(d.name for d in layout.group_dtypes)
    what = f"{_name(tx)} on {layout.num_leaves} leaves ({groups}; {where})"
    with _progress.task("warmup", what, 2 * steps, progress) as advance:
        for value in (1e-3, 1e3):  # a clip that leaves the updates alone, and one that scales them
            grads = FlatTree.zeros(layout, None, device).fill_(value).tree
            p_update, p_step = (FlatTree.zeros(layout, None, device).fill_(0.5) for _ in range(2))
            s_update, s_step = tx.init(p_update), tx.init(p_step)
            for _ in range(steps):
                u, s_update = tx.update(grads, s_update, p_update)
                apply_updates_(p_update, u)
                s_step = step_(tx, grads, s_step, p_step)
                advance()
    return [where]


def _name(tx: Any) -> str:
    """What `warmup` says it compiles for: the class of the stage behind ``tx`` (of ``tx`` itself
    for a foreign transformation), a chain's with its stages' (``Chain(ClipByGlobalNorm,
    ScaleByAdam)``)."""
    from .base import Chain, stage_of

    stage = stage_of(tx)
    name = type(tx if stage is None else stage).__name__.lstrip("_")
    if isinstance(stage, Chain):
        name += "(" + ", ".join(type(s).__name__.lstrip("_") for s in stage.stages) + ")"
    return name


def _longest_cycle(tx: Any) -> int:
    """The longest accumulation cycle in ``tx`` (MultiSteps' ``every_k_schedule`` at step 0,
    apply_every's ``k``), 1 if none."""
    from .accumulation import MultiSteps, _ApplyEvery
    from .base import Stage, stage_of

    longest, seen, todo = 1, set(), [stage_of(tx)]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            todo += list(obj)
            continue
        if not isinstance(obj, Stage):
            continue
        if isinstance(obj, MultiSteps):
            longest = max(longest, obj._schedule(np.int32(0)))  # (a schedule's value at step 0)
        elif isinstance(obj, _ApplyEvery):
            longest = max(longest, obj.k)
        todo += [v for name, v in vars(obj).items() if name != "_kept"]
    return longest
