"""A NumPy classifier on the CPU: clipped AdamW on a schedule, and an EMA of its weights.

    python examples/classifier_ema.py

Three interleaved spirals in the plane (generated, with noise), and a float32 MLP with two hidden
layers of 32 ReLU units, trained on mini-batches of 32 points with
`chain(clip_by_global_norm(1.0), adamw(schedule, weight_decay=1e-4))`, the learning rate warming
up over 100 steps to 1e-2 and decaying along a cosine. Beside the weights, `ema(0.99)` keeps
their exponential moving average (Polyak averaging, debiased): `ema.update(params, state)`
returns the average, which is evaluated on a held-out set with the same code as the weights are.
The average lags the weights over the first steps, then follows them with less noise; once the
learning rate has decayed, the two agree.
"""

import numpy as np

import numbaccum as nba


def spirals(rng, n_per_class: int, noise: float = 0.5):
    """Points of 3 spiral arms (x: float32 (3n, 2)) and their arm (y: (3n,))."""
    r = np.tile(np.linspace(0.1, 1.0, n_per_class), 3)
    arm = np.repeat(np.arange(3), n_per_class)
    angle = 4.0 * r + arm * 2 * np.pi / 3 + rng.normal(0, noise, r.shape)
    x = np.stack([r * np.cos(angle), r * np.sin(angle)], 1).astype(np.float32)
    return x, arm


def forward(p: dict, x: np.ndarray):
    """The hidden activations and class probabilities of params ``p`` at ``x``."""
    h1 = np.maximum(x @ p["w1"] + p["b1"], 0)
    h2 = np.maximum(h1 @ p["w2"] + p["b2"], 0)
    z = h2 @ p["w3"] + p["b3"]
    z = np.exp(z - z.max(1, keepdims=True))
    return (h1, h2), z / z.sum(1, keepdims=True)


def evaluate(p: dict, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(the mean cross-entropy, the accuracy) of params ``p``."""
    prob = forward(p, x)[1]
    return float(-np.mean(np.log(prob[np.arange(len(y)), y]))), float(
        np.mean(prob.argmax(1) == y)
    )


def main(
    steps: int = 2000, batch: int = 32, seed: int = 0, log_every: int = 250
) -> dict:
    rng = np.random.default_rng(seed)
    x_train, y_train = spirals(rng, 200)
    x_test, y_test = spirals(rng, 200)

    def layer(n_in, n_out):  # He initialisation for ReLU
        return (rng.standard_normal((n_in, n_out)) * np.sqrt(2 / n_in)).astype(
            np.float32
        )

    params = nba.FlatTree.from_tree(
        {
            "w1": layer(2, 32),
            "b1": np.zeros(32, np.float32),
            "w2": layer(32, 32),
            "b2": np.zeros(32, np.float32),
            "w3": layer(32, 3),
            "b3": np.zeros(3, np.float32),
        }
    )
    grads = params.zeros_like()
    p, g = params.tree, grads.tree
    schedule = nba.warmup_cosine_decay_schedule(
        0.0, 1e-2, warmup_steps=100, decay_steps=steps
    )
    opt = nba.chain(
        nba.clip_by_global_norm(1.0), nba.adamw(schedule, weight_decay=1e-4)
    )
    state = opt.init(params)
    # the average of the weights: a transformation of the params themselves
    ema = nba.ema(0.99)
    ema_state = ema.init(params)

    def loss_and_grads(x, y):
        (h1, h2), prob = forward(p, x)
        d_z = prob
        d_z[np.arange(len(y)), y] -= 1
        d_z /= len(y)
        g["w3"][...] = h2.T @ d_z
        g["b3"][...] = d_z.sum(0)
        d_h2 = (d_z @ p["w3"].T) * (h2 > 0)
        g["w2"][...] = h1.T @ d_h2
        g["b2"][...] = d_h2.sum(0)
        d_h1 = (d_h2 @ p["w2"].T) * (h1 > 0)
        g["w1"][...] = x.T @ d_h1
        g["b1"][...] = d_h1.sum(0)

    keys = ("step", "loss", "ema_loss", "accuracy", "ema_accuracy")
    history = {key: [] for key in keys}
    for step in range(1, steps + 1):
        idx = rng.integers(0, len(x_train), batch)
        loss_and_grads(x_train[idx], y_train[idx])
        state = nba.step_(opt, grads, state, params)  # params += update, in place
        # the average, a FlatTree: averaged.tree's leaves
        averaged, ema_state = ema.update(params, ema_state)
        if step % 25 == 0:
            loss, acc = evaluate(p, x_test, y_test)
            ema_loss, ema_acc = evaluate(averaged.tree, x_test, y_test)
            for key, value in zip(keys, (step, loss, ema_loss, acc, ema_acc)):
                history[key].append(value)
            if log_every and step % log_every == 0:
                lr = float(schedule(step))
                print(
                    f"step {step:4d}  lr {lr:.5f}  test loss {loss:.4f} "
                    f"(EMA {ema_loss:.4f})  accuracy {acc:.3f} (EMA {ema_acc:.3f})"
                )
    history["averaged"] = averaged.tree
    history["test"] = (x_test, y_test)
    return history


def plot(history: dict) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    left.plot(history["step"], history["loss"], label="the weights", alpha=0.8)
    left.plot(history["step"], history["ema_loss"], label="their EMA, ema(0.99)")
    left.set(
        xlabel="step",
        ylabel="test cross-entropy",
        yscale="log",
        title="Held-out loss",
    )
    left.legend()
    grid = np.linspace(-1.2, 1.2, 200, dtype=np.float32)
    xx, yy = np.meshgrid(grid, grid)
    points = np.stack([xx.ravel(), yy.ravel()], 1)
    regions = forward(history["averaged"], points)[1].argmax(1).reshape(xx.shape)
    right.contourf(
        xx,
        yy,
        regions,
        levels=[-0.5, 0.5, 1.5, 2.5],
        colors=["#fbb4ae", "#b3cde3", "#ccebc5"],
    )
    x_test, y_test = history["test"]
    right.scatter(
        *x_test.T, c=np.array(["#e41a1c", "#377eb8", "#4daf4a"])[y_test], s=8
    )
    right.set(
        title="The EMA's classes, and the held-out points",
        aspect="equal",
        xticks=[],
        yticks=[],
    )


if __name__ == "__main__":
    import matplotlib.pyplot as plt

    plot(main())
    plt.show()
