"""examples/data_parallel.py (the gallery's MPI example) on every rank of MPI.COMM_WORLD.

CI's MPI pass runs this file on two ranks with the rest of tests/mpi (`.ci/run`); the plain
``python -m pytest`` runs it on one rank, where the example is plain gradient accumulation.
"""

import sys
from pathlib import Path

import pytest

MPI = pytest.importorskip("mpi4py.MPI")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
COMM = MPI.COMM_WORLD


def test_data_parallel_example_learns_with_the_same_parameters_on_every_rank(capsys):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import data_parallel
    finally:
        sys.path.remove(str(EXAMPLES))
    # main raises SystemExit on every rank at once if the ranks' parameters differ
    final = data_parallel.main(steps=200, comm=COMM, log_every=100)
    out = capsys.readouterr().out
    losses = COMM.allgather(final)
    assert losses == [losses[0]] * COMM.Get_size()  # the loss over the whole data set, everywhere
    assert final < 0.6
    if COMM.Get_rank() == 0:
        assert f"on {COMM.Get_size()} rank(s)" in out and "same parameters on every rank: True" in out
        assert "step 100: loss" in out and "step 200: loss" in out
