"""DDP communication hooks compared on one training run each, under torchrun (Gloo, CPU):

    torchrun --standalone --nproc_per_node 2 benchmarks/python/ddp_hooks.py --steps 300

The byte-level TinyLM of examples/python/train_lm.py (fortunes text; each rank its own batches)
trains with torch.optim.AdamW, the same seeds, under: DDP's own all-reduce, PyTorch's PowerSGD hook
(rank 4, error feedback, warm start, compressing from step 2), and gwt.distributed.wavelet_hook
(Haar level 2 and 3). Rank 0 prints a Markdown table: bytes this rank put into the collectives per
step (counted from the tensors each hook hands to torch.distributed; DDP's own all-reduce sends
every gradient), the final training loss (mean of the last 20 steps), the validation loss and
ms / step.
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import gwt.distributed

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "python"))
from train_lm import TinyLM, batches, load_text, validation_loss  # noqa: E402


class ByteCounter:
    """Counts the bytes of the tensors handed to dist.all_reduce and dist.all_gather (the Python
    collectives the hooks call) while active."""

    def __init__(self):
        self.bytes = 0
        self._reduce, self._gather = dist.all_reduce, dist.all_gather

    def __enter__(self):
        def all_reduce(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return self._reduce(tensor, *args, **kwargs)

        def all_gather(tensors, tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return self._gather(tensors, tensor, *args, **kwargs)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather
        return self

    def __exit__(self, *exc):
        dist.all_reduce, dist.all_gather = self._reduce, self._gather


def run(hook_name, data, val, args):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM(seq_len=args.seq_len)
    # One bucket after the first step: under Gloo, PowerSGD's chained all-reduces of two buckets can
    # reach the ranks in different orders (a collective mismatch).
    ddp = DistributedDataParallel(model, bucket_cap_mb=1000)
    if hook_name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2, use_error_feedback=True,
                                            warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook_name.startswith("wavelet"):
        ddp.register_comm_hook(gwt.distributed.WaveletHookState(level=int(hook_name[-1])),
                               gwt.distributed.wavelet_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    def schedule(t):  # warm-up, then cosine to 0.1 of the peak
        return min(1.0, (t + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * t / args.steps)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(1 + rank)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    losses, sent = [], 0
    start = time.perf_counter()
    with ByteCounter() as counter:
        for _ in range(args.steps):
            x, y = batches(data, args.batch, args.seq_len, gen)
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        sent = counter.bytes if hook_name != "allreduce" else full * args.steps
    ms = (time.perf_counter() - start) * 1e3 / args.steps
    val_loss = validation_loss(model, val, args.batch, args.seq_len)
    train_loss = sum(losses[-20:]) / 20
    return sent / args.steps, full, train_loss, val_loss, ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hooks", default="allreduce,powersgd,wavelet2,wavelet3")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    text = torch.frombuffer(bytearray(load_text("")), dtype=torch.uint8)
    split = int(0.9 * text.numel())
    data, val = text[:split], text[split:]
    rows = []
    for name, label in [("allreduce", "DDP all-reduce (no hook)"),
                        ("powersgd", "PowerSGD hook, rank 4"),
                        ("wavelet2", "gwt.distributed.wavelet_hook, level 2"),
                        ("wavelet3", "gwt.distributed.wavelet_hook, level 3")]:
        if name not in args.hooks.split(","):
            continue
        per_step, full, train_loss, val_loss, ms = run(name, data, val, args)
        rows.append((label, per_step, per_step / full, train_loss, val_loss, ms))
        if dist.get_rank() == 0:
            print(f"{label}: done", flush=True)
    if dist.get_rank() == 0:
        print(f"\n{dist.get_world_size()} ranks, {args.steps} steps, batch {args.batch} x "
              f"{args.seq_len} per rank\n")
        print("| communication | bytes / step / rank | vs all-reduce | train loss (last 20) "
              "| val loss | ms / step |\n|---|---:|---:|---:|---:|---:|")
        for label, per_step, ratio, train_loss, val_loss, ms in rows:
            print(f"| {label} | {per_step:,.0f} | {ratio:.3f}x | {train_loss:.4f} | "
                  f"{val_loss:.4f} | {ms:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
