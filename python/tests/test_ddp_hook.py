"""gwt.distributed.wavelet_hook, the DistributedDataParallel communication hook: its result under
torchrun against PyWavelets and NumPy (ddp_hook_check.py), and its options' errors."""

import pathlib

import pytest
import torch.distributed as dist

import gwt.distributed
from gwt_test_util import run_torchrun

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="needs torch.distributed with Gloo")
def test_the_hook_averages_as_the_rule_says_on_two_ranks():
    output = run_torchrun(HERE / "ddp_hook_check.py")
    for rank in (0, 1):
        assert f"GWT_DDP_HOOK_OK rank={rank}" in output, output


@pytest.mark.parametrize("level, error", [(0, ValueError), (31, ValueError), (2.0, TypeError),
                                          (True, TypeError)])
def test_a_bad_level_is_refused(level, error):
    with pytest.raises(error, match="level"):
        gwt.distributed.WaveletHookState(level=level)


def test_error_feedback_must_be_a_bool():
    with pytest.raises(TypeError, match="error_feedback must be a bool"):
        gwt.distributed.WaveletHookState(error_feedback=1)
