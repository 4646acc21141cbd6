// The NCCL process group for init_from_env("nccl") (compiled with USE_C10D_NCCL when gwt is built
// against a CUDA LibTorch and finds nccl.h; the symbols are libtorch_cuda.so's).

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <cstdlib>
#include <exception>

namespace gwt {
namespace distributed {
namespace detail {

c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            int world, int64_t device,
                                            std::chrono::milliseconds timeout) {
  // One GPU per process: every collective's buffers, and NCCL's communicator, on this rank's.
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  // Without blocking wait, Work::wait() under NCCL only orders the current stream after the
  // collective and returns: a dead or hung peer would never become the c10::Error every wait in
  // gwt::distributed promises. The group reads the variable when it is made; a value the user set
  // is kept.
  setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  try {
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gwt::distributed::init_from_env: rank ", rank, " of ", world,
                " could not create the NCCL group: ", e.what());
  }
}

}  // namespace detail
}  // namespace distributed
}  // namespace gwt
