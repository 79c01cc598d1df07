"""numbaccum: optax-style gradient accumulation, averaging and clipping over flat buffers.

A parameter tree is flattened once into contiguous buffers (`FlatTree`); transformations with
optax's names and semantics drive parallel numba kernels over those buffers.
"""

from .accumulation import (
    ApplyEvery,
    EmaState,
    MultiSteps,
    MultiStepsState,
    TraceState,
    apply_every,
    ema,
    skip_large_updates,
    skip_not_finite,
    trace,
)
from .base import (
    EmptyState,
    GradientTransformation,
    GradientTransformationExtraArgs,
    apply_updates,
    apply_updates_,
    chain,
    copy_state,
    named_chain,
    with_extra_args_support,
)
from .clipping import (
    ApplyIfFiniteState,
    ClipByGlobalNormState,
    ClipState,
    ZeroNansState,
    apply_if_finite,
    clip,
    clip_by_block_rms,
    clip_by_global_norm,
    global_norm,
    normalize_by_update_norm,
    zero_nans,
)
from .flat import FlatTree, to_device, to_host
from .optim import (
    ScaleByAdamState,
    ScaleByScheduleState,
    adam,
    add_decayed_weights,
    identity,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    sgd,
)
from .privacy import (
    DifferentiallyPrivateAggregateState,
    differentially_private_aggregate,
    dpsgd,
    per_example_global_norm_clip,
    per_example_layer_norm_clip,
)
from .tree import tree_flatten, tree_map, tree_unflatten
from .warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "ApplyEvery",
    "ApplyIfFiniteState",
    "ClipByGlobalNormState",
    "ClipState",
    "DifferentiallyPrivateAggregateState",
    "EmaState",
    "EmptyState",
    "FlatTree",
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "MultiSteps",
    "MultiStepsState",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "TraceState",
    "ZeroNansState",
    "adam",
    "add_decayed_weights",
    "apply_every",
    "apply_if_finite",
    "apply_updates",
    "apply_updates_",
    "chain",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "copy_state",
    "differentially_private_aggregate",
    "dpsgd",
    "ema",
    "global_norm",
    "identity",
    "named_chain",
    "normalize_by_update_norm",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "sgd",
    "skip_large_updates",
    "skip_not_finite",
    "trace",
    "to_device",
    "to_host",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "warmup",
    "with_extra_args_support",
    "zero_nans",
]
