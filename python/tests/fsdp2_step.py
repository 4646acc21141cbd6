"""Run by test_fsdp2.py under torchrun (2 ranks, Gloo, CPU): what a new user tries with FSDP2.

A two-layer model, fully_shard per layer and on the whole, gwt.WaveletAdam over its (DTensor)
parameters, a backward and a step. gwt must refuse the DTensors with a clear error on every rank
(it used to crash the process: its kernels wrote through the DTensors' data_ptr()). Prints
MARKER and the error on a refusal; exits 0 either way once the process group is gone, so that only
a refusal prints the marker and only a crash or a hang fails the run.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gwt

MARKER = "GWT_FSDP2_REFUSED"


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        try:
            opt = gwt.WaveletAdam(model.parameters())
            model(torch.randn(4, 16)).square().sum().backward()
            opt.step()
        except (TypeError, ValueError) as error:
            print(f"{MARKER} rank={rank}: {type(error).__name__}: {error}", flush=True)
        else:
            print(f"rank={rank}: the step ran on DTensor parameters", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
