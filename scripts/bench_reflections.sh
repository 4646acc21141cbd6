#!/usr/bin/env bash
# Builds benchmarks/bench_reflections.cpp and prints its table: four ways of applying HRA's
# Householder reflections in a training step (WY on x, WY on W, r rank-1 updates, a dense [in, in]
# product), timed in the same run. Arguments go to the binary (--quick: one shape).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
gwt_setup
mkdir -p "$GWT_ROOT/build"
gwt_build "$GWT_ROOT/build" -DGWT_BUILD_BENCHMARKS=ON >&2
# Freed blocks stay in the heap (see scripts/bench.sh): no page faults on each step's temporaries.
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1073741824}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-4294967296}"
export MALLOC_TOP_PAD_="${MALLOC_TOP_PAD_:-536870912}"
"$GWT_ROOT/build/benchmarks/gwt_bench_reflections" "$@"
