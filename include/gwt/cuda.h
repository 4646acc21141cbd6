#pragma once

/// \file
/// Whether this build of gwt has its CUDA kernels, and whether they run on a device.

namespace gwt {
namespace kernels {

/// Whether this build of gwt contains the CUDA kernels (built where nvcc and a CUDA LibTorch were
/// found; GWT_CUDA).
bool built_with_cuda();

/// Whether the CUDA kernels can run on CUDA device `device_index`: the build has them and holds
/// machine code for the device's compute capability or PTX its driver can compile
/// (GWT_CUDA_ARCHITECTURES). Asked once per device and remembered; where the answer is no, a
/// one-time warning names the device's compute capability and the architectures built, and
/// WaveletAdam gives that device's parameters the reference path. False without CUDA kernels,
/// without a driver or without that device; never throws for those.
bool cuda_kernels_run_on(int device_index);

}  // namespace kernels
}  // namespace gwt
