#!/usr/bin/env bash
# Builds gwt's CPU library, tests and examples with AddressSanitizer and UndefinedBehaviorSanitizer
# (build-sanitize/, GWT_SANITIZE=address,undefined, CUDA off) and runs the unit tests; any report
# fails the run. LibTorch comes uninstrumented: leak checking is off (LibTorch keeps global
# allocations alive on purpose) and tests/sanitizers/*.supp suppress reports inside LibTorch's own
# frames only, each with its reason.
#
#   ./scripts/sanitize.sh [gtest filter]      e.g. ./scripts/sanitize.sh 'Fused.*'
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
gwt_setup
build="$GWT_ROOT/build-sanitize"
mkdir -p "$build"
gwt_build "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGWT_SANITIZE=address,undefined -DGWT_CUDA=OFF \
  -DGWT_WARNINGS_AS_ERRORS=ON -DGWT_BUILD_TESTS=ON -DGWT_BUILD_EXAMPLES=ON
supp="$GWT_ROOT/tests/sanitizers"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_odr_violation=0:suppressions=$supp/asan.supp"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:report_error_type=1:suppressions=$supp/ubsan.supp"
log="$build/sanitize.log"
set +e
"$build/tests/gwt_tests" --gtest_filter="${1:-*}" --gtest_brief=1 2>&1 | tee "$log" | grep -E '^\[  (PASSED|FAILED)|^\[  FAILED|ERROR: |runtime error|SUMMARY'
rc=${PIPESTATUS[0]}
set -e
if grep -qE 'ERROR: AddressSanitizer|runtime error:|SUMMARY: (Address|UndefinedBehavior)Sanitizer' "$log"; then
  echo "sanitize: reports found (see $log)"; exit 1
fi
[[ $rc -eq 0 ]] || { echo "sanitize: gwt_tests exited $rc (see $log)"; exit "$rc"; }
echo "sanitize: gwt_tests passed under ASan+UBSan with no report"
