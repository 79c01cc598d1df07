"""Parameter-tree workloads shared by the benchmarks.

A *shape tree* is a nested ``dict`` (or ``list``) whose leaves are shape tuples of ints;
``make_tree`` turns it into a tree of arrays with the same structure. Dict keys are
zero-padded where they are numbers so that sorted-key flattening (JAX's order, and
numbaccum's) walks the blocks in model order.

Nothing here imports numbaccum: the NumPy baselines must not depend on the code they
are compared with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

GPT2_SMALL_N_LEAVES = 148
GPT2_SMALL_N_PARAMS = 124_439_808


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, (int, np.integer)) for d in x)


def gpt2_small_shapes(vocab: int = 50257, n_ctx: int = 1024, d: int = 768, n_layer: int = 12) -> dict:
    """GPT-2-small parameter shapes (HF naming, Conv1D layout ``(in, out)``).

    148 leaves, 124,439,808 parameters with the defaults.
    """

    def ln() -> dict:
        return {"g": (d,), "b": (d,)}

    def dense(n_in: int, n_out: int) -> dict:
        return {"w": (n_in, n_out), "b": (n_out,)}

    blocks = {
        f"{i:02d}": {
            "ln_1": ln(),
            "attn": {"c_attn": dense(d, 3 * d), "c_proj": dense(d, d)},
            "ln_2": ln(),
            "mlp": {"c_fc": dense(d, 4 * d), "c_proj": dense(4 * d, d)},
        }
        for i in range(n_layer)
    }
    return {"wte": (vocab, d), "wpe": (n_ctx, d), "h": blocks, "ln_f": ln()}


def resnet50_shapes(classes: int = 1000) -> dict:
    """ResNet-50 parameter shapes (torchvision's layout: conv weights ``(out, in, kh, kw)`` without
    bias, each followed by a batch norm's weight and bias).

    161 leaves, 25,557,032 parameters with the defaults.
    """

    def conv_bn(n_in: int, n_out: int, k: int) -> dict:
        return {"conv": (n_out, n_in, k, k), "bn": {"b": (n_out,), "g": (n_out,)}}

    def bottleneck(n_in: int, width: int, first: bool) -> dict:
        block = {
            "1": conv_bn(n_in, width, 1),
            "2": conv_bn(width, width, 3),
            "3": conv_bn(width, 4 * width, 1),
        }
        if first:  # the shortcut's projection to the block's output width
            block["down"] = conv_bn(n_in, 4 * width, 1)
        return block

    layers, n_in = {}, 64
    for i, (width, n_blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)]):
        layers[f"layer{i + 1}"] = {
            f"{j}": bottleneck(n_in if j == 0 else 4 * width, width, j == 0) for j in range(n_blocks)
        }
        n_in = 4 * width
    return {"stem": conv_bn(3, 64, 7), "layers": layers, "fc": {"w": (classes, n_in), "b": (classes,)}}


def many_small_shapes(n: int = 2000, seed: int = 0) -> dict:
    """``n`` 1-D leaves with sizes drawn uniformly from [100, 5000] (about 5.1M params)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(100, 5000, size=n, endpoint=True)
    width = len(str(max(n - 1, 0)))
    return {f"p{i:0{width}d}": (int(s),) for i, s in enumerate(sizes)}


def tiny_shapes() -> dict:
    """10 leaves of 10 elements: a launch/dispatch-overhead workload."""
    return {f"p{i}": (10,) for i in range(10)}


def iter_leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` in sorted-key order; a leaf is an array or a shape tuple."""
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from iter_leaves(tree[k], f"{path}[{k!r}]")
    elif _is_shape(tree) or isinstance(tree, np.ndarray) or hasattr(tree, "shape"):
        yield path, tree
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from iter_leaves(v, f"{path}[{i}]")
    elif tree is None:
        return
    else:
        raise TypeError(f"unexpected node {type(tree).__name__} at {path or '<root>'}")


def leaves(tree: Any) -> list:
    return [leaf for _, leaf in iter_leaves(tree)]


def count_leaves(tree: Any) -> int:
    return sum(1 for _ in iter_leaves(tree))


def count_params(tree: Any) -> int:
    total = 0
    for _, leaf in iter_leaves(tree):
        shape = leaf if _is_shape(leaf) else leaf.shape
        total += int(np.prod(shape, dtype=np.int64))
    return total


def map_shapes(f, shapes: Any) -> Any:
    """Apply ``f(shape)`` to every shape leaf, keeping the structure."""
    if isinstance(shapes, dict):
        return {k: map_shapes(f, shapes[k]) for k in shapes}
    if _is_shape(shapes):
        return f(shapes)
    if isinstance(shapes, list):
        return [map_shapes(f, v) for v in shapes]
    if isinstance(shapes, tuple):
        return tuple(map_shapes(f, v) for v in shapes)
    if shapes is None:
        return None
    raise TypeError(f"unexpected node {type(shapes).__name__}")


def make_tree(shapes: Any, dtype: Any = np.float32, seed: int = 0, scale: float = 1.0) -> Any:
    """A tree of C-contiguous arrays ~ N(0, scale^2) with the structure of ``shapes``.

    Leaves are generated in sorted-key order from one ``default_rng(seed)`` stream, so a
    tree is reproducible from ``(shapes, dtype, seed)``. float32/float64 are drawn
    directly in that dtype (no float64 temporary for a 154 MB leaf); float16 is drawn in
    float32 and cast.
    """
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"make_tree needs a floating dtype, got {dtype}")
    rng = np.random.default_rng(seed)
    draw_dtype = dtype if dtype in (np.float32, np.float64) else np.dtype(np.float32)
    # Draw in flattening order so the values do not depend on dict insertion order.
    order = [path for path, _ in iter_leaves(shapes)]
    drawn: dict[str, np.ndarray] = {}
    for path, shape in iter_leaves(shapes):
        a = rng.standard_normal(shape, dtype=draw_dtype)
        if scale != 1.0:
            a *= draw_dtype.type(scale)
        drawn[path] = a.astype(dtype, copy=False)
    assert len(drawn) == len(order)

    def build(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            return {k: build(node[k], f"{path}[{k!r}]") for k in node}
        if _is_shape(node):
            return drawn[path]
        if isinstance(node, list):
            return [build(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return tuple(build(v, f"{path}[{i}]") for i, v in enumerate(node))
        return None

    return build(shapes, "")


def zeros_tree(shapes: Any, dtype: Any = np.float32) -> Any:
    return map_shapes(lambda s: np.zeros(s, dtype=dtype), shapes)


def bench_trees(name: str) -> tuple[Any, Any]:
    """``(params, grads)`` of the workload ``name`` as ``numbaccum bench`` times it: float32, params
    ~ N(0, 1), grads ~ N(0, 1e-4); the same values in every process that asks (a peer's own
    process builds its copy rather than receiving one)."""
    shapes = WORKLOADS[name]()
    return make_tree(shapes, np.float32, seed=0), make_tree(shapes, np.float32, seed=1, scale=1e-2)


WORKLOADS: dict[str, Callable[[], dict]] = {
    "gpt2_small": gpt2_small_shapes,
    "resnet50": resnet50_shapes,
    "many_small": many_small_shapes,
    "tiny": tiny_shapes,
}


if __name__ == "__main__":
    for name, fn in WORKLOADS.items():
        s = fn()
        print(f"{name:12s} leaves={count_leaves(s):5d} params={count_params(s):,}")
