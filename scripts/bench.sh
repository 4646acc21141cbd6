#!/usr/bin/env bash
# Builds the benchmarks and prints the optimizer-step table (CPU), writing results/bench_cpu.json,
# then the interleaved table (results/bench_interleaved.md).
# Arguments go to the benchmark binary (e.g. --benchmark_filter=haar).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
gwt_setup
mkdir -p "$GWT_ROOT/build" "$GWT_ROOT/results"
gwt_build "$GWT_ROOT/build" -DGWT_BUILD_BENCHMARKS=ON >&2
# glibc returns large freed blocks to the kernel (mmap threshold, heap trimming), so an optimizer
# that allocates temporaries every step (torch::optim::Adam) may page-fault them in again on each
# step, and its time then flips from one process to the next (docs/performance.md). Fixed
# thresholds keep freed memory in the heap, which measures every variant at its best.
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1073741824}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-4294967296}"
export MALLOC_TOP_PAD_="${MALLOC_TOP_PAD_:-536870912}"
"$GWT_ROOT/build/benchmarks/gwt_bench_step" --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true --benchmark_out="$GWT_ROOT/results/bench_cpu.json" \
  --benchmark_out_format=json "$@" >&2
python3 "$GWT_ROOT/scripts/bench_table.py" "$GWT_ROOT/results/bench_cpu.json" \
  --machine "$(uname -m), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
# The same variants interleaved round by round in one process: ratios within each round, robust
# to a machine whose speed drifts between the benchmarks above.
echo
echo "Interleaved, $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs):"
"$GWT_ROOT/build/benchmarks/gwt_bench_interleaved" | tee "$GWT_ROOT/results/bench_interleaved.md"
