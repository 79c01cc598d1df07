"""numbaccum's lbfgs against scipy.optimize.minimize(method="L-BFGS-B") on the same problems.

Problems: logistic regression on scikit-learn's breast_cancer (standardised features, an
intercept, an L2 penalty of 1e-3), and the Rosenbrock function in 10 and 1,000 dimensions from 0.
Both solvers get the same objective (a NumPy function returning value and gradient), the same
start and memory (10 pairs), and stop when the largest |gradient| is below ``--gtol`` (SciPy's
``gtol`` is that test; its ``ftol`` is set to 0 so that it does not stop earlier) or after
``--maxiter`` iterations. Each row: iterations, objective evaluations, final value, wall time (the
median of ``--rounds`` runs, the two solvers alternated).

    python benchmarks/lbfgs_scipy.py [--rounds 5] [--gtol 1e-6] [--maxiter 10000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.optimize as so

import numbaccum as nba


def rosenbrock(x: np.ndarray) -> tuple[float, np.ndarray]:
    return float(so.rosen(x)), so.rosen_der(x)


def logistic_problem() -> tuple:
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    X = (data.data - data.data.mean(0)) / data.data.std(0)
    X = np.hstack([X, np.ones((X.shape[0], 1))])
    y = data.target.astype(np.float64)
    lam = 1e-3

    def fn(w: np.ndarray) -> tuple[float, np.ndarray]:
        z = X @ w
        loss = np.mean(np.logaddexp(0.0, z) - y * z) + 0.5 * lam * (w[:-1] @ w[:-1])
        p = 0.5 * (1.0 + np.tanh(0.5 * z))  # sigmoid, without overflow
        g = X.T @ (p - y) / X.shape[0]
        g[:-1] += lam * w[:-1]
        return float(loss), g

    return fn, np.zeros(X.shape[1])


def run_numbaccum(fn, x0: np.ndarray, gtol: float, maxiter: int) -> tuple:
    calls = [0]

    def value_fn(p: dict) -> tuple:
        calls[0] += 1
        v, g = fn(p["w"])
        return v, {"w": g}

    params = {"w": x0.copy()}
    tx = nba.lbfgs()
    state = tx.init(params)
    value_and_grad = nba.value_and_grad_from_state(value_fn)
    it = 0
    while True:
        value, grad = value_and_grad(params, state=state)
        if np.max(np.abs(grad["w"])) <= gtol or it >= maxiter:
            break
        state = nba.step_(tx, grad, state, params, value=value, grad=grad, value_fn=value_fn)
        it += 1
    return it, calls[0], value


def run_scipy(fn, x0: np.ndarray, gtol: float, maxiter: int) -> tuple:
    r = so.minimize(
        fn,
        x0.copy(),
        jac=True,
        method="L-BFGS-B",
        options={"gtol": gtol, "ftol": 0.0, "maxiter": maxiter, "maxcor": 10},
    )
    return r.nit, r.nfev, float(r.fun)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gtol", type=float, default=1e-6)
    ap.add_argument("--maxiter", type=int, default=10000)
    args = ap.parse_args()
    problems = {
        "logistic regression, breast_cancer (31 params)": logistic_problem(),
        "Rosenbrock, 10 dimensions": (rosenbrock, np.zeros(10)),
        "Rosenbrock, 1,000 dimensions": (rosenbrock, np.zeros(1000)),
    }
    print("| problem | solver | iterations | evaluations | final value | wall ms (median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (fn, x0) in problems.items():
        run_numbaccum(fn, x0, args.gtol, 5)  # compiles the kernels before the timings
        times: dict[str, list] = {"numbaccum.lbfgs": [], "scipy L-BFGS-B": []}
        out = {}
        for _ in range(args.rounds):  # alternated: A, B, A, B, ...
            for solver, run in (("numbaccum.lbfgs", run_numbaccum), ("scipy L-BFGS-B", run_scipy)):
                t = time.perf_counter()
                out[solver] = run(fn, x0, args.gtol, args.maxiter)
                times[solver].append(time.perf_counter() - t)
        for solver, (nit, nfev, value) in out.items():
            ms = 1e3 * float(np.median(times[solver]))
            print(f"| {name} | {solver} | {nit} | {nfev} | {value:.10g} | {ms:.1f} |")


if __name__ == "__main__":
    main()
