#!/usr/bin/env bash
# The README's test command: installs what is missing, builds gwt with -Werror, runs every test.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
gwt_setup
mkdir -p "$GWT_ROOT/build"
gwt_build "$GWT_ROOT/build" -DGWT_WARNINGS_AS_ERRORS=ON -DGWT_BUILD_TESTS=ON -DGWT_BUILD_EXAMPLES=ON -DGWT_BUILD_GPU_CHECK=ON
cd "$GWT_ROOT/build"
ctest --output-on-failure --timeout 900 "$@"

# The Python package (python/): built against the environment's torch, its C++ with warnings as
# errors like the rest (objects kept in python/build/, so a second run rebuilds only what changed),
# then its pytest suite.
if gwt_install_python_test_deps; then
  CMAKE_BUILD_PARALLEL_LEVEL="${GWT_JOBS:-$(nproc)}" "$GWT_PYTHON" -m pip install --quiet \
    --no-build-isolation -C cmake.define.GWT_WARNINGS_AS_ERRORS=ON "$GWT_ROOT/python"
  "$GWT_PYTHON" -m pytest -q "$GWT_ROOT/python/tests"
else
  gwt_log "no torch in the Python environment (LibTorch was named): python/ is not built or tested"
fi
