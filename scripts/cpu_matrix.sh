#!/usr/bin/env bash
# The fused-kernel/reference tests under emulated CPUs and thread counts (issue 12): MKL's
# conditional numerical reproducibility modes (MKL_CBWR; MKL falls back where the CPU lacks an
# instruction set), ATen's dispatch level (ATEN_CPU_CAPABILITY), gwt's own kernels without AVX2
# (GWT_NO_AVX2=1), the one-row general kernel on every row (GWT_NO_ROWS8=1: the AVX2 build steps
# float32 rows eight at a time otherwise), and 1 and 2 threads; gwt_gpu_check's CPU checks
# (device against reference in every dtype) and the Python package's tests too, where
# scripts/test.sh built and installed them. Run by .ci/run after scripts/test.sh.
#
#   ./scripts/cpu_matrix.sh [build dir] [gtest filter]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${1:-$root/build}/tests/gwt_tests"
checks="${1:-$root/build}/benchmarks/gwt_gpu_check"
filter="${2:-Fused.*:KernelRows.*:KernelLanes.*:WaveletAdam*.*:Transform*.*:Compression.*}"
[[ -x "$bin" ]] || { echo "cpu_matrix: $bin not built (run ./scripts/test.sh first)" >&2; exit 2; }
# The Python environment scripts/test.sh used and installed the package into (setup.sh finds it;
# after scripts/test.sh it has nothing left to install).
python=""
if source "$root/scripts/setup.sh" && gwt_setup >/dev/null 2>&1 &&
  [[ -n "${GWT_PYTHON:-}" ]] && "$GWT_PYTHON" -c "import gwt" >/dev/null 2>&1; then
  python="$GWT_PYTHON"
fi
settings=(
  "MKL_CBWR=COMPATIBLE" "MKL_CBWR=AVX2" "MKL_CBWR=AVX512"
  "ATEN_CPU_CAPABILITY=default" "ATEN_CPU_CAPABILITY=avx2" "GWT_NO_AVX2=1" "GWT_NO_ROWS8=1"
  "OMP_NUM_THREADS=1" "OMP_NUM_THREADS=2"
)
passed=0 failed=0 failures=()
for setting in "${settings[@]}"; do
  start=$SECONDS
  ok=1
  out=$(env "$setting" "$bin" --gtest_filter="$filter" --gtest_brief=1 2>&1) || ok=0
  tests=$(printf '%s\n' "$out" | sed -n 's/^\[==========\] \([0-9]*\) tests.*ran.*/\1/p' | tail -1)
  extra=""
  if [[ -x "$checks" ]]; then
    extra=" + gwt_gpu_check"
    check_out=$(env "$setting" "$checks" --device cpu --checks-only 2>&1)
    if ! grep -q '^all checks passed' <<<"$check_out"; then
      ok=0 out="$out"$'\n'"$(grep -E 'FAIL|rror' <<<"$check_out" | head -20)"
    fi
  fi
  if [[ -n "$python" ]]; then
    extra="$extra + pytest"
    if ! py_out=$(env "$setting" "$python" -m pytest -q -p no:cacheprovider "$root/python/tests" 2>&1); then
      ok=0 out="$out"$'\n'"$(tail -30 <<<"$py_out")"
    fi
  fi
  if [[ $ok -eq 1 ]]; then
    passed=$((passed + 1)); verdict=ok
  else
    failed=$((failed + 1)); verdict=FAILED; failures+=("$setting")
    printf '%s\n' "$out" | grep -vE '^\[       OK|^\[ RUN' | tail -40
  fi
  printf 'cpu_matrix: %-28s %-6s %s tests%s, %ds\n' "$setting" "$verdict" "${tests:-?}" "$extra" \
    $((SECONDS - start))
done
[[ $failed -eq 0 ]] || echo "cpu_matrix: failed under ${failures[*]}"
echo "cpu_matrix: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
