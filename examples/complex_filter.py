"""Complex parameters: identifying a complex FIR filter with Adam.

    python examples/complex_filter.py

A channel of 8 complex taps `h` distorts a stream of QPSK symbols `x` (a radio's baseband
signal), and complex Gaussian noise is added, at 30 dB below the signal: `y = h * x + noise`.
The filter `w` (complex64, one leaf) is fitted to the recording by Adam on mini-batches of 256
samples, minimising the mean of `|X w - y|^2` (`X` the convolution matrix of `x`). The gradient
of a real loss in a complex parameter is the direction of steepest ascent, `dL/dRe + i dL/dIm =
2 X^H (X w - y) / n`, the convention optax's complex support uses; numbaccum runs Adam on it with
optax's semantics (the first moment complex, the second `|g|^2`, real). With the
learning rate decaying along a cosine, the fit ends at the least-squares solution (NumPy's
`lstsq`), up to the noise the mini-batches leave.
"""

import numpy as np

import numbaccum as nba

TAPS, N, BATCH = 8, 4096, 256


def convolution_matrix(x: np.ndarray, taps: int) -> np.ndarray:
    """``X[n, k] = x[n - k]``, 0 before the start: ``X @ h`` convolves x with h."""
    X = np.zeros((len(x), taps), x.dtype)
    for k in range(taps):
        X[k:, k] = x[: len(x) - k]
    return X


def main(steps: int = 600, seed: int = 0, log_every: int = 100) -> dict:
    rng = np.random.default_rng(seed)

    def complex_normal(n):  # mean 0, variance 2
        return rng.standard_normal(n) + 1j * rng.standard_normal(n)

    h = complex_normal(TAPS) * np.exp(-np.arange(TAPS) / 3) / 2  # decaying taps
    qpsk = np.array([1 + 1j, 1 - 1j, -1 + 1j, -1 - 1j]) / np.sqrt(2)
    X = convolution_matrix(rng.choice(qpsk, N), TAPS).astype(np.complex64)
    clean = X @ h
    noise_power = np.mean(np.abs(clean) ** 2) / 10**3  # 30 dB below the signal
    y = (clean + np.sqrt(noise_power / 2) * complex_normal(N)).astype(np.complex64)
    # to measure the fit: the exact minimiser, and the loss, in double precision
    X64, y64 = X.astype(np.complex128), y.astype(np.complex128)
    w_ls = np.linalg.lstsq(X64, y64, rcond=None)[0]

    params = {"w": np.zeros(TAPS, np.complex64)}
    # real hyperparameters, complex leaves
    opt = nba.adam(nba.cosine_decay_schedule(1e-2, steps))
    state = opt.init(params)
    history = {"step": [], "loss": [], "path": [params["w"].copy()]}
    for step in range(1, steps + 1):
        idx = rng.integers(0, N, BATCH)
        err = X[idx] @ params["w"] - y[idx]
        grads = {"w": 2 * X[idx].conj().T @ err / BATCH}  # dL/dRe + i dL/dIm
        state = nba.step_(opt, grads, state, params)
        if step % 10 == 0:
            history["step"].append(step)
            loss = float(np.mean(np.abs(X64 @ params["w"] - y64) ** 2))
            history["loss"].append(loss)
            history["path"].append(params["w"].copy())
        if log_every and step % log_every == 0:
            print(f"step {step:4d}  mean |X w - y|^2 = {history['loss'][-1]:.3e}")

    w = params["w"]
    ls_loss = float(np.mean(np.abs(X64 @ w_ls - y64) ** 2))
    nu = state[0].nu.tree["w"]  # Adam's second moment: |g|^2, in w's dtype
    print(
        f"least squares (lstsq): {ls_loss:.3e}, the noise's power {noise_power:.3e}"
    )
    real = not nu.imag.any()
    print(f"dtypes: w {w.dtype}, Adam's nu {nu.dtype} (imaginary parts 0: {real})")
    off_ls, off_h = np.max(np.abs(w - w_ls)), np.max(np.abs(w - h))
    print(f"largest |w - lstsq| {off_ls:.1e}, largest |w - h| {off_h:.1e}")
    print("taps  true h            fitted w")
    for k in range(TAPS):
        print(f"{k:4d}  {h[k]:16.3f}  {complex(w[k]):16.3f}")
    history.update(h=h, w_ls=w_ls, ls_loss=ls_loss, noise_power=noise_power, w=w)
    return history


def plot(history: dict) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    left.plot(history["step"], np.array(history["loss"]) - history["ls_loss"])
    left.set(
        xlabel="step",
        ylabel="mean |X w - y|^2 above least squares",
        yscale="log",
        title="The fit",
    )
    path = np.array(history["path"])
    for k in range(TAPS):
        right.plot(path[:, k].real, path[:, k].imag, color="C0", lw=0.8, alpha=0.6)
    h, w = history["h"], history["w"]
    right.scatter(h.real, h.imag, s=50, marker="x", color="k", label="true taps h")
    ring = {"s": 80, "facecolor": "none", "edgecolor": "C1"}
    right.scatter(w.real, w.imag, **ring, label="fitted w (paths from 0)")
    right.set(
        xlabel="real part",
        ylabel="imaginary part",
        title="The taps in the complex plane",
    )
    right.set_aspect("equal", adjustable="datalim")
    right.legend(loc="lower right")


if __name__ == "__main__":
    import matplotlib.pyplot as plt

    plot(main())
    plt.show()
