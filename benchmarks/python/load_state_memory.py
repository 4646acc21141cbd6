"""Peak host memory of WaveletAdam.load_state_dict: how much the process's resident set grows above
what it held before the call, while the call runs.

    $GWT_PYTHON benchmarks/python/load_state_memory.py [--size 5000] [--level 0]

One float32 parameter of size x size; level 0 is dense Adam, so the state is two moments of
size * size values each (at level L they shrink along the last dimension to about size / 2**L).
A first process steps once and saves state_dict() with torch.save; a fresh process builds the
optimizer, torch.load()s the file, then measures load_state_dict alone: the kernel's high-water
mark (VmHWM) is reset just before the call through /proc/self/clear_refs, and the increase is
VmHWM after the call minus VmRSS before it.
"""

import argparse
import os
import subprocess
import sys
import tempfile


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def build(size, level):
    import torch

    import gwt
    param = torch.nn.Parameter(torch.zeros(size, size))
    return param, gwt.WaveletAdam([param], level=level)


def save(path, size, level):
    import torch
    param, opt = build(size, level)
    param.grad = torch.randn(size, size)
    opt.step()
    torch.save(opt.state_dict(), path)
    print(f"state: {opt.state_bytes() / 2**20:.1f} MiB "
          f"({opt.state_bytes() // 4} float32 values)", flush=True)


def load(path, size, level):
    import gc

    import torch
    _, opt = build(size, level)
    state_dict = torch.load(path, weights_only=True)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = rss_kib("VmRSS")
    opt.load_state_dict(state_dict)
    peak = rss_kib("VmHWM")
    print(f"load_state_dict: peak RSS increase {(peak - before) / 1024:.1f} MiB "
          f"(VmRSS before {before / 1024:.1f} MiB, VmHWM during {peak / 1024:.1f} MiB)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=5000)
    parser.add_argument("--level", type=int, default=0)
    parser.add_argument("--step", choices=["save", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step == "save":
        return save(args.path, args.size, args.level)
    if args.step == "load":
        return load(args.path, args.size, args.level)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pt")
        for step in ("save", "load"):
            subprocess.run([sys.executable, __file__, "--step", step, "--path", path, "--size",
                            str(args.size), "--level", str(args.level)], check=True)


if __name__ == "__main__":
    main()
