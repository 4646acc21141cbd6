// Process groups from the environment and the collectives gwt::distributed is made of.
//
// Compiled with USE_C10D_GLOO (CMake adds it when Gloo's headers are found). The headers come from
// Debian's libgloo-dev and the symbols from LibTorch's libtorch_cpu.so; nothing of Debian's libgloo
// is linked. That is safe because c10d::ProcessGroupGloo holds every gloo type it names by pointer
// (std::shared_ptr<gloo::transport::Device>, std::shared_ptr<gloo::Context>, ...): the layout of a
// ProcessGroupGloo, its Options and everything gwt touches does not depend on the gloo headers' age.
// The distributed tests construct one and run every collective used here, so a layout that did
// change would fail them.

#include "comm.h"

#include <c10/util/irange.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/cuda.h>

#include <cmath>
#include <cstdlib>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "gwt/distributed.h"
#include "gwt/transform.h"
#include "gwt/wavelet.h"

namespace gwt {
namespace distributed {

#ifdef GWT_HAVE_NCCL
namespace detail {
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store,
                                            int rank, int world, std::chrono::milliseconds timeout);
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

at::Device comm_device(const c10d::Backend& pg) {
  return pg.getBackendName() == "nccl" ? at::Device(at::kCUDA) : at::Device(at::kCPU);
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

void allreduce(const c10::intrusive_ptr<c10d::Backend>& pg, at::Tensor& t, c10d::ReduceOp op,
               const std::string& what) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = pg->allreduce(tensors, options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gwt::distributed: ", what, " failed on ", where(*pg), ": ", e.what());
  }
  wait(work, *pg, what);
}

void broadcast(const c10::intrusive_ptr<c10d::Backend>& pg, at::Tensor& t, int64_t root,
               const std::string& what) {
  std::vector<at::Tensor> tensors{t};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = pg->broadcast(tensors, options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gwt::distributed: ", what, " failed on ", where(*pg), ": ", e.what());
  }
  wait(work, *pg, what);
}

std::vector<at::Tensor> allgather(const c10::intrusive_ptr<c10d::Backend>& pg, const at::Tensor& t,
                                  const std::string& what) {
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < pg->getSize(); ++r) outputs[0].push_back(at::empty_like(t));
  std::vector<at::Tensor> inputs{t};
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = pg->allgather(outputs, inputs);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "gwt::distributed: ", what, " failed on ", where(*pg), ": ", e.what());
  }
  wait(work, *pg, what);
  return outputs[0];
}

bool any(const c10::intrusive_ptr<c10d::Backend>& pg, bool flag, const std::string& what) {
  at::Tensor t = at::full({1}, flag ? 1 : 0, at::TensorOptions(at::kLong).device(comm_device(*pg)));
  allreduce(pg, t, c10d::ReduceOp::MAX, what);
  return t.cpu().item<int64_t>() != 0;
}

void check_same(const c10::intrusive_ptr<c10d::Backend>& pg, const std::vector<int64_t>& values,
                const std::string& op, const std::string& differs) {
  // max(v) and max(-v) over the ranks: equal everywhere exactly when max(v) == -max(-v).
  const auto n = static_cast<int64_t>(values.size());
  at::Tensor t = at::empty({2 * n}, at::kLong);
  for (const auto i : c10::irange(n)) {
    TORCH_INTERNAL_ASSERT(values[i] != std::numeric_limits<int64_t>::min());
    t[i] = values[i], t[n + i] = -values[i];
  }
  at::Tensor on = t.to(comm_device(*pg));
  allreduce(pg, on, c10d::ReduceOp::MAX, op);
  const at::Tensor r = on.cpu();
  bool same = true;
  for (const auto i : c10::irange(n)) same = same && r[i].item<int64_t>() == -r[n + i].item<int64_t>();
  TORCH_CHECK(same, "gwt::distributed::", op, ": ", differs, " differ between the ranks (seen on ", where(*pg),
              "); every rank must pass the same parameters, in the same order and shapes, with "
              "gradients defined for the same ones");
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
    const bool split = i > begin && (tensors[i].scalar_type() != tensors[begin].scalar_type() ||
                                     tensors[i].device() != tensors[begin].device() ||
                                     bytes + b > max_bytes);
    if (split) out.emplace_back(begin, i), begin = i, bytes = 0;
    bytes += b;
  }
  if (begin < tensors.size()) out.emplace_back(begin, tensors.size());
  return out;
}

// ------------------------------------------------------------------------------------------------
// What all_reduce_gradients remembers between calls
// ------------------------------------------------------------------------------------------------

namespace {

struct Residual {
  c10::weak_intrusive_ptr<c10::TensorImpl> param;
  at::Tensor value;  // the Haar coefficients not sent yet (float32 or float64)
  int64_t level = 0;
};

struct Synced {
  c10::weak_intrusive_ptr<c10::TensorImpl> grad;
  int64_t version = 0;
};

struct Memory {
  std::mutex mutex;
  std::unordered_map<const void*, Residual> residuals;
  std::vector<Synced> synced;  // the gradients the last call wrote, in parameter order
  GradSyncStats stats;
  uint64_t calls = 0;  // all_reduce_gradients calls so far: the same count on every rank
};

Memory& memory() {
  static Memory m;
  return m;
}

}  // namespace

bool gradients_already_averaged(const std::vector<at::Tensor>& params) {
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  size_t k = 0;
  for (const auto& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (k >= m.synced.size()) return false;
    const Synced& s = m.synced[k++];
    auto held = s.grad.lock();
    if (!held || held.get() != g.unsafeGetTensorImpl() || g._version() != s.version) return false;
  }
  return k == m.synced.size() && k > 0;
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
    options.isServer = rank == 0;
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
    return detail::make_nccl(store, static_cast<int>(rank), static_cast<int>(world), timeout);
#else
    TORCH_CHECK(false, who, ": backend 'nccl' was asked for, but gwt was built without NCCL "
                "(it needs a CUDA LibTorch and nccl.h at configure time); use 'gloo'");
#endif
  }
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  // Gloo's sockets bind to this host's address: loopback for a single machine, else the address
  // the host name resolves to (GWT_GLOO_HOSTNAME overrides both).
  const bool local = host == "127.0.0.1" || host == "localhost" || host == "::1";
  const std::string bind = env("GWT_GLOO_HOSTNAME").value_or(local ? "127.0.0.1" : "");
  try {
    options->devices.push_back(bind.empty()
                                   ? c10d::ProcessGroupGloo::createDefaultDevice()
                                   : c10d::ProcessGroupGloo::createDeviceForHostname(bind));
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank),
                                                       static_cast<int>(world), options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, who, ": rank ", rank, " of ", world,
                " could not join the Gloo group within ", timeout.count() / 1000.0, " s: ",
                e.what());
  }
}

// ------------------------------------------------------------------------------------------------
// Gradient averaging
// ------------------------------------------------------------------------------------------------

namespace {

void check_sync_options(const GradSyncOptions& o) {
  const char* who = "gwt::distributed::all_reduce_gradients";
  TORCH_CHECK(o.compression == "none" || o.compression == "wavelet", who,
              ": unknown compression '", o.compression, "' (valid: none, wavelet)");
  TORCH_CHECK(o.level >= 1 && o.level <= 30, who, ": level ", o.level,
              " is out of range (valid: 1 to 30)");
  TORCH_CHECK(std::isfinite(o.bucket_mb) && o.bucket_mb > 0 && o.bucket_mb <= 1 << 20, who,
              ": bucket_mb ", o.bucket_mb, " must be a positive number of MiB");
}

bool compressible(const at::Tensor& g, int64_t level) {
  return g.dim() >= 2 && g.size(-1) >= (int64_t{1} << level);
}

// The Haar coefficients of `e` along the last dimension, side by side: [A, D_L, ..., D_1]; their
// lengths go to `lengths`.
at::Tensor to_coeffs(const at::Tensor& e, int64_t level, std::vector<int64_t>& lengths) {
  const WaveletCoeffs c = wavedec(e, Wavelet("haar"), level);
  std::vector<at::Tensor> parts{c.approx};
  parts.insert(parts.end(), c.details.begin(), c.details.end());
  lengths.clear();
  for (const auto& t : parts) lengths.push_back(t.size(-1));
  return at::cat(parts, -1);
}

at::Tensor from_coeffs(const at::Tensor& flat, const std::vector<int64_t>& lengths, int64_t n) {
  WaveletCoeffs c;
  int64_t offset = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const at::Tensor t = flat.narrow(-1, offset, lengths[i]);
    offset += lengths[i];
    if (i == 0)
      c.approx = t;
    else
      c.details.push_back(t);
  }
  return waverec(c, Wavelet("haar"), -1, BoundaryMode::zero, n);
}

// The coefficients a call sends: one of 2^level equal pieces of the last dimension, as
// [start, start + width). Piece 0 is the approximation band, sent at every even call; the odd calls
// send the detail pieces 1 .. 2^level - 1 in turn.
std::pair<int64_t, int64_t> piece(int64_t total, int64_t level, uint64_t call) {
  const int64_t parts = int64_t{1} << level;
  const int64_t width = (total + parts - 1) / parts;
  const int64_t which =
      call % 2 == 0 ? 0 : 1 + static_cast<int64_t>((call / 2) % static_cast<uint64_t>(parts - 1));
  const int64_t start = std::min(total, which * width);
  return {start, std::min(width, total - start)};
}

}  // namespace

void all_reduce_gradients(const c10::intrusive_ptr<c10d::Backend>& pg,
                          const std::vector<at::Tensor>& params, GradSyncOptions options) {
  const char* who = "gwt::distributed::all_reduce_gradients";
  TORCH_CHECK(pg, who, ": the process group is null");
  check_sync_options(options);
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    TORCH_CHECK(p.defined(), who, ": got an undefined parameter tensor");
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    TORCH_CHECK(g.layout() == at::kStrided, who, ": sparse gradients are not supported");
    TORCH_CHECK(g.is_floating_point(), who, ": a gradient has dtype ", g.scalar_type(),
                "; only floating-point gradients can be averaged");
    grads.push_back(g);
  }
  const bool wavelet = options.compression == "wavelet";
  detail::check_same(pg, {static_cast<int64_t>(params.size()), detail::shape_digest(params, true),
                          wavelet ? options.level : 0},
                     "all_reduce_gradients", "the parameters, their gradients or the compression");
  const double world = static_cast<double>(pg->getSize());
  detail::Memory& m = detail::memory();

  // Payloads: the gradient itself (reduced-precision ones in float32), or a 2^-level piece of its
  // Haar coefficients along the last dimension.
  //
  // Which piece turns with the calls (the same on every rank): the approximation band at every
  // other call, the pieces of the detail bands in turn at the calls between, so that every
  // coefficient is sent at least once in 2 (2^level - 1) calls. Error feedback keeps the
  // coefficients not sent and adds them to the next call's, so each one arrives, with all that
  // accumulated, late but not lost. Measured on the tiny LM (2 ranks, README "Scale-out"), the
  // validation loss against the full all-reduce's: this schedule +5.4% after 150 steps and +5.1%
  // after 600; the approximation band at every call (the detail bands never arrive, the residual
  // only grows in them, and each update is constant over 2^level-wide windows) +3.4% and +9.6%;
  // the four pieces in plain turn +27% and +5.5%; the band of randomly sign-flipped gradients
  // +27% and +12%.
  GradSyncStats stats;
  uint64_t call = 0;
  std::vector<at::Tensor> payload(grads.size()), coeffs(grads.size());
  std::vector<std::vector<int64_t>> lengths(grads.size());
  std::vector<std::pair<int64_t, int64_t>> range(grads.size());
  std::vector<const void*> key(grads.size(), nullptr);
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    call = m.calls++;
    size_t k = 0;
    for (const auto& p : params) {
      if (!p.grad().defined()) continue;
      const at::Tensor& g = grads[k];
      const at::ScalarType math = g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      stats.bytes_full += static_cast<int64_t>(g.numel()) * c10::elementSize(math);
      if (wavelet && compressible(g, options.level)) {
        key[k] = p.unsafeGetTensorImpl();
        coeffs[k] = to_coeffs(g.to(math), options.level, lengths[k]);
        auto it = m.residuals.find(key[k]);
        if (options.error_feedback && it != m.residuals.end() &&
            it->second.param.lock().get() == key[k] && it->second.level == options.level &&
            it->second.value.sizes() == coeffs[k].sizes() &&
            it->second.value.dtype() == coeffs[k].dtype())
          coeffs[k].add_(it->second.value);
        range[k] = piece(coeffs[k].size(-1), options.level, call);
        payload[k] = coeffs[k].narrow(-1, range[k].first, range[k].second).contiguous();
        ++stats.compressed_tensors;
      } else {
        payload[k] = g.to(math).contiguous();
      }
      ++k;
    }
  }

  // Bucketed SUM all-reduce of the flattened payloads.
  for (const auto& [begin, end] : detail::buckets(
           payload, static_cast<int64_t>(options.bucket_mb * 1024 * 1024))) {
    std::vector<at::Tensor> flat;
    for (size_t i = begin; i < end; ++i) flat.push_back(payload[i].reshape({-1}));
    at::Tensor bucket = at::cat(flat).to(detail::comm_device(*pg));
    stats.bytes_sent += static_cast<int64_t>(bucket.nbytes());
    ++stats.collectives;
    detail::allreduce(pg, bucket, c10d::ReduceOp::SUM, "all_reduce_gradients");
    bucket = bucket.to(payload[begin].device()).div_(world);
    int64_t offset = 0;
    for (size_t i = begin; i < end; ++i) {
      const int64_t n = payload[i].numel();
      payload[i] = bucket.narrow(0, offset, n).view(payload[i].sizes());
      offset += n;
    }
  }

  // Write back; keep the coefficients not sent as the next call's error feedback.
  std::lock_guard<std::mutex> lock(m.mutex);
  m.synced.clear();
  size_t k = 0;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    at::Tensor g = p.grad();
    if (key[k] != nullptr) {
      const auto [start, width] = range[k];
      at::Tensor arrived = at::zeros_like(coeffs[k]);
      arrived.narrow(-1, start, width).copy_(payload[k]);
      g.copy_(from_coeffs(arrived, lengths[k], g.size(-1)));
      if (options.error_feedback) {
        at::Tensor residual = coeffs[k];
        residual.narrow(-1, start, width).zero_();
        // A non-finite gradient (the step will be skipped) must not poison later steps.
        if (!at::isfinite(residual).all().item<bool>()) residual.zero_();
        m.residuals.insert_or_assign(
            key[k], detail::Residual{c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr()),
                             residual, options.level});
      } else {
        m.residuals.erase(key[k]);
      }
    } else {
      g.copy_(payload[k]);
    }
    m.synced.push_back({c10::weak_intrusive_ptr<c10::TensorImpl>(g.getIntrusivePtr()),
                        static_cast<int64_t>(g._version())});
    ++stats.tensors;
    ++k;
  }
  // Residuals of parameters that no longer exist.
  for (auto it = m.residuals.begin(); it != m.residuals.end();)
    it = it->second.param.expired() ? m.residuals.erase(it) : std::next(it);
  m.stats = stats;
}

GradSyncStats last_grad_sync_stats() {
  detail::Memory& m = detail::memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  return m.stats;
}

void reset_error_feedback() {
  detail::Memory& m = detail::memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  m.residuals.clear();
}

void broadcast_parameters(const c10::intrusive_ptr<c10d::Backend>& pg,
                          const std::vector<at::Tensor>& params, int64_t root) {
  const char* who = "gwt::distributed::broadcast_parameters";
  TORCH_CHECK(pg, who, ": the process group is null");
  TORCH_CHECK(root >= 0 && root < pg->getSize(), who, ": root ", root, " is not a rank (0 to ",
              pg->getSize() - 1, ")");
  for (const auto& p : params) TORCH_CHECK(p.defined(), who, ": got an undefined parameter");
  detail::check_same(pg, {static_cast<int64_t>(params.size()), detail::shape_digest(params, false)},
                     "broadcast_parameters", "the parameters");
  at::NoGradGuard no_grad;
  for (const auto& [begin, end] : detail::buckets(params, int64_t{64} << 20)) {
    std::vector<at::Tensor> flat;
    for (size_t i = begin; i < end; ++i) flat.push_back(params[i].detach().reshape({-1}));
    at::Tensor bucket = at::cat(flat).to(detail::comm_device(*pg));
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
