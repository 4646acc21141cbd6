#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU, nvcc and python3's torch but no network and no
# Debian packages: builds gwt's CUDA kernels and benchmarks/gpu_check.cpp (LibTorch only), runs
# the CUDA correctness checks against the CPU reference (PASS/FAIL lines: kernel image for the
# device, every kernel and type against the reference, the norm pass's bit-reproducibility with
# 2048 blocks and on resume), the unit tests' CUDA cases, compute-sanitizer's memcheck and
# racecheck over those, then prints the step-time table with the ratio to torch::optim::Adam and
# at::_fused_adam_ and the share of a device-to-device copy's bandwidth. A few minutes on a
# 16-core machine, more with the sanitizers.
#
#   benchmarks/gpu_check.sh
#
# Without a GPU (no nvidia-smi, or it lists none; or GWT_GPU_CHECK_DRY=1) it is a dry run: it
# configures and builds everything a GPU run would, says so, and runs nothing on a device.
#
# Environment:
#   GWT_CUDA_ARCHITECTURES  architectures to build (default: the project's list, 80-real to
#                           90-real plus 90 PTX; "90" alone builds faster on a Hopper machine)
#   GWT_GPU_BUILD           build folder (default build-gpu)
#   Torch_DIR               LibTorch's TorchConfig.cmake folder (default: from $PYTHON's torch)
#   GWT_SANITIZER_TOOLS     compute-sanitizer tools (default "memcheck racecheck"; "" skips)
#   GWT_SANITIZER_FILTER    the unit tests they run (default the CUDA tests below)
#
# To run the unit tests' CUDA cases as well, put GoogleTest's sources in third_party/googletest
# (cp -r /usr/src/googletest third_party/) and carry that folder to the GPU machine; without them
# the sanitizers run over gwt_gpu_check --checks-only.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${GWT_GPU_BUILD:-$root/build-gpu}"
python="${PYTHON:-python3}"
torch_dir="${Torch_DIR:-$("$python" -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')}"
nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
start=$(date +%s)

dry=0
if [[ "${GWT_GPU_CHECK_DRY:-0}" == 1 ]] || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  dry=1
  echo "gpu_check: no GPU visible (nvidia-smi lists none): DRY RUN, building only"
fi

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
archs=()
[[ -n "${GWT_CUDA_ARCHITECTURES:-}" ]] && archs=("-DGWT_CUDA_ARCHITECTURES=$GWT_CUDA_ARCHITECTURES")

cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "-DTorch_DIR=$torch_dir" \
  -DGWT_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc" "${archs[@]}" \
  -DGWT_BUILD_GPU_CHECK=ON "${tests[@]}" -DGWT_BUILD_EXAMPLES=OFF >"$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; exit 1; }
grep 'gwt: CUDA kernels for architectures' "$build.configure.log" || true
cmake --build "$build" --target "${targets[@]}" --parallel "$(nproc)"
echo "built ${targets[*]} in $(( $(date +%s) - start )) s"

# The unit tests with a CUDA device (they skip without one) and the host tests of the CUDA bodies.
device_tests='FusedCuda.*:CudaDeterminism.*'
host_tests='KernelRows.*:KernelLanes.*:KernelImage.*'
if [[ $dry == 1 ]]; then
  echo "gpu_check: DRY RUN: built everything; no GPU, so no check, test, sanitizer or timing ran"
  exit 0
fi

status=0
have_tests=0
[[ " ${targets[*]} " == *" gwt_tests "* ]] && have_tests=1
if [[ $have_tests == 1 ]]; then
  "$build/tests/gwt_tests" --gtest_filter="$device_tests:$host_tests" || status=1
fi

# compute-sanitizer over the CUDA tests: memcheck (out-of-bounds and misaligned device accesses;
# PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives each tensor its own allocation, so an access past one is
# seen rather than landing in the caching allocator's next block) and racecheck (shared-memory
# hazards between the threads of a block).
sanitizer="$(command -v compute-sanitizer || echo "$(dirname "$nvcc")/compute-sanitizer")"
tools="${GWT_SANITIZER_TOOLS-memcheck racecheck}"
if [[ -n "$tools" && ! -x "$sanitizer" ]]; then
  echo "FAIL compute-sanitizer not found (next to $nvcc or on PATH); GWT_SANITIZER_TOOLS= skips it"
  status=1
  tools=""
fi
for tool in $tools; do
  if [[ $have_tests == 1 ]]; then
    run=("$build/tests/gwt_tests" "--gtest_filter=${GWT_SANITIZER_FILTER:-$device_tests}")
  else
    run=("$build/benchmarks/gwt_gpu_check" --device cuda --checks-only)
  fi
  echo "compute-sanitizer --tool $tool: ${run[*]}"
  tool_start=$(date +%s)
  if PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool "$tool" --error-exitcode 99 \
      --print-limit 20 "${run[@]}" >"$build/sanitizer-$tool.log" 2>&1; then
    echo "PASS compute-sanitizer $tool ($(( $(date +%s) - tool_start )) s): $(tail -1 "$build/sanitizer-$tool.log")"
  else
    echo "FAIL compute-sanitizer $tool: last lines of $build/sanitizer-$tool.log:"
    tail -40 "$build/sanitizer-$tool.log"
    status=1
  fi
done

"$build/benchmarks/gwt_gpu_check" --device cuda --json "$build/gpu_check.json" || status=1
if [[ -f "$build/gpu_check.json" ]]; then
  gpu="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1 || true)"
  "$python" "$root/scripts/bench_table.py" "$build/gpu_check.json" --machine "${gpu:-unknown GPU}"
fi
echo "gpu_check finished in $(( $(date +%s) - start )) s with status $status"
exit "$status"
