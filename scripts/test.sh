#!/usr/bin/env bash
# The README's test command: installs what is missing, builds gwt with -Werror, runs every test.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
gwt_setup
mkdir -p "$GWT_ROOT/build"
gwt_build "$GWT_ROOT/build" -DGWT_WARNINGS_AS_ERRORS=ON -DGWT_BUILD_TESTS=ON -DGWT_BUILD_EXAMPLES=ON -DGWT_BUILD_GPU_CHECK=ON
cd "$GWT_ROOT/build"
ctest --output-on-failure --timeout 900 "$@"
