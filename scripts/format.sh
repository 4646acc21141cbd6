#!/usr/bin/env bash
# Formats gwt's own C++ with the checked-in .clang-format (--check: report, change nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh' | grep -v '^include/gwt/filters.h$')
if [[ "${1:-}" == "--check" ]]; then
  clang-format --dry-run --Werror $files
else
  clang-format -i $files
fi
