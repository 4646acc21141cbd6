#!/usr/bin/env python3
"""Prints the optimizer-step benchmark table (Markdown) from Google Benchmark JSON.

    bench_table.py results.json [--machine "description"] [--extra other.json]

Every ratio compares numbers from the same run: time against torch::optim::Adam on the same
workload, effective bandwidth (bytes the step must move / time) against the plain copy
(BM_Copy). With repetitions the median is used. --extra adds rows measured by another program in
the same run (e.g. the GPU check's at::_fused_adam_ row)."""
import argparse
import json
import re
import sys


def load(path):
    with open(path) as f:
        data = json.load(f)
    rows = {}
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        m = re.match(r"BM_(\w+?)/(\d+)", b["name"])
        if not m:
            continue
        variant, workload = m.group(1), int(m.group(2))
        unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        rows[(variant, workload)] = {
            "ms": b["real_time"] * unit,
            "bytes_per_param": b.get("bytes/param", 0.0),
            "params": b.get("params", 0.0),
            "label": b.get("label", str(workload)),
        }
    return data.get("context", {}), rows


NAMES = {
    "Copy": "copy (bandwidth baseline)",
    "TorchAdam": "torch::optim::Adam",
    "TorchAdamW": "torch::optim::AdamW",
    "FusedAdam": "at::_fused_adam_",
    "WaveletAdamReference_haar_L2": "WaveletAdam reference, haar L=2",
    "WaveletAdamFused_haar_L1": "WaveletAdam fused, haar L=1",
    "WaveletAdamFused_haar_L2": "WaveletAdam fused, haar L=2",
    "WaveletAdamFused_haar_L3": "WaveletAdam fused, haar L=3",
    "WaveletAdamFused_db2_L2": "WaveletAdam fused, db2 L=2",
    "WaveletAdamFused_haar2d_L2": "WaveletAdam fused, haar 2-D L=2",
    "WaveletAdamFusedSkipParam_haar_L2": "WaveletAdam fused skip_param, haar L=2",
    "WaveletAdamFusedSkipParam_db2_L2": "WaveletAdam fused skip_param, db2 L=2",
    "WaveletAdamFusedSkipParam_haar2d_L2": "WaveletAdam fused skip_param, haar 2-D L=2",
    "GaLoreAdam_r128": "GaLoreAdam r=128 (no refresh)",
    "GaLoreRefreshExact_r128": "GaLoreAdam r=128, step with exact-SVD refresh",
    "GaLoreRefreshRandomized_r128": "GaLoreAdam r=128, step with randomized-SVD refresh",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--machine", default="")
    ap.add_argument("--extra", action="append", default=[])
    args = ap.parse_args()
    context, rows = load(args.json)
    for extra in args.extra:
        rows.update(load(extra)[1])
    workloads = sorted({w for (_, w) in rows})
    if args.machine:
        print(f"Machine: {args.machine}")
    print(f"Run: {context.get('date', '?')}, {context.get('num_cpus', '?')} CPUs\n")
    print("| workload | variant | ms / step | bytes/param | effective GB/s | time vs Adam | "
          "time vs _fused_adam_ | % of copy GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for w in workloads:
        adam = rows.get(("TorchAdam", w))
        fused = rows.get(("FusedAdam", w))
        copy = rows.get(("Copy", w))
        copy_gbs = copy["bytes_per_param"] * copy["params"] / (copy["ms"] * 1e6) if copy else None
        order = [v for v in NAMES if (v, w) in rows] + sorted(v for (v, ww) in rows if ww == w and v not in NAMES)
        for v in order:
            r = rows[(v, w)]
            gbs = r["bytes_per_param"] * r["params"] / (r["ms"] * 1e6)
            vs_adam = f"{r['ms'] / adam['ms']:.2f}x" if adam else "-"
            vs_fused = f"{r['ms'] / fused['ms']:.2f}x" if fused else "-"
            of_copy = f"{100 * gbs / copy_gbs:.0f}%" if copy_gbs else "-"
            print(f"| {r['label']} | {NAMES.get(v, v)} | {r['ms']:.2f} | {r['bytes_per_param']:.0f} | "
                  f"{gbs:.1f} | {vs_adam} | {vs_fused} | {of_copy} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
