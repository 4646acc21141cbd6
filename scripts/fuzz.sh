#!/usr/bin/env bash
# Builds gwt's libFuzzer targets (fuzz/) with clang, AddressSanitizer and UndefinedBehaviorSanitizer
# into build-fuzz/ and runs each for SECONDS on a copy of its committed seed corpus.
#
#   scripts/fuzz.sh SECONDS [target...]     targets: transform step galore load compression adapters
#                                          (default all)
#
# One line per target (executions, rate, crashes) and a total; exits non-zero if any target
# crashed (the input is kept as fuzz/crashes/<target>-crash-*, reproduce it with
# build-fuzz/fuzz/gwt_fuzz_<target> <file>) or could not run.
#
# Environment: GWT_FUZZ_BUILD (build dir, default build-fuzz), GWT_JOBS (build jobs),
# GWT_FUZZ_RUNS=N (also stop a target after N executions, whichever of the two comes first),
# GWT_FUZZ_SEED=N (libFuzzer's -seed: the same seed, corpus and binary replay the same inputs in
# the same order, so a run is reproducible and a gate can pass by construction; unset, each run
# draws a seed and explores new inputs, which is what a developer's run is for),
# GWT_FUZZ_MERGE=1 (merge the inputs that found new coverage back into fuzz/corpus/<target>),
# GWT_FUZZ_NOTES=<dir> (inputs of the targets' notes, see fuzz/fuzz_util.h).
set -euo pipefail

usage() { echo "usage: scripts/fuzz.sh SECONDS [transform|step|galore|load|compression|adapters ...]" >&2; exit 2; }
[[ $# -ge 1 && "$1" =~ ^[0-9]+$ && "$1" -ge 1 ]] || usage
seconds="$1"; shift
all_targets=(transform step galore load compression adapters)
targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  [[ " ${all_targets[*]} " == *" $t "* ]] || { echo "scripts/fuzz.sh: unknown target '$t'" >&2; usage; }
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=setup.sh
source "$root/scripts/setup.sh"
# Debian 12: clang 14; libFuzzer and the sanitizer runtimes are in libclang-rt-14-dev, the
# symbolizer for readable stacks in llvm-14.
gwt_setup clang libclang-rt-14-dev llvm-14

build="${GWT_FUZZ_BUILD:-$root/build-fuzz}"
mkdir -p "$build"
start=$(date +%s)
if ! cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=clang++ "-DTorch_DIR=$GWT_TORCH_DIR" -DGWT_BUILD_FUZZERS=ON \
    -DGWT_BUILD_TESTS=OFF -DGWT_BUILD_EXAMPLES=OFF -DGWT_CUDA=OFF >"$build/configure.log" 2>&1; then
  cat "$build/configure.log" >&2
  exit 1
fi
# shellcheck disable=SC2046
cmake --build "$build" --parallel "${GWT_JOBS:-$(nproc)}" \
  --target $(printf 'gwt_fuzz_%s ' "${targets[@]}") >"$build/build.log" 2>&1 \
  || { tail -50 "$build/build.log" >&2; exit 1; }
echo "fuzz: built in $(($(date +%s) - start)) s ($build)"

# LibTorch is not instrumented and keeps allocations in globals for the life of the process:
# leak checking would only report those. A huge allocation is an error the code must handle
# (c10::Error from LibTorch's allocator), not an abort.
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$root/fuzz/ubsan.supp:${UBSAN_OPTIONS:-}"
symbolizer="$(command -v llvm-symbolizer || command -v llvm-symbolizer-14 || true)"
[[ -n "$symbolizer" ]] && export ASAN_SYMBOLIZER_PATH="$symbolizer"
# One thread: executions stay small, and the CPU goes to the fuzzer loop.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

crashes_dir="$root/fuzz/crashes"
mkdir -p "$crashes_dir"
# The working corpus lives on tmpfs where there is one: libFuzzer takes its seed inputs in the order
# the directory lists them (ties of size stay in that order), and tmpfs lists in the order the files
# were made, which the sorted glob below fixes; ext4 lists in the order of a hash seeded per
# filesystem, so a fixed GWT_FUZZ_SEED would replay other inputs on another disk.
# (Where /dev/shm has under 256 MB free, as in a container's default 64 MB, the disk it is.)
shm_free_kb=$(df --output=avail -k /dev/shm 2>/dev/null | tail -1 | tr -d ' ' || true)
if [[ "${shm_free_kb:-0}" =~ ^[0-9]+$ && "${shm_free_kb:-0}" -ge 262144 ]]; then
  work="$(mktemp -d -p /dev/shm)"
else
  work="$(mktemp -d)"
fi
trap 'rm -rf "$work"' EXIT
total_execs=0 total_crashes=0 failed=0
for t in "${targets[@]}"; do
  corpus="$work/$t"
  mkdir -p "$corpus"
  [[ -d "$root/fuzz/corpus/$t" ]] && cp "$root/fuzz/corpus/$t/"* "$corpus/" 2>/dev/null || true
  seeds=$(find "$corpus" -type f | wc -l)
  log="$work/$t.log"
  rc=0
  t_start=$(date +%s)
  "$build/fuzz/gwt_fuzz_$t" -max_total_time="$seconds" ${GWT_FUZZ_RUNS:+-runs=$GWT_FUZZ_RUNS} \
    ${GWT_FUZZ_SEED:+-seed=$GWT_FUZZ_SEED} \
    -timeout=10 -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="$crashes_dir/$t-" "$corpus" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *\([0-9]*\).*/\1/p' "$log" | tail -1)
  seed=$(sed -n 's/^INFO: Seed: *\([0-9]*\).*/\1/p' "$log" | head -1)
  units=$(find "$corpus" -type f | wc -l)
  # libFuzzer stops at the first crash (or timeout, or out-of-memory) and exits non-zero.
  crashes=0
  if [[ $rc -ne 0 || -z "$execs" ]]; then
    crashes=1
    failed=1
    echo "fuzz $t: CRASHED (exit $rc) after ${execs:-?} executions (seed ${seed:-?}); log tail:"
    tail -40 "$log" | sed 's/^/  | /'
    grep -h 'Test unit written to' "$log" | sed 's/.*written to /  input: /' || true
  else
    echo "fuzz $t: $execs executions in $(( $(date +%s) - t_start )) s (${rate:-?}/s, seed ${seed:-?}), 0 crashes, corpus $seeds -> $units inputs"
  fi
  grep -h '^gwt fuzz note' "$log" | sed 's/^/  /' || true
  total_execs=$((total_execs + ${execs:-0}))
  total_crashes=$((total_crashes + crashes))
  if [[ "${GWT_FUZZ_MERGE:-0}" == 1 && $rc -eq 0 ]]; then
    mkdir -p "$root/fuzz/corpus/$t"
    "$build/fuzz/gwt_fuzz_$t" -merge=1 "$root/fuzz/corpus/$t" "$corpus" >"$work/$t.merge.log" 2>&1 \
      || { echo "fuzz $t: merge failed"; tail -20 "$work/$t.merge.log"; failed=1; }
  fi
done
echo "fuzz total: ${#targets[@]} targets, $total_execs executions, $total_crashes crashes"
exit "$failed"
