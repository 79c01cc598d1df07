"""L-BFGS beside SciPy's L-BFGS-B on Rosenbrock's function.

    pip install scipy
    python examples/lbfgs_rosenbrock.py

Rosenbrock's banana valley, `f(x) = sum 100 (x[i+1] - x[i]^2)^2 + (1 - x[i])^2`, minimum 0 at
all ones, in 2 dimensions from the classical start (-1.2, 1) and in 10 from the origin. `lbfgs`
(optax's L-BFGS: 10 pairs of memory, the zoom line search with the strong Wolfe conditions) and
`scipy.optimize.minimize(method="L-BFGS-B")` (10 pairs too, More and Thuente's line search) get
the same objective, a NumPy function returning the value and the gradient (SciPy's `rosen` and
`rosen_der`), and stop when the largest |gradient| is below 1e-6. numbaccum's line search takes
the function as `value_fn`, and `value_and_grad_from_state` hands back the value and gradient the
search computed at the point it accepted: an iteration does not evaluate the function again at
its start. The two take the same number of iterations, or nearly, to the same minimum; their
line searches differ, and so do their evaluation counts.
"""

import numpy as np
from scipy.optimize import minimize, rosen, rosen_der

import numbaccum as nba

GTOL, MAXITER = 1e-6, 500


def solve_numbaccum(x0: np.ndarray) -> dict:
    evaluations = [0]

    def value_fn(params):
        evaluations[0] += 1
        return float(rosen(params["x"])), {"x": rosen_der(params["x"])}

    params = {"x": x0.copy()}
    solver = nba.lbfgs(memory_size=10)
    state = solver.init(params)
    value_and_grad = nba.value_and_grad_from_state(value_fn)
    path, values = [x0.copy()], []
    iterations = 0
    while True:
        value, grad = value_and_grad(params, state=state)  # where the search ended
        values.append(value)
        if np.max(np.abs(grad["x"])) <= GTOL or iterations == MAXITER:
            break
        state = nba.step_(
            solver, grad, state, params, value=value, grad=grad, value_fn=value_fn
        )
        path.append(params["x"].copy())
        iterations += 1
    return {
        "iterations": iterations,
        "evaluations": evaluations[0],
        "value": value,
        "x": params["x"],
        "path": np.array(path),
        "values": values,
    }


def solve_scipy(x0: np.ndarray) -> dict:
    path, values = [x0.copy()], [float(rosen(x0))]

    def record(
        intermediate_result,
    ):  # after each iteration (SciPy passes a result by this name)
        path.append(intermediate_result.x.copy())
        values.append(float(intermediate_result.fun))

    r = minimize(
        lambda x: (rosen(x), rosen_der(x)),
        x0.copy(),
        jac=True,
        method="L-BFGS-B",
        callback=record,
        options={"maxcor": 10, "gtol": GTOL, "ftol": 0.0, "maxiter": MAXITER},
    )
    return {
        "iterations": r.nit,
        "evaluations": r.nfev,
        "value": float(r.fun),
        "x": r.x,
        "path": np.array(path),
        "values": values,
    }


def main() -> dict:
    problems = {
        "2-D, from (-1.2, 1)": np.array([-1.2, 1.0]),
        "10-D, from 0": np.zeros(10),
    }
    results = {}
    head = (
        "problem",
        "solver",
        "iterations",
        "evaluations",
        "final value",
        "max |x - 1|",
    )
    print("{:20} {:15} {:>10} {:>11} {:>11} {:>11}".format(*head))
    solvers = {"numbaccum.lbfgs": solve_numbaccum, "SciPy L-BFGS-B": solve_scipy}
    for name, x0 in problems.items():
        for solver, solve in solvers.items():
            r = results[name, solver] = solve(x0)
            row = (name, solver, r["iterations"], r["evaluations"], r["value"])
            error = np.max(np.abs(r["x"] - 1))
            print("{:20} {:15} {:10d} {:11d} {:11.2e} {:11.1e}".format(*row, error))
    return results


def plot(results: dict) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    a, b = np.meshgrid(np.linspace(-1.5, 1.5, 300), np.linspace(-0.5, 1.5, 200))
    left.contour(
        a,
        b,
        np.log10(rosen(np.stack([a, b]))),
        levels=15,
        colors="0.7",
        linewidths=0.7,
    )
    for (name, solver), r in results.items():
        marker = "o-" if solver.startswith("numbaccum") else "s--"
        if name.startswith("2-D"):
            left.plot(
                *r["path"].T,
                marker,
                ms=3,
                lw=1,
                label=f"{solver}: {r['iterations']} iterations",
            )
        else:
            right.semilogy(
                np.maximum(r["values"], 1e-20), marker, ms=2, lw=1, label=solver
            )
    left.plot(1, 1, "k*", ms=10)
    left.set(xlabel="x[0]", ylabel="x[1]", title="2 dimensions: the iterates")
    left.legend(loc="lower right")
    right.set(xlabel="iteration", ylabel="f(x)", title="10 dimensions: the value")
    right.legend()


if __name__ == "__main__":
    import matplotlib.pyplot as plt

    plot(main())
    plt.show()
