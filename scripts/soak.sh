#!/usr/bin/env bash
# Soak run (issue 12, item 6): the tiny LM of examples/train_lm trained for STEPS steps (default
# 10000) with WaveletAdam (haar L=2) and GaLoreAdam, the optimizer saved and reloaded into a fresh
# object every EVERY steps (default 1000) and compared bit for bit with a run of the same seed that
# never reloads. Prints the table and writes it to docs/notes/soak.md; exit status 1 when a check fails.
#
#   scripts/soak.sh [STEPS] [-- extra lm_soak arguments, e.g. --batch 8 --seq 64]
#
# Environment: GWT_SOAK_BUILD (default build/, configured by scripts/test.sh with the examples),
# GWT_SOAK_NOBUILD=1 uses the binary already built there; GWT_SOAK_DOC (default docs/notes/soak.md).
# On a small machine run it below the builds' priority: nice -n 10 scripts/soak.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
steps=10000
if [[ $# -gt 0 && "$1" != "--" ]]; then steps="$1"; shift; fi
[[ "${1:-}" == "--" ]] && shift
build="${GWT_SOAK_BUILD:-$root/build}"
doc="${GWT_SOAK_DOC:-$root/docs/notes/soak.md}"

if [[ "${GWT_SOAK_NOBUILD:-0}" != 1 ]]; then
  source "$root/scripts/setup.sh"
  gwt_setup
  if [[ ! -f "$build/CMakeCache.txt" ]]; then
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "-DTorch_DIR=$GWT_TORCH_DIR" \
      -DGWT_BUILD_EXAMPLES=ON >"$build.configure.log" 2>&1 || { cat "$build.configure.log" >&2; exit 1; }
  fi
  cmake --build "$build" --target lm_soak --parallel "${GWT_JOBS:-$(nproc)}"
fi
bin="$build/examples/lm_soak"
[[ -x "$bin" ]] || { echo "soak.sh: $bin is not built" >&2; exit 1; }

every=$((steps >= 10000 ? 1000 : (steps >= 10 ? steps / 10 : 1)))
table="$(mktemp)"
trap 'rm -f "$table"' EXIT
set +e
"$bin" --steps "$steps" --every "$every" "$@" | tee "$table"
rc=${PIPESTATUS[0]}
set -e
[[ $rc -eq 0 || $rc -eq 1 ]] || { echo "soak.sh: lm_soak failed ($rc)" >&2; exit "$rc"; }

{
  echo "# Soak run"
  echo
  echo "\`${OMP_NUM_THREADS:+OMP_NUM_THREADS=$OMP_NUM_THREADS }scripts/soak.sh $steps${*:+ -- $*}\`"
  echo "(examples/train_lm/soak.cpp), $(date -u +%Y-%m-%d) on"
  # nproc --all: plain nproc follows OMP_NUM_THREADS.
  echo "$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc --all) cores, $(uname -m)."
  echo
  echo "Each optimizer trains two copies of the same model from the same seed on the same batches, in"
  echo "lockstep: one saves its optimizer (torch::save) every $every steps and continues with a fresh"
  echo "optimizer object over the same parameters loaded from that file (torch::load); the other never"
  echo "reloads. *reload identical* counts the marks (every $every steps and the end) where every"
  echo "parameter of the two copies is equal (at::equal); *state identical* the marks where the two"
  echo "optimizers' saved states are the same bytes. *NaNs* counts non-finite losses and marks with a"
  echo "non-finite parameter; *skipped* is skipped_steps() summed over every optimizer object of both"
  echo "copies; the losses are of the reloading copy (validation: evenly spaced held-out windows;"
  echo "training: mean over the $every steps before the mark). ms / step is per model step (two per"
  echo "step of the pair, forward, backward and optimizer), on a machine shared with other jobs."
  echo
  cat "$table"
  echo
  if [[ $rc -eq 0 ]]; then
    echo "Every check holds: no NaN, no skipped step, final loss below the loss at step $every, and the"
    echo "reloaded runs bit-identical to the runs without reloads."
  else
    echo "**A check failed** (the *pass* column says which optimizer)."
  fi
} >"$doc"
echo "soak.sh: wrote $doc" >&2
exit "$rc"
