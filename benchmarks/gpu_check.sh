#!/usr/bin/env bash
# The device check: one call of at most 8 minutes on an H100 (torch 2.11 + CUDA 13, no network).
# Builds gwt's CUDA kernels for sm_90 and benchmarks/gpu_check.cpp (LibTorch only: no GoogleTest,
# no examples), then, with a GPU:
#   1. the checks against the CPU reference in every dtype and path, 56 tensors in one step, a
#      step under LibTorch's sync debug mode set to error, a CUDA graph's replays against eager
#      steps (PASS/FAIL lines);
#   2. compute-sanitizer memcheck over the small checks (caching allocator on), racecheck over one
#      small general-wavelet case;
#   3. the step times: whole steps (median of 50, eager and graph-replayed) on the llama60m set, one
#      4096x4096 matrix and a 1B-parameter set, against CUDA at::_fused_adamw_ and a copy in the
#      same process: JSON and a Markdown table in $GWT_GPU_BUILD (default build-gpu).
#
#   benchmarks/gpu_check.sh
#
# Without a GPU (nvidia-smi lists none, or GWT_GPU_CHECK_DRY=1) it is the dry run that CI makes:
# the same build, then the checks on the CPU with the multi-tensor kernels emulated on the host
# (gwt_gpu_check --device cpu --emulate).
#
# Environment: GWT_CUDA_ARCHITECTURES (default 90), GWT_GPU_BUILD (build folder), Torch_DIR
# (default: from $PYTHON's torch), GWT_SANITIZER_TOOLS (default "memcheck racecheck"; "" skips).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${GWT_GPU_BUILD:-$root/build-gpu}"
python="${PYTHON:-python3}"
torch_dir="${Torch_DIR:-$("$python" -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')}"
nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
start=$(date +%s)
stage() { echo "=== gpu_check: $1 ($(( $(date +%s) - start )) s so far)"; }

dry=0
if [[ "${GWT_GPU_CHECK_DRY:-0}" == 1 ]] || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  dry=1
  echo "gpu_check: no GPU visible: DRY RUN (build, then the checks with the kernels emulated on the host)"
fi

stage "configure and build (sm_${GWT_CUDA_ARCHITECTURES:-90})"
cmake -S "$root" -B "$build" "${generator[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release \
  "-DTorch_DIR=$torch_dir" -DGWT_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc" \
  "-DGWT_CUDA_ARCHITECTURES=${GWT_CUDA_ARCHITECTURES:-90}" -DGWT_BUILD_GPU_CHECK=ON \
  -DGWT_BUILD_TESTS=OFF -DGWT_BUILD_EXAMPLES=OFF >"$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; exit 1; }
grep 'gwt: CUDA kernels for architectures' "$build.configure.log" || true
cmake --build "$build" --target gwt_gpu_check --parallel "$(nproc)"
check="$build/benchmarks/gwt_gpu_check"

if [[ $dry == 1 ]]; then
  stage "checks on the CPU, multi-tensor kernels emulated"
  status=0
  "$check" --device cpu --emulate --checks-only >"$build/dry-checks.log" 2>&1 || status=1
  grep -E '^(FAIL|all checks|SOME)' "$build/dry-checks.log" || true
  echo "$(grep -c '^PASS' "$build/dry-checks.log") checks passed"
  stage "dry run finished with status $status"
  exit "$status"
fi

status=0
stage "checks on the GPU"
"$check" --device cuda --checks-only || status=1

sanitizer="$(command -v compute-sanitizer || echo "$(dirname "$nvcc")/compute-sanitizer")"
for tool in ${GWT_SANITIZER_TOOLS-memcheck racecheck}; do
  if [[ ! -x "$sanitizer" ]]; then
    echo "FAIL compute-sanitizer not found (next to $nvcc or on PATH); GWT_SANITIZER_TOOLS= skips it"
    status=1
    break
  fi
  run=("$check" --device cuda --checks-only --quick)
  [[ $tool == racecheck ]] && run+=(--only db2)
  stage "compute-sanitizer --tool $tool: ${run[*]}"
  if "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 20 "${run[@]}" \
      >"$build/sanitizer-$tool.log" 2>&1; then
    echo "PASS compute-sanitizer $tool: $(tail -1 "$build/sanitizer-$tool.log")"
  else
    echo "FAIL compute-sanitizer $tool: last lines of $build/sanitizer-$tool.log:"
    tail -40 "$build/sanitizer-$tool.log"
    status=1
  fi
done

stage "timing"
"$check" --device cuda --json "$build/gpu_check.json" --markdown "$build/gpu_check.md" || status=1
[[ -f "$build/gpu_check.md" ]] && cat "$build/gpu_check.md"
stage "finished with status $status"
exit "$status"
