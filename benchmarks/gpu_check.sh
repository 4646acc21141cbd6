#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU, nvcc and python3's torch but no network and no
# Debian packages: builds gwt's CUDA kernels and benchmarks/gpu_check.cpp (LibTorch only), runs
# the CUDA correctness checks against the CPU reference, then prints the step-time table with the
# ratio to torch::optim::Adam and at::_fused_adam_ and the share of a device-to-device copy's
# bandwidth. A few minutes on a 16-core machine.
#
#   benchmarks/gpu_check.sh            (GWT_CUDA_ARCHITECTURES=90 by default: Hopper)
#
# To run the unit tests' CUDA cases as well, put GoogleTest's sources in third_party/googletest
# (cp -r /usr/src/googletest third_party/) and carry that folder to the GPU machine.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${GWT_GPU_BUILD:-$root/build-gpu}"
python="${PYTHON:-python3}"
torch_dir="$("$python" -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')"
nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
start=$(date +%s)

# With GoogleTest's sources (default third_party/googletest, e.g. a copy of Debian's
# /usr/src/googletest carried along), the unit tests' CUDA cases run too.
gtest="${GWT_GTEST_SOURCE_DIR:-$root/third_party/googletest}"
tests=(-DGWT_BUILD_TESTS=OFF)
targets=(gwt_gpu_check)
if [[ -f "$gtest/CMakeLists.txt" ]]; then
  tests=(-DGWT_BUILD_TESTS=ON "-DGWT_GTEST_SOURCE_DIR=$gtest")
  targets+=(gwt_tests)
else
  echo "no GoogleTest sources at $gtest: running gwt_gpu_check's own checks only"
fi

cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "-DTorch_DIR=$torch_dir" \
  -DGWT_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc" "-DGWT_CUDA_ARCHITECTURES=${GWT_CUDA_ARCHITECTURES:-90}" \
  -DGWT_BUILD_GPU_CHECK=ON "${tests[@]}" -DGWT_BUILD_EXAMPLES=OFF >"$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; exit 1; }
cmake --build "$build" --target "${targets[@]}" --parallel "$(nproc)"
echo "built in $(( $(date +%s) - start )) s"

status=0
if [[ " ${targets[*]} " == *" gwt_tests "* ]]; then
  "$build/tests/gwt_tests" --gtest_filter='FusedCuda.*:KernelRows.*' || status=1
fi
"$build/benchmarks/gwt_gpu_check" --device cuda --json "$build/gpu_check.json" || status=$?
if [[ -f "$build/gpu_check.json" ]]; then
  gpu="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1 || true)"
  "$python" "$root/scripts/bench_table.py" "$build/gpu_check.json" --machine "${gpu:-unknown GPU}"
fi
echo "gpu_check finished in $(( $(date +%s) - start )) s with status $status"
exit "$status"
