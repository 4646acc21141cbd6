#!/usr/bin/env bash
# Fashion-MNIST comparison: AdamW against WaveletAdam on an MLP and a small CNN. Installs what is
# missing (Debian's dataset-fashion-mnist among it), unpacks the IDX files into ~/.cache/gwt, builds
# and runs examples/fashion_mnist. Argument: epochs (default 1).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
gwt_setup dataset-fashion-mnist
data="$GWT_CACHE/fashion-mnist"
mkdir -p "$data"
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  [[ -f "$data/$f" ]] || gunzip -c "/usr/share/datasets/fashion-mnist/$f.gz" >"$data/$f"
done
mkdir -p "$GWT_ROOT/build"
gwt_build "$GWT_ROOT/build" -DGWT_BUILD_EXAMPLES=ON >&2
"$GWT_ROOT/build/examples/fashion_mnist" "$data" "${1:-1}"
