"""Optimizer step time of the Python package: ``python benchmarks/python/step_time.py``.

Times one ``step()`` on the LLaMA-60M wavelet-eligible set (benchmarks/workloads.h: 8 layers of q, k,
v, o 512x512, gate and up 1376x512, down 512x1376, 25.3M float32 values with fixed gradients) for

- ``gwt.WaveletAdam`` (Haar, level 2, the defaults otherwise: the C++ kernels), and with
  ``nonfinite="skip_param"`` (each tensor's norm pass and update back to back, while its gradient
  is in the cache, instead of every norm pass first: see docs/options.md),
- ``torch.optim.Adam(foreach=True)`` and ``torch.optim.Adam(fused=True)``,
- the same GWT rule written in PyTorch ops (``PureTorchGWT`` below), per tensor as the GWT
  authors' optimizer computes it: a multilevel Haar DWT of the gradient, Adam on the
  approximation, details divided by its denominator, the norm-growth limiter, the inverse DWT.
  Its Haar transform uses strided slices, the fastest pure-ops form (a convolution, as general
  wavelet libraries use, is slower): the comparison favours it.

Variants run interleaved, round by round (the order rotates each round), on their own copies of
the parameters; each round's times are divided by gwt.WaveletAdam's of the same round and the
table shows the median of those ratios, which a machine whose speed drifts between rounds leaves
alone. Prints a Markdown table and the machine it ran on.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Sequence

import torch

import gwt

INV_SQRT2 = 1.0 / math.sqrt(2.0)


def llama60m_shapes() -> List[List[int]]:
    shapes = []
    for _ in range(8):
        shapes += [[512, 512]] * 4 + [[1376, 512], [1376, 512], [512, 1376]]
    return shapes


def tiny_shapes() -> List[List[int]]:
    return [[64, 128], [128, 64], [32, 256]]


WORKLOADS = {"llama60m": llama60m_shapes, "tiny": tiny_shapes}


# ------------------------------------------------------------------------------------------------
# The GWT rule in PyTorch ops
# ------------------------------------------------------------------------------------------------

def haar_wavedec(x: torch.Tensor, level: int) -> List[torch.Tensor]:
    """pywt.wavedec(x, "haar", level, axis=-1) for lengths divisible by 2**level:
    [cA_L, cD_L, ..., cD_1]."""
    details = []
    a = x
    for _ in range(level):
        even, odd = a[..., 0::2], a[..., 1::2]
        details.append((even - odd) * INV_SQRT2)
        a = (even + odd) * INV_SQRT2
    return [a] + details[::-1]


def haar_waverec(coeffs: Sequence[torch.Tensor]) -> torch.Tensor:
    """pywt.waverec(coeffs, "haar") (its inverse)."""
    a = coeffs[0]
    for d in coeffs[1:]:
        a = torch.stack(((a + d) * INV_SQRT2, (a - d) * INV_SQRT2), dim=-1).flatten(-2)
    return a


class PureTorchGWT(torch.optim.Optimizer):
    """GWT (docs/algorithm.md#the-update) with Haar along the last dimension, in PyTorch ops,
    one tensor at a time. Lengths along the last dimension must be divisible by 2**level."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, level=2, scale=1.0,
                 norm_growth_limit=1.01, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, level=level, scale=scale,
                                      norm_growth_limit=norm_growth_limit,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            gamma = group["norm_growth_limit"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                coeffs = haar_wavedec(p.grad, group["level"])
                approx = coeffs[0]
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(approx)
                    state["exp_avg_sq"] = torch.zeros_like(approx)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(approx, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(approx, approx, value=1 - beta2)
                denom = v.sqrt().add_(group["eps"])
                normalized = m / denom
                step_size = group["lr"] * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
                lim = None
                if gamma > 0:
                    norm = torch.linalg.vector_norm(normalized)
                    if "norm" not in state:
                        state["norm"] = norm
                    else:
                        lim = torch.clamp(norm / (state["norm"] + 1e-8), min=gamma) / gamma
                        normalized = normalized / lim
                        state["norm"] = norm / lim
                d = denom
                details = []
                for detail in coeffs[1:]:
                    scale = d[..., : detail.shape[-1]]
                    details.append(detail / (scale * lim if lim is not None else scale))
                    d = d.repeat_interleave(2, dim=-1)
                update = haar_waverec([normalized] + details)[..., : p.shape[-1]]
                p.add_(update, alpha=-step_size * group["scale"])
                if group["weight_decay"] != 0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])


# ------------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------------

def set_malloc_thresholds() -> str:
    """Keeps freed memory in glibc's heap (as scripts/bench.sh does with MALLOC_*_ variables): an
    optimizer that allocates temporaries every step would otherwise page-fault them in again on
    each step, and its time would flip between two levels from one process to the next."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "default (no glibc)"
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = (libc.mallopt(m_mmap_threshold, 1 << 30) == 1
          and libc.mallopt(m_trim_threshold, (1 << 31) - 1) == 1
          and libc.mallopt(m_top_pad, 512 << 20) == 1)
    return ("mmap threshold 1 GiB, trim threshold 2 GiB, top pad 512 MiB" if ok
            else "default (mallopt failed)")


def machine_description(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    text = (f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), torch {torch.__version__} "
            f"with {torch.get_num_threads()} threads, gwt {gwt.__version__}")
    if device.type == "cuda":
        text += f", GPU {torch.cuda.get_device_name(device)}"
    return text


def make_variants(shapes, device, lr, names):
    torch.manual_seed(0)
    base = [(torch.randn(s) * 0.02).to(device) for s in shapes]
    grads = [(torch.randn(s) * 1e-3).to(device) for s in shapes]

    def params():
        out = []
        for b, g in zip(base, grads):
            p = b.clone().requires_grad_()
            p.grad = g  # shared: no optimizer here writes gradients
            out.append(p)
        return out

    factories: Dict[str, Callable[[], torch.optim.Optimizer]] = {
        "gwt.WaveletAdam": lambda: gwt.WaveletAdam(params(), lr=lr, wavelet="haar", level=2),
        "gwt.WaveletAdam(nonfinite=skip_param)": lambda: gwt.WaveletAdam(
            params(), lr=lr, wavelet="haar", level=2, nonfinite="skip_param"),
        "torch.optim.Adam(foreach=True)": lambda: torch.optim.Adam(params(), lr=lr, foreach=True),
        "torch.optim.Adam(fused=True)": lambda: torch.optim.Adam(params(), lr=lr, fused=True),
        "pure PyTorch GWT": lambda: PureTorchGWT(params(), lr=lr, level=2),
    }
    unknown = set(names) - set(factories)
    if unknown:
        raise SystemExit(f"step_time.py: unknown variant(s) {sorted(unknown)}; valid: "
                         f"{list(factories)}")
    return {name: factories[name]() for name in factories if name in names}


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for entry in opt.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += value.numel() * value.element_size()
    return total


def run(args) -> str:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    malloc = set_malloc_thresholds() if not args.no_mallopt else "default"
    shapes = WORKLOADS[args.workload]()
    values = sum(math.prod(s) for s in shapes)
    variants = make_variants(shapes, device, args.lr, args.variants)
    names = list(variants)
    reference = "gwt.WaveletAdam" if "gwt.WaveletAdam" in names else names[0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(args.warmup + args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            sync()
            start = time.perf_counter()
            variants[name].step()
            sync()
            elapsed = time.perf_counter() - start
            if r >= args.warmup:
                times[name].append(elapsed)

    def median_ratio(name, reference_name):
        return statistics.median(t / ref for t, ref in zip(times[name], times[reference_name]))

    # Ratios against gwt.WaveletAdam, and against torch.optim.Adam(fused=True) when it ran.
    references = [reference] + [n for n in ("torch.optim.Adam(fused=True)",)
                                if n in names and n != reference]
    lines = [
        f"Optimizer step, workload {args.workload} ({len(shapes)} tensors, {values / 1e6:.3g}M "
        f"float32 values) on {device}, {args.rounds} rounds after {args.warmup} warm-up, "
        f"interleaved; ratios are medians of per-round ratios.",
        f"Machine: {machine_description(device)}; malloc: {malloc}.",
        "",
        "| optimizer | median ms / step | "
        + " | ".join(f"time / {ref}" for ref in references) + " | state MiB |",
        "|---|---:|" + "---:|" * len(references) + "---:|",
    ]
    for name in names:
        lines.append(f"| {name} | {1e3 * statistics.median(times[name]):.2f} | "
                     + " | ".join(f"{median_ratio(name, ref):.2f}x" for ref in references)
                     + f" | {state_bytes(variants[name]) / 2**20:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/python/step_time.py", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="llama60m")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--variants", nargs="+",
                        default=["gwt.WaveletAdam", "gwt.WaveletAdam(nonfinite=skip_param)",
                                 "torch.optim.Adam(foreach=True)",
                                 "torch.optim.Adam(fused=True)", "pure PyTorch GWT"])
    parser.add_argument("--no-mallopt", action="store_true",
                        help="leave glibc's malloc thresholds at their defaults")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
