"""One registry of numbaccum's public transformations, for every test that loops over them.

Each `Case` builds one transformation with typical hyperparameters, the same transformation from
`tests/reference.py` where the reference has it, the keyword arguments that make its required
parameters valid (for the hostile-input test), and what the README claims about it:

- ``exact``: float32 (and float64) results equal the reference bit for bit, step after step
  (the README: "float32 results match optax's recipes bit for bit"); otherwise the comparison is
  per leaf within `_testutil.RTOL`.
- ``fusable``: a stage that `chain` may fuse with its neighbours (the fusion pool).
- ``cuda``: runs on the CUDA backend (every transformation does; a Case says no only with a
  reason in ``note``).
- ``per_example``: its updates carry a leading batch dimension.
- ``optax``: optax's own construction of the same transformation, from the optax module
  (``lambda optax: optax.amsgrad(1e-2)``); test_against_optax.py runs both where it is set.

`test_registry.py` checks that every name of ``numbaccum.__all__`` is either the ``public`` of
some Case or listed in `EXEMPT` with the reason it is not a transformation, so a new public
transformation cannot be forgotten by test_cuda, the fusion pool, the hostile constructors or
the reference tests: they all read this list.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import reference as ref

import numbaccum as nba


class Case(NamedTuple):
    public: str
    make: Callable[[], Any]
    reference: Callable[[], Any] | None = None
    required: dict | None = None
    exact: bool = False
    fusable: bool = True
    cuda: bool = True
    per_example: bool = False
    note: str = ""
    ref_state: bool = True  # the reference's state has numbaccum's field names (compare it)
    optax: Callable[[Any], Any] | None = None


def _ndim_mask(tree: Any) -> Any:
    return nba.tree_map(lambda x: np.ndim(x) > 1, tree)


def _stateless(fn: Callable[..., Any]) -> Callable[[], Any]:
    """A reference Transformation from a tree function ``fn(updates, params)``."""

    def make() -> Any:
        return ref.Transformation(lambda params: ref.EmptyState(), lambda u, s, p=None, **e: (fn(u, p), s))

    return make


def _ref_clip(max_delta: float) -> Callable[[], Any]:
    def clip(u: Any, p: Any) -> Any:
        return ref.tree_map(lambda x: np.clip(x, -x.dtype.type(max_delta), x.dtype.type(max_delta)), u)

    return _stateless(clip)


def _ref_slices(**kw: Any) -> Callable[[], Any]:
    return _stateless(lambda u, p: ref.scale_slices(u, **kw))


def _quietly(make: Callable[..., Any], *args: Any) -> Any:
    """``make(*args)`` without its DeprecationWarning (optax's deprecated optimistic_adam)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return make(*args)


def _skip_second_of_three(step: Any) -> Any:
    return step % 3 != 1  # (NumPy and JAX scalars alike)


def _even_steps(step: Any) -> Any:
    return step % 2 == 0


def _decaying_rate(count: Any) -> Any:
    """A learning-rate schedule of the step count, for NumPy and JAX counts alike (no int())."""
    return 0.1 / (1.0 + count)


def _sophia_hessian(f: Callable[[Any], Any]) -> Any:
    """A deterministic estimate ``f(params)`` of the Hessian's diagonal, for Sophia's Cases:
    computed on the host in each leaf's dtype, returned where the params live."""

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        if isinstance(params, nba.FlatTree):
            params = params.tree
        on_device = any(hasattr(x, "copy_to_host") for x in nba.tree_flatten(params)[0])
        host = nba.to_host(params) if on_device else params
        h = nba.tree_map(lambda p: np.asarray(f(np.asarray(p)), np.asarray(p).dtype), host)
        return (nba.to_device(h) if on_device else h), state

    return nba.GradientTransformation(lambda params: nba.EmptyState(), update)


def _jax_sophia_hessian(optax: Any, f: Callable[[Any], Any]) -> Any:
    """`_sophia_hessian` for optax's Sophia, in JAX."""
    import jax

    return optax.GradientTransformation(
        lambda params: optax.EmptyState(), lambda u, s, params=None: (jax.tree.map(f, params), s)
    )


CASES: dict[str, Case] = {}


def _add(name: str, public: str, make, reference=None, required=None, **kw) -> None:
    assert name not in CASES, name
    CASES[name] = Case(public, make, reference, required, **kw)


def _alike(name: str, public: str, build: Callable[[Any], Any], reference=None, optax=True, **kw) -> None:
    """A Case built by one call ``build(lib)`` of numbaccum and optax alike (``optax=False``: a
    transformation optax lacks), and of tests/reference.py unless ``reference`` builds the
    reference's otherwise."""
    reference = reference or (lambda: build(ref))
    _add(name, public, lambda: build(nba), reference, optax=build if optax else None, **kw)


def _adaptive(name: str, public: str, build: Callable[[Any], Any], reference=None) -> None:
    """`_alike` for numbaccum.adaptive's clippers: torchzero's, not optax's; the reference's state
    has fields of its own."""
    _alike(name, public, build, reference, optax=False, ref_state=False)


# The note of the Cases whose 1 / sqrt is rounded once more than the reference's
_RSQRT = "1 / sqrt in float64 then rounded, as optax's rsqrt is not 1 / sqrt in float32 either"


# --- accumulation and scaling ----------------------------------------------------------------
_add("identity", "identity", nba.identity, ref.identity, {}, exact=True)
_add("trace", "trace", lambda: nba.trace(0.9), lambda: ref.trace(0.9), {"decay": 0.9}, exact=True)
_add(
    "trace_nesterov",
    "trace",
    lambda: nba.trace(0.5, nesterov=True),
    lambda: ref.trace(0.5, nesterov=True),
    exact=True,
)
_add(
    "trace_nesterov_f64acc",
    "trace",
    lambda: nba.trace(0.9, nesterov=True, accumulator_dtype=np.float64),
    lambda: ref.trace(0.9, nesterov=True, accumulator_dtype=np.float64),
    exact=True,
)
_add("ema", "ema", lambda: nba.ema(0.9), lambda: ref.ema(0.9), {"decay": 0.9}, exact=True)
_add(
    "ema_nodebias",
    "ema",
    lambda: nba.ema(0.75, debias=False),
    lambda: ref.ema(0.75, debias=False),
    exact=True,
)
_add("scale", "scale", lambda: nba.scale(-0.3), lambda: ref.scale(-0.3), {"step_size": 0.5}, exact=True)
_add(
    "scale_by_learning_rate",
    "scale_by_learning_rate",
    lambda: nba.scale_by_learning_rate(lambda c: 0.1 / (1 + int(c))),
    lambda: ref.scale_by_learning_rate(lambda c: 0.1 / (1 + int(c))),
    {"learning_rate": 0.1},
    exact=True,
)
_add(
    "add_decayed_weights",
    "add_decayed_weights",
    lambda: nba.add_decayed_weights(0.1),
    lambda: ref.add_decayed_weights(0.1),
    {},
    exact=True,
)
_add(
    "add_decayed_weights_masked",
    "add_decayed_weights",
    lambda: nba.add_decayed_weights(0.1, _ndim_mask),
    lambda: ref.add_decayed_weights_masked(0.1, _ndim_mask),
    exact=True,
)
_add("scale_by_sign", "scale_by_sign", nba.scale_by_sign, ref.scale_by_sign, {}, exact=True)
_add(
    "sign_sgd",
    "sign_sgd",
    lambda: nba.sign_sgd(0.1),
    lambda: ref.sign_sgd(0.1),
    {"learning_rate": 1e-3},
    exact=True,
)
_add("sgd", "sgd", lambda: nba.sgd(0.1), lambda: ref.sgd(0.1), {"learning_rate": 0.1}, exact=True)
_add(
    "sgd_nesterov",
    "sgd",
    lambda: nba.sgd(0.1, momentum=0.9, nesterov=True),
    lambda: ref.sgd(0.1, momentum=0.9, nesterov=True),
    exact=True,
)
_add("apply_every", "apply_every", lambda: nba.apply_every(2), lambda: ref.apply_every(2), {}, fusable=False)
_add(
    "zero_nans",
    "zero_nans",
    nba.zero_nans,
    _stateless(lambda u, p: ref.tree_map(lambda x: np.where(np.isnan(x), x.dtype.type(0), x), u)),
    {},
    exact=True,
)

_add("set_to_zero", "set_to_zero", nba.set_to_zero, ref.set_to_zero, {}, exact=True)
_add(
    "keep_params_nonnegative",
    "keep_params_nonnegative",
    nba.keep_params_nonnegative,
    ref.keep_params_nonnegative,
    {},
    exact=True,
    optax=lambda o: o.keep_params_nonnegative(),
)
_add(
    "scale_by_schedule",
    "scale_by_schedule",
    lambda: nba.scale_by_schedule(lambda c: 0.5 / (1 + int(c))),
    lambda: ref.scale_by_schedule(lambda c: 0.5 / (1 + int(c))),
    {"step_size_fn": lambda c: 0.1},
    exact=True,
)
_add(
    "stateless",
    "stateless",
    lambda: nba.stateless(lambda u, p: nba.tree_map(lambda g: g * g.dtype.type(2), u)),
    lambda: ref.scale(2.0),
    None,  # its argument is user code (tests: test_user_transformations)
    exact=True,
    fusable=False,
    cuda=False,
    note="user code: what it does with CUDA arrays is its own (no numbaccum kernel runs)",
)
_add(
    "stateless_with_tree_map",
    "stateless_with_tree_map",
    lambda: nba.stateless_with_tree_map(lambda g, p: g * g.dtype.type(2)),
    lambda: ref.scale(2.0),
    None,
    exact=True,
    fusable=False,
    cuda=False,
    note="user code: what it does with CUDA arrays is its own (no numbaccum kernel runs)",
)


def _by_rank(tree: Any) -> Any:
    """A label per leaf: ``"matrix"`` for rank >= 2, ``"vector"`` otherwise."""
    return nba.tree_map(lambda x: "matrix" if np.ndim(x) > 1 else "vector", tree)


# --- Adam and optax's optimizer library ------------------------------------------------------
_add("scale_by_adam", "scale_by_adam", nba.scale_by_adam, ref.scale_by_adam, {}, exact=True)
_add("adam", "adam", lambda: nba.adam(1e-2), lambda: ref.adam(1e-2), {"learning_rate": 1e-3}, exact=True)
_add(
    "adam_eps_root",
    "adam",
    lambda: nba.adam(1e-2, b1=0.5, b2=0.75, eps=1e-3, eps_root=1e-4),
    lambda: ref.adam(1e-2, b1=0.5, b2=0.75, eps=1e-3, eps_root=1e-4),
    exact=True,
)
_alike("adam_nesterov", "adam", lambda L: L.adam(1e-2, nesterov=True), lambda: ref.nadam(1e-2), exact=True)
_add(
    "scale_by_nadam",
    "scale_by_nadam",
    nba.scale_by_nadam,
    ref.scale_by_nadam,
    {},
    exact=True,
)
_add(
    "nadam",
    "nadam",
    lambda: nba.nadam(1e-2),
    lambda: ref.nadam(1e-2),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.nadam(1e-2),
)
_alike("nadam_b1", "nadam", lambda L: L.nadam(1e-2, b1=0.8), exact=True)
# optax's nadam and nadamw are adam and adamw with nesterov=True by default (issue 47)
_alike(
    "nadam_nesterov_false",
    "nadam",
    lambda L: L.nadam(1e-2, nesterov=False),
    lambda: ref.adam(1e-2),
    exact=True,
)
_add(
    "adamw",
    "adamw",
    lambda: nba.adamw(1e-2, weight_decay=0.1),
    lambda: ref.adamw(1e-2, weight_decay=0.1),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.adamw(1e-2, weight_decay=0.1),
)
_alike("adamw_schedule_nesterov", "adamw", lambda L: L.adamw(_decaying_rate, nesterov=True), exact=True)
_alike("adamw_nesterov_masked", "adamw", lambda L: L.adamw(1e-2, nesterov=True, mask=_ndim_mask), exact=True)
_add(
    "nadamw",
    "nadamw",
    lambda: nba.nadamw(1e-2, weight_decay=0.1),
    lambda: ref.adamw(1e-2, weight_decay=0.1, nesterov=True),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.nadamw(1e-2, weight_decay=0.1),
)
_alike(
    "nadamw_nesterov_false",
    "nadamw",
    lambda L: L.nadamw(1e-2, weight_decay=0.1, nesterov=False),
    lambda: ref.adamw(1e-2, weight_decay=0.1),
    exact=True,
)
_add(
    "amsgrad",
    "amsgrad",
    lambda: nba.amsgrad(1e-2),
    lambda: ref.amsgrad(1e-2),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.amsgrad(1e-2),
)
_alike("amsgrad_schedule", "amsgrad", lambda L: L.amsgrad(_decaying_rate), exact=True)
_alike(
    "amsgrad_no_corrections",
    "amsgrad",
    lambda L: L.amsgrad(1e-2, bias_correction_mu=False, bias_correction_nu=False),
    exact=True,
)
_add("scale_by_amsgrad", "scale_by_amsgrad", nba.scale_by_amsgrad, None, {})
_add(
    "adamax",
    "adamax",
    lambda: nba.adamax(1e-2),
    lambda: ref.adamax(1e-2),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.adamax(1e-2),
)
_add("scale_by_adamax", "scale_by_adamax", nba.scale_by_adamax, None, {})
_add(
    "yogi",
    "yogi",
    lambda: nba.yogi(1e-2),
    lambda: ref.yogi(1e-2),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.yogi(1e-2),
)
_YOGI = {"b1": 0.5, "b2": 0.75, "eps": 1e-4, "eps_root": 1e-5, "initial_accumulator_value": 0.5}
_add(
    "scale_by_yogi",
    "scale_by_yogi",
    lambda: nba.scale_by_yogi(**_YOGI),
    lambda: ref.scale_by_yogi(**_YOGI),
    {},
    exact=True,
    optax=lambda o: o.scale_by_yogi(**_YOGI),
)
_add(
    "adabelief",
    "adabelief",
    lambda: nba.adabelief(1e-2),
    lambda: ref.adabelief(1e-2),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.adabelief(1e-2),
)
_add(
    "adabelief_nesterov",
    "adabelief",
    lambda: nba.adabelief(1e-2, nesterov=True),
    lambda: ref.adabelief(1e-2, nesterov=True),
    exact=True,
    optax=lambda o: o.adabelief(1e-2, nesterov=True),
)
_add("scale_by_belief", "scale_by_belief", nba.scale_by_belief, None, {})
_add(
    "lion",
    "lion",
    lambda: nba.lion(1e-2),
    lambda: ref.lion(1e-2),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.lion(1e-2),
)
_alike("lion_weight_decay", "lion", lambda L: L.lion(1e-2, weight_decay=0.1), exact=True)
_add("scale_by_lion", "scale_by_lion", nba.scale_by_lion, ref.scale_by_lion, {}, exact=True)
_add(
    "scale_by_lion_smooth",
    "scale_by_lion",
    lambda: nba.scale_by_lion(mode="smooth", smooth_beta=2.0),
    lambda: ref.scale_by_lion(mode="smooth", smooth_beta=2.0),
    exact=False,
    note="tanh: NumPy's and the compiled libm's float32 tanh may differ in the last bit",
    optax=lambda o: o.scale_by_lion(mode="smooth", smooth_beta=2.0),
)
_add(
    "scale_by_lion_refined",
    "scale_by_lion",
    lambda: nba.scale_by_lion(mode="refined"),
    lambda: ref.scale_by_lion(mode="refined"),
    exact=True,
)
_add(
    "rmsprop",
    "rmsprop",
    lambda: nba.rmsprop(1e-2, eps_in_sqrt=False),
    lambda: ref.rmsprop(1e-2, eps_in_sqrt=False),
    {"learning_rate": 1e-3},
    exact=True,
)
_add(
    "rmsprop_bias_correction",
    "rmsprop",
    lambda: nba.rmsprop(1e-2, bias_correction=True, initial_scale=0.5),
    lambda: ref.rmsprop(1e-2, bias_correction=True, initial_scale=0.5),
    exact=False,
    note=_RSQRT,
)
_add(
    "rmsprop_centered_momentum",
    "rmsprop",
    lambda: nba.rmsprop(1e-2, centered=True, momentum=0.9, nesterov=True),
    lambda: ref.rmsprop(1e-2, centered=True, momentum=0.9, nesterov=True),
    exact=False,
    note=_RSQRT,
)
_add(
    "rmsprop_centered_bc_eps_out",
    "rmsprop",
    lambda: nba.rmsprop(1e-2, centered=True, bias_correction=True, eps_in_sqrt=False, eps=1e-3),
    lambda: ref.rmsprop(1e-2, centered=True, bias_correction=True, eps_in_sqrt=False, eps=1e-3),
    exact=True,
)
_alike("rmsprop_eps_in_sqrt", "rmsprop", lambda L: L.rmsprop(1e-2), note=_RSQRT)
_alike("rmsprop_centered_only", "rmsprop", lambda L: L.rmsprop(1e-2, centered=True), note=_RSQRT)
# Momentum 0.75: with 0.5 or 0.9 a trace element of test_bitexact's data cancels (a step's update
# against the last one's, 8e-6 relative apart after 1 / sqrt's one-ulp rounding), past its rtol.
_alike(
    "rmsprop_bias_correction_momentum",
    "rmsprop",
    lambda L: L.rmsprop(1e-2, bias_correction=True, momentum=0.75),
    note=_RSQRT,
)
_RMSPROP_EVERY_OPTION = {
    "eps_in_sqrt": False,
    "centered": True,
    "momentum": 0.9,
    "nesterov": True,
    "bias_correction": True,
}
_alike(
    "rmsprop_every_option",
    "rmsprop",
    lambda L: L.rmsprop(_decaying_rate, 0.8, 1e-6, 0.5, **_RMSPROP_EVERY_OPTION),
    exact=True,
)
_add("scale_by_rms", "scale_by_rms", nba.scale_by_rms, None, {})
_add("scale_by_stddev", "scale_by_stddev", nba.scale_by_stddev, None, {})
_add(
    "adagrad",
    "adagrad",
    lambda: nba.adagrad(0.1),
    lambda: ref.adagrad(0.1),
    {"learning_rate": 1e-3},
    exact=False,
    note=_RSQRT,
    optax=lambda o: o.adagrad(0.1),
)
_alike("adagrad_from_zero", "adagrad", lambda L: L.adagrad(0.1, 0.0), note=_RSQRT)
_add("scale_by_rss", "scale_by_rss", nba.scale_by_rss, None, {})

# --- clipping and the norm family ------------------------------------------------------------
_add("clip", "clip", lambda: nba.clip(0.5), _ref_clip(0.5), {"max_delta": 1.0}, exact=True)
_add(
    "clip_by_global_norm",
    "clip_by_global_norm",
    lambda: nba.clip_by_global_norm(1.0),
    _ref_slices(dim="global", max_norm=1.0),
    {"max_norm": 1.0},
    note="the norm's sum runs in another order than the reference's",
)
_add("clip_by_block_rms", "clip_by_block_rms", lambda: nba.clip_by_block_rms(0.3), None, {"threshold": 1.0})
_add(
    "normalize_by_update_norm",
    "normalize_by_update_norm",
    lambda: nba.normalize_by_update_norm(2.0),
    None,
    {},
)
_add(
    "clip_norm_rows",
    "clip_norm",
    lambda: nba.clip_norm(1.0, dim=1),
    _ref_slices(dim=1, max_norm=1.0),
    {"max_norm": 1.0},
)
_add("clip_norm_p3", "clip_norm", lambda: nba.clip_norm(0.5, ord=3), _ref_slices(ord=3, max_norm=0.5))
_add(
    "normalize_std_inverse",
    "normalize",
    lambda: nba.normalize(0.5, ord="std", dim=1, inverse_dims=True),
    _ref_slices(ord="std", dim=1, inverse_dims=True, norm_value=0.5),
    {},
)
_add(
    "normalize_global_l1",
    "normalize",
    lambda: nba.normalize(2.0, ord=1, dim="global"),
    _ref_slices(ord=1, dim="global", norm_value=2.0),
)
_add("centralize", "centralize", nba.centralize, _stateless(lambda u, p: ref.centralize(u)), {})
_add(
    "adaptive_grad_clip",
    "adaptive_grad_clip",
    lambda: nba.adaptive_grad_clip(0.05),
    _stateless(lambda u, p: ref.adaptive_grad_clip(u, p, 0.05)),
    {"clipping": 0.1},
)
_add(
    "clip_norm_by_ema",
    "clip_norm_by_ema",
    lambda: nba.clip_norm_by_ema(0.9),
    lambda: ref.clip_norm_by_ema(0.9),
    {},
    ref_state=False,
)
_adaptive("clip_norm_by_ema_beta_half", "clip_norm_by_ema", lambda L: L.clip_norm_by_ema(beta=0.5))
_add(
    "normalize_by_ema",
    "normalize_by_ema",
    lambda: nba.normalize_by_ema(0.9),
    lambda: ref.clip_norm_by_ema(0.9, normalize=True),
    {},
    ref_state=False,
)
_adaptive(
    "normalize_by_ema_global",
    "normalize_by_ema",
    lambda L: L.normalize_by_ema(beta=0.5, tensorwise=False),
    lambda: ref.clip_norm_by_ema(beta=0.5, tensorwise=False, normalize=True),
)
_add(
    "clip_value_by_ema",
    "clip_value_by_ema",
    lambda: nba.clip_value_by_ema(0.9),
    lambda: ref.clip_value_by_ema(0.9),
    {},
    ref_state=False,
)
_adaptive("clip_value_by_ema_beta_half", "clip_value_by_ema", lambda L: L.clip_value_by_ema(beta=0.5))
_add(
    "clip_norm_growth",
    "clip_norm_growth",
    nba.clip_norm_growth,
    ref.clip_norm_growth,
    {},
    ref_state=False,
)
_add(
    "clip_value_growth",
    "clip_value_growth",
    lambda: nba.clip_value_growth(add=0.5),
    lambda: ref.clip_value_growth(add=0.5),
    {},
    ref_state=False,
)
_adaptive("clip_value_growth_add_one", "clip_value_growth", lambda L: L.clip_value_growth(add=1.0))

# --- wrappers and combinators ----------------------------------------------------------------
_add(
    "chain_decay",
    "chain",
    lambda: nba.chain(nba.trace(0.5), nba.add_decayed_weights(1e-2), nba.scale(-0.1)),
    lambda: ref.chain(ref.trace(0.5), ref.add_decayed_weights(1e-2), ref.scale(-0.1)),
    exact=True,
    fusable=False,
)
_add(
    "named_chain",
    "named_chain",
    lambda: nba.named_chain(("clip", nba.clip_by_global_norm(1.0)), ("adam", nba.adam(1e-2))),
    None,
    fusable=False,
)
_add(
    "masked_trace",
    "masked",
    lambda: nba.masked(nba.chain(nba.scale(2.0), nba.trace(0.9)), _ndim_mask),
    lambda: ref.masked(ref.chain(ref.scale(2.0), ref.trace(0.9)), _ndim_mask),
    {"inner": nba.sgd(0.1), "mask": _ndim_mask},
    exact=True,
    fusable=False,
)
_add(
    "adamaxw",
    "adamaxw",
    lambda: nba.adamaxw(1e-2, weight_decay=0.1),
    lambda: ref.adamaxw(1e-2, weight_decay=0.1),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.adamaxw(1e-2, weight_decay=0.1),
)
_add(
    "radam",
    "radam",
    lambda: nba.radam(1e-2),
    lambda: ref.radam(1e-2),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.radam(1e-2),
)
_add(
    "scale_by_radam_nesterov",
    "scale_by_radam",
    lambda: nba.scale_by_radam(threshold=3.0, nesterov=True),
    lambda: ref.scale_by_radam(threshold=3.0, nesterov=True),
    {},
    exact=True,
    optax=lambda o: o.scale_by_radam(threshold=3.0, nesterov=True),
)
_add(
    "adadelta",
    "adadelta",
    lambda: nba.adadelta(0.5, weight_decay=0.01),
    lambda: ref.adadelta(0.5, weight_decay=0.01),
    {},
    exact=True,
    optax=lambda o: o.adadelta(0.5, weight_decay=0.01),
)
_add("scale_by_adadelta", "scale_by_adadelta", nba.scale_by_adadelta, ref.scale_by_adadelta, {}, exact=True)
_add(
    "lamb",
    "lamb",
    lambda: nba.lamb(1e-2, weight_decay=0.1),
    lambda: ref.lamb(1e-2, weight_decay=0.1),
    {"learning_rate": 1e-3},
    fusable=False,
    note="per-leaf norms in float64 (summed in the engine's order): within rounding of the reference",
    optax=lambda o: o.lamb(1e-2, weight_decay=0.1),
)
_add(
    "lars",
    "lars",
    lambda: nba.lars(0.5, weight_decay=0.01, trust_coefficient=0.01),
    lambda: ref.lars(0.5, weight_decay=0.01, trust_coefficient=0.01),
    {"learning_rate": 1e-3},
    fusable=False,
    note="per-leaf norms in float64 (summed in the engine's order): within rounding of the reference",
    optax=lambda o: o.lars(0.5, weight_decay=0.01, trust_coefficient=0.01),
)
_add(
    "scale_by_trust_ratio",
    "scale_by_trust_ratio",
    lambda: nba.scale_by_trust_ratio(min_norm=0.1, trust_coefficient=0.5, eps=1e-3),
    lambda: ref.scale_by_trust_ratio(min_norm=0.1, trust_coefficient=0.5, eps=1e-3),
    {},
    fusable=False,
    note="per-leaf norms in float64 (summed in the engine's order): within rounding of the reference",
    optax=lambda o: o.scale_by_trust_ratio(min_norm=0.1, trust_coefficient=0.5, eps=1e-3),
)
_add(
    "signum",
    "signum",
    lambda: nba.signum(1e-2),
    lambda: ref.signum(1e-2),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.signum(1e-2),
)
_add(
    "rprop",
    "rprop",
    lambda: nba.rprop(1e-2),
    lambda: ref.rprop(1e-2),
    {"learning_rate": 1e-3},
    exact=True,
    note="the current step, as torch.optim.Rprop: optax 0.2.8 emits the previous one (its PR #1725)",
)
_add(
    "scale_by_rprop",
    "scale_by_rprop",
    lambda: nba.scale_by_rprop(0.05, 0.3, 1.5, 1e-3, 0.07),
    lambda: ref.scale_by_rprop(0.05, 0.3, 1.5, 1e-3, 0.07),
    {"learning_rate": 1e-3},
    exact=True,
)
_add(
    "adan",
    "adan",
    lambda: nba.adan(1e-2, weight_decay=0.01),
    lambda: ref.adan(1e-2, weight_decay=0.01),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.adan(1e-2, weight_decay=0.01),
)
_add(
    "scale_by_adan",
    "scale_by_adan",
    lambda: nba.scale_by_adan(eps_root=1e-8),
    lambda: ref.scale_by_adan(eps_root=1e-8),
    {},
    exact=True,
)
_add(
    "fromage",
    "fromage",
    lambda: nba.fromage(0.3),
    lambda: ref.fromage(0.3),
    {"learning_rate": 1e-3},
    fusable=False,
    note="per-leaf norms in float64 (summed in the engine's order): within rounding of the reference",
    optax=lambda o: o.fromage(0.3),
)
# Dyadic alpha and beta: with 0.7 and 0.4 the first step's (alpha + beta) g - beta g is a bfloat16
# tie for some g in exact arithmetic, broken either way by float32's and float64's rounding noise.
_add(
    "scale_by_optimistic_gradient",
    "scale_by_optimistic_gradient",
    lambda: nba.scale_by_optimistic_gradient(0.75, 0.375),
    lambda: ref.scale_by_optimistic_gradient(0.75, 0.375),
    {},
    exact=True,
    optax=lambda o: o.scale_by_optimistic_gradient(0.75, 0.375),
)
_add(
    "optimistic_gradient_descent",
    "optimistic_gradient_descent",
    lambda: nba.optimistic_gradient_descent(0.1, 0.75, 0.375),
    lambda: ref.optimistic_gradient_descent(0.1, 0.75, 0.375),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.optimistic_gradient_descent(0.1, 0.75, 0.375),
)
_add(
    "optimistic_adam_v2",
    "optimistic_adam_v2",
    lambda: nba.optimistic_adam_v2(1e-2, alpha=0.8, beta=0.5),
    lambda: ref.optimistic_adam_v2(1e-2, alpha=0.8, beta=0.5),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.optimistic_adam_v2(1e-2, alpha=0.8, beta=0.5),
)
_add(
    "optimistic_adam",
    "optimistic_adam",
    lambda: _quietly(nba.optimistic_adam, 1e-2, 0.5),
    lambda: ref.optimistic_adam_v2(1.0, alpha=1e-2, beta=0.5),
    {"learning_rate": 1e-3},
    exact=True,
    note="deprecated in optax (a DeprecationWarning): optimistic_adam_v2 with the rate as alpha",
    optax=lambda o: _quietly(o.optimistic_adam, 1e-2, 0.5),
)
_add(
    "conditionally_transform",
    "conditionally_transform",
    lambda: nba.conditionally_transform(nba.adam(1e-2), _skip_second_of_three),
    lambda: ref.conditionally_transform(ref.adam(1e-2), _skip_second_of_three),
    {"inner": nba.sgd(0.1), "should_transform_fn": _skip_second_of_three},
    exact=True,
    fusable=False,
    optax=lambda o: o.conditionally_transform(o.adam(1e-2), _skip_second_of_three),
)
_add(
    "conditionally_mask",
    "conditionally_mask",
    lambda: nba.conditionally_mask(nba.chain(nba.scale(0.5), nba.sgd(0.1, momentum=0.9)), _even_steps),
    lambda: ref.conditionally_mask(ref.chain(ref.scale(0.5), ref.sgd(0.1, momentum=0.9)), _even_steps),
    {"inner": nba.sgd(0.1), "should_transform_fn": _even_steps},
    exact=True,
    fusable=False,
    optax=lambda o: o.conditionally_mask(o.chain(o.scale(0.5), o.sgd(0.1, momentum=0.9)), _even_steps),
)
_add(
    "add_noise",
    "add_noise",
    lambda: nba.add_noise(0.01, 0.55, key=3),
    lambda: ref.add_noise(0.01, 0.55, key=3),
    {"eta": 0.01, "gamma": 0.55, "key": 0},
    note="Philox4x32-10 draws, not JAX's: the reference's own Philox and NumPy's log and cos",
)
_add(
    "noisy_sgd",
    "noisy_sgd",
    lambda: nba.noisy_sgd(0.1, key=3),
    lambda: ref.noisy_sgd(0.1, key=3),
    {"learning_rate": 0.1, "key": 0},
    note="Philox4x32-10 draws, not JAX's: the reference's own Philox and NumPy's log and cos",
)
_add(
    "novograd",
    "novograd",
    lambda: nba.novograd(1e-2, weight_decay=0.1),
    lambda: ref.novograd(1e-2, weight_decay=0.1),
    {"learning_rate": 1e-3},
    fusable=False,
    note="per-leaf norms in float64 (summed in the engine's order): within rounding of the reference",
    optax=lambda o: o.novograd(1e-2, weight_decay=0.1),
)
_add(
    "scale_by_novograd",
    "scale_by_novograd",
    lambda: nba.scale_by_novograd(0.8, 0.5, 1e-3, 1e-4),
    lambda: ref.scale_by_novograd(0.8, 0.5, 1e-3, 1e-4),
    {},
    fusable=False,
    note="per-leaf norms in float64 (summed in the engine's order): within rounding of the reference",
    optax=lambda o: o.scale_by_novograd(0.8, 0.5, 1e-3, 1e-4),
)
_add(
    "scale_by_distance_over_gradients",
    "scale_by_distance_over_gradients",
    lambda: nba.scale_by_distance_over_gradients(1e-3, 1e-6, global_scale=-0.5),
    lambda: ref.scale_by_distance_over_gradients(1e-3, 1e-6, global_scale=-0.5),
    {},
    fusable=False,
    note="per-leaf norms in float64 (summed in the engine's order): within rounding of the reference",
    optax=lambda o: o.scale_by_distance_over_gradients(1e-3, 1e-6, global_scale=-0.5),
)
_add(
    "scale_by_factored_rms",
    "scale_by_factored_rms",
    lambda: nba.scale_by_factored_rms(min_dim_size_to_factor=2),
    lambda: ref.scale_by_factored_rms(min_dim_size_to_factor=2),
    {},
    fusable=False,
    note="row and column means in float64, factors in float64: within rounding of the reference",
    optax=lambda o: o.scale_by_factored_rms(min_dim_size_to_factor=2),
)
_add(
    "scale_by_factored_rms_unfactored",
    "scale_by_factored_rms",
    lambda: nba.scale_by_factored_rms(False, decay_rate=0.5, step_offset=-2, epsilon=1e-6),
    lambda: ref.scale_by_factored_rms(False, decay_rate=0.5, step_offset=-2, epsilon=1e-6),
    fusable=False,
    note="every leaf keeps a full second moment (RMSProp with Adafactor's decay schedule)",
    optax=lambda o: o.scale_by_factored_rms(False, decay_rate=0.5, step_offset=-2, epsilon=1e-6),
)
_add(
    "scale_by_sm3",
    "scale_by_sm3",
    lambda: nba.scale_by_sm3(0.5, 0.9),
    lambda: ref.scale_by_sm3(0.5, 0.9),
    {},
    fusable=False,
    note="1 / sqrt in place of optax's rsqrt: within rounding of the reference",
    optax=lambda o: o.scale_by_sm3(0.5, 0.9),
)
_add(
    "sm3",
    "sm3",
    lambda: nba.sm3(0.1),
    lambda: ref.sm3(0.1),
    {"learning_rate": 0.1},
    fusable=False,
    note="1 / sqrt in place of optax's rsqrt: within rounding of the reference",
    optax=lambda o: o.sm3(0.1),
)
_add(
    "adafactor",
    "adafactor",
    lambda: nba.adafactor(1e-2, 2, momentum=0.9, dtype_momentum=None, weight_decay_rate=1e-3),
    None,
    {},
    fusable=False,
    note="a chain of scale_by_factored_rms and block-RMS stages: compared with optax",
    optax=lambda o: o.adafactor(1e-2, 2, momentum=0.9, dtype_momentum=None, weight_decay_rate=1e-3),
)
_add(
    "adafactor_defaults",
    "adafactor",
    nba.adafactor,
    None,
    {},
    fusable=False,
    note="no learning rate: the relative step of the parameter scale alone",
    optax=lambda o: o.adafactor(),
)
_add(
    "snapshot",
    "snapshot",
    lambda: nba.snapshot("norm", nba.global_norm),
    _stateless(lambda u, p: ref.tree_map(np.copy, u)),
    {"measure_name": "norm", "measure": nba.global_norm},
    exact=True,
    fusable=False,
    ref_state=False,
)
_add(
    "scale_by_lbfgs",
    "scale_by_lbfgs",
    lambda: nba.scale_by_lbfgs(memory_size=3),
    lambda: ref.scale_by_lbfgs(memory_size=3),
    {},
    fusable=False,
    ref_state=False,
    note="inner products in float64 (summed in the engine's order): within rounding of the reference",
    optax=lambda o: o.scale_by_lbfgs(memory_size=3),
)
_add(
    "adopt",
    "adopt",
    lambda: nba.adopt(1e-2),
    lambda: ref.adopt(1e-2),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.contrib.adopt(1e-2),
)
_add(
    "scale_by_adopt_nesterov",
    "scale_by_adopt",
    lambda: nba.scale_by_adopt(b2=0.99, nesterov=True, clip_value_fn=lambda c: 0.5 + c),
    lambda: ref.scale_by_adopt(b2=0.99, nesterov=True, clip_value_fn=lambda c: 0.5 + c),
    {},
    exact=True,
)
# ACProp: no NumPy reference; optax.contrib's is the peer (its eager float32 and float64 bits
# equal ours; under jit within XLA's rounding, which test_against_optax.py allows).
_ACPROP = {"b1": 0.8, "b2": 0.9, "eps": 1e-6, "eps_root": 1e-8}
_add(
    "acprop",
    "acprop",
    lambda: nba.acprop(1e-2, weight_decay=0.1),
    None,
    {"learning_rate": 1e-3},
    optax=lambda o: o.contrib.acprop(1e-2, weight_decay=0.1),
)
_add(
    "scale_by_acprop",
    "scale_by_acprop",
    lambda: nba.scale_by_acprop(**_ACPROP),
    None,
    {},
    optax=lambda o: o.contrib.scale_by_acprop(**_ACPROP),
)
_add(
    "ademamix",
    "ademamix",
    lambda: nba.ademamix(1e-2, weight_decay=0.1),
    lambda: ref.ademamix(1e-2, weight_decay=0.1),
    {"learning_rate": 1e-3},
    exact=True,
    optax=lambda o: o.contrib.ademamix(1e-2, weight_decay=0.1),
)
_add(
    "scale_by_ademamix_schedules",
    "scale_by_ademamix",
    lambda: nba.scale_by_ademamix(b3=lambda c: 0.9 + 0.01 * c, alpha=lambda c: 1.0 + c),
    lambda: ref.scale_by_ademamix(b3=lambda c: 0.9 + 0.01 * c, alpha=lambda c: 1.0 + c),
    {},
    exact=True,
)
_add(
    "simplified_ademamix",
    "simplified_ademamix",
    lambda: nba.simplified_ademamix(1e-2, alpha=2.0, weight_decay=0.1),
    None,
    {"learning_rate": 1e-3},
    optax=lambda o: o.contrib.simplified_ademamix(1e-2, alpha=2.0, weight_decay=0.1),
)
_add(
    "scale_by_simplified_ademamix_schedule",
    "scale_by_simplified_ademamix",
    lambda: nba.scale_by_simplified_ademamix(b2=0.9, alpha=lambda c: 1.0 + c, eps_root=1e-6),
    None,
    {},
    optax=lambda o: o.contrib.scale_by_simplified_ademamix(b2=0.9, alpha=lambda c: 1.0 + c, eps_root=1e-6),
)
# Sophia with a deterministic Hessian estimate (the registry's tests pass no hvp_fn; the
# Hutchinson estimator and the hvp_fn/grad_fn interface: tests/test_sophia.py). params + 0.25 is
# negative in places: gamma nu floored by eps there, so the clip acts too.
_SOPHIA_HESSIAN = _sophia_hessian(lambda p: p + 0.25)
_SOPHIA_HESSIAN_POSITIVE = _sophia_hessian(lambda p: p * p + 0.25)
_add(
    "sophia",
    "sophia",
    lambda: nba.sophia(
        1e-2, b2=0.5, weight_decay=0.1, gamma=2.0, update_interval=2, hessian_diagonal_fn=_SOPHIA_HESSIAN
    ),
    lambda: ref.sophia(
        1e-2, b2=0.5, weight_decay=0.1, gamma=2.0, update_interval=2, hessian_diagonal_fn=_SOPHIA_HESSIAN
    ),
    {"learning_rate": 1e-3, "hessian_diagonal_fn": _SOPHIA_HESSIAN},
    exact=True,
    optax=lambda o: o.contrib.sophia(
        1e-2,
        b2=0.5,
        weight_decay=0.1,
        gamma=2.0,
        update_interval=2,
        hessian_diagonal_fn=_jax_sophia_hessian(o, lambda p: p + 0.25),
    ),
)
_add(
    "scale_by_sophia_no_clip",
    "scale_by_sophia",
    lambda: nba.scale_by_sophia(
        b1=0.5,
        b2=0.75,
        gamma=0.5,
        clip_threshold=None,
        update_interval=3,
        hessian_diagonal_fn=_SOPHIA_HESSIAN_POSITIVE,
    ),
    lambda: ref.scale_by_sophia(
        b1=0.5,
        b2=0.75,
        gamma=0.5,
        clip_threshold=None,
        update_interval=3,
        hessian_diagonal_fn=_SOPHIA_HESSIAN_POSITIVE,
    ),
    {"hessian_diagonal_fn": _SOPHIA_HESSIAN},
    exact=True,
    optax=lambda o: o.contrib._sophia.scale_by_sophia(  # (not in optax.contrib's public names)
        b1=0.5,
        b2=0.75,
        gamma=0.5,
        clip_threshold=None,
        update_interval=3,
        hessian_diagonal_fn=_jax_sophia_hessian(o, lambda p: p * p + 0.25),
    ),
)
_add(
    "scale_by_param_block_norm",
    "scale_by_param_block_norm",
    nba.scale_by_param_block_norm,
    ref.scale_by_param_block_norm,
    {},
    fusable=False,
    note="per-leaf norms in float64 (summed in the engine's order): within rounding of the reference",
    optax=lambda o: o.scale_by_param_block_norm(),
)
_add(
    "scale_by_param_block_rms",
    "scale_by_param_block_rms",
    lambda: nba.scale_by_param_block_rms(0.5),
    lambda: ref.scale_by_param_block_rms(0.5),
    {},
    fusable=False,
    note="per-leaf norms in float64 (summed in the engine's order): within rounding of the reference",
    optax=lambda o: o.scale_by_param_block_rms(0.5),
)
_add(
    "schedule_free_sgd",
    "schedule_free_sgd",
    lambda: nba.schedule_free_sgd(0.1, weight_decay=0.01),
    None,
    {},
    fusable=False,
    optax=lambda o: o.contrib.schedule_free_sgd(0.1, weight_decay=0.01),
)
_add(
    "schedule_free_adamw",
    "schedule_free_adamw",
    lambda: nba.schedule_free_adamw(1e-2, warmup_steps=3, weight_decay=0.1),
    None,
    {},
    fusable=False,
    optax=lambda o: o.contrib.schedule_free_adamw(1e-2, warmup_steps=3, weight_decay=0.1),
)
_add(
    "schedule_free_adam",
    "schedule_free",
    lambda: nba.schedule_free(nba.adam(0.05, b1=0.0), 0.05, b1=0.8),
    None,
    {"base_optimizer": nba.sgd(0.1), "learning_rate": 0.1},
    fusable=False,
    optax=lambda o: o.contrib.schedule_free(o.adam(0.05, b1=0.0), 0.05, b1=0.8),
)
_add(
    "dadapt_adamw",
    "dadapt_adamw",
    lambda: nba.dadapt_adamw(weight_decay=0.1),
    None,
    {},
    fusable=False,
    note="its inner products and L1 norm in float64: within rounding of optax.contrib's",
    optax=lambda o: o.contrib.dadapt_adamw(weight_decay=0.1),
)
_add(
    "prodigy",
    "prodigy",
    lambda: nba.prodigy(weight_decay=0.01),
    None,
    {},
    fusable=False,
    note="its inner products and L1 norm in float64: within rounding of optax.contrib's",
    optax=lambda o: o.contrib.prodigy(weight_decay=0.01),
)
_add(
    "partition",
    "partition",
    lambda: nba.partition({"matrix": nba.adam(1e-2), "vector": nba.sgd(0.1, momentum=0.9)}, _by_rank),
    lambda: ref.partition({"matrix": ref.adam(1e-2), "vector": ref.sgd(0.1, momentum=0.9)}, _by_rank),
    {"transforms": {"a": nba.sgd(0.1)}, "param_labels": "a"},
    fusable=False,
)
_add(
    "multi_transform",
    "multi_transform",
    lambda: nba.multi_transform({"matrix": nba.trace(0.9), "vector": nba.scale(-1.0)}, _by_rank),
    lambda: ref.partition({"matrix": ref.trace(0.9), "vector": ref.scale(-1.0)}, _by_rank),
    {"transforms": {"a": nba.sgd(0.1)}, "param_labels": "a"},
    exact=True,
    fusable=False,
)
_add(
    "freeze",
    "freeze",
    lambda: nba.freeze(_ndim_mask),
    lambda: ref.masked(ref.set_to_zero(), _ndim_mask),
    {"mask": _ndim_mask},
    exact=True,
    fusable=False,
)
_add(
    "selective_transform",
    "selective_transform",
    lambda: nba.selective_transform(nba.adam(1e-2), freeze_mask=True),
    lambda: ref.set_to_zero(),
    {"optimizer": nba.sgd(0.1), "freeze_mask": False},
    exact=True,
    fusable=False,
    ref_state=False,
)
_add(
    "multisteps_adam",
    "MultiSteps",
    lambda: nba.MultiSteps(nba.adam(1e-2), 2),
    lambda: ref.MultiSteps(ref.adam(1e-2), 2).gradient_transformation(),
    {"opt": nba.sgd(0.1), "every_k_schedule": 2},
    fusable=False,
)
_add(
    "apply_if_finite",
    "apply_if_finite",
    lambda: nba.apply_if_finite(nba.adam(1e-2), 2),
    None,
    {"inner": nba.sgd(0.1), "max_consecutive_errors": 2},
    fusable=False,
)
_add(
    "inject_hyperparams_adam",
    "inject_hyperparams",
    lambda: nba.inject_hyperparams(nba.adam)(learning_rate=1e-2),
    None,
    fusable=False,
)
_add(
    "inject_stateful_hyperparams_schedule",
    "inject_stateful_hyperparams",
    lambda: nba.inject_stateful_hyperparams(nba.sgd)(
        learning_rate=nba.WrappedSchedule(lambda count: 0.1 / (1 + count)), momentum=0.9
    ),
    lambda: ref.sgd(lambda count: 0.1 / (1 + count), momentum=0.9),
    fusable=False,
    ref_state=False,
)
_add(
    "differentially_private_aggregate",
    "differentially_private_aggregate",
    lambda: nba.differentially_private_aggregate(1.0, 0.5, seed=0),
    None,
    {"l2_norm_clip": 1.0, "noise_multiplier": 0.5, "seed": 0},
    fusable=False,
    per_example=True,
)
_add(
    "dpsgd",
    "dpsgd",
    lambda: nba.dpsgd(0.1, 1.0, 0.5, seed=0),
    None,
    {"learning_rate": 0.1, "l2_norm_clip": 1.0, "noise_multiplier": 0.5, "seed": 0},
    fusable=False,
    per_example=True,
)

# Transformations the registry-driven tests cannot drive (every update needs an extra argument,
# params of another kind, or leaves of one dtype), with the tests that cover them.
OWN_TESTS: dict[str, str] = {
    "scale_by_polyak": "update(..., value=f) (tests: test_optimizers' polyak tests)",
    "polyak_sgd": "update(..., value=f) (tests: test_optimizers' polyak tests)",
    "lbfgs": "update(..., value=, grad=, value_fn=) (tests: test_lbfgs)",
    "scale_by_zoom_linesearch": "update(..., value=, grad=, value_fn=) (tests: test_lbfgs)",
    "scale_by_backtracking_linesearch": "update(..., value=, grad=, value_fn=) (tests: test_lbfgs)",
    "lookahead": "params are a LookaheadParams(fast, slow) (tests: test_lookahead, with every Case inside)",
    "reduce_on_plateau": "update(..., value=loss) (tests: test_optimizers' reduce_on_plateau tests)",
    "hutchinson_estimator_diag_hessian": "update(..., hvp_fn= or grad_fn=) (tests: test_sophia)",
    "flatten": "leaves of one dtype (tests: test_masking's flatten tests)",
}

# Names of numbaccum.__all__ that are not transformation constructors, with the reason.
_STATES = "a state or node type"
_FUNCTION = "a function of trees, not a transformation"
_SCHEDULE = "a schedule"
EXEMPT: dict[str, str] = {
    **{n: _STATES for n in nba.__all__ if n.endswith("State") or n in ("MaskedNode", "ApplyEvery")},
    "WeightDecaySchedule": _STATES,
    "Explanation": "explain's result",
    "FlatTree": "the flat buffer type",
    "GradientTransformation": "the protocol type",
    "GradientTransformationExtraArgs": "the protocol type",
    "WrappedSchedule": _SCHEDULE,
    "with_extra_args_support": "wraps a user's transformation (tests: test_semantics)",
    "register_state_class": "names a user's state class for checkpoints (tests: test_checkpoint)",
    "ZoomLinesearchInfo": _STATES,
    "BacktrackingLinesearchInfo": _STATES,
    "LookaheadParams": "lookahead's params pair",
    **{
        n: _FUNCTION
        for n in (
            "apply_updates",
            "apply_updates_",
            "clip_grad_norm_",
            "clip_grad_value_",
            "copy_state",
            "explain",
            "global_norm",
            "load_state",
            "save_state",
            "normalize_grads_",
            "per_example_clip_from_norms",
            "per_example_clip_weights",
            "per_example_global_norm_clip",
            "per_example_layer_norm_clip",
            "skip_large_updates",
            "skip_not_finite",
            "step_",
            "to_device",
            "to_host",
            "tree_flatten",
            "tree_map",
            "tree_unflatten",
            "unitwise_clip",
            "unitwise_norm",
            "value_and_grad_from_state",
            "schedule_free_eval_params",
            "dp_epsilon",
            "warmup",
            "stats",
        )
    },
    **{
        n: _SCHEDULE
        for n in nba.__all__
        if (n.endswith("_schedule") and n != "scale_by_schedule")
        or n in ("exponential_decay", "join_schedules")
    },
}


# Stages of each kind, for the tests whose subject is a driver or a dtype path rather than each
# formula (the parallel and streaming loops, the fused composites' rounding between parts, a
# second complex dtype): moments with bias corrections, an accumulator of another dtype, signs,
# masks and partitions, a pre-pass with its pending factor, per-slice and per-leaf norms, user
# code, wrappers, a flag in the state. Each formula still runs on every path in the tests whose
# subject it is; NUMBACCUM_EXPLORE=1 runs every Case everywhere. `sweep` keeps the SAMPLE in the
# README's test command and marks the other Cases ``exhaustive`` (.ci/run's next step).
SAMPLE = {
    "adam", "adamw", "adan", "amsgrad", "chain_decay", "conditionally_mask", "lion", "masked_trace",
    "multi_transform", "optimistic_gradient_descent", "rprop", "scale_by_radam_nesterov", "sgd_nesterov",
    "sign_sgd", "stateless", "trace_nesterov_f64acc", "yogi", "zero_nans", "adaptive_grad_clip",
    "centralize", "clip_by_global_norm", "clip_norm_rows", "lamb", "multisteps_adam",
    "rmsprop_centered_momentum", "clip_norm_by_ema", "clip_value_growth", "novograd", "add_noise",
}  # fmt: skip
EXPLORE = os.environ.get("NUMBACCUM_EXPLORE", "") not in ("", "0")
# Fewer still, for a sweep of the SAMPLE itself through another driver or dtype (the parallel and
# streaming kernels, complex128, bfloat16's fusion): a moment with bias corrections, a sign, an
# accumulator of another dtype, a partition, a pre-pass with its pending factor, a per-slice norm,
# a wrapper. `sweep(..., keep=DRIVERS)`: these in the README's command, the others exhaustive.
DRIVERS = {
    "adamw", "lion", "trace_nesterov_f64acc", "multi_transform", "clip_by_global_norm", "clip_norm_rows",
    "multisteps_adam",
}  # fmt: skip


def sampled(names: list[str]) -> list[str]:
    """``names`` in `SAMPLE` (all of them under NUMBACCUM_EXPLORE=1)."""
    return [n for n in names if EXPLORE or n in SAMPLE]


def sweep(params: list[Any], keep: set[str] = SAMPLE) -> list[Any]:
    """``params`` (Case names, or tuples of parameters that start with one) as pytest parameters,
    those of a Case outside ``keep`` (`SAMPLE`, or `DRIVERS` for a sweep of the SAMPLE itself)
    marked ``exhaustive``: a test of every Case in a second dtype,
    through ``step_`` or inside a wrapper runs the SAMPLE in the README's test command (each
    formula's own numbers are checked there by test_bitexact.py's serial runs) and every Case in
    .ci/run's ``-m exhaustive`` step. Each Case compiles kernels of its own for that dtype or
    path: the bulk of a cold run's time. Under NUMBACCUM_EXPLORE=1 none is marked (`sampled`)."""
    out = []
    for p in params:
        values = p if isinstance(p, tuple) else (p,)
        default = EXPLORE or values[0] in keep
        out.append(pytest.param(*values, marks=() if default else pytest.mark.exhaustive))
    return out


def cases(**flags: bool) -> list[str]:
    """The names of the Cases whose flags equal ``flags`` (``exact=True``, ``cuda=True`` ...)."""
    return sorted(n for n, c in CASES.items() if all(getattr(c, k) == v for k, v in flags.items()))


def with_reference(**flags: bool) -> list[str]:
    """The names of the Cases that have a reference (and the given flags)."""
    return [n for n in cases(**flags) if CASES[n].reference is not None]


def public_names() -> set[str]:
    return {c.public for c in CASES.values()}
