#!/usr/bin/env python3
"""Draws the fine-tuning comparison of examples/train_lm/finetune.cpp: validation loss on the new
text (left) and on the original text (right: forgetting) against fine-tuning step, one line per
method at its best learning rate.

    plot_finetune.py RESULTS_DIR      (reads <method>.csv, writes finetune.png)
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHODS = ["full-adamw", "full-wavelet", "lora-k8", "delta-core-k8", "hra-r8", "hra-delta"]


def read(path):
    with open(path) as f:
        title = f.readline().lstrip("# ").strip()
        rows = list(csv.DictReader(f))
    return title, rows


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out = sys.argv[1]
    runs = [m for m in METHODS if os.path.exists(os.path.join(out, m + ".csv"))]
    if not runs:
        print(f"plot_finetune: error: no method CSVs in {out}", file=sys.stderr)
        return 2
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), dpi=120)
    for run in runs:
        title, rows = read(os.path.join(out, run + ".csv"))
        steps = [int(r["step"]) for r in rows]
        left.plot(steps, [float(r["new_val_loss"]) for r in rows], marker="o", markersize=3, label=title)
        right.plot(steps, [float(r["old_val_loss"]) for r in rows], marker="o", markersize=3, label=title)
    left.set_title("new text (licences): validation loss")
    right.set_title("original text (fortunes): validation loss, forgetting")
    for ax in (left, right):
        ax.set_xlabel("fine-tuning step")
        ax.set_ylabel("nats per byte")
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    path = os.path.join(out, "finetune.png")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot_finetune: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
