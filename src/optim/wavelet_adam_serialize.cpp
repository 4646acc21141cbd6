// gwt::WaveletAdam's checkpoints: the per-parameter state's archive form, and save/load (one
// nested archive per group, each holding its options and its parameters' state by position;
// load() reads and checks everything before it changes anything).

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <string>

#include "checkpoint.h"
#include "common.h"
#include "device_steps.h"
#include "gwt/optim/wavelet_adam.h"
#include "wavelet_adam_detail.h"

namespace gwt {

namespace {
c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key,
                       const char* what) {
  return optim_detail::read_value(archive, key, what, "gwt::WaveletAdam");
}
constexpr const char* k_format = "gwt.WaveletAdam.v1";

}  // namespace

void WaveletAdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  archive.write("exp_avg", exp_avg());
  archive.write("exp_avg_sq", exp_avg_sq());
  archive.write("has_norm", c10::IValue(norm().defined()));
  if (norm().defined()) archive.write("norm", norm());
  archive.write("skipped", c10::IValue(skipped()));
}

void WaveletAdamParamState::serialize(torch::serialize::InputArchive& archive) {
  const char* what = "saved WaveletAdamParamState";
  step(read_value(archive, "step", what).toInt());
  // InputArchive::read into a defined tensor overwrites that tensor in place: read each entry into
  // a fresh one.
  auto read_tensor = [&](const char* key) {
    at::Tensor tensor;
    TORCH_CHECK(archive.try_read(key, tensor), "gwt: ", what, " has no ", key);
    return tensor;
  };
  exp_avg(read_tensor("exp_avg"));
  exp_avg_sq(read_tensor("exp_avg_sq"));
  norm(read_value(archive, "has_norm", what).toBool() ? read_tensor("norm") : at::Tensor());
  c10::IValue skipped_value;  // absent from checkpoints before nonfinite("skip_param")
  skipped(archive.try_read("skipped", skipped_value) && skipped_value.isInt()
              ? skipped_value.toInt()
              : 0);
}

bool operator==(const WaveletAdamParamState& lhs, const WaveletAdamParamState& rhs) {
  auto same = [](const at::Tensor& a, const at::Tensor& b) {
    return a.defined() == b.defined() && (!a.defined() || at::equal(a, b));
  };
  return lhs.step() == rhs.step() && same(lhs.exp_avg(), rhs.exp_avg()) &&
         same(lhs.exp_avg_sq(), rhs.exp_avg_sq()) && same(lhs.norm(), rhs.norm()) &&
         lhs.skipped() == rhs.skipped();
}

namespace wavelet_adam_detail {

void prepare_loaded_state(WaveletAdamParamState& state, const at::Tensor& param,
                          const WaveletAdamOptions& options, const char* who,
                          const std::string& where, bool own_storage) {
  check_state(state, param, plan_for(param, options));
  TORCH_CHECK(state.skipped() >= 0, who, ": the saved skipped count for ", where, " is ",
              state.skipped(), "; it counts steps (>= 0)");
  const auto moments = param.options().dtype(state_dtype(param, options));
  const auto math = param.options().dtype(optim_detail::compute_dtype(param));
  using optim_detail::loaded_state_tensor;
  state.exp_avg(
      loaded_state_tensor(state.exp_avg(), moments, who, "exp_avg", where, false, own_storage));
  state.exp_avg_sq(loaded_state_tensor(state.exp_avg_sq(), moments, who, "exp_avg_sq", where, true,
                                       own_storage));
  state.norm(
      loaded_state_tensor(state.norm(), math, who, "limiter norm", where, true, own_storage));
  if (state.norm().defined()) state.norm(state.norm().reshape({}));
}

}  // namespace wavelet_adam_detail

void WaveletAdam::save(torch::serialize::OutputArchive& archive) const {
  sync_device_steps();
  optim_detail::save_checkpoint<WaveletAdamOptions, WaveletAdamParamState>(
      *this, archive, k_format, {{"skipped_steps", skipped_steps_}});
  optim_detail::save_param_digests(*this, archive);
}

void WaveletAdam::load(torch::serialize::InputArchive& archive) {
  using wavelet_adam_detail::check_state;
  using wavelet_adam_detail::plan_for;
  using wavelet_adam_detail::state_dtype;
  // Parameters reordered (or moved between groups) since the save, seen by their bytes; only for
  // our own format (load_checkpoint reports any other).
  c10::IValue format;
  if (archive.try_read("format", format) && format.isString() && format.toStringRef() == k_format)
    optim_detail::check_param_digests(*this, archive, "gwt::WaveletAdam");
  const auto where = optim_detail::param_positions(*this);
  const auto counters = optim_detail::load_checkpoint<WaveletAdamOptions, WaveletAdamParamState>(
      *this, archive, k_format, {"skipped_steps"}, "gwt::WaveletAdam",
      [&where](WaveletAdamParamState& state, const at::Tensor& param,
               const WaveletAdamOptions& options) {
        wavelet_adam_detail::prepare_loaded_state(state, param, options, "gwt::WaveletAdam::load",
                                                  where.at(param.unsafeGetTensorImpl()),
                                                  /*own_storage=*/false);
      },
      [](const at::Tensor& param, const WaveletAdamOptions& options, int64_t next_step) {
        // As add_param_group does for every parameter, with state or without (a parameter without
        // state got past prepare's check_state unchecked: found by fuzz_load).
        plan_for(param, options);  // dim against the parameter's rank
        wavelet_adam_detail::check_options_fit(param, options, next_step);
      });
  skipped_steps_ = counters.at("skipped_steps");
  // The loaded counts are the host's; the device's, if any, are stale now.
  if (device_steps_) device_steps_->clear();
}

}  // namespace gwt
