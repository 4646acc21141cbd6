#!/usr/bin/env bash
# Installs what gwt's build needs and prints nothing else of note. Sourced by scripts/run.sh and
# scripts/test.sh; safe to run again (it only installs what is missing).
#
# Sets GWT_TORCH_DIR (the directory holding TorchConfig.cmake) and the ccache variables.
#
# LibTorch, first match wins:
#   1. Torch_DIR            a directory holding TorchConfig.cmake
#   2. LIBTORCH             an unpacked LibTorch (the zip from pytorch.org) or any prefix of one
#   3. CMAKE_PREFIX_PATH    searched for share/cmake/Torch/TorchConfig.cmake
#   4. otherwise a pinned torch wheel from PyPI in a virtual environment outside the repository,
#      ${GWT_CACHE:-~/.cache/gwt}/torch-<version>, reused by every later clone.

set -euo pipefail

GWT_TORCH_VERSION="${GWT_TORCH_VERSION:-2.15.0}"
GWT_TRANSFORMERS_VERSION="${GWT_TRANSFORMERS_VERSION:-5.25.0}"  # Hugging Face Trainer example and test only
GWT_ACCELERATE_VERSION="${GWT_ACCELERATE_VERSION:-1.16.0}"
GWT_CACHE="${GWT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gwt}"
GWT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

gwt_log() { printf '[gwt setup] %s\n' "$*" >&2; }

gwt_install_debian_packages() {
  local wanted=(cmake ninja-build g++ ccache libgtest-dev googletest libbenchmark-dev fortunes libgloo-dev procps python3 python3-venv "$@")
  local missing=()
  for pkg in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  # A python3 with venv outside Debian's packages (pyenv, ...) is as good as Debian's.
  if command -v python3 >/dev/null && python3 -c 'import venv, ensurepip' 2>/dev/null; then
    local filtered=()
    for pkg in "${missing[@]}"; do [[ "$pkg" == python3 || "$pkg" == python3-venv ]] || filtered+=("$pkg"); done
    missing=("${filtered[@]+"${filtered[@]}"}")
  fi
  [[ ${#missing[@]} -eq 0 ]] && return 0
  gwt_log "installing Debian packages: ${missing[*]}"
  local sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

gwt_find_torch_dir() {
  if [[ -n "${Torch_DIR:-}" && -f "${Torch_DIR}/TorchConfig.cmake" ]]; then
    GWT_TORCH_DIR="$Torch_DIR"; return 0
  fi
  local prefixes=()
  [[ -n "${LIBTORCH:-}" ]] && prefixes+=("$LIBTORCH")
  if [[ -n "${CMAKE_PREFIX_PATH:-}" ]]; then
    IFS=':;' read -r -a from_env <<<"$CMAKE_PREFIX_PATH"
    prefixes+=("${from_env[@]}")
  fi
  for prefix in "${prefixes[@]+"${prefixes[@]}"}"; do
    for candidate in "$prefix/share/cmake/Torch" "$prefix/cmake/Torch" "$prefix/Torch" "$prefix"; do
      if [[ -f "$candidate/TorchConfig.cmake" ]]; then GWT_TORCH_DIR="$(cd "$candidate" && pwd)"; return 0; fi
    done
  done
  return 1
}

gwt_install_torch_wheel() {
  local venv="$GWT_CACHE/torch-$GWT_TORCH_VERSION"
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    gwt_log "no LibTorch named (Torch_DIR, LIBTORCH, CMAKE_PREFIX_PATH): installing torch==$GWT_TORCH_VERSION"
    gwt_log "from PyPI into $venv (about 3 GB to download, 5.5 GB on disk; once per machine)"
    mkdir -p "$GWT_CACHE"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --no-cache-dir --upgrade pip
    "$venv/bin/pip" install --quiet --no-cache-dir "torch==$GWT_TORCH_VERSION" numpy matplotlib
  fi
  GWT_TORCH_DIR="$("$venv/bin/python" -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')"
  GWT_PYTHON="$venv/bin/python"
}

# A python3 with matplotlib for the plots: the torch virtual environment when we made one, else a
# small one of its own (${GWT_CACHE}/tools, about 60 MB).
gwt_install_plot_python() {
  if [[ -n "${GWT_PYTHON:-}" ]] && "$GWT_PYTHON" -c "import matplotlib" 2>/dev/null; then return 0; fi
  if [[ -n "${GWT_PYTHON:-}" ]]; then
    gwt_log "installing matplotlib into $(dirname "$(dirname "$GWT_PYTHON")")"
    "$GWT_PYTHON" -m pip install --quiet --no-cache-dir matplotlib && return 0
  fi
  local venv="$GWT_CACHE/tools"
  if ! "$venv/bin/python" -c "import matplotlib" 2>/dev/null; then
    gwt_log "installing matplotlib from PyPI into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --no-cache-dir matplotlib
  fi
  GWT_PYTHON="$venv/bin/python"
}

# What the Python package (python/) needs to build and test in the environment that has torch:
# scikit-build-core builds it; pytest and PyWavelets (a test-only reference) test it. Returns 1
# (installing nothing) when that environment has no torch (LibTorch named by Torch_DIR, LIBTORCH or
# CMAKE_PREFIX_PATH).
gwt_install_python_test_deps() {
  if [[ -z "${GWT_PYTHON:-}" ]] || ! "$GWT_PYTHON" -c "import torch" 2>/dev/null; then return 1; fi
  # The extension module needs Python.h: Debian's python3 has it from python3-dev (pyenv's and
  # most others' ship their headers).
  if ! "$GWT_PYTHON" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
    gwt_install_debian_packages python3-dev
  fi
  if ! "$GWT_PYTHON" -c "import pytest, pywt, scikit_build_core" 2>/dev/null; then
    gwt_log "installing pytest, PyWavelets and scikit-build-core into $(dirname "$(dirname "$GWT_PYTHON")")"
    "$GWT_PYTHON" -m pip install --quiet --no-cache-dir pytest PyWavelets "scikit-build-core>=0.10"
  fi
  # Only the Hugging Face Trainer example and its test use these (pinned: the Trainer's API moves).
  if ! "$GWT_PYTHON" -c "import transformers, accelerate, sys; sys.exit(transformers.__version__ != '$GWT_TRANSFORMERS_VERSION' or accelerate.__version__ != '$GWT_ACCELERATE_VERSION')" 2>/dev/null; then
    gwt_log "installing transformers $GWT_TRANSFORMERS_VERSION and accelerate $GWT_ACCELERATE_VERSION"
    "$GWT_PYTHON" -m pip install --quiet --no-cache-dir "transformers==$GWT_TRANSFORMERS_VERSION" "accelerate==$GWT_ACCELERATE_VERSION"
  fi
}

gwt_setup() {
  gwt_install_debian_packages "$@"
  GWT_PYTHON="${GWT_PYTHON:-}"
  if ! gwt_find_torch_dir; then gwt_install_torch_wheel; fi
  gwt_install_plot_python
  export GWT_TORCH_DIR GWT_PYTHON
  # A CUDA-enabled LibTorch wants a CUDA toolkit at configure time; its major version must match.
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
  # The compiler cache lives outside the repository so that a fresh clone reuses it.
  export CCACHE_DIR="${CCACHE_DIR:-$GWT_CACHE/ccache}"
  export CCACHE_BASEDIR="$GWT_ROOT"
  export CCACHE_NOHASHDIR=1
  export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
  gwt_log "LibTorch: $GWT_TORCH_DIR"
}

# Configures and builds gwt into $1 (default build/) with the given extra CMake arguments.
gwt_build() {
  local build_dir="${1:-$GWT_ROOT/build}"; shift || true
  cmake -S "$GWT_ROOT" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    "-DTorch_DIR=$GWT_TORCH_DIR" "$@" >"$build_dir.configure.log" 2>&1 \
    || { cat "$build_dir.configure.log" >&2; return 1; }
  cmake --build "$build_dir" --parallel "${GWT_JOBS:-$(nproc)}"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  gwt_setup "$@"
fi
