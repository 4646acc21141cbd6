#!/usr/bin/env python3
"""Draws validation loss against step for every run of examples/train_lm in one chart.

    plot_lm.py RESULTS_DIR      (reads <run>.csv and <run>.summary, writes val_loss.png)
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label_of(summary_path, fallback):
    try:
        with open(summary_path) as f:
            for line in f:
                if line.startswith("label="):
                    return line.strip().split("=", 1)[1]
    except OSError:
        pass
    return fallback


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out = sys.argv[1]
    runs = sorted(f[:-4] for f in os.listdir(out) if f.endswith(".csv"))
    if not runs:
        print(f"plot_lm: error: no run CSVs in {out}", file=sys.stderr)
        return 2
    order = ["adamw"] + [r for r in runs if r != "adamw"]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for run in (r for r in order if r in runs):
        with open(os.path.join(out, run + ".csv")) as f:
            rows = list(csv.DictReader(f))
        steps = [int(r["step"]) for r in rows]
        loss = [float(r["val_loss"]) for r in rows]
        ax.plot(steps, loss, marker="o", markersize=3, label=label_of(os.path.join(out, run + ".summary"), run))
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title("gwt: byte-level LLaMA-style decoder, AdamW vs WaveletAdam")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = os.path.join(out, "val_loss.png")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot_lm: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
