"""The CPU backend: how to walk a buffer with numba ``@njit`` loops, never what to compute.

- `driver`: compiles the formulas of `numbaccum.formulas` into parallel loops (`map_`).
- `reduce`: the reduction engine over the tables of `numbaccum.tables`.
- `per_example`: the batch-weighted sum of per-example (DP-SGD) gradients.

`numbaccum.backend.ops_for` puts the three behind `numbaccum.contract.Ops`; `numbaccum.cuda` has
the same modules with the same primitives (tests/test_contract.py checks it).
"""
