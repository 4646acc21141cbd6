// Fuzz target: the CompressedGradient decoder, operator>>(InputArchive&, CompressedGradient&)
// followed by gwt::decompress_gradient, on arbitrary bytes (read with
// torch::serialize::InputArchive::load_from). The seed corpus (fuzz/corpus/compression, written by
// gwt_fuzz_seed) holds real encodings: every position format, 1-D to 3-D gradients, several
// wavelets, modes, levels, dims and dtypes.
//
// Properties:
// - decoding and decompressing let nothing but a c10::Error escape (LibTorch's own archive parser,
//   load_from, may throw its std::exceptions: bytes it cannot read never reach gwt);
// - a decoded gradient has the recorded shape and the approximation's dtype;
// - re-encoding the decoded CompressedGradient and decoding that gives the same fields and,
//   decompressed, the same gradient byte for byte.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <sstream>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "libtorch_guard.h"
#include "gwt/compression.h"

namespace {

using gwt_fuzz::fail;

bool same_list(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!gwt_fuzz::same_bytes(a[i], b[i])) return false;
  return true;
}

std::string differs(const gwt::CompressedGradient& a, const gwt::CompressedGradient& b) {
  if (a.shape != b.shape) return "shape";
  if (a.wavelet != b.wavelet || a.boundary != b.boundary || a.threshold_mode != b.threshold_mode)
    return "names";
  if (a.level != b.level || a.dim != b.dim) return "level or dim";
  if (!(a.threshold == b.threshold || (std::isnan(a.threshold) && std::isnan(b.threshold))))
    return "threshold";
  if (!gwt_fuzz::same_bytes(a.approx, b.approx)) return "approx";
  if (a.detail_shapes != b.detail_shapes) return "detail shapes";
  if (!same_list(a.detail_values, b.detail_values)) return "detail values";
  if (!same_list(a.detail_indices, b.detail_indices)) return "detail indices";
  // Masks: an empty list and a list of undefined tensors mean the same.
  for (size_t k = 0; k < std::max(a.detail_masks.size(), b.detail_masks.size()); ++k) {
    const at::Tensor ma = k < a.detail_masks.size() ? a.detail_masks[k] : at::Tensor();
    const at::Tensor mb = k < b.detail_masks.size() ? b.detail_masks[k] : at::Tensor();
    if (!gwt_fuzz::same_bytes(ma, mb)) return "detail masks";
  }
  return "";
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  gwt_fuzz::init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  torch::serialize::InputArchive archive;
  if (!gwt_fuzz::read_archive(data, size, archive)) return 0;  // see libtorch_guard.h
  gwt::CompressedGradient c;
  at::Tensor g;
  try {
    archive >> c;
    g = gwt::decompress_gradient(c);
  } catch (const c10::Error&) {
    return 0;
  } catch (const std::exception& e) {
    fail(std::string("the decoder threw an exception other than c10::Error: ") + e.what());
  } catch (...) {
    fail("the decoder threw a non-std exception");
  }
  GWT_FUZZ_CHECK(g.defined() && g.sizes().vec() == c.shape, "decoded shape is not the recorded one");
  GWT_FUZZ_CHECK(g.scalar_type() == c.approx.scalar_type(), "decoded dtype is not approx's");

  // Re-encode, decode again: the same CompressedGradient and the same gradient.
  gwt::CompressedGradient again;
  at::Tensor g2;
  try {
    torch::serialize::OutputArchive out;
    out << c;
    std::ostringstream stream;
    out.save_to(stream);
    const std::string bytes = stream.str();
    torch::serialize::InputArchive in;
    in.load_from(bytes.data(), bytes.size());
    in >> again;
    g2 = gwt::decompress_gradient(again);
  } catch (const c10::Error& e) {
    fail(std::string("a decoded CompressedGradient does not re-encode and decode: ") +
         e.what_without_backtrace());
  }
  const std::string changed = differs(c, again);
  if (!changed.empty()) fail("re-encoding changed the " + changed);
  GWT_FUZZ_CHECK(gwt_fuzz::same_bytes(g, g2), "re-encoded gradient decompresses differently");
  return 0;
}
