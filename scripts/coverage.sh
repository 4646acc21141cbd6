#!/usr/bin/env bash
# Line and branch coverage of src/optim/ and src/kernels/ by the unit tests (issue 12, item 7).
#
#   scripts/coverage.sh [gtest filter]      (default: every test of gwt_tests)
#
# Builds the CPU library and gwt_tests with gcov instrumentation (--coverage -O0, no CUDA) in
# build-cov/, runs gwt_tests (the ctest-only consumer tests, which install and rebuild the package,
# are left out: they exercise CMake, not src/), then its kernel tests again with the baseline
# kernel bodies forced (GWT_NO_AVX2=1 GWT_NO_ROWS8=1), and writes with gcovr (Debian's package,
# installed by the set-up):
#   build-cov/coverage/summary.txt      per-file lines, with the uncovered line numbers
#   build-cov/coverage/index.html       annotated sources
#   build-cov/coverage/coverage.json    gcovr's JSON (for scripting)
#   build-cov/coverage/branches.txt     per-file branches, with the lines that have an untaken one
#   build-cov/coverage/untaken_branches.txt  each line that ran with a branch no test took
# GWT_BUILD_LOCK=FILE serialises the configure and build steps with flock on FILE (for machines
# where several builds share the cores). docs/notes/coverage.md holds the last figures and the list of
# branches no test reaches.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
gwt_setup gcovr

dir="$GWT_ROOT/build-cov"
filter="${1:-*}"
locked() { if [[ -n "${GWT_BUILD_LOCK:-}" ]]; then flock "$GWT_BUILD_LOCK" "$@"; else "$@"; fi; }

mkdir -p "$dir"
# -fprofile-update=atomic: the kernels run on several threads (at::parallel_for, and the lane tests'
# std::barrier lanes); plain counters race there and gcov then reports negative counts, which gcovr
# refuses to parse. ccache is bypassed: instrumented objects name their .gcno/.gcda paths, which a cache hit from
# another directory would get wrong.
export CCACHE_DISABLE=1
locked cmake -S "$GWT_ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  "-DTorch_DIR=$GWT_TORCH_DIR" -DGWT_CUDA=OFF -DGWT_BUILD_TESTS=ON -DGWT_BUILD_EXAMPLES=ON \
  -DGWT_WARNINGS_AS_ERRORS=ON "-DCMAKE_CXX_FLAGS=--coverage -O0 -fprofile-update=atomic" \
  -DCMAKE_EXE_LINKER_FLAGS=--coverage -DCMAKE_SHARED_LINKER_FLAGS=--coverage \
  >"$dir/configure.log" 2>&1 || { cat "$dir/configure.log" >&2; exit 1; }
locked cmake --build "$dir" --target gwt_tests --parallel "${GWT_JOBS:-$(nproc)}"

find "$dir" -name '*.gcda' -delete
gwt_log "running gwt_tests --gtest_filter='$filter' (instrumented, -O0: slower than usual)"
(cd "$dir/tests" && ./gwt_tests --gtest_brief=1 "--gtest_filter=$filter")
# The kernels' baseline builds (and the one-row general body) run only where the AVX2 ones do not:
# the kernel tests again with them forced, so that their lines count (gcov adds the runs up).
kernel_tests='Fused.*:WaveletAdam.*:WaveletAdamKernels.*:KernelRows.*:Errors.*'
if [[ "$filter" == "*" ]]; then
  gwt_log "running the kernel tests again with GWT_NO_AVX2=1 GWT_NO_ROWS8=1 (the baseline bodies)"
  (cd "$dir/tests" && GWT_NO_AVX2=1 GWT_NO_ROWS8=1 ./gwt_tests --gtest_brief=1 \
    "--gtest_filter=$kernel_tests")
fi

out="$dir/coverage"
rm -rf "$out" && mkdir -p "$out"
# --exclude-throw-branches: the exception edges g++ adds to every call that may throw are not
# branches of gwt's code; --exclude-unreachable-branches: branches on lines with no code.
common=(--root "$GWT_ROOT" --object-directory "$dir" --filter "$GWT_ROOT/src/optim/"
  --filter "$GWT_ROOT/src/kernels/" --exclude-throw-branches --exclude-unreachable-branches)
gcovr "${common[@]}" --txt "$out/summary.txt" --html-details "$out/index.html" \
  --json "$out/coverage.json" --print-summary "$dir" | tee "$out/total.txt"
gcovr "${common[@]}" --branches --txt "$out/branches.txt" "$dir" >/dev/null
# Lines that ran but have a branch outcome no test took (a TORCH_CHECK that never failed, one side
# of an if), with the source line: the list docs/notes/coverage.md groups. At -O0 the compiler's own
# branches (short-circuit terms, temporaries) are counted too, and a template's branches once per
# instantiation, so read it line by line rather than as a figure.
python3 - "$out/coverage.json" "$GWT_ROOT" >"$out/untaken_branches.txt" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
for f in data["files"]:
    source = open(f"{sys.argv[2]}/{f['file']}").read().split("\n")
    for line in f["lines"]:
        branches = [b for b in line.get("branches", []) if not b.get("throw")]
        untaken = sum(1 for b in branches if b["count"] == 0)
        if untaken and line["count"] > 0:
            text = source[line["line_number"] - 1].strip()[:120]
            print(f"{f['file']}:{line['line_number']} ({untaken}/{len(branches)} untaken): {text}")
PY
cat "$out/summary.txt"
gwt_log "coverage report: $out/summary.txt, $out/branches.txt, $out/untaken_branches.txt, $out/index.html"
