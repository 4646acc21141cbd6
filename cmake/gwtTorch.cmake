# Finding LibTorch for gwt and for projects that consume gwt (installed next to gwtConfig.cmake).
#
# - A CUDA-enabled LibTorch (the default PyPI wheel) needs a CUDA toolkit at configure time: we point
#   CMake at /usr/local/cuda when nothing else was said, and default TORCH_CUDA_ARCH_LIST to Hopper.
# - The wheel's libtorch_cuda.so finds NCCL, cuDNN, ... in site-packages/nvidia/*/lib through its
#   RUNPATH at run time, but GNU ld does not look there at link time and may pick an older system
#   copy (e.g. /usr/local/cuda/lib/libnccl.so.2) instead. gwt_torch_link_dirs() lists those
#   directories so targets can pass them to the linker with -rpath-link.

macro(gwt_find_torch)
  if(NOT DEFINED CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT} AND NOT DEFINED ENV{CUDACXX}
     AND EXISTS "/usr/local/cuda/bin/nvcc")
    set(CUDAToolkit_ROOT "/usr/local/cuda")
    if(NOT DEFINED CMAKE_CUDA_COMPILER)
      set(CMAKE_CUDA_COMPILER "/usr/local/cuda/bin/nvcc")
    endif()
  endif()
  if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(TORCH_CUDA_ARCH_LIST "9.0")
  endif()
  find_package(Torch ${ARGN})
endmacro()

# Sets <out_var> to the linker options that let `ld` resolve the wheel's bundled CUDA libraries.
function(gwt_torch_link_options out_var)
  set(opts "")
  if(DEFINED TORCH_INSTALL_PREFIX)
    file(GLOB nvidia_lib_dirs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
    foreach(dir IN LISTS nvidia_lib_dirs)
      if(IS_DIRECTORY "${dir}")
        list(APPEND opts "LINKER:-rpath-link,${dir}")
      endif()
    endforeach()
  endif()
  set(${out_var} "${opts}" PARENT_SCOPE)
endfunction()

# ATen's at::parallel_for runs an OpenMP region inline in the caller when LibTorch was built with
# OpenMP (the PyPI wheels are), so gwt's CPU kernels are compiled with -fopenmp and must link the
# OpenMP runtime LibTorch itself loads: the wheel's bundled libgomp.so.1 when it has one (linking
# the system copy as well would make CMake warn that one hides the other), else the toolchain's.
# Sets <out_var> to what to link (empty when neither exists).
function(gwt_openmp_runtime out_var)
  set(runtime "")
  if(DEFINED TORCH_INSTALL_PREFIX AND EXISTS "${TORCH_INSTALL_PREFIX}/lib/libgomp.so.1")
    set(runtime "${TORCH_INSTALL_PREFIX}/lib/libgomp.so.1")
  else()
    find_package(OpenMP QUIET COMPONENTS CXX)
    if(OpenMP_CXX_FOUND)
      set(runtime OpenMP::OpenMP_CXX)
    endif()
  endif()
  set(${out_var} "${runtime}" PARENT_SCOPE)
endfunction()
