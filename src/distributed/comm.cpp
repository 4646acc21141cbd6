// Process groups from the environment and the collectives gwt::distributed is made of (the
// gradient averaging built on them is grad_sync.cpp).
//
// Compiled with USE_C10D_GLOO (CMake adds it when Gloo's headers are found). The headers come from
// Debian's libgloo-dev and the symbols from LibTorch's libtorch_cpu.so; nothing of Debian's libgloo
// is linked. That is safe because c10d::ProcessGroupGloo holds every gloo type it names by pointer
// (std::shared_ptr<gloo::transport::Device>, std::shared_ptr<gloo::Context>, ...): the layout of a
// ProcessGroupGloo, its Options and everything gwt touches does not depend on the gloo headers'
// age. The distributed tests construct one and run every collective used here, so a layout that did
// change would fail them.

#include "comm.h"

#include <c10/util/irange.h>
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <limits>
#include <optional>
#include <sstream>

#include "../plain_tensor.h"
#include "gwt/distributed.h"

namespace gwt {
namespace distributed {

#ifdef GWT_HAVE_NCCL
namespace detail {
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            int world, int64_t device,
                                            std::chrono::milliseconds timeout);
}  // namespace detail
#endif

namespace detail {

namespace {

std::string where(const c10d::Backend& pg) {
  std::ostringstream s;
  s << "rank " << pg.getRank() << " of " << pg.getSize();
  return s.str();
}

}  // namespace

namespace {
// The CUDA device init_from_env chose for this process's NCCL group (-1: none chosen).
std::atomic<int64_t> nccl_device{-1};
}  // namespace

at::Device comm_device(const c10d::Backend& pg, const at::Tensor& like) {
  if (pg.getBackendName() != "nccl") return at::Device(at::kCPU);
  if (like.defined() && like.is_cuda()) return like.device();
  const int64_t chosen = nccl_device.load();
  return chosen >= 0 ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(chosen))
                     : at::Device(at::kCUDA);
}

void remember_nccl_device(int64_t index) {
  nccl_device = index;
}

void wait(const c10::intrusive_ptr<c10d::Work>& work, const c10d::Backend& pg,
          const std::string& what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gwt::distributed: ", what, " failed on ", where(pg),
                " (a peer died, timed out or is in another collective): ", e.what());
  }
}

namespace {

// Starts a collective (`start` returns its Work) and waits for it; either failing is a c10::Error
// that names the call and this rank.
template <typename Start>
void run(const c10::intrusive_ptr<c10d::Backend>& pg, const std::string& what, Start&& start) {
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = start();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gwt::distributed: ", what, " failed on ", where(*pg), ": ", e.what());
  }
  wait(work, *pg, what);
}

}  // namespace

void allreduce(const c10::intrusive_ptr<c10d::Backend>& pg, at::Tensor& t, c10d::ReduceOp op,
               const std::string& what) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  run(pg, what, [&] { return pg->allreduce(tensors, options); });
}

void broadcast(const c10::intrusive_ptr<c10d::Backend>& pg, at::Tensor& t, int64_t root,
               const std::string& what) {
  std::vector<at::Tensor> tensors{t};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  run(pg, what, [&] { return pg->broadcast(tensors, options); });
}

std::vector<at::Tensor> allgather(const c10::intrusive_ptr<c10d::Backend>& pg, const at::Tensor& t,
                                  const std::string& what) {
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < pg->getSize(); ++r) outputs[0].push_back(at::empty_like(t));
  std::vector<at::Tensor> inputs{t};
  run(pg, what, [&] { return pg->allgather(outputs, inputs); });
  return outputs[0];
}

Agreed agree(const c10::intrusive_ptr<c10d::Backend>& pg, const std::vector<int64_t>& flags,
             const std::vector<int64_t>& same, const std::string& what) {
  // max(flags), and max(v) and max(-v) of the values that must agree: equal everywhere exactly
  // when max(v) == -max(-v).
  const auto f = static_cast<int64_t>(flags.size()), n = static_cast<int64_t>(same.size());
  at::Tensor t = at::empty({f + 2 * n}, at::kLong);
  int64_t* v = t.data_ptr<int64_t>();
  for (const auto i : c10::irange(f)) v[i] = flags[i];
  for (const auto i : c10::irange(n)) {
    TORCH_INTERNAL_ASSERT(same[i] != std::numeric_limits<int64_t>::min());
    v[f + i] = same[i], v[f + n + i] = -same[i];
  }
  at::Tensor on = t.to(comm_device(*pg));
  allreduce(pg, on, c10d::ReduceOp::MAX, what);
  const at::Tensor r = on.cpu().contiguous();
  const int64_t* m = r.data_ptr<int64_t>();
  Agreed out;
  out.max.assign(m, m + f);
  for (const auto i : c10::irange(n)) out.same = out.same && m[f + i] == -m[f + n + i];
  return out;
}

bool any(const c10::intrusive_ptr<c10d::Backend>& pg, bool flag, const std::string& what) {
  return agree(pg, {flag ? 1 : 0}, {}, what).max[0] != 0;
}

void fail_differ(const c10d::Backend& pg, const std::string& op, const std::string& differs) {
  TORCH_CHECK(false, "gwt::distributed::", op, ": ", differs, " differ between the ranks (seen on ",
              where(pg),
              "); every rank must pass the same parameters, in the same order and shapes, with "
              "gradients defined for the same ones, and the same options");
}

void check_same(const c10::intrusive_ptr<c10d::Backend>& pg, const std::vector<int64_t>& values,
                const std::string& op, const std::string& differs) {
  if (!agree(pg, {}, values, op).same) fail_differ(*pg, op, differs);
}

std::string capture(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
  return {};
}

int64_t failure_flag(const c10d::Backend& pg, const std::string& error) {
  return error.empty() ? 0 : pg.getRank() + 1;
}

void throw_if_failed(const c10d::Backend& pg, int64_t flag, const std::string& error,
                     const std::string& what, const std::string& suffix) {
  if (flag == 0) return;
  TORCH_CHECK(error.empty(), error, suffix);
  TORCH_CHECK(false, "gwt::distributed::", what, ": failed on rank ", flag - 1, " (", where(pg),
              " is stopping with it; that rank's message says why)", suffix);
}

void send(const c10::intrusive_ptr<c10d::Backend>& pg, at::Tensor& t, int64_t dst, int tag,
          const std::string& what) {
  std::vector<at::Tensor> tensors{t};
  run(pg, what, [&] { return pg->send(tensors, static_cast<int>(dst), tag); });
}

void recv(const c10::intrusive_ptr<c10d::Backend>& pg, at::Tensor& t, int64_t src, int tag,
          const std::string& what) {
  std::vector<at::Tensor> tensors{t};
  run(pg, what, [&] { return pg->recv(tensors, static_cast<int>(src), tag); });
}

int64_t shape_digest(const std::vector<at::Tensor>& tensors, bool with_grads) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a over the numbers below
  auto mix = [&h](int64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xff;
      h *= 1099511628211ULL;
    }
  };
  for (const auto& t : tensors) {
    mix(t.dim());
    for (const auto s : t.sizes()) mix(s);
    mix(static_cast<int64_t>(t.scalar_type()));
    if (with_grads) mix(t.grad().defined() ? 1 : 0);
  }
  return static_cast<int64_t>(h >> 2);
}

std::vector<std::pair<size_t, size_t>> buckets(const std::vector<at::Tensor>& tensors,
                                               int64_t max_bytes) {
  std::vector<std::pair<size_t, size_t>> out;
  size_t begin = 0;
  int64_t bytes = 0;
  for (const auto i : c10::irange(tensors.size())) {
    const int64_t b = static_cast<int64_t>(tensors[i].nbytes());
    const bool split =
        i > begin && (tensors[i].scalar_type() != tensors[begin].scalar_type() ||
                      tensors[i].device() != tensors[begin].device() || bytes + b > max_bytes);
    if (split) out.emplace_back(begin, i), begin = i, bytes = 0;
    bytes += b;
  }
  if (begin < tensors.size()) out.emplace_back(begin, tensors.size());
  return out;
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// init_from_env
// ------------------------------------------------------------------------------------------------

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int64_t env_int(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const auto v = env(name);
  if (!v) return fallback;
  size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(*v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == v->size() && x >= lo && x <= hi, "gwt::distributed::init_from_env: ", name,
              "='", *v, "' is not a whole number from ", lo, " to ", hi);
  return static_cast<int64_t>(x);
}

}  // namespace

namespace detail {
int64_t cuda_device_for_rank(int64_t rank, int64_t device_count) {
  TORCH_CHECK(device_count > 0,
              "gwt::distributed::init_from_env: backend 'nccl' needs a CUDA "
              "device and this process sees none (CUDA_VISIBLE_DEVICES?); use 'gloo'");
  // A launcher that gives each process one GPU (CUDA_VISIBLE_DEVICES) leaves it one device,
  // whatever its LOCAL_RANK.
  if (device_count == 1) return 0;
  if (env("LOCAL_RANK")) {
    const int64_t index = env_int("LOCAL_RANK", 0, 0, int64_t{1} << 20);
    TORCH_CHECK(index < device_count, "gwt::distributed::init_from_env: LOCAL_RANK=", index,
                " but this process sees ", device_count,
                " CUDA devices (CUDA_VISIBLE_DEVICES?); run at most one process per device");
    return index;
  }
  return rank % device_count;
}
}  // namespace detail

c10::intrusive_ptr<c10d::Backend> init_from_env(const std::string& backend,
                                                std::chrono::milliseconds timeout) {
  const char* who = "gwt::distributed::init_from_env";
  const int64_t world = env_int("WORLD_SIZE", 1, 1, 1 << 20);
  const int64_t rank = env_int("RANK", 0, 0, world - 1);
  if (const auto t = env("GWT_DIST_TIMEOUT_S")) {
    double s = 0;
    size_t used = 0;
    try {
      s = std::stod(*t, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK(used == t->size() && std::isfinite(s) && s > 0 && s < 1e7, who,
                ": GWT_DIST_TIMEOUT_S='", *t, "' is not a positive number of seconds");
    timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(s * 1000)));
  }
  TORCH_CHECK(timeout.count() > 0, who, ": the timeout must be positive, got ", timeout.count(),
              " ms");
  std::string name = backend;
  if (name == "auto") name = torch::cuda::is_available() ? "nccl" : "gloo";
#ifndef GWT_HAVE_NCCL
  if (backend == "auto") name = "gloo";
#endif
  TORCH_CHECK(name == "gloo" || name == "nccl", who, ": unknown backend '", backend,
              "' (valid: auto, gloo, nccl)");

  const std::string host = env("MASTER_ADDR").value_or("127.0.0.1");
  c10::intrusive_ptr<c10d::Store> store;
  if (const auto path = env("GWT_STORE_FILE")) {
    try {
      store = c10::make_intrusive<c10d::FileStore>(*path, static_cast<int>(world));
    } catch (const std::exception& e) {
      TORCH_CHECK(false, who, ": cannot use GWT_STORE_FILE='", *path, "': ", e.what());
    }
  } else {
    TORCH_CHECK(world == 1 || env("MASTER_PORT"), who, ": WORLD_SIZE is ", world,
                " but MASTER_PORT is not set (torchrun sets it; or set GWT_STORE_FILE to a "
                "path every rank can reach)");
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(env_int("MASTER_PORT", 29500, 1, 65535));
    // Under torchrun the agent of rank 0 already serves a TCPStore at MASTER_PORT and tells its
    // workers so (TORCHELASTIC_USE_AGENT_STORE=True): then every rank is a client of it.
    options.isServer = rank == 0 && env("TORCHELASTIC_USE_AGENT_STORE").value_or("") != "True";
    options.numWorkers = static_cast<std::size_t>(world);
    options.waitWorkers = true;
    options.timeout = timeout;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(host, options);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, who, ": rank ", rank, " of ", world, " could not ",
                  rank == 0 ? "serve" : "reach", " the TCPStore at ", host, ":", options.port,
                  " within ", timeout.count() / 1000.0, " s: ", e.what());
    }
  }
  store->setTimeout(timeout);

  if (name == "nccl") {
#ifdef GWT_HAVE_NCCL
    const int64_t device =
        detail::cuda_device_for_rank(rank, static_cast<int64_t>(torch::cuda::device_count()));
    detail::remember_nccl_device(device);
    return detail::make_nccl(store, static_cast<int>(rank), static_cast<int>(world), device,
                             timeout);
#else
    TORCH_CHECK(false, who,
                ": backend 'nccl' was asked for, but gwt was built without NCCL "
                "(it needs a CUDA LibTorch and nccl.h at configure time); use 'gloo'");
#endif
  }
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // Gloo's sockets bind to this host's address: loopback for a single machine, else the address
  // the host name resolves to (GWT_GLOO_HOSTNAME overrides both).
  const bool local = host == "127.0.0.1" || host == "localhost" || host == "::1";
  const std::string bind = env("GWT_GLOO_HOSTNAME").value_or(local ? "127.0.0.1" : "");
  // The group is returned after the try block: a return inside it leaves GCC at -O0 (coverage,
  // Debug builds) unsure that the catch block, whose TORCH_CHECK(false) always throws, returns.
  c10::intrusive_ptr<c10d::Backend> group;
  try {
    options->devices.push_back(bind.empty()
                                   ? c10d::ProcessGroupGloo::createDefaultDevice()
                                   : c10d::ProcessGroupGloo::createDeviceForHostname(bind));
    group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank),
                                                        static_cast<int>(world), options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, who, ": rank ", rank, " of ", world,
                " could not join the Gloo group within ", timeout.count() / 1000.0,
                " s: ", e.what());
  }
  return group;
}

// ------------------------------------------------------------------------------------------------
// Parameters from one rank to all
// ------------------------------------------------------------------------------------------------

void broadcast_parameters(const c10::intrusive_ptr<c10d::Backend>& pg,
                          const std::vector<at::Tensor>& params, int64_t root) {
  const char* who = "gwt::distributed::broadcast_parameters";
  TORCH_CHECK(pg, who, ": the process group is null");
  // Checked on each rank, then agreed on, so that no rank waits for one that gave up.
  int64_t digest = 0;
  const std::string error = detail::capture([&] {
    TORCH_CHECK(root >= 0 && root < pg->getSize(), who, ": root ", root, " is not a rank (0 to ",
                pg->getSize() - 1, ")");
    for (const auto& p : params) gwt::detail::check_plain_tensor(who, "a parameter", p);
    digest = detail::shape_digest(params, false);
  });
  const detail::Agreed agreed = detail::agree(
      pg, {detail::failure_flag(*pg, error)},
      {error.empty() ? static_cast<int64_t>(params.size()) : 0, digest, error.empty() ? root : 0},
      "broadcast_parameters");
  detail::throw_if_failed(*pg, agreed.max[0], error, "broadcast_parameters");
  if (!agreed.same) detail::fail_differ(*pg, "broadcast_parameters", "the parameters or the root");
  at::NoGradGuard no_grad;
  for (const auto& [begin, end] : detail::buckets(params, int64_t{64} << 20)) {
    std::vector<at::Tensor> flat;
    for (size_t i = begin; i < end; ++i) flat.push_back(params[i].detach().reshape({-1}));
    at::Tensor bucket = at::cat(flat).to(detail::comm_device(*pg, params[begin]));
    detail::broadcast(pg, bucket, root, "broadcast_parameters");
    if (pg->getRank() == root) continue;
    int64_t offset = 0;
    for (size_t i = begin; i < end; ++i) {
      const int64_t n = params[i].numel();
      params[i].detach().copy_(bucket.narrow(0, offset, n).view(params[i].sizes()));
      offset += n;
    }
  }
}

}  // namespace distributed
}  // namespace gwt
