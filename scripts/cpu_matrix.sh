#!/usr/bin/env bash
# The fused-kernel/reference tests under emulated CPUs and thread counts (issue 12): MKL's
# conditional numerical reproducibility modes (MKL_CBWR; MKL falls back where the CPU lacks an
# instruction set), ATen's dispatch level (ATEN_CPU_CAPABILITY), gwt's own kernels without AVX2
# (GWT_NO_AVX2=1), the one-row general kernel on every row (GWT_NO_ROWS8=1: the AVX2 build steps
# float32 rows eight at a time otherwise), and 1 and 2 threads; gwt_gpu_check's CPU checks
# (device against reference in every dtype) and the Python package's tests too, where
# scripts/test.sh built and installed them. Then the same tests on whole other CPUs, emulated by
# QEMU's user mode (qemu-user, installed here on x86-64): Nehalem (SSE4.2, no AVX), Sandy Bridge
# (AVX, no AVX2) and Haswell (AVX2, FMA, F16C). There every program in the process, LibTorch, MKL
# and gwt's dispatch, reads that CPU's CPUID, and an AVX instruction run where the CPU has none
# stops the test with SIGILL: what the settings above cannot show (they switch paths on a CPU that
# has them all). Run by .ci/run after scripts/test.sh (docs/reliability.md, "Other CPUs").
#
#   ./scripts/cpu_matrix.sh [build dir] [gtest filter]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${1:-$root/build}/tests/gwt_tests"
checks="${1:-$root/build}/benchmarks/gwt_gpu_check"
filter="${2:-Fused.*:KernelRows.*:KernelLanes.*:WaveletAdam*.*:Transform*.*:Compression.*:Foam*.*}"
[[ -x "$bin" ]] || { echo "cpu_matrix: $bin not built (run ./scripts/test.sh first)" >&2; exit 2; }
# The Python environment scripts/test.sh used and installed the package into (setup.sh finds it;
# after scripts/test.sh it has nothing left to install but, the first time, qemu-user).
python="" qemu=""
arch="$(uname -m)"
extra_packages=()
[[ "$arch" == x86_64 ]] && extra_packages+=(qemu-user)
if source "$root/scripts/setup.sh" && gwt_setup "${extra_packages[@]+"${extra_packages[@]}"}" >/dev/null 2>&1; then
  [[ -n "${GWT_PYTHON:-}" ]] && "$GWT_PYTHON" -c "import gwt" >/dev/null 2>&1 && python="$GWT_PYTHON"
fi
set +e  # setup.sh turned errexit on; this script counts failures itself
[[ "$arch" == x86_64 ]] && qemu="$(command -v qemu-x86_64 || true)"
settings=(
  "MKL_CBWR=COMPATIBLE" "MKL_CBWR=AVX2" "MKL_CBWR=AVX512"
  "ATEN_CPU_CAPABILITY=default" "ATEN_CPU_CAPABILITY=avx2" "GWT_NO_AVX2=1" "GWT_NO_ROWS8=1"
  "OMP_NUM_THREADS=1" "OMP_NUM_THREADS=2"
)
passed=0 failed=0 failures=()
# The gtest summary's count of tests ran, from $out.
tests_ran() { printf '%s\n' "$out" | sed -n 's/^\[==========\] \([0-9]*\) tests.*ran.*/\1/p' | tail -1; }
# Counts one lane ($1, its name) as passed or failed by $ok, printing $out's failures.
tally() {
  if [[ $ok -eq 1 ]]; then
    passed=$((passed + 1)); verdict=ok
  else
    failed=$((failed + 1)); verdict=FAILED; failures+=("$1")
    printf '%s\n' "$out" | grep -vE '^\[       OK|^\[ RUN' | tail -40
  fi
}
for setting in "${settings[@]}"; do
  start=$SECONDS
  ok=1
  out=$(env "$setting" "$bin" --gtest_filter="$filter" --gtest_brief=1 2>&1) || ok=0
  tests=$(tests_ran)
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
  tally "$setting"
  printf 'cpu_matrix: %-28s %-6s %s tests%s, %ds\n' "$setting" "$verdict" "${tests:-?}" "$extra" \
    $((SECONDS - start))
done
# Other CPUs (x86-64 only): the gtest filter's tests, without gwt_gpu_check and pytest (a Python
# that imports torch under emulation takes minutes). The tests of the eight-row and AVX2 bodies
# themselves skip on a CPU without AVX2; the count of skips is printed. On Haswell none may skip:
# a QEMU that does not emulate AVX2 (before 7.2) would hide it (with a warning filtered out here)
# and the lane would test nothing of it. Each lane has 15 minutes.
if [[ "$arch" == x86_64 && -z "$qemu" ]]; then
  failed=$((failed + 1)); failures+=("qemu-x86_64 (not installed)")
  echo "cpu_matrix: qemu-x86_64 not found (Debian's qemu-user): the other CPUs did not run"
elif [[ -n "$qemu" ]]; then
  echo "cpu_matrix: other CPUs by $("$qemu" --version | head -1)"
fi
for cpu in ${qemu:+Nehalem SandyBridge Haswell-noTSX}; do
  start=$SECONDS
  ok=1
  out=$(timeout 900 "$qemu" -cpu "$cpu" "$bin" --gtest_filter="$filter" --gtest_brief=1 2>&1 |
    grep -v "^qemu-x86_64: warning: TCG doesn't support") || ok=0
  tests=$(tests_ran)
  skipped=$(printf '%s\n' "$out" | sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' | tail -1)
  grep -q '^\[  PASSED  \]' <<<"$out" || ok=0
  if [[ "$cpu" == Haswell* && "${skipped:-0}" != 0 ]]; then
    ok=0 out="$out"$'\n'"cpu_matrix: tests skipped on an emulated AVX2 CPU: does this QEMU emulate AVX2?"
  fi
  tally "qemu -cpu $cpu"
  printf 'cpu_matrix: %-28s %-6s %s tests (%s skipped), %ds\n' "qemu -cpu $cpu" "$verdict" \
    "${tests:-?}" "${skipped:-0}" $((SECONDS - start))
done
[[ $failed -eq 0 ]] || echo "cpu_matrix: failed under ${failures[*]}"
echo "cpu_matrix: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
