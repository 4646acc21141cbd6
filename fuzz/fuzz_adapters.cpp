// Fuzz target: gwt::nn::load_delta_adapters of arbitrary bytes (read with
// torch::serialize::InputArchive::load_from) onto the model of adapter_setup.h. The seed corpus
// (fuzz/corpus/adapters, written by gwt_fuzz_seed) holds real adapter archives for its layers.
//
// Properties:
// - load_delta_adapters lets nothing but a c10::Error escape (LibTorch's own archive parser,
//   load_from, may throw its std::exceptions: bytes it cannot read never reach gwt);
// - after an error the model is as before: the same module at every name, every parameter's bytes
//   and requires_grad;
// - after a load: each adapter returned is the module registered at its name, and the one its
//   parent runs (a torch::nn::Sequential runs its own list); its forward of a fixed input is finite
//   when every value it multiplies is at most 1e3 in magnitude (the reflections and the core are
//   orthogonal products of normalised vectors, so such an output is at most a few 1e10);
//   the model's adapters saved again load onto a fresh model, to the same adapters.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "adapter_setup.h"
#include "fuzz_util.h"
#include "libtorch_guard.h"

namespace {

using gwt::nn::DeltaLinearImpl;
using gwt_fuzz::fail;

struct ModelSnapshot {
  std::map<std::string, const torch::nn::Module*> modules;
  std::map<std::string, std::pair<at::Tensor, bool>> params;  // copy, requires_grad
};

ModelSnapshot snapshot(const torch::nn::Module& model) {
  ModelSnapshot s;
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    s.modules[item.key()] = item.value().get();
  for (const auto& item : model.named_parameters())
    s.params[item.key()] = {gwt_fuzz::copy_of(item.value()), item.value().requires_grad()};
  return s;
}

void expect_unchanged(const ModelSnapshot& before, const ModelSnapshot& after,
                      const std::string& why) {
  if (before.modules != after.modules) fail(why + ": a module was replaced");
  GWT_FUZZ_CHECK(before.params.size() == after.params.size(), why);
  for (const auto& [name, value] : before.params) {
    const auto it = after.params.find(name);
    if (it == after.params.end() || !gwt_fuzz::same_bytes(value.first, it->second.first) ||
        value.second != it->second.second)
      fail(why + ": parameter '" + name + "' changed");
  }
}

double max_abs_of(const at::Tensor& t) {
  return t.defined() ? gwt_fuzz::max_abs(t.to(at::kDouble)) : 0.0;
}

// The adapter archive of `model`'s adapters, as bytes.
std::string saved_adapters(const torch::nn::Module& model) {
  torch::serialize::OutputArchive out;
  gwt::nn::save_delta_adapters(model, out);
  std::ostringstream bytes;
  out.save_to(bytes);
  return bytes.str();
}

void check_loaded(gwt_fuzz::AdapterModel& model,
                  std::vector<std::pair<std::string, gwt::nn::DeltaLinear>>& loaded) {
  const auto modules = model->named_modules("", /*include_self=*/false);
  for (auto& [name, adapter] : loaded) {
    const std::string where = "adapter '" + name + "'";
    GWT_FUZZ_CHECK(modules.contains(name) && modules[name].get() == adapter.get(),
                   where + " is not the module registered at its name");
    const auto dot = name.rfind('.');
    if (dot != std::string::npos) {
      if (auto* seq =
              dynamic_cast<torch::nn::SequentialImpl*>(modules[name.substr(0, dot)].get())) {
        bool runs = false;
        for (size_t i = 0; i < seq->size(); ++i) runs = runs || seq->ptr(i).get() == adapter.get();
        if (!runs)
          fail(where +
               " was put into a torch::nn::Sequential, whose forward still runs the "
               "layer it replaced");
      }
    }
    const DeltaLinearImpl& a = *adapter;
    const double largest = std::max({max_abs_of(a.weight), max_abs_of(a.bias), max_abs_of(a.U),
                                     max_abs_of(a.V), max_abs_of(a.core), a.scaling()});
    const at::Tensor x = at::linspace(-1, 1, 2 * a.options().in_features(), at::kDouble)
                             .view({2, a.options().in_features()})
                             .to(a.weight.scalar_type());
    at::Tensor y;
    try {
      y = adapter->forward(x);
    } catch (const c10::Error& e) {
      fail(where + ": the forward of a loaded adapter threw: " + e.what_without_backtrace());
    }
    if (largest <= 1e3 && !gwt_fuzz::all_finite(y))
      fail(where + ": the forward of a loaded adapter with values at most " + c10::str(largest) +
           " is not finite (reflections " + c10::str(a.options().reflections()) +
           ", gram_schmidt " + c10::str(a.options().gram_schmidt()) + ", rank " +
           c10::str(a.options().rank()) + ", core " + c10::str(a.options().orthogonal_core()) +
           ")");
  }
  // What was loaded saves and loads again, onto a fresh model, to the same adapters.
  const std::string bytes = saved_adapters(*model);
  torch::serialize::InputArchive again;
  again.load_from(bytes.data(), bytes.size());
  gwt_fuzz::AdapterModel fresh;
  try {
    gwt::nn::load_delta_adapters(*fresh, again);
  } catch (const c10::Error& e) {
    fail(std::string("the loaded adapters, saved again, did not load: ") +
         e.what_without_backtrace());
  }
  if (saved_adapters(*fresh) != bytes) fail("the loaded adapters, saved and loaded again, differ");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  gwt_fuzz::init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  torch::serialize::InputArchive archive;
  if (!gwt_fuzz::read_archive(data, size, archive)) return 0;  // see libtorch_guard.h
  gwt_fuzz::AdapterModel model;
  const ModelSnapshot before = snapshot(*model);
  std::vector<std::pair<std::string, gwt::nn::DeltaLinear>> loaded;
  try {
    loaded = gwt::nn::load_delta_adapters(*model, archive);
  } catch (const c10::Error& e) {
    expect_unchanged(before, snapshot(*model),
                     std::string("after the error '") + e.what_without_backtrace() + "'");
    return 0;
  } catch (const std::exception& e) {
    fail(std::string("an exception other than c10::Error: ") + e.what());
  } catch (...) {
    fail("a non-std exception");
  }
  check_loaded(model, loaded);
  return 0;
}
