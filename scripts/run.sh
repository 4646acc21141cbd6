#!/usr/bin/env bash
# The README's first command, gwt's main job: installs what is missing, builds, and runs the
# quickstart comparison (torch::optim::AdamW against gwt::WaveletAdam). Arguments go to it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
gwt_setup
mkdir -p "$GWT_ROOT/build"
gwt_build "$GWT_ROOT/build" -DGWT_BUILD_EXAMPLES=ON >&2
"$GWT_ROOT/build/examples/quickstart" "$@"
