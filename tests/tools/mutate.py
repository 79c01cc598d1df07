"""Does the test suite see a wrong formula? One-line mutations of the formulas, each in a copy.

Usage (from the repository root; not part of the default test run, which skips tests/tools)::

    python tests/tools/mutate.py                  # every mutation, the targeted tests
    python tests/tools/mutate.py adam_bc1_inside  # the named ones
    python tests/tools/mutate.py --list

Each mutation replaces one line (a substring that must occur exactly once) of a file of the
package, in a copy of the repository's ``numbaccum`` and ``tests`` in a temporary directory, and
runs a fast targeted subset there (`TARGETS`: the bit-exact and reference tests), stopping at
the first failure. A mutation that no test fails is a *survivor*: a wrong answer the suite lets
through. The script prints one line per mutation and exits 1 if any survived.

Two kinds: rounding changes (the same formula in another order, which the README's "bit for
bit" promise rules out) and plain bugs (a wrong sign, bound, operator or branch).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The targeted subset: the serial bit-exact tests first (one kernel variant to compile), then
# the reference tests. -x: a killed mutation stops at its first failing test.
TARGETS = [
    "tests/test_bitexact.py",
    "-k",
    "not parallel",
    "tests/test_reference_hypothesis.py",
    "tests/test_fusion.py",
]


class Mutation(NamedTuple):
    name: str
    path: str  # relative to the repository root
    old: str  # occurs exactly once in the file
    new: str
    kind: str  # "rounding" or "bug"


F = "numbaccum/formulas.py"
O = "numbaccum/optimizers.py"  # the optimizers' formulas, beside their declarations
A = "numbaccum/accumulation.py"
MUTATIONS = [
    # the issue's: the same value, rounded differently in about a third of float32 results
    Mutation(
        "adam_bc1_inside",
        O,
        "return m, v, quot(quot(m, bc1), math.sqrt(v / bc2 + eps_root) + eps)",
        "return m, v, quot(m, bc1 * (math.sqrt(v / bc2 + eps_root) + eps))",
        "rounding",
    ),
    Mutation(
        "adam_eps_in_sqrt",
        O,
        "return m, v, quot(quot(m, bc1), math.sqrt(v / bc2 + eps_root) + eps)",
        "return m, v, quot(quot(m, bc1), math.sqrt(v / bc2 + eps_root + eps))",
        "bug",
    ),
    Mutation(
        "adam_nu_not_squared",
        O,
        "    v = one_minus_b2 * abs_sq(g) + b2 * re(nu)\n    return m, v, quot(quot(m, bc1)",
        "    v = one_minus_b2 * abs(g) + b2 * re(nu)\n    return m, v, quot(quot(m, bc1)",
        "bug",
    ),
    Mutation(
        "adam_moment_order",
        O,
        "    m = one_minus_b1 * g + b1 * mu\n"
        "    v = one_minus_b2 * abs_sq(g) + b2 * re(nu)\n    return m, v, quot(quot(m,",
        "    m = mu + one_minus_b1 * (g - mu)\n"
        "    v = one_minus_b2 * abs_sq(g) + b2 * re(nu)\n    return m, v, quot(quot(m,",
        "rounding",
    ),
    Mutation(
        "adam_bias_correction_order",
        O,
        "return m, v, quot(quot(m, bc1), math.sqrt(v / bc2 + eps_root) + eps)",
        "return m, v, quot(quot(m, math.sqrt(v / bc2 + eps_root) + eps), bc1)",
        "rounding",
    ),
    Mutation(
        "nadam_bc_swapped",
        O,
        "    m_hat = b1 * quot(m, bc1_next) + one_minus_b1 * quot(g, bc1)\n    return m, v, quot(m_hat",
        "    m_hat = b1 * quot(m, bc1) + one_minus_b1 * quot(g, bc1_next)\n    return m, v, quot(m_hat",
        "bug",
    ),
    Mutation(
        "nadam_factored",
        O,
        "    m_hat = b1 * quot(m, bc1_next) + one_minus_b1 * quot(g, bc1)\n    return m, v, quot(m_hat",
        "    m_hat = quot(b1 * m, bc1_next) + one_minus_b1 * quot(g, bc1)\n    return m, v, quot(m_hat",
        "rounding",
    ),
    Mutation(
        "ema_debias_order",
        F,
        "    e = one_minus_decay * g + decay * ema\n    return e, quot(e, bias_correction)",
        "    e = one_minus_decay * g + decay * ema\n    return e, e * (1.0 / bias_correction)",
        "rounding",
    ),
    Mutation(
        "ema_sign",
        F,
        "    e = one_minus_decay * g + decay * ema\n",
        "    e = one_minus_decay * g - decay * ema\n",
        "bug",
    ),
    Mutation(
        "trace_nesterov_uses_old_trace",
        A,
        "return t, (g + decay * t if nesterov else t)",
        "return t, (g + decay * trace if nesterov else t)",
        "bug",
    ),
    Mutation(
        "trace_nesterov_ignored",
        A,
        "return t, (g + decay * t if nesterov else t)",
        "return t, t",
        "bug",
    ),
    Mutation(
        "clamp_bound",
        F,
        "    if v < -bound:\n        return -bound",
        "    if v < -bound:\n        return bound",
        "bug",
    ),
    Mutation(
        "clamp_strict",
        F,
        "    if v > bound:\n        return bound",
        "    if v > 2 * bound:\n        return bound",
        "bug",
    ),
    Mutation("add_scaled_sign", F, "    return x + s * y\n", "    return x - s * y\n", "bug"),
    Mutation(
        "mean_accumulate_welford",
        F,
        "return g + 0 if fresh else acc + quot(g - acc, count)",
        "return g + 0 if fresh else acc + quot(g - acc, count + 1)",
        "bug",
    ),
    Mutation(
        "amsgrad_max_before_debias",
        O,
        "    vm = maximum(re(nu_max), v / bc2)\n",
        "    vm = maximum(re(nu_max), v) / bc2\n",
        "bug",
    ),
    Mutation(
        "adamax_eps_outside",
        O,
        "    v = maximum(abs(g) + eps, b2 * re(nu))\n",
        "    v = maximum(abs(g), b2 * re(nu)) + eps\n",
        "bug",
    ),
    Mutation(
        "belief_eps_root_outside",
        O,
        "    v = (one_minus_b2 * abs_sq(e) + b2 * re(nu)) + eps_root\n",
        "    v = one_minus_b2 * abs_sq(e) + (b2 * re(nu) + eps_root)\n",
        "rounding",
    ),
    Mutation(
        "lion_mu_from_c",
        O,
        "    return one_minus_b2 * g + b2 * mu, out",
        "    return one_minus_b2 * c + b2 * mu, out",
        "bug",
    ),
    Mutation(
        "sign_of_zero", F, "    if x > 0:\n        return 1.0", "    if x >= 0:\n        return 1.0", "bug"
    ),
    Mutation(
        "rms_eps_placement",
        F,
        "    return like(n, 1.0) / (sqrt(n) + eps)",
        "    return like(n, 1.0) / sqrt(n + eps)",
        "bug",
    ),
    Mutation(
        "stddev_variance_sign",
        O,
        "    var = v / bc - abs_sq(mh)",
        "    var = v / bc + abs_sq(mh)",
        "bug",
    ),
    Mutation(
        "rss_order",
        O,
        "    s = abs_sq(g) + re(sum_of_squares)\n",
        "    s = g * abs(g) + re(sum_of_squares)\n",
        "bug",
    ),
    # the declarations: the scalars the formulas get
    Mutation(
        "adam_bc2_from_b1",
        "numbaccum/optimizers.py",
        "        bc1, bc2 = bias_correction(b1, t, ct), bias_correction(b2, t, ct)\n"
        "        return (b1, 1.0 - b1, b2, 1.0 - b2, bc1, bc2, self.eps, self.eps_root)",
        "        bc1, bc2 = bias_correction(b1, t, ct), bias_correction(b1, t, ct)\n"
        "        return (b1, 1.0 - b1, b2, 1.0 - b2, bc1, bc2, self.eps, self.eps_root)",
        "bug",
    ),
    Mutation(
        "nadam_bc1_next_same",
        "numbaccum/optimizers.py",
        "bias_correction(b1, int(safe_increment(count)), ct)\n        bc2 = bias_correction(b2, t, ct)\n"
        "        return (b1, 1.0 - b1, b2, 1.0 - b2, bc1, bc1_next, bc2, self.eps, self.eps_root)\n",
        "bias_correction(b1, t, ct)\n        bc2 = bias_correction(b2, t, ct)\n"
        "        return (b1, 1.0 - b1, b2, 1.0 - b2, bc1, bc1_next, bc2, self.eps, self.eps_root)\n",
        "bug",
    ),
    Mutation(
        "bias_correction_in_float64",
        "numbaccum/declared.py",
        "    return one - d ** int(count)\n",
        "    return type(one)(1.0 - float(d) ** int(count))\n",
        "rounding",
    ),
    # Sophia (numbaccum/contrib.py): the new nu in the ratio instead of the previous one, and the
    # estimate taken at the count after the step instead of optax's count before it
    Mutation(
        "sophia_new_nu_in_ratio",
        "numbaccum/contrib.py",
        "    u = (m / bc1) / maximum(gamma * nu, eps)\n    if clipping:\n"
        "        u = minimum(maximum(u, -clip_threshold), clip_threshold)\n"
        "    v = one_minus_b2 * h + b2 * nu if hessian_step else nu\n",
        "    v = one_minus_b2 * h + b2 * nu if hessian_step else nu\n"
        "    u = (m / bc1) / maximum(gamma * v, eps)\n    if clipping:\n"
        "        u = minimum(maximum(u, -clip_threshold), clip_threshold)\n",
        "bug",
    ),
    Mutation(
        "sophia_hessian_step_after",
        "numbaccum/contrib.py",
        "hessian_step = int(state.count) % interval == 0",
        "hessian_step = (int(state.count) + 1) % interval == 0",
        "bug",
    ),
]


def apply(root: str, m: Mutation) -> None:
    path = os.path.join(root, m.path)
    with open(path) as f:
        text = f.read()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"{m.name}: the line to mutate occurs {n} times in {m.path} (the code moved?)")
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))


def run_one(m: Mutation, cache: str, timeout: float) -> tuple[bool, str, float]:
    """(killed, the first failing test or why it survived, seconds)."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        for d in ("numbaccum", "tests"):
            shutil.copytree(
                os.path.join(ROOT, d), os.path.join(tmp, d), ignore=shutil.ignore_patterns("__pycache__")
            )
        shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp)
        apply(tmp, m)
        env = dict(os.environ, NUMBACCUM_TEST_CACHE_DIR=cache, PYTHONPATH=tmp, PYTHONDONTWRITEBYTECODE="1")
        # -m: the exhaustive sweeps of the targets too (pyproject's addopts leave them out)
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        cmd += ["-m", "exhaustive or not exhaustive", *TARGETS]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:.0f} s", time.perf_counter() - t0
        dt = time.perf_counter() - t0
        failed = [ln for ln in r.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        if r.returncode == 0:
            return False, "every targeted test passed", dt
        if not failed:
            return True, f"pytest exit {r.returncode}: {r.stdout.strip().splitlines()[-1:]}", dt
        return True, failed[0], dt


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for m in MUTATIONS:
            print(f"{m.name:32s} {m.kind:8s} {m.path}")
        return 0
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    for m in chosen:  # every mutation must still apply: fail early if the code moved
        with open(os.path.join(ROOT, m.path)) as f:
            if f.read().count(m.old) != 1:
                raise SystemExit(f"{m.name}: the line to mutate is not in {m.path} exactly once")
    cache = tempfile.mkdtemp(prefix="mutate-cache-")
    os.chmod(cache, 0o700)
    survivors = []
    try:
        for m in chosen:
            killed, why, dt = run_one(m, cache, timeout=1200)
            print(
                f"{'killed ' if killed else 'SURVIVED'} {m.name:32s} {m.kind:8s} {dt:6.1f} s  {why}",
                flush=True,
            )
            if not killed:
                survivors.append(m.name)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(
        f"{len(chosen) - len(survivors)}/{len(chosen)} killed"
        + (f"; survivors: {survivors}" if survivors else "")
    )
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
