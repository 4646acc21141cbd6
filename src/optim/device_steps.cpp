#include "device_steps.h"

#include <c10/core/DeviceGuard.h>

#ifdef GWT_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

#include <atomic>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>

#include "common.h"
#include "kernels/shared/multi_tensor.h"
#include "kernels/shared/multi_tensor_emulate.h"

namespace gwt {
namespace optim_detail {

namespace mt = kernels::mt;

struct DeviceSteps::Impl {
  // Per parameter (by TensorImpl): its counts, int64 [2] (mt::Count) on its device.
  std::unordered_map<const void*, at::Tensor> counts;
  // General wavelets with a threshold: details kept at the last step, per row, and their number.
  struct Kept {
    at::Tensor per_row;
    int64_t total = 0;
  };
  std::unordered_map<const void*, Kept> kept;
  // mt::StepFlags (int32, int32, int64) on the device; zeroed when made.
  at::Tensor flags;
  // The last metadata uploaded, and where: a step with the same bytes uploads nothing.
  std::vector<unsigned char> uploaded;
  at::Tensor device_metadata;
};

DeviceSteps::DeviceSteps(std::string who) : who_(std::move(who)), impl_(std::make_unique<Impl>()) {}
DeviceSteps::~DeviceSteps() = default;

bool DeviceSteps::empty() const {
  return impl_->counts.empty() && !impl_->flags.defined();
}

void DeviceSteps::clear() {
  impl_ = std::make_unique<Impl>();
}

namespace {

std::atomic<bool> emulated{false};

bool capturing() {
#ifdef GWT_WITH_CUDA
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  return false;
#endif
}

}  // namespace

void DeviceSteps::step(const std::vector<DeviceItem>& items) {
  TORCH_INTERNAL_ASSERT(!items.empty());
  const c10::Device device = items.front().param.device();
  const c10::DeviceGuard guard(device);
  const bool graph = device.is_cuda() && capturing();
  Impl& d = *impl_;
  auto first_use = [graph, this](const char* what) {
    TORCH_CHECK(!graph, who_, ": a CUDA graph is being captured, and this step needs ", what,
                " first; run one step before the capture (warm-up) with the same parameters, "
                "gradients and options");
  };
  if (!d.flags.defined()) {
    first_use("the optimizer's device flags");
    d.flags = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(device));
  }
  // The counts of parameters new to the device, in one copy.
  std::vector<int64_t> fresh;
  for (const DeviceItem& item : items)
    if (d.counts.count(item.param.unsafeGetTensorImpl()) == 0)
      fresh.insert(fresh.end(), {*item.slots.step, *item.slots.skipped});
  if (!fresh.empty()) {
    first_use("the parameters' step counts on the device");
    const int64_t k = static_cast<int64_t>(fresh.size()) / 2;
    const at::Tensor all = at::tensor(fresh, at::kLong).view({k, 2}).to(device);
    int64_t next = 0;
    for (const DeviceItem& item : items)
      if (d.counts.count(item.param.unsafeGetTensorImpl()) == 0)
        d.counts.emplace(item.param.unsafeGetTensorImpl(), all[next++]);
  }
  mt::Planner planner;
  for (const DeviceItem& item : items) {
    at::Tensor* norm = item.slots.norm;
    // The limiter's saved norm lives on the device in the math type; -1: none yet.
    if (norm != nullptr && !(norm->defined() && norm->device() == device)) {
      first_use("the limiter's norm on the device");
      const auto math = item.param.options().dtype(optim_detail::compute_dtype(item.param));
      *norm = norm->defined() ? norm->to(math).reshape({}) : at::full({}, -1.0, math);
    }
    const mt::GroupKey key{optim_detail::kind_of(item.param.scalar_type()),
                           optim_detail::kind_of(item.exp_avg.scalar_type()),
                           optim_detail::compute_dtype(item.param) == at::kDouble};
    mt::TensorMeta meta = item.meta;
    meta.param = item.param.data_ptr();
    meta.grad = item.param.grad().data_ptr();
    meta.exp_avg = item.exp_avg.data_ptr();
    meta.exp_avg_sq = item.exp_avg_sq.data_ptr();
    meta.norm = norm != nullptr ? norm->data_ptr() : nullptr;
    meta.counts = d.counts.at(item.param.unsafeGetTensorImpl()).data_ptr<int64_t>();
    if (meta.kind != mt::Kind::general) {
      planner.add(key, meta);
      continue;
    }
    if (item.general.threshold > 0) {
      auto kept = d.kept.find(item.param.unsafeGetTensorImpl());
      if (kept == d.kept.end()) {
        first_use("the parameter's kept-detail counts on the device");
        const kernels::WaveletAdamArgs& a = item.general;
        kept = d.kept
                   .emplace(
                       item.param.unsafeGetTensorImpl(),
                       Impl::Kept{
                           at::zeros({a.rows}, at::TensorOptions().dtype(at::kLong).device(device)),
                           a.rows * (a.coeff_len - a.approx_len)})
                   .first;
      }
      meta.kept_per_row = kept->second.per_row.data_ptr<int64_t>();
    }
    planner.add_general(key, meta, item.general);
  }
  const mt::StepLayout layout(planner.groups());
  std::vector<unsigned char> bytes(layout.bytes());
  layout.write(planner.groups(), bytes.data());
  if (device.is_cpu()) {  // emulate_device_steps_on_cpu: the kernels' bodies on the host
    d.uploaded = std::move(bytes);
    mt::run_step(planner.groups(), layout, d.uploaded.data(),
                 static_cast<mt::StepFlags*>(d.flags.data_ptr()), mt::HostKernels{});
    return;
  }
  if (bytes != d.uploaded) {
    first_use("its tensors' metadata on the device (the parameters, gradients or options changed)");
    if (!d.device_metadata.defined() ||
        d.device_metadata.numel() < static_cast<int64_t>(bytes.size()))
      d.device_metadata = at::empty({static_cast<int64_t>(bytes.size())},
                                    at::TensorOptions().dtype(at::kByte).device(device));
    // From pinned memory, queued on the stream after the previous step's kernels: nothing waits.
    at::Tensor pinned = at::empty({static_cast<int64_t>(bytes.size())},
                                  at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(pinned.data_ptr(), bytes.data(), bytes.size());
    d.device_metadata.narrow(0, 0, pinned.numel()).copy_(pinned, /*non_blocking=*/true);
    d.uploaded = std::move(bytes);
  }
  mt::multi_tensor_step_cuda(planner.groups(), layout,
                             static_cast<unsigned char*>(d.device_metadata.data_ptr()),
                             static_cast<mt::StepFlags*>(d.flags.data_ptr()));
}

void DeviceSteps::sync(const std::function<bool(const void*, DeviceSlots&)>& slots_of,
                       int64_t& skipped_steps) {
  Impl& d = *impl_;
  // Everything the host needs gathered on the device, then one copy: counts, norms (as double),
  // kept details, and the optimizer's skipped steps.
  std::vector<DeviceSlots> slots;
  std::vector<at::Tensor> counts, values;
  std::vector<int64_t> kept_total;
  for (const auto& [key, c] : d.counts) {
    DeviceSlots s;
    if (!slots_of(key, s)) continue;
    slots.push_back(s);
    counts.push_back(c);
    const bool has_norm = s.norm != nullptr && s.norm->defined();
    values.push_back(has_norm ? s.norm->to(c.device(), at::kDouble).reshape({})
                              : at::zeros({}, c.options().dtype(at::kDouble)));
    auto kept = d.kept.find(key);
    const bool has_kept = kept != d.kept.end();
    values.push_back(has_kept ? kept->second.per_row.sum().to(at::kDouble)
                              : at::zeros({}, c.options().dtype(at::kDouble)));
    kept_total.push_back(has_kept ? kept->second.total : -1);
  }
  if (!slots.empty()) {
    const at::Tensor host_counts = at::stack(counts).cpu();
    const at::Tensor host_values = at::stack(values).cpu();
    const int64_t* count = host_counts.const_data_ptr<int64_t>();
    const double* value = host_values.const_data_ptr<double>();
    for (size_t i = 0; i < slots.size(); ++i) {
      const DeviceSlots& s = slots[i];
      *s.step = count[2 * i + mt::k_steps];
      *s.skipped = count[2 * i + mt::k_skipped];
      if (s.norm != nullptr && s.norm->defined() && value[2 * i] < 0) *s.norm = at::Tensor();
      if (kept_total[i] >= 0 && *s.step > 0 && s.kept_details != nullptr) {
        *s.kept_details = static_cast<int64_t>(value[2 * i + 1]);
        *s.total_details = kept_total[i];
      }
    }
  }
  if (d.flags.defined()) {
    // StepFlags::skipped_steps is the second int64.
    skipped_steps += d.flags[1].item<int64_t>();
    d.flags[1].zero_();
  }
}

bool device_steps_run_on(const c10::Device& device) {
  return device.is_cpu() ? device_steps_emulated()
                         : device.is_cuda() && kernels::built_with_cuda() &&
                               kernels::cuda_kernels_run_on(device.index());
}

void emulate_device_steps_on_cpu(bool on) {
  emulated.store(on);
}

bool device_steps_emulated() {
  return emulated.load();
}

}  // namespace optim_detail
}  // namespace gwt
