"""examples/python/train_lm.py runs (a few steps; the full run is in docs/results.md)."""

import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python" / "train_lm.py"


@pytest.mark.skipif(not SCRIPT.exists(), reason="examples/python/train_lm.py not found")
def test_train_lm_example_runs_both_optimizers():
    out = subprocess.run([sys.executable, str(SCRIPT), "--steps", "10", "--batch", "4"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "| torch.optim.AdamW |" in out and "| gwt.WaveletAdam haar L=2 |" in out
