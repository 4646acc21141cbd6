// The NCCL process group for init_from_env("nccl") (compiled with USE_C10D_NCCL when gwt is built
// against a CUDA LibTorch and finds nccl.h; the symbols are libtorch_cuda.so's).

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <exception>

namespace gwt {
namespace distributed {
namespace detail {

c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            int world, std::chrono::milliseconds timeout) {
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
