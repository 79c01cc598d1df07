"""An MLP classifier trained with gradient accumulation, beside scikit-learn's MLPClassifier.

    pip install "numbaccum[docs]"  # scikit-learn, matplotlib
    python examples/sklearn_mlp.py

scikit-learn's handwritten digits (1,797 images of 8x8 pixels, shipped with it), standardised
and split into 1,437 training and 360 test images. Both models are the same: one hidden layer of
64 ReLU units, a softmax output, the mean cross-entropy, Glorot-uniform initial weights, Adam
with a learning rate of 1e-3 on batches of 32 images, no L2 penalty. scikit-learn's
`MLPClassifier` takes each batch of 32 at once. The NumPy model takes it as 4 mini-batches of 8,
and `MultiSteps(adam(1e-3), every_k_schedule=4)` averages their gradients and takes one Adam step
every 4: the step of the whole batch, with the activations of 8 images in memory at a time. The
two start from different random weights and shuffle differently, so their curves differ in the
details, not in where they go.
"""

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

import numbaccum as nba

HIDDEN, BATCH, K, LR = 64, 32, 4, 1e-3


def glorot(rng, fan_in, fan_out):  # scikit-learn's initialisation of a ReLU layer
    bound = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, (fan_in, fan_out))


def main(epochs: int = 30, seed: int = 0) -> dict:
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=0.2, random_state=seed
    )
    mean, std = x_train.mean(0), x_train.std(0) + 1e-8
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    n_in, n_out = x_train.shape[1], 10

    rng = np.random.default_rng(seed)
    params = nba.FlatTree.from_tree(
        {
            "w1": glorot(rng, n_in, HIDDEN),
            "b1": np.zeros(HIDDEN),
            "w2": glorot(rng, HIDDEN, n_out),
            "b2": np.zeros(n_out),
        }
    )
    grads = params.zeros_like()  # the backward pass writes into its leaves
    p, g = params.tree, grads.tree
    opt = nba.MultiSteps(nba.adam(LR), every_k_schedule=K)
    state = opt.init(params)

    def forward(x):
        h = np.maximum(x @ p["w1"] + p["b1"], 0)
        z = h @ p["w2"] + p["b2"]
        z = np.exp(z - z.max(1, keepdims=True))
        return h, z / z.sum(1, keepdims=True)  # the softmax probabilities

    def loss_and_grads(x, y):
        h, prob = forward(x)
        loss = -np.mean(np.log(prob[np.arange(len(y)), y]))
        d_z = prob.copy()
        d_z[np.arange(len(y)), y] -= 1
        d_z /= len(y)
        g["w2"][...] = h.T @ d_z
        g["b2"][...] = d_z.sum(0)
        d_h = (d_z @ p["w2"].T) * (h > 0)
        g["w1"][...] = x.T @ d_h
        g["b1"][...] = d_h.sum(0)
        return loss

    sk = MLPClassifier(
        hidden_layer_sizes=(HIDDEN,),
        alpha=0.0,
        batch_size=BATCH,
        learning_rate_init=LR,
        random_state=seed,
    )
    mini = BATCH // K
    print("numbaccum's MultiSteps(adam) vs scikit-learn's MLPClassifier:")
    keys = ("epoch", "loss", "sk_loss", "accuracy", "sk_accuracy")
    history = {key: [] for key in keys}
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(x_train))
        losses = []
        # whole mini-batches only: the few images left wait for another shuffle
        for start in range(0, len(order) - mini + 1, mini):
            idx = order[start : start + mini]
            losses.append(loss_and_grads(x_train[idx], y_train[idx]))
            # an Adam step on every K-th mini-batch
            state = nba.step_(opt, grads, state, params)
        # one epoch of batches of 32
        sk.partial_fit(x_train, y_train, classes=np.arange(n_out))
        history["epoch"].append(epoch)
        history["loss"].append(float(np.mean(losses)))
        history["sk_loss"].append(float(sk.loss_))
        history["accuracy"].append(
            float(np.mean(forward(x_test)[1].argmax(1) == y_test))
        )
        history["sk_accuracy"].append(float(sk.score(x_test, y_test)))
        if epoch % 5 == 0 or epoch == 1:
            loss, sk_loss = history["loss"][-1], history["sk_loss"][-1]
            acc, sk_acc = history["accuracy"][-1], history["sk_accuracy"][-1]
            print(
                f"epoch {epoch:2d}: training loss {loss:.4f} vs {sk_loss:.4f}, "
                f"test accuracy {acc:.3f} vs {sk_acc:.3f}"
            )
    steps = int(state.gradient_step)
    print(f"Adam steps taken: {steps} (one per {K} mini-batches of {mini})")
    return history


def plot(history: dict) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    for key, label in (
        ("", "numbaccum: MultiSteps(adam, 4), mini-batches of 8"),
        ("sk_", "MLPClassifier, batches of 32"),
    ):
        left.plot(history["epoch"], history[key + "loss"], label=label)
        right.plot(history["epoch"], history[key + "accuracy"], label=label)
    left.set(
        xlabel="epoch",
        ylabel="training cross-entropy",
        yscale="log",
        title="Training loss",
    )
    right.set(
        xlabel="epoch",
        ylabel="accuracy",
        title="Test accuracy (360 digits)",
        ylim=(0.8, 1.0),
    )
    right.legend(loc="lower right")


if __name__ == "__main__":
    import matplotlib.pyplot as plt

    plot(main())
    plt.show()
