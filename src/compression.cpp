#include "gwt/compression.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cmath>
#include <cctype>
#include <map>
#include <memory>

#include "gwt/optim/param_groups.h"
#include "gwt/transform.h"

namespace gwt {

// ----------------------------------------------------------------------------------------------
// ThresholdScheduler
// ----------------------------------------------------------------------------------------------

ThresholdScheduler::ThresholdScheduler(WaveletAdam& optimizer, Rule rule)
    : optimizer_(optimizer), rule_(std::move(rule)) {
  TORCH_CHECK(rule_ != nullptr, "gwt::ThresholdScheduler needs a rule");
  apply(0);
}

ThresholdScheduler ThresholdScheduler::linear_ramp(WaveletAdam& optimizer, double start, double end,
                                                   int64_t steps, double floor, double ceiling) {
  TORCH_CHECK(steps >= 1, "gwt::ThresholdScheduler::linear_ramp: steps must be >= 1, got ", steps);
  TORCH_CHECK(floor <= ceiling, "gwt::ThresholdScheduler::linear_ramp: floor ", floor,
              " is above ceiling ", ceiling);
  return ThresholdScheduler(optimizer, [=](int64_t step, double) {
    const double progress = std::min(1.0, static_cast<double>(step) / static_cast<double>(steps));
    return std::clamp(start + (end - start) * progress, floor, ceiling);
  });
}

void ThresholdScheduler::step() {
  apply(step_count_ + 1);
  ++step_count_;
}

void ThresholdScheduler::apply(int64_t step) {
  // Every value first, then all of them: a rule that fails for one group changes no group, and
  // step() does not advance. A group added to the optimizer after the scheduler was made takes
  // its threshold at that point as its base.
  const size_t groups = optimizer_.param_groups().size();
  std::vector<double> base = base_;
  for (size_t i = base.size(); i < groups; ++i) base.push_back(optimizer_.group_options(i).threshold());
  std::vector<double> values(groups);
  for (const auto i : c10::irange(groups)) {
    const double value = rule_(step, base[i]);
    TORCH_CHECK(std::isfinite(value) && value >= 0,
                "gwt::ThresholdScheduler: the rule gave threshold ", value, " for group ", i,
                " at step ", step, "; thresholds must be finite and >= 0 (no group was changed)");
    values[i] = value;
  }
  for (const auto i : c10::irange(groups))
    static_cast<WaveletAdamOptions&>(optimizer_.param_groups()[i].options()).threshold(values[i]);
  base_ = std::move(base);
}

// ----------------------------------------------------------------------------------------------
// Per-layer strength
// ----------------------------------------------------------------------------------------------

namespace {
// The first dot-separated component of a name that is a number, or -1.
int64_t layer_of(const std::string& name) {
  size_t start = 0;
  while (start <= name.size()) {
    const size_t end = std::min(name.find('.', start), name.size());
    const std::string part = name.substr(start, end - start);
    if (!part.empty() &&
        std::all_of(part.begin(), part.end(), [](unsigned char c) { return std::isdigit(c); }))
      return std::stoll(part);
    start = end + 1;
  }
  return -1;
}
}  // namespace

std::vector<torch::optim::OptimizerParamGroup> depth_param_groups(
    const torch::nn::Module& module, const WaveletAdamOptions& options,
    const std::function<WaveletAdamOptions(int64_t, int64_t, WaveletAdamOptions)>& strength) {
  const auto assignments = assign_param_groups(module);
  int64_t layers = 0;
  for (const auto& a : assignments)
    if (a.wavelet) layers = std::max(layers, layer_of(a.name) + 1);
  std::map<int64_t, std::vector<at::Tensor>> by_layer;  // -1: wavelet without a layer number
  std::vector<at::Tensor> dense;
  for (const auto& a : assignments)
    (a.wavelet ? by_layer[layer_of(a.name)] : dense).push_back(a.param);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (auto& [layer, params] : by_layer) {
    WaveletAdamOptions o = layer < 0 ? options : strength(layer, layers, options);
    validate_options(o);
    groups.emplace_back(std::move(params), std::make_unique<WaveletAdamOptions>(o));
  }
  if (!dense.empty())
    groups.emplace_back(std::move(dense),
                        std::make_unique<WaveletAdamOptions>(WaveletAdamOptions(options).level(0)));
  return groups;
}

// ----------------------------------------------------------------------------------------------
// Compressed gradients
// ----------------------------------------------------------------------------------------------

int64_t CompressedGradient::bytes() const {
  int64_t total = approx.defined() ? static_cast<int64_t>(approx.nbytes()) : 0;
  for (const auto* list : {&detail_values, &detail_indices, &detail_masks})
    for (const at::Tensor& t : *list)
      if (t.defined()) total += static_cast<int64_t>(t.nbytes());
  return total;
}

namespace {

const at::Tensor& bit_weights() {
  static const at::Tensor weights = at::tensor({1, 2, 4, 8, 16, 32, 64, 128}, at::kByte);
  return weights;
}

// A bool vector as bits, least significant first, padded with zeros to whole bytes.
at::Tensor pack_bits(const at::Tensor& keep) {
  const int64_t n = keep.numel(), bytes = (n + 7) / 8;
  at::Tensor bits = at::zeros({bytes * 8}, at::kByte);
  bits.narrow(0, 0, n).copy_(keep.cpu());
  return (bits.view({bytes, 8}) * bit_weights()).sum(1, false, at::kByte);
}

at::Tensor unpack_bits(const at::Tensor& mask, int64_t n) {
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.dim() == 1 && mask.numel() == (n + 7) / 8,
              "gwt::decompress_gradient: a detail mask of ", mask.numel(), " bytes for ", n,
              " coefficients (need ", (n + 7) / 8, " uint8)");
  return mask.cpu().unsqueeze(1).bitwise_and(bit_weights()).ne(0).view({-1}).narrow(0, 0, n);
}

}  // namespace

int64_t CompressedGradient::dense_bytes() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n * static_cast<int64_t>(approx.defined() ? approx.element_size() : 4);
}

CompressedGradient compress_gradient(const at::Tensor& grad, const Wavelet& wavelet, int64_t level,
                                     double threshold_value, const std::string& threshold_mode,
                                     int64_t dim, BoundaryMode boundary,
                                     const std::string& positions) {
  TORCH_CHECK(grad.defined() && grad.dim() >= 1,
              "gwt::compress_gradient needs a tensor with a dimension");
  TORCH_CHECK(level >= 1, "gwt::compress_gradient: level must be >= 1, got ", level);
  TORCH_CHECK(std::isfinite(threshold_value) && threshold_value >= 0,
              "gwt::compress_gradient: invalid threshold ", threshold_value,
              "; it must be finite and >= 0 (0 keeps every detail coefficient)");
  TORCH_CHECK(positions == "auto" || positions == "indices" || positions == "bitmask",
              "gwt::compress_gradient: unknown positions '", positions,
              "' (valid: auto, indices, bitmask)");
  CompressedGradient c;
  c.shape = grad.sizes().vec();
  c.wavelet = wavelet.name(), c.boundary = to_string(boundary), c.threshold_mode = threshold_mode;
  c.level = level, c.dim = dim, c.threshold = threshold_value;
  const WaveletCoeffs coeffs = wavedec(grad, wavelet, level, dim, boundary);
  c.approx = coeffs.approx.contiguous();
  for (const auto& detail : coeffs.details) {
    const at::Tensor kept =
        threshold_value > 0 ? threshold(detail, threshold_value, threshold_mode) : detail;
    const at::Tensor flat = kept.contiguous().view({-1});
    const at::Tensor indices = flat.nonzero().view({-1});
    // 4 bytes per kept coefficient against 1 bit per coefficient.
    const bool too_long = flat.numel() >= (int64_t{1} << 31);  // for int32 indices
    const bool bitmask =
        positions == "bitmask" ||
        (positions == "auto" && (too_long || 4 * indices.numel() > (flat.numel() + 7) / 8));
    if (bitmask) {
      c.detail_indices.emplace_back();
      c.detail_masks.push_back(pack_bits(flat.ne(0)));
    } else {
      TORCH_CHECK(!too_long,
                  "gwt::compress_gradient: a subband too large for int32 indices; use "
                  "positions \"bitmask\"");
      c.detail_indices.push_back(indices.to(at::kInt));
      c.detail_masks.emplace_back();
    }
    c.detail_values.push_back(flat.index_select(0, indices));
    c.detail_shapes.push_back(detail.sizes().vec());
  }
  const at::Tensor back = decompress_gradient(c).to(at::kDouble), original = grad.to(at::kDouble);
  const double norm = original.norm().item<double>();
  c.relative_error = norm > 0 ? (back - original).norm().item<double>() / norm : 0.0;
  return c;
}

at::Tensor decompress_gradient(const CompressedGradient& c) {
  const size_t levels = c.detail_shapes.size();
  TORCH_CHECK(c.approx.defined() && c.detail_values.size() == levels &&
                  c.detail_indices.size() == levels &&
                  (c.detail_masks.empty() || c.detail_masks.size() == levels),
              "gwt::decompress_gradient: an incomplete CompressedGradient");
  // The subbands must be the ones wavedec gives for the recorded shape, or waverec would return a
  // gradient of another shape (found by fuzz_compression on a damaged archive).
  const auto rank = static_cast<int64_t>(c.shape.size());
  TORCH_CHECK(rank >= 1 && c.dim >= -rank && c.dim < rank, "gwt::decompress_gradient: dim ", c.dim,
              " is out of range for the recorded shape ", c10::IntArrayRef(c.shape),
              " (valid: -", rank, " to ", rank - 1, "; a shape needs at least one dimension)");
  const int64_t dim = c.dim < 0 ? c.dim + rank : c.dim;
  TORCH_CHECK(std::all_of(c.shape.begin(), c.shape.end(), [](int64_t s) { return s >= 0; }),
              "gwt::decompress_gradient: the recorded shape ", c10::IntArrayRef(c.shape),
              " has a negative size");
  TORCH_CHECK(c.level >= 1 && static_cast<size_t>(c.level) == levels,
              "gwt::decompress_gradient: level ", c.level, " but ", levels, " detail subbands");
  {
    const Wavelet wavelet(c.wavelet);
    const BoundaryMode mode = boundary_mode_from_string(c.boundary);
    std::vector<int64_t> lengths = {c.shape[static_cast<size_t>(dim)]};  // finest first
    for (int64_t l = 0; l < c.level; ++l)
      lengths.push_back(dwt_coeff_len(lengths.back(), wavelet.length(), mode));
    auto expected = [&](int64_t length) {
      std::vector<int64_t> s = c.shape;
      s[static_cast<size_t>(dim)] = length;
      return s;
    };
    TORCH_CHECK(c.approx.sizes().vec() == expected(lengths.back()),
                "gwt::decompress_gradient: the approximation has shape ", c.approx.sizes(),
                " but a gradient of shape ", c10::IntArrayRef(c.shape), " at level ", c.level,
                " has ", c10::IntArrayRef(expected(lengths.back())));
    for (size_t k = 0; k < levels; ++k) {
      const auto want = expected(lengths[levels - k]);  // coarsest first
      TORCH_CHECK(c.detail_shapes[k] == want, "gwt::decompress_gradient: detail subband ", k,
                  " has shape ", c10::IntArrayRef(c.detail_shapes[k]), " but should have ",
                  c10::IntArrayRef(want));
    }
  }
  WaveletCoeffs coeffs;
  coeffs.approx = c.approx;
  for (size_t k = 0; k < levels; ++k) {
    at::Tensor flat = at::zeros(c.detail_shapes[k], c.approx.options()).view({-1});
    const bool bitmask = !c.detail_masks.empty() && c.detail_masks[k].defined();
    TORCH_CHECK(bitmask != c.detail_indices[k].defined(), "gwt::decompress_gradient: detail level ",
                k, " needs exactly one of indices and mask");
    if (bitmask) {
      const at::Tensor keep = unpack_bits(c.detail_masks[k], flat.numel()).to(flat.device());
      TORCH_CHECK(keep.sum().item<int64_t>() == c.detail_values[k].numel(),
                  "gwt::decompress_gradient: detail level ", k, " has ", c.detail_values[k].numel(),
                  " values for ", keep.sum().item<int64_t>(), " set bits");
      flat.masked_scatter_(keep, c.detail_values[k]);
    } else {
      flat.index_copy_(0, c.detail_indices[k].to(at::kLong), c.detail_values[k]);
    }
    coeffs.details.push_back(flat.view(c.detail_shapes[k]));
  }
  return waverec(coeffs, c.wavelet, c.dim, boundary_mode_from_string(c.boundary), c.shape.at(dim));
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const CompressedGradient& c) {
  // v1: indices only (older gwt reads those); v2: some level has a bitmask.
  bool masks = false;
  for (const at::Tensor& mask : c.detail_masks) masks = masks || mask.defined();
  archive.write("format", c10::IValue(std::string(masks ? "gwt.CompressedGradient.v2"
                                                        : "gwt.CompressedGradient.v1")));
  archive.write("shape", c10::IValue(c.shape));
  archive.write("wavelet", c10::IValue(c.wavelet));
  archive.write("boundary", c10::IValue(c.boundary));
  archive.write("threshold_mode", c10::IValue(c.threshold_mode));
  archive.write("level", c10::IValue(c.level));
  archive.write("dim", c10::IValue(c.dim));
  archive.write("threshold", c10::IValue(c.threshold));
  archive.write("relative_error", c10::IValue(c.relative_error));
  archive.write("approx", c.approx);
  for (size_t k = 0; k < c.detail_shapes.size(); ++k) {
    archive.write("detail_shape_" + std::to_string(k), c10::IValue(c.detail_shapes[k]));
    if (c.detail_indices[k].defined()) {
      archive.write("detail_indices_" + std::to_string(k), c.detail_indices[k]);
    } else {
      TORCH_CHECK(k < c.detail_masks.size() && c.detail_masks[k].defined(), "gwt: detail level ", k,
                  " of a CompressedGradient has neither indices nor mask");
      archive.write("detail_mask_" + std::to_string(k), c.detail_masks[k]);
    }
    archive.write("detail_values_" + std::to_string(k), c.detail_values[k]);
  }
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           CompressedGradient& c) {
  auto value = [&](const std::string& key) {
    c10::IValue v;
    TORCH_CHECK(archive.try_read(key, v), "gwt: not a CompressedGradient (no '", key, "')");
    return v;
  };
  auto tensor = [&](const std::string& key) {
    at::Tensor t;
    TORCH_CHECK(archive.try_read(key, t), "gwt: not a CompressedGradient (no '", key, "')");
    return t;
  };
  const std::string format = value("format").toStringRef();
  TORCH_CHECK(format == "gwt.CompressedGradient.v1" || format == "gwt.CompressedGradient.v2",
              "gwt: not a CompressedGradient this gwt reads (format '", format, "')");
  CompressedGradient out;
  out.shape = value("shape").toIntVector();
  out.wavelet = value("wavelet").toStringRef(), out.boundary = value("boundary").toStringRef();
  out.threshold_mode = value("threshold_mode").toStringRef();
  out.level = value("level").toInt(), out.dim = value("dim").toInt();
  out.threshold = value("threshold").toDouble(),
  out.relative_error = value("relative_error").toDouble();
  out.approx = tensor("approx");
  for (int64_t k = 0; k < out.level; ++k) {
    out.detail_shapes.push_back(value("detail_shape_" + std::to_string(k)).toIntVector());
    at::Tensor indices, mask;
    if (!archive.try_read("detail_indices_" + std::to_string(k), indices))
      mask = tensor("detail_mask_" + std::to_string(k));
    out.detail_indices.push_back(indices);
    out.detail_masks.push_back(mask);
    out.detail_values.push_back(tensor("detail_values_" + std::to_string(k)));
  }
  c = std::move(out);
  return archive;
}

}  // namespace gwt
