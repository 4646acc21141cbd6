// gwt::WaveletAdamOptions: accessors, comparison, checkpoint form, and validate_options.

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "common.h"
#include "gwt/optim/wavelet_adam.h"
#include "gwt/wavelet.h"

namespace gwt {

WaveletAdamOptions::WaveletAdamOptions(double lr) : lr_(lr) {}

double WaveletAdamOptions::get_lr() const {
  return lr();
}
void WaveletAdamOptions::set_lr(const double lr) {
  this->lr(lr);
}

bool operator==(const WaveletAdamOptions& lhs, const WaveletAdamOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.betas() == rhs.betas() && lhs.eps() == rhs.eps() &&
         lhs.weight_decay() == rhs.weight_decay() && lhs.wavelet() == rhs.wavelet() &&
         lhs.level() == rhs.level() && lhs.boundary() == rhs.boundary() &&
         lhs.scale() == rhs.scale() && lhs.norm_growth_limit() == rhs.norm_growth_limit() &&
         lhs.correct_bias() == rhs.correct_bias() && lhs.dim() == rhs.dim() &&
         lhs.fused() == rhs.fused() && lhs.state_dtype() == rhs.state_dtype() &&
         lhs.transform() == rhs.transform() && lhs.threshold() == rhs.threshold() &&
         lhs.threshold_mode() == rhs.threshold_mode() && lhs.min_size() == rhs.min_size() &&
         lhs.nonfinite() == rhs.nonfinite();
}

namespace {
c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key,
                       const char* what) {
  return optim_detail::read_value(archive, key, what, "gwt::WaveletAdam");
}
}  // namespace

void WaveletAdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr()));
  archive.write("beta1", c10::IValue(std::get<0>(betas())));
  archive.write("beta2", c10::IValue(std::get<1>(betas())));
  archive.write("eps", c10::IValue(eps()));
  archive.write("weight_decay", c10::IValue(weight_decay()));
  archive.write("wavelet", c10::IValue(wavelet()));
  archive.write("level", c10::IValue(level()));
  archive.write("boundary", c10::IValue(boundary()));
  archive.write("scale", c10::IValue(scale()));
  archive.write("norm_growth_limit", c10::IValue(norm_growth_limit()));
  archive.write("correct_bias", c10::IValue(correct_bias()));
  archive.write("dim", c10::IValue(dim()));
  archive.write("fused", c10::IValue(fused()));
  archive.write("state_dtype", c10::IValue(state_dtype()));
  archive.write("transform", c10::IValue(transform()));
  archive.write("threshold", c10::IValue(threshold()));
  archive.write("threshold_mode", c10::IValue(threshold_mode()));
  archive.write("min_size", c10::IValue(min_size()));
  archive.write("nonfinite", c10::IValue(nonfinite()));
}

void WaveletAdamOptions::serialize(torch::serialize::InputArchive& archive) {
  const char* what = "saved WaveletAdamOptions";
  lr(read_value(archive, "lr", what).toDouble());
  betas(std::make_tuple(read_value(archive, "beta1", what).toDouble(),
                        read_value(archive, "beta2", what).toDouble()));
  eps(read_value(archive, "eps", what).toDouble());
  weight_decay(read_value(archive, "weight_decay", what).toDouble());
  wavelet(read_value(archive, "wavelet", what).toStringRef());
  level(read_value(archive, "level", what).toInt());
  boundary(read_value(archive, "boundary", what).toStringRef());
  scale(read_value(archive, "scale", what).toDouble());
  norm_growth_limit(read_value(archive, "norm_growth_limit", what).toDouble());
  correct_bias(read_value(archive, "correct_bias", what).toBool());
  dim(read_value(archive, "dim", what).toInt());
  fused(read_value(archive, "fused", what).toBool());
  state_dtype(read_value(archive, "state_dtype", what).toStringRef());
  transform(read_value(archive, "transform", what).toStringRef());
  threshold(read_value(archive, "threshold", what).toDouble());
  threshold_mode(read_value(archive, "threshold_mode", what).toStringRef());
  min_size(read_value(archive, "min_size", what).toInt());
  // Checkpoints from before the option: the behaviour they had.
  c10::IValue nonfinite_value;
  nonfinite(archive.try_read("nonfinite", nonfinite_value) && nonfinite_value.isString()
                ? nonfinite_value.toStringRef()
                : std::string("skip_step"));
}

void validate_options(const WaveletAdamOptions& o) {
  auto finite = [](double x) { return std::isfinite(x); };
  optim_detail::check_adam_options("gwt::WaveletAdam", o.lr(), o.betas(), o.eps(),
                                   o.weight_decay());
  TORCH_CHECK(o.level() >= 0 && o.level() <= 30, "gwt::WaveletAdam: invalid level ", o.level(),
              "; it must be in [0, 30] (0 = dense Adam)");
  TORCH_CHECK(finite(o.scale()), "gwt::WaveletAdam: invalid scale ", o.scale(),
              "; it must be finite");
  // A positive limit below the smallest normal float32 is 0 in the float32 math (0 / 0 = NaN).
  TORCH_CHECK(finite(o.norm_growth_limit()) &&
                  (o.norm_growth_limit() == 0 ||
                   o.norm_growth_limit() >= std::numeric_limits<float>::min()),
              "gwt::WaveletAdam: invalid norm_growth_limit ", o.norm_growth_limit(),
              "; it must be 0 (no limiter) or finite and >= ", std::numeric_limits<float>::min(),
              " (the smallest normal float32; Fira uses 1.01)");
  TORCH_CHECK(o.transform() == "1d" || o.transform() == "2d",
              "gwt::WaveletAdam: invalid transform '", o.transform(), "'; valid values are 1d, 2d");
  TORCH_CHECK(finite(o.threshold()) && o.threshold() >= 0, "gwt::WaveletAdam: invalid threshold ",
              o.threshold(), "; it must be finite and >= 0 (0 = off)");
  TORCH_CHECK(o.threshold_mode() == "soft" || o.threshold_mode() == "hard",
              "gwt::WaveletAdam: invalid threshold_mode '", o.threshold_mode(),
              "'; valid values are soft, hard");
  TORCH_CHECK(o.min_size() >= 0, "gwt::WaveletAdam: invalid min_size ", o.min_size(),
              "; it must be >= 0");
  // Any other name ("bf16", "float32", ...) would silently mean the "auto" moments.
  TORCH_CHECK(o.state_dtype() == "auto" || o.state_dtype() == "bfloat16",
              "gwt::WaveletAdam: invalid state_dtype '", o.state_dtype(),
              "'; valid values are auto, bfloat16");
  TORCH_CHECK(o.nonfinite() == "skip_step" || o.nonfinite() == "skip_param",
              "gwt::WaveletAdam: invalid nonfinite '", o.nonfinite(),
              "'; valid values are skip_step (the whole step), skip_param (that parameter only)");
  Wavelet(o.wavelet());                     // throws listing the valid names
  boundary_mode_from_string(o.boundary());  // throws listing the valid modes
}

}  // namespace gwt
