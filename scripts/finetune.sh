#!/usr/bin/env bash
# The fine-tuning main job (issue 13): installs what is missing, builds, pre-trains the tiny LM on
# the fortunes text (or reuses results/finetune/pretrained.pt), adapts it to Debian's licence texts
# (/usr/share/common-licenses) with full fine-tuning and with gwt::nn::DeltaLinear adapters, and
# prints the table. Writes results/finetune/: results.md, sweep.csv, one CSV per method and
# finetune.png. Arguments go to train_finetune (e.g. --steps 400, --methods lora-k8,hra-r8).
# Also reachable as ./scripts/run.sh --task finetune.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
gwt_setup
mkdir -p "$GWT_ROOT/build"
gwt_build "$GWT_ROOT/build" -DGWT_BUILD_EXAMPLES=ON >&2
out="$GWT_ROOT/results/finetune"
args=("$@")
for ((i = 0; i < ${#args[@]}; ++i)); do
  [[ "${args[i]}" == "--out" && $((i + 1)) -lt ${#args[@]} ]] && out="${args[i + 1]}"
done
"$GWT_ROOT/build/examples/train_finetune" --out "$out" "$@"
"$GWT_PYTHON" "$GWT_ROOT/scripts/plot_finetune.py" "$out" >&2
