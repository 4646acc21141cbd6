#!/usr/bin/env bash
# The README's first command, gwt's main job: installs what is missing, builds, and runs the
# language-model comparison (examples/train_lm: a byte-level LLaMA-style decoder on the English
# text of Debian's fortunes package, AdamW against WaveletAdam at several settings). Prints the
# results table and writes results/lm/: one CSV per run, results.md and val_loss.png.
# Arguments go to train_lm (e.g. --preset llama-20m --device cuda, --corpus my.txt, --quiet).
# --task finetune runs the fine-tuning job instead (scripts/finetune.sh, the rest of the arguments
# going to it); --task pretrain is this comparison.
set -euo pipefail
if [[ "${1:-}" == "--task" ]]; then
  case "${2:-}" in
    finetune) shift 2; exec "$(dirname "${BASH_SOURCE[0]}")/finetune.sh" "$@" ;;
    pretrain) shift 2 ;;
    *) echo "run.sh: error: --task must be pretrain or finetune, got '${2:-}'" >&2; exit 2 ;;
  esac
fi
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
gwt_setup
mkdir -p "$GWT_ROOT/build"
gwt_build "$GWT_ROOT/build" -DGWT_BUILD_EXAMPLES=ON >&2
out="$GWT_ROOT/results/lm"
args=("$@")
for ((i = 0; i < ${#args[@]}; ++i)); do
  [[ "${args[i]}" == "--out" && $((i + 1)) -lt ${#args[@]} ]] && out="${args[i + 1]}"
done
"$GWT_ROOT/build/examples/train_lm" --out "$out" "$@"
"$GWT_PYTHON" "$GWT_ROOT/scripts/plot_lm.py" "$out" >&2
