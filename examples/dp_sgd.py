"""DP-SGD with gradient accumulation, and the privacy it spends.

    pip install "numbaccum[dp]"  # dp-accounting, for dp_epsilon
    python examples/dp_sgd.py

A logistic regression on 10,000 generated examples (20 features, 10% of the labels flipped),
trained with differential privacy: `dpsgd` clips each example's gradient to norm 1, adds Gaussian
noise of `noise_multiplier` times that norm to their sum, and steps on the noisy mean. A logical
batch of 50 examples is taken as 5 mini-batches of 10 per-example gradients, and
`MultiSteps(dpsgd(...), every_k_schedule=5)` adds the noise once per logical batch: the same
update, and so the same privacy, as one step on all 50. After each epoch, `dp_epsilon` gives
the epsilon spent so far at delta = 1e-5 (Renyi-DP accounting, for a sampling rate of 50 /
10,000), and at the end privacy loss distributions' tighter one (`accountant="pld"`). More noise
spends less privacy, and past some point costs accuracy; the non-private line is the same loop with
`MultiSteps(sgd(...), 5)` on the mean gradient, unclipped.
"""

import numpy as np

import numbaccum as nba

N, D, BATCH, K, DELTA, LR = 10_000, 20, 50, 5, 1e-5, 0.1


def data(rng, n: int):
    """Features (float32 (n, D)) and labels (0/1, a tenth of them flipped)."""
    w = np.linspace(-1.0, 1.0, D)
    x = rng.standard_normal((n, D)).astype(np.float32)
    y = (x @ w > 0).astype(np.float32)
    flip = rng.random(n) < 0.1
    return x, np.where(flip, 1 - y, y)


def per_example_grads(params: dict, x: np.ndarray, y: np.ndarray) -> dict:
    """Each example's gradient of its log-loss (batch on axis 0, as dpsgd takes it)."""
    p = 1 / (1 + np.exp(-(x @ params["w"] + params["b"])))
    return {"w": (p - y)[:, None] * x, "b": p - y}


def accuracy(params: dict, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(((x @ params["w"] + params["b"]) > 0) == y))


def train(
    opt, x, y, x_test, y_test, epochs: int, seed: int, private: bool
) -> tuple[list[float], dict]:
    """(the test accuracy after each epoch of ``opt``, `stats` of its last state); ``opt`` takes
    per-example gradients if ``private``, their mean if not."""
    rng = np.random.default_rng(seed)
    params = {"w": np.zeros(D, np.float32), "b": np.zeros((), np.float32)}
    state = opt.init(params)
    mini = BATCH // K
    accuracies = []
    for _ in range(epochs):
        # shuffled fixed-size batches: Poisson sampling's usual stand-in
        order = rng.permutation(len(x))
        for start in range(0, len(x), mini):
            idx = order[start : start + mini]
            grads = per_example_grads(params, x[idx], y[idx])
            if not private:
                grads = {k: g.mean(0) for k, g in grads.items()}
            state = nba.step_(opt, grads, state, params)
        accuracies.append(accuracy(params, x_test, y_test))
    return accuracies, nba.stats(state)


def main(epochs: int = 3, noise_multipliers=(1.0, 2.0, 4.0), seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x, y = data(rng, N)
    x_test, y_test = data(rng, 2000)
    steps_per_epoch = N // BATCH
    results = {"epochs": list(range(1, epochs + 1))}
    plain = nba.MultiSteps(nba.sgd(LR), every_k_schedule=K)
    results["non-private"] = train(
        plain, x, y, x_test, y_test, epochs, seed, private=False
    )[0]
    steps = epochs * steps_per_epoch
    print(f"{epochs} epochs, {steps} steps; epsilon at delta {DELTA:g}")
    print(f"non-private: test accuracy {results['non-private'][-1]:.3f}")
    for sigma in noise_multipliers:
        opt = nba.MultiSteps(
            nba.dpsgd(LR, l2_norm_clip=1.0, noise_multiplier=sigma, seed=seed),
            every_k_schedule=K,
        )
        acc, log = train(opt, x, y, x_test, y_test, epochs, seed, private=True)
        eps = [
            nba.dp_epsilon(sigma, BATCH / N, e * steps_per_epoch, DELTA)
            for e in results["epochs"]
        ]
        pld = nba.dp_epsilon(sigma, BATCH / N, steps, DELTA, accountant="pld")
        results[sigma] = {"accuracy": acc, "epsilon": eps, "pld": pld}
        print(
            f"noise multiplier {sigma}: test accuracy {acc[-1]:.3f}, "
            f"epsilon {eps[-1]:.2f} (RDP), {pld:.2f} (PLD)"
        )
        # what the last step did
        clipped = log["multisteps/differentially_private_aggregate/clipped"]
        noise = log["multisteps/differentially_private_aggregate/noise_std"]
        print(f"  last step: {clipped} of {BATCH} clipped, noise std {noise:.3f}")
    return results


def plot(results: dict) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    epochs = results["epochs"]
    left.plot(epochs, results["non-private"], "k--", label="non-private")
    for i, sigma in enumerate(s for s in results if isinstance(s, float)):
        run = results[sigma]
        style = {
            "marker": "o",
            "color": f"C{i}",
            "label": f"noise multiplier {sigma}",
        }
        left.plot(epochs, run["accuracy"], **style)
        right.plot(epochs, run["epsilon"], **style)
    left.set(
        xlabel="epoch", ylabel="test accuracy", title="Accuracy", xticks=epochs
    )
    left.legend()
    right.set(
        xlabel="epoch",
        ylabel="epsilon (RDP)",
        title=f"Privacy spent, delta = {DELTA:g}",
        xticks=epochs,
    )


if __name__ == "__main__":
    import matplotlib.pyplot as plt

    plot(main())
    plt.show()
