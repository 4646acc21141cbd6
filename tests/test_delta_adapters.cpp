// gwt::nn's functions over a whole model of DeltaLinear adapters: add_delta_adapters, merging
// back, learning-rate groups, the adapters saved alone and loaded onto a base, and diagnostics.
// Exactness and tolerances as in test_delta.cpp (float64, against products written out here).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "delta_test_util.h"
#include "gwt/gwt.h"
#include "test_util.h"

namespace {

using gwt::nn::DeltaLinear;
using gwt::nn::DeltaLinearOptions;
using gwt_test::max_abs_diff;
using namespace gwt_test::delta;

TEST(DeltaAdapters, WrapAModelTrainAndMergeBack) {
  at::manual_seed(9);
  Stack model(std::vector<std::pair<int64_t, int64_t>>{{12, 16}, {16, 16}, {16, 3}});
  const at::Tensor x = at::randn({5, 12}, at::kDouble);
  const at::Tensor before = model->forward(x).detach();
  const auto adapters =
      gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(4).reflections(2),
                                  [](const std::string& name) { return name != "2"; });
  ASSERT_EQ(adapters.size(), 2u);
  EXPECT_EQ(adapters[0].first, "0");
  EXPECT_EQ(adapters[1].first, "1");
  EXPECT_LE(max_abs_diff(model->forward(x), before), 1e-12);  // paired start
  // Trainable: the adapters' parameters and the head that was not wrapped.
  int64_t trainable = 0;
  for (const auto& p : model->parameters()) trainable += p.requires_grad() ? p.numel() : 0;
  EXPECT_EQ(trainable, (16 * 4 + 12 * 4 + 12 * 2) + (16 * 4 + 16 * 4 + 16 * 2) + (16 * 3 + 3));
  // Learning-rate groups: base (the head) at lr, U/V at 3x, reflections at 0.25x.
  auto groups = gwt::nn::delta_param_groups(
      *model, 1e-2, [](double lr) { return std::make_unique<torch::optim::AdamWOptions>(lr); });
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_DOUBLE_EQ(groups[0].options().get_lr(), 1e-2);
  EXPECT_EQ(groups[0].params().size(), 2u);
  EXPECT_DOUBLE_EQ(groups[1].options().get_lr(), 3e-2);
  EXPECT_EQ(groups[1].params().size(), 4u);
  EXPECT_DOUBLE_EQ(groups[2].options().get_lr(), 2.5e-3);
  torch::optim::AdamW opt(std::move(groups));
  EXPECT_DOUBLE_EQ(opt.param_groups()[1].options().get_lr(), 3e-2);  // the groups' own options
  for (int t = 0; t < 5; ++t) {
    opt.zero_grad();
    model->forward(x).pow(2).sum().backward();
    opt.step();
  }
  const at::Tensor adapted = model->forward(x).detach();
  EXPECT_GT(max_abs_diff(adapted, before), 1e-4);
  // The adapters took part: layer 0's U moved (it starts at zero).
  EXPECT_GT(model->layer(0)->as<gwt::nn::DeltaLinearImpl>()->U.abs().max().item<double>(), 0);
  EXPECT_EQ(gwt::nn::merge_delta_adapters(*model), 2);
  for (const auto& child : model->children())
    EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(child) != nullptr);
  EXPECT_LE(max_abs_diff(model->forward(x), adapted), 1e-12);
  // WaveletAdam takes the same groups (U and V are matrices: their state is compressed too).
  gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(8),
                              [](const std::string& name) { return name != "2"; });
  gwt::WaveletAdam wopt(gwt::nn::delta_param_groups(*model, 1e-3, [](double lr) {
    return std::make_unique<gwt::WaveletAdamOptions>(gwt::WaveletAdamOptions(lr).min_size(0));
  }));
  ASSERT_EQ(wopt.param_groups().size(), 2u);
  EXPECT_DOUBLE_EQ(wopt.group_options(0).lr(), 1e-3);
  EXPECT_DOUBLE_EQ(wopt.group_options(1).lr(), 3e-3);
  EXPECT_TRUE(wopt.is_wavelet_param(model->named_parameters()["1.U"]));
}

// `steps` AdamW steps (lr 1e-2) on `loss`, over `params`.
void adamw_steps(const std::vector<at::Tensor>& params, const std::function<at::Tensor()>& loss,
                 int steps) {
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));
  for (int t = 0; t < steps; ++t) {
    opt.zero_grad();
    loss().backward();
    opt.step();
  }
}

// A copy of `model`'s parameters into `other` (same architecture).
void copy_parameters(torch::nn::Module& from, torch::nn::Module& to) {
  at::NoGradGuard no_grad;
  auto dst = to.named_parameters();
  for (const auto& item : from.named_parameters()) dst[item.key()].copy_(item.value());
}

TEST(DeltaAdapters, SavedAloneTheyLoadOntoAFreshBaseAndRefuseAnotherShape) {
  at::manual_seed(10);
  Stack model = three_layers();
  Stack fresh = three_layers();
  copy_parameters(*model, *fresh);  // the same base, never adapted
  gwt::nn::add_delta_adapters(*model,
                              DeltaLinearOptions(0, 0).rank(4).reflections(2).orthogonal_core(true),
                              [](const std::string& name) { return name != "2"; });
  const at::Tensor x = at::randn({5, 12}, at::kDouble);
  auto train_steps = [&](int steps) {
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int t = 0; t < steps; ++t) {
      opt.zero_grad();
      model->forward(x).pow(2).sum().backward();
      opt.step();
    }
  };
  train_steps(5);
  model->layer(1)->as<gwt::nn::DeltaLinearImpl>()->resize_rank(8);  // a rank-changed adapter
  train_steps(5);
  const at::Tensor expected = model->forward(x).detach();
  torch::serialize::OutputArchive out;
  gwt::nn::save_delta_adapters(*model, out);
  std::ostringstream bytes;
  out.save_to(bytes);
  auto archive_of = [&] {
    auto in = std::make_shared<torch::serialize::InputArchive>();
    std::istringstream stream(bytes.str());
    in->load_from(stream);
    return in;
  };
  // Onto the fresh base: the same function, bit for bit (the head was trained in `model` only, so
  // it is copied too: it is not an adapter).
  copy_parameters(*model->layer(2), *fresh->layer(2));
  const auto loaded = gwt::nn::load_delta_adapters(*fresh, *archive_of());
  ASSERT_EQ(loaded.size(), 2u);
  EXPECT_EQ(loaded[1].second->rank(), 8);
  EXPECT_TRUE(at::equal(fresh->forward(x), expected));
  // Onto the adapted model after more training: back to the saved adapters.
  train_steps(3);
  gwt::nn::load_delta_adapters(*model, *archive_of());
  copy_parameters(*fresh->layer(2), *model->layer(2));  // the head is not an adapter: put it back
  EXPECT_TRUE(at::equal(model->forward(x), expected));
  // Onto a base of another shape: an error naming it, and nothing replaced or frozen.
  Stack other = three_layers(/*hidden=*/8);
  expect_error([&] { gwt::nn::load_delta_adapters(*other, *archive_of()); },
               "was saved for a layer of weight [16, 16] but layer '1' has weight [8, 16]");
  for (const auto& child : other->children())
    EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(child) != nullptr);
  for (const auto& p : other->parameters()) EXPECT_TRUE(p.requires_grad());
  // Not an adapter archive.
  torch::serialize::OutputArchive foreign;
  foreign.write("format", c10::IValue(std::string("something.else")));
  std::ostringstream foreign_bytes;
  foreign.save_to(foreign_bytes);
  torch::serialize::InputArchive foreign_in;
  std::istringstream foreign_stream(foreign_bytes.str());
  foreign_in.load_from(foreign_stream);
  expect_error([&] { gwt::nn::load_delta_adapters(*other, foreign_in); },
               "not a gwt.DeltaAdapters.v1");
}

// The bytes of `module`'s adapters (save_delta_adapters), and an archive that reads them.
std::string adapter_bytes(const torch::nn::Module& module) {
  torch::serialize::OutputArchive out;
  gwt::nn::save_delta_adapters(module, out);
  std::ostringstream bytes;
  out.save_to(bytes);
  return bytes.str();
}
std::shared_ptr<torch::serialize::InputArchive> archive_of(const std::string& bytes) {
  auto in = std::make_shared<torch::serialize::InputArchive>();
  std::istringstream stream(bytes);
  in->load_from(stream);
  return in;
}

torch::nn::Sequential sequential_of_adapters(const DeltaLinearOptions& o) {
  return torch::nn::Sequential(
      DeltaLinear(make_base(12, 16), DeltaLinearOptions(o).in_features(12).out_features(16)),
      DeltaLinear(make_base(16, 3), DeltaLinearOptions(o).in_features(16).out_features(3)));
}

TEST(DeltaAdapters, LoadIntoASequentialOfAdaptersSetsTheirValuesInPlace) {
  // A Sequential runs its own list of modules: a loaded adapter must be that list's. Before, load
  // replaced the Sequential's child in name only, and its forward kept the old adapter. Adapters
  // with the saved options now take the values in place: the forward is the saved model's, and
  // the parameters keep their identity, so an optimizer built before the load trains the loaded
  // values.
  at::manual_seed(12);
  const DeltaLinearOptions o =
      DeltaLinearOptions(0, 0).rank(3).reflections(2).orthogonal_core(true);
  torch::nn::Sequential trained = sequential_of_adapters(o);
  torch::nn::Sequential fresh = sequential_of_adapters(o);
  copy_parameters(*trained, *fresh);  // the same bases
  const at::Tensor x = at::randn({5, 12}, at::kDouble);
  adamw_steps(
      trained->parameters(), [&] { return trained->forward(x).pow(2).sum(); }, 5);
  const at::Tensor expected = trained->forward(x).detach();
  std::vector<const void*> identity;
  for (const auto& p : fresh->parameters()) identity.push_back(p.unsafeGetTensorImpl());
  torch::optim::AdamW opt(fresh->parameters(), torch::optim::AdamWOptions(1e-2));
  ASSERT_FALSE(at::equal(fresh->forward(x), expected));
  fresh->forward(x).pow(2).sum().backward();  // gradients of the values about to be replaced
  const auto loaded = gwt::nn::load_delta_adapters(*fresh, *archive_of(adapter_bytes(*trained)));
  for (const auto& p : fresh->parameters()) EXPECT_FALSE(p.grad().defined());  // stale: reset
  ASSERT_EQ(loaded.size(), 2u);
  EXPECT_EQ(loaded[0].second.get(), fresh->ptr(0).get());
  EXPECT_EQ(loaded[1].second.get(), fresh->ptr(1).get());
  EXPECT_TRUE(at::equal(fresh->forward(x), expected));  // the same values, the same operations
  std::vector<const void*> after;
  for (const auto& p : fresh->parameters()) after.push_back(p.unsafeGetTensorImpl());
  EXPECT_EQ(after, identity);
  const at::Tensor u_before = loaded[0].second->U.detach().clone();
  opt.zero_grad();
  fresh->forward(x).pow(2).sum().backward();
  opt.step();
  EXPECT_FALSE(at::equal(loaded[0].second->U, u_before));  // the optimizer trains the loaded U
}

TEST(DeltaAdapters, LoadAndMergeRefuseToReplaceALayerInsideASequential) {
  at::manual_seed(13);
  torch::nn::Sequential adapted = sequential_of_adapters(DeltaLinearOptions(0, 0).rank(2));
  const std::string bytes = adapter_bytes(*adapted);
  // Onto plain Linear layers in a Sequential (which add_delta_adapters refuses to adapt), and onto
  // adapters of another rank: each would have to be replaced, which the Sequential would not see.
  torch::nn::Sequential plain(make_base(12, 16), make_base(16, 3));
  torch::nn::Sequential other = sequential_of_adapters(DeltaLinearOptions(0, 0).rank(3));
  for (torch::nn::Sequential* target : {&plain, &other}) {
    std::vector<std::pair<const void*, at::Tensor>> before;
    for (const auto& child : (*target)->children())
      for (const auto& p : child->parameters())
        before.emplace_back(child.get(), p.detach().clone());
    std::vector<bool> requires_grad;
    for (const auto& p : (*target)->parameters()) requires_grad.push_back(p.requires_grad());
    expect_error([&] { gwt::nn::load_delta_adapters(**target, *archive_of(bytes)); },
                 "layer '0' is inside a torch::nn::Sequential, which runs its own list of modules");
    expect_error([&] { gwt::nn::load_delta_adapters(**target, *archive_of(bytes)); },
                 "load onto DeltaLinear layers with the saved options there");
    size_t i = 0;
    for (const auto& child : (*target)->children())
      for (const auto& p : child->parameters()) {
        EXPECT_EQ(before[i].first, child.get());
        EXPECT_TRUE(at::equal(p, before[i].second));
        ++i;
      }
    std::vector<bool> requires_grad_after;
    for (const auto& p : (*target)->parameters()) requires_grad_after.push_back(p.requires_grad());
    EXPECT_EQ(requires_grad_after, requires_grad);
  }
  // Merging would replace the adapters in name only, too; in a ModuleList as well.
  expect_error([&] { gwt::nn::merge_delta_adapters(*adapted); },
               "gwt::nn::merge_delta_adapters: layer '0' is inside a torch::nn::Sequential");
  for (const auto& child : adapted->children())
    EXPECT_TRUE(std::dynamic_pointer_cast<gwt::nn::DeltaLinearImpl>(child) != nullptr);
  torch::nn::ModuleList list(DeltaLinear(make_base(4, 4), DeltaLinearOptions(4, 4).rank(1)),
                             make_base(4, 4));
  expect_error([&] { gwt::nn::merge_delta_adapters(*list); },
               "layer '0' is inside a torch::nn::ModuleList");
  EXPECT_TRUE(std::dynamic_pointer_cast<gwt::nn::DeltaLinearImpl>(list->ptr(0)) != nullptr);
  // A ModuleDict keeps its own list too: adding adapters there is refused.
  torch::nn::ModuleDict dict(
      std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
          {"q", make_base(4, 4).ptr()}});
  expect_error(
      [&] { gwt::nn::add_delta_adapters(*dict, DeltaLinearOptions(0, 0).rank(1), nullptr); },
      "layer 'q' is inside a torch::nn::ModuleDict");
  EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(dict["q"]) != nullptr);
}

TEST(DeltaAdapters, LoadRejectsARepeatedNameAndDrawsNoRandomNumbers) {
  at::manual_seed(15);
  Stack source = three_layers();
  gwt::nn::add_delta_adapters(*source, DeltaLinearOptions(0, 0).rank(2).reflections(2),
                              [](const std::string& name) { return name != "2"; });
  const std::string bytes = adapter_bytes(*source);
  // The same name twice (an archive written by hand): the second entry would be built on the
  // layer the first replaces.
  {
    torch::serialize::OutputArchive out;
    out.write("format", c10::IValue(std::string("gwt.DeltaAdapters.v1")));
    out.write("count", c10::IValue(int64_t{2}));
    for (int i = 0; i < 2; ++i) {
      torch::serialize::OutputArchive entry;
      entry.write("name", c10::IValue(std::string("1")));
      entry.write("in_features", c10::IValue(int64_t{16}));
      entry.write("out_features", c10::IValue(int64_t{16}));
      entry.write("rank", c10::IValue(int64_t{0}));
      entry.write("reflections", c10::IValue(int64_t{1}));
      entry.write("orthogonal_core", c10::IValue(false));
      entry.write("alpha", c10::IValue(0.0));
      entry.write("gram_schmidt", c10::IValue(false));
      entry.write("train_base", c10::IValue(false));
      entry.write("scaling", c10::IValue(1.0));
      entry.write("reflection_vectors", at::ones({16, 1}));
      out.write("adapter_" + std::to_string(i), entry);
    }
    std::ostringstream twice;
    out.save_to(twice);
    Stack target = three_layers();
    expect_error([&] { gwt::nn::load_delta_adapters(*target, *archive_of(twice.str())); },
                 "adapter '1' appears twice in the archive");
    EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(target->layer(1)) != nullptr);
    for (const auto& p : target->parameters()) EXPECT_TRUE(p.requires_grad());
  }
  // Building the replacements draws start values that the saved ones overwrite: the default
  // generator's state is put back, after a load and after a failed one.
  for (const bool fail : {false, true}) {
    Stack target = three_layers(fail ? 8 : 16);  // hidden 8: layer 1 has another shape
    at::manual_seed(16);
    const at::Tensor expected = at::rand({8});
    at::manual_seed(16);
    if (fail)
      EXPECT_THROW(gwt::nn::load_delta_adapters(*target, *archive_of(bytes)), c10::Error);
    else
      EXPECT_EQ(gwt::nn::load_delta_adapters(*target, *archive_of(bytes)).size(), 2u);
    EXPECT_TRUE(at::equal(at::rand({8}), expected)) << (fail ? "failed load" : "load");
  }
}

TEST(DeltaAdapters, LoadRejectsReflectionVectorsThatDefineNoReflection) {
  // A zero reflection vector (with gram_schmidt, one that is zero once the vectors before it are
  // projected out) has no reflection: its normalisation is 0 / 0, and every output of the layer
  // was NaN after such a load. Such archives are rejected, with nothing changed.
  at::manual_seed(14);
  struct Case {
    DeltaLinearOptions options;
    std::function<void(gwt::nn::DeltaLinearImpl&)> spoil;
    std::string words;
    bool nan_forward = true;  // what such values do to the forward
  };
  const std::vector<Case> cases = {
      {DeltaLinearOptions(0, 0).reflections(2),
       [](gwt::nn::DeltaLinearImpl& a) { a.reflections.select(1, 1).zero_(); },
       "reflection vectors include one whose reflection cannot be computed in Double (a zero "
       "vector"},
      {DeltaLinearOptions(0, 0).reflections(3).gram_schmidt(true),
       [](gwt::nn::DeltaLinearImpl& a) {
         // The third vector in the span of the first two, exactly in float64: 2 e0 + e1 after
         // the first two are made e0 and e1.
         a.reflections.zero_();
         a.reflections[0][0] = 1, a.reflections[1][1] = 1;
         a.reflections[0][2] = 2, a.reflections[1][2] = 1;
       },
       "reflection vectors include one whose reflection cannot be computed in Double (zero once "
       "the ones before it are projected out"},
      {DeltaLinearOptions(0, 0).rank(2).orthogonal_core(true),
       [](gwt::nn::DeltaLinearImpl& a) { a.core.select(1, 0).zero_(); },
       "core vectors include one whose reflection cannot be computed in Double (a zero vector"},
      // A norm that overflows normalises the vector to zero: the forward took that reflection for
      // the identity, without a word.
      {DeltaLinearOptions(0, 0).reflections(2),
       [](gwt::nn::DeltaLinearImpl& a) { a.reflections.select(1, 0).fill_(1e300); },
       "reflection vectors include one whose reflection cannot be computed in Double (a zero "
       "vector, or one whose norm under- or overflows)",
       /*nan_forward=*/false}};
  for (const auto& c : cases) {
    Stack source = three_layers();
    Stack target = three_layers();
    copy_parameters(*source, *target);
    const auto adapters = gwt::nn::add_delta_adapters(
        *source, c.options, [](const std::string& name) { return name == "1"; });
    {
      at::NoGradGuard no_grad;
      // A delta that is not zero, so that the core takes part.
      // (at::randn, not normal_(): GCC's -Wmaybe-uninitialized misfires on normal_'s default
      // generator argument in the sanitizer build.)
      at::Tensor& u = adapters[0].second.ptr()->U;
      if (u.defined()) u.copy_(at::randn(u.sizes(), u.options()));
      c.spoil(*adapters[0].second.ptr());
    }
    const at::Tensor x = at::randn({5, 12}, at::kDouble);
    if (c.nan_forward) {  // why
      EXPECT_FALSE(at::isfinite(source->forward(x)).all().item<bool>()) << c.words;
    }
    const at::Tensor before = target->forward(x);
    const std::string bytes = adapter_bytes(*source);
    expect_error([&] { gwt::nn::load_delta_adapters(*target, *archive_of(bytes)); },
                 "adapter '1''s " + c.words);
    EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(target->layer(1)) != nullptr);
    EXPECT_TRUE(target->layer(1)->parameters()[0].requires_grad());
    EXPECT_TRUE(at::equal(target->forward(x), before));
  }
}

TEST(DeltaAdapters, DiagnosticsMeasureTheFrozenWeightsGradientAndClip) {
  at::manual_seed(11);
  Stack model(std::vector<std::pair<int64_t, int64_t>>{{10, 6}});
  gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(3).reflections(2), nullptr);
  auto layer = model->layer(0)->as<gwt::nn::DeltaLinearImpl>();
  randomize_impl(*layer);
  const at::Tensor x = at::randn({7, 10}, at::kDouble), r = at::randn({7, 6}, at::kDouble);
  auto loss = [&] { return (model->forward(x) * r).sum(); };
  // Without clipping: the figures against dense derivatives written here. L = sum(r * y), so
  // dL/dW = r^T (x H^T) (the would-be gradient of the frozen W) and dL/dU = s r^T (x V).
  const auto d = gwt::nn::delta_diagnostics(*model, loss, 0.0);
  ASSERT_EQ(d.layers.size(), 1u);
  const at::Tensor h = dense_reflections(layer->reflections);
  const double grad_w = at::matmul(r.t(), at::matmul(x, h.t())).norm().item<double>();
  const double grad_u =
      (at::matmul(r.t(), at::matmul(x, layer->V)) * layer->scaling()).norm().item<double>();
  EXPECT_NEAR(d.layers[0].grad_w, grad_w, 1e-12 * grad_w);
  EXPECT_NEAR(d.layers[0].grad_u, grad_u, 1e-12 * grad_u);
  EXPECT_NEAR(d.layers[0].ratio, grad_u / grad_w, 1e-12 * grad_u / grad_w);
  EXPECT_FALSE(d.clipped);
  EXPECT_FALSE(layer->weight.requires_grad());  // frozen again
  EXPECT_FALSE(layer->weight.grad().defined());
  EXPECT_LE(d.max_orthogonality_error, 1e-12);
  EXPECT_NE(d.summary().find("1 adapters"), std::string::npos) << d.summary();
  // With clipping: fired, and the gradients left total clip_norm.
  const auto c = gwt::nn::delta_diagnostics(*model, loss, 1e-3);
  EXPECT_TRUE(c.clipped);
  EXPECT_NEAR(c.grad_norm, d.grad_norm, 1e-12 * d.grad_norm);  // the same step, measured again
  double total = 0;
  for (const auto& p : model->parameters())
    if (p.requires_grad() && p.grad().defined()) total += p.grad().pow(2).sum().item<double>();
  EXPECT_NEAR(std::sqrt(total), 1e-3, 1e-9);
  EXPECT_NE(c.summary().find("(clipped)"), std::string::npos);
}

// ------------------------------------------------------------------------------------------------
// Issue 38: whole-model functions.
// ------------------------------------------------------------------------------------------------

TEST(DeltaAdapters, AddChecksEveryLayerFirstAndCallsTheFilterOnce) {
  at::manual_seed(26);
  Stack model = three_layers();
  {
    // Layer 1's bias in another dtype: the constructor refuses it, and add_delta_adapters did not
    // check it first, so layer 0 was already replaced.
    at::NoGradGuard no_grad;
    auto l1 = model->layer(1)->as<torch::nn::LinearImpl>();
    l1->bias.set_data(l1->bias.to(at::kFloat));
  }
  std::map<std::string, int> calls;
  auto filter = [&](const std::string& name) {
    ++calls[name];
    return true;
  };
  expect_error(
      [&] { gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(2), filter); },
      "the base bias must be [16] with the weight's device and dtype");
  expect_untouched(*model);
  {
    at::NoGradGuard no_grad;
    auto l1 = model->layer(1)->as<torch::nn::LinearImpl>();
    l1->bias.set_data(l1->bias.to(at::kDouble));
  }
  calls.clear();
  EXPECT_EQ(gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(2), filter).size(),
            3u);
  EXPECT_EQ(calls, (std::map<std::string, int>{{"0", 1}, {"1", 1}, {"2", 1}}));
}

// A module with a parameter of its own named "U", next to an adapted layer.
struct WithOwnUImpl : torch::nn::Module {
  WithOwnUImpl() {
    U = register_parameter("U", at::randn({4}, at::kDouble));
    layer =
        register_module("layer", DeltaLinear(make_base(6, 4), DeltaLinearOptions(6, 4).rank(2)));
  }
  at::Tensor U;
  DeltaLinear layer{nullptr};
};

TEST(DeltaAdapters, ParamGroupsGoByModuleTypeNotByName) {
  // A parameter named U (or V, core, reflections) outside any DeltaLinear took the adapters' rate.
  auto model = std::make_shared<WithOwnUImpl>();
  const auto groups = gwt::nn::delta_param_groups(
      *model, 1e-2, [](double lr) { return std::make_unique<torch::optim::AdamWOptions>(lr); });
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_DOUBLE_EQ(groups[0].options().get_lr(), 1e-2);
  ASSERT_EQ(groups[0].params().size(), 1u);
  EXPECT_TRUE(groups[0].params()[0].is_same(model->U));
  EXPECT_DOUBLE_EQ(groups[1].options().get_lr(), 3e-2);
  EXPECT_EQ(groups[1].params().size(), 2u);
}

TEST(DeltaAdapters, ATrainedBaseTravelsWithItsAdapters) {
  // save_delta_adapters wrote the adapters of a train_base layer without the base they were
  // trained with: loaded onto the original base, the model computed something else.
  at::manual_seed(27);
  Stack model = three_layers();
  Stack fresh = three_layers();
  copy_parameters(*model, *fresh);
  gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(2).train_base(true),
                              [](const std::string& name) { return name == "1"; });
  const at::Tensor x = at::randn({5, 12}, at::kDouble);
  adamw_steps(
      model->parameters(), [&] { return model->forward(x).pow(2).sum(); }, 3);
  copy_parameters(*model->layer(0), *fresh->layer(0));  // not adapters: trained in `model` only
  copy_parameters(*model->layer(2), *fresh->layer(2));
  Stack again = three_layers();
  copy_parameters(*fresh, *again);
  gwt::nn::load_delta_adapters(*fresh, *archive_of(adapter_bytes(*model)));
  EXPECT_TRUE(at::equal(fresh->forward(x), model->forward(x)));
  // Through a file, read to a named device (the map location: CUDA-saved adapters load on the CPU).
  const std::string path = ::testing::TempDir() + "gwt_delta_train_base.pt";
  gwt::nn::save_delta_adapters(*model, path);
  gwt::nn::load_delta_adapters(*again, path, at::Device(at::kCPU));
  std::remove(path.c_str());
  EXPECT_TRUE(at::equal(again->forward(x), model->forward(x)));
}

}  // namespace
