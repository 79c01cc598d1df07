"""The examples run and learn."""

import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_mlp_example_trains():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import mlp
    finally:
        sys.path.remove(str(EXAMPLES))
    untrained = mlp.main(steps=0)
    trained = mlp.main(steps=400)
    assert trained < 0.6 * untrained


def test_mlp_example_runs_as_a_script(capsys):
    runpy.run_path(str(EXAMPLES / "mlp.py"), run_name="__main__")
    assert "final training loss" in capsys.readouterr().out
