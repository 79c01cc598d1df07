"""A two-layer NumPy MLP trained with gradient accumulation, clipping and Adam.

    python examples/mlp.py

Regression on a generated data set; the gradients are written straight into a FlatTree.
"""

import numpy as np

import numbaccum as nba


def main(steps: int = 400, batch: int = 32, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2048, 8)).astype(np.float32)
    y = np.sin(x @ rng.standard_normal((8, 1))).astype(np.float32)  # smooth

    params = nba.FlatTree.from_tree(
        {
            "w1": (rng.standard_normal((8, 64)) / np.sqrt(8)).astype(np.float32),
            "b1": np.zeros(64, np.float32),
            "w2": (rng.standard_normal((64, 1)) / 8).astype(np.float32),
            "b2": np.zeros(1, np.float32),
        }
    )
    grads = params.zeros_like()  # filled in place by the backward pass below
    opt = nba.MultiSteps(
        nba.chain(nba.clip_by_global_norm(1.0), nba.adam(1e-3)), every_k_schedule=4
    )
    state = opt.init(params)
    p, g = params.tree, grads.tree

    def loss_and_grads(xb, yb):
        h = np.maximum(xb @ p["w1"] + p["b1"], 0)
        err = h @ p["w2"] + p["b2"] - yb
        d_out = 2 * err / len(xb)
        g["w2"][...] = h.T @ d_out
        g["b2"][...] = d_out.sum(0)
        d_h = (d_out @ p["w2"].T) * (h > 0)
        g["w1"][...] = xb.T @ d_h
        g["b1"][...] = d_h.sum(0)
        return float(np.mean(err**2))

    for _ in range(steps):
        idx = rng.integers(0, len(x), batch)
        loss_and_grads(x[idx], y[idx])
        updates, state = opt.update(grads, state, params)
        nba.apply_updates_(params, updates)  # zeros on the 3 mini-steps of every 4
    return loss_and_grads(x, y)


if __name__ == "__main__":
    print(f"final training loss: {main():.4f}")
