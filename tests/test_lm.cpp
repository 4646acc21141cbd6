// The pieces of examples/train_lm that can be tested quickly: the model, the data split, the
// schedule, the report writers and the user errors.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "gwt/gwt.h"
#include "lm.h"

namespace {

lm::ModelConfig small_config() {
  return {256, 32, 2, 2, 64, 16};
}

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "gwt_lm_" + std::to_string(::getpid()) + "_" + name;
}

template <typename Fn>
void expect_input_error(Fn&& fn, const std::string& words) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning '" << words << "'";
  } catch (const lm::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "not one line: " << e.what();
  }
}

TEST(LanguageModel, ForwardShapes) {
  at::manual_seed(0);
  lm::Decoder model(small_config());
  const at::Tensor tokens = at::randint(0, 256, {3, 16}, at::kLong);
  EXPECT_EQ(model->forward(tokens).sizes(), (std::vector<int64_t>{3, 16, 256}));
  EXPECT_EQ(model->forward(tokens.narrow(1, 0, 5)).sizes(), (std::vector<int64_t>{3, 5, 256}));
}

TEST(LanguageModel, CausalMaskingHidesTheFuture) {
  at::manual_seed(1);
  lm::Decoder model(small_config());
  at::NoGradGuard no_grad;
  at::Tensor tokens = at::randint(0, 256, {2, 16}, at::kLong);
  const at::Tensor before = model->forward(tokens);
  tokens[0][10] = (tokens[0][10].item<int64_t>() + 1) % 256;
  const at::Tensor after = model->forward(tokens);
  EXPECT_TRUE(at::equal(before[0].narrow(0, 0, 10), after[0].narrow(0, 0, 10)));
  EXPECT_FALSE(at::allclose(before[0].narrow(0, 10, 6), after[0].narrow(0, 10, 6)));
  EXPECT_TRUE(at::equal(before[1], after[1]));
}

TEST(LanguageModel, PaperGroupingKeepsEmbeddingHeadAndNormsDense) {
  lm::Decoder model(small_config());
  for (const auto& a : gwt::assign_param_groups(*model)) {
    const bool projection = a.name.find("_proj.weight") != std::string::npos;
    EXPECT_EQ(a.wavelet, projection) << a.name;
  }
}

TEST(LanguageModel, WaveletStateIsAtMost35PercentOfAdamW) {
  const lm::Preset tiny = lm::preset("tiny");
  at::manual_seed(2);
  lm::Decoder a(tiny.model), b(tiny.model);
  auto adamw = lm::make_optimizer(lm::optimizer_spec("adamw"), a);
  auto wavelet = lm::make_optimizer(lm::optimizer_spec("wavelet-haar-l2"), b);
  for (auto* m : {&a, &b}) {
    const at::Tensor tokens = at::randint(0, 256, {2, 9}, at::kLong);
    (*m)->forward(tokens.narrow(1, 0, 8)).sum().backward();
  }
  adamw->step(), wavelet->step();
  const auto [adamw_bytes, adamw_wavelet] = lm::state_bytes(*adamw);
  const auto [wavelet_bytes, wavelet_part] = lm::state_bytes(*wavelet);
  EXPECT_EQ(adamw_wavelet, 0);
  EXPECT_GT(wavelet_part, 0);
  EXPECT_LE(static_cast<double>(wavelet_bytes), 0.35 * static_cast<double>(adamw_bytes));
}

TEST(LanguageModel, FoamFoldsTheProjectionsIntoAQuarterOfTheirState) {
  // foam-l2: gwt::foam_param_groups folds the projections (one moment pair per block of 4 along
  // each row), and the rest is dense Adam.
  const lm::Preset tiny = lm::preset("tiny");
  at::manual_seed(2);
  lm::Decoder model(tiny.model);
  auto foam = lm::make_optimizer(lm::optimizer_spec("foam-l2"), model);
  const at::Tensor tokens = at::randint(0, 256, {2, 9}, at::kLong);
  model->forward(tokens.narrow(1, 0, 8)).sum().backward();
  foam->step();
  int64_t expected = 0;
  for (const auto& a : gwt::assign_param_groups(*model))
    if (a.wavelet) {
      const int64_t n = a.param.size(-1), rows = a.param.numel() / n;
      expected += 2 * rows * ((n + 3) / 4) * static_cast<int64_t>(sizeof(float));
    }
  const auto [bytes, folded] = lm::state_bytes(*foam);
  EXPECT_GT(folded, 0);
  EXPECT_EQ(folded, expected);
  EXPECT_GT(bytes, folded);  // the dense group's full moments
}

TEST(LanguageModelData, SplitIsDeterministicDisjointAndComplete) {
  std::string text;
  for (int i = 0; i < 100; ++i)
    text += "fortune number " + std::to_string(i) + "\nsecond line\n%\n";
  const lm::Corpus a = lm::split_corpus(text), b = lm::split_corpus(text);
  EXPECT_EQ(a.documents, 100);
  EXPECT_EQ(a.train, b.train);
  EXPECT_EQ(a.val, b.val);
  // Every 20th document validates: 0, 20, 40, 60, 80.
  for (int i = 0; i < 100; ++i) {
    const std::string doc = "fortune number " + std::to_string(i) + "\n";
    const bool in_val = a.val.find(doc) != std::string::npos,
               in_train = a.train.find(doc) != std::string::npos;
    EXPECT_NE(in_val, in_train) << i;
    EXPECT_EQ(in_val, i % 20 == 0) << i;
  }
  EXPECT_EQ(a.train.size() + a.val.size(), text.size() - 100 * 2);  // the "%\n" separators
}

TEST(LanguageModelData, BatchesAndValidationWindowsRepeat) {
  std::string text(5000, 'a');
  for (size_t i = 0; i < text.size(); ++i) text[i] = static_cast<char>('a' + i % 26);
  lm::Batches x(text, 4, 32, 7), y(text, 4, 32, 7);
  const at::Tensor bx = x.next(), by = y.next();
  EXPECT_EQ(bx.sizes(), (std::vector<int64_t>{4, 33}));
  EXPECT_TRUE(at::equal(bx, by));
  EXPECT_FALSE(at::equal(x.next(), bx));
  EXPECT_TRUE(at::equal(lm::validation_windows(text, 32, 8), lm::validation_windows(text, 32, 8)));
}

TEST(LanguageModelData, CorpusErrorsAreOneLine) {
  expect_input_error([] { lm::load_corpus("/nonexistent/corpus.txt", 16); }, "does not exist");
  const std::string empty = temp_path("empty.txt");
  std::ofstream(empty) << "\n\n";
  expect_input_error([&] { lm::load_corpus(empty, 16); }, "is empty");
  const std::string small = temp_path("small.txt");
  std::ofstream(small) << "just a few words";
  expect_input_error([&] { lm::load_corpus(small, 16); }, "too small");
  std::remove(empty.c_str()), std::remove(small.c_str());
}

TEST(LanguageModelData, UnlistableCorpusDirectoryIsAnInputError) {
  // fs::directory_iterator threw std::filesystem::filesystem_error, which main() does not catch.
  // A directory with no permissions cannot be listed except by root; for root, /proc/1/map_files
  // needs CAP_SYS_ADMIN. The test uses the first of them that this process really cannot open.
  const std::string locked = temp_path("locked_corpus");
  std::filesystem::create_directories(locked);
  std::filesystem::permissions(locked, std::filesystem::perms::none);
  std::string unlistable;
  for (const std::string& dir : {locked, std::string("/proc/1/map_files")}) {
    std::error_code ec;
    std::filesystem::directory_iterator probe(dir, ec);
    if (ec && std::filesystem::is_directory(dir, ec)) {
      unlistable = dir;
      break;
    }
  }
  if (!unlistable.empty())
    expect_input_error([&] { lm::load_corpus(unlistable, 16); }, "cannot be listed");
  std::filesystem::permissions(locked, std::filesystem::perms::owner_all);
  std::filesystem::remove_all(locked);
  if (unlistable.empty()) GTEST_SKIP() << "every candidate directory can be listed by this process";
}

TEST(LanguageModelData, DefaultCorpusIsTheFortunesText) {
  if (!std::filesystem::exists(lm::default_corpus_dir()))
    GTEST_SKIP() << "Debian's fortunes package is not installed (scripts/setup.sh installs it)";
  const lm::Corpus c = lm::load_corpus("", 128);
  EXPECT_GT(c.documents, 1000);
  EXPECT_GT(c.train.size(), 19 * c.val.size() / 2);
}

TEST(LanguageModelData, ParagraphCorpusKeepsEachParagraphOnceAndSkipsLinks) {
  namespace fs = std::filesystem;
  const std::string dir = temp_path("licences");
  fs::create_directories(dir);
  {
    std::ofstream a(dir + "/A-1.0");  // a name with an extension, as Debian's licences have
    for (int i = 0; i < 40; ++i) a << "clause " << i << " of A\nsecond line\n\n";
    std::ofstream b(dir + "/B");  // repeats A's clause 3 with other white space, then its own
    b << "clause  3 of A\n  second line\n\n";
    for (int i = 0; i < 20; ++i) b << "clause " << i << " of B\n\n\n";
  }
  fs::create_symlink(dir + "/A-1.0", dir + "/C");  // Debian's GPL -> GPL-3: the same text
  const lm::Corpus c = lm::load_paragraph_corpus(dir, 8);
  EXPECT_EQ(c.documents, 60);  // 40 of A, 20 of B; neither the repeat nor the link's copy
  auto count = [](const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  // Documents 0, 20, 40 (A's clauses 0 and 20, B's clause 0) validate; each paragraph is in one
  // split, once, followed by a blank line.
  for (int i = 0; i < 40; ++i) {
    const std::string p = "clause " + std::to_string(i) + " of A\nsecond line\n\n";
    EXPECT_EQ(count(c.val, p), i % 20 == 0 ? 1u : 0u) << i;
    EXPECT_EQ(count(c.train, p), i % 20 == 0 ? 0u : 1u) << i;
  }
  EXPECT_EQ(count(c.val, "clause 0 of B\n\n"), 1u);
  EXPECT_EQ(count(c.train + c.val, "clause  3"), 0u);
  expect_input_error([&] { lm::load_paragraph_corpus(dir + "/none", 8); }, "does not exist");
  expect_input_error([&] { lm::load_paragraph_corpus(dir, 1000); }, "too small");
  fs::remove_all(dir);
}

TEST(LanguageModelFinetune, AdaptersStartAtTheBaseAndOnlyTheyTrain) {
  at::manual_seed(3);
  lm::Decoder base(small_config());
  const at::Tensor tokens = at::randint(0, 256, {2, 16}, at::kLong);
  at::Tensor expected;
  {
    at::NoGradGuard no_grad;
    expected = base->forward(tokens);
  }
  for (const auto& name : lm::finetune_method_names()) {
    SCOPED_TRACE(name);
    const lm::FinetuneSpec spec = lm::finetune_spec(name);
    lm::Decoder model(small_config());
    {
      at::NoGradGuard no_grad;
      auto to = model->parameters();
      auto from = base->parameters();
      for (size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
    }
    const auto adapters = lm::add_adapters(model, spec);
    // 2 blocks x (q, k, v, o, gate, up, down); none for full fine-tuning.
    EXPECT_EQ(adapters.size(), spec.full ? 0u : 14u);
    at::Tensor start;
    {
      at::NoGradGuard no_grad;
      start = model->forward(tokens);
    }
    if (spec.reflections == 0) {
      // U starts at zero: the delta adds exactly 0, so the adapted model computes what its base
      // does.
      EXPECT_TRUE(at::equal(start, expected));
    } else {
      // Paired reflections multiply to I up to rounding: each H_{2j} H_{2j+1} x is x to a few
      // float32 ulps of |x|, and the logits are O(1) (std 0.02 weights); 1e-4 leaves a margin of
      // ~100x over the float32 error through two blocks.
      EXPECT_TRUE(at::allclose(start, expected, 1e-4, 1e-4));
    }
    int64_t trainable = 0;
    for (const auto& item : model->named_parameters())
      if (item.value().requires_grad()) {
        ++trainable;
        const std::string last = item.key().substr(item.key().rfind('.') + 1);
        if (!spec.full) {
          EXPECT_TRUE(last == "U" || last == "V" || last == "reflections" || last == "core")
              << item.key();
        }
      }
    EXPECT_GT(lm::trainable_parameters(model), 0);
    if (spec.full) {
      EXPECT_EQ(trainable, static_cast<int64_t>(model->parameters().size()));
    }

    auto opt = lm::make_finetune_optimizer(spec, model, 1e-2);
    const at::Tensor frozen = model->named_parameters()["embed.weight"].clone();
    for (int step = 0; step < 3; ++step) {
      opt->zero_grad();
      const at::Tensor logits = model->forward(tokens.narrow(1, 0, 15));
      at::cross_entropy_loss(logits.reshape({-1, 256}), tokens.narrow(1, 1, 15).reshape({-1}))
          .backward();
      opt->step();
    }
    at::NoGradGuard no_grad;
    // The adapters train (the output moves); for adapters the rest stays as it was, bit for bit.
    EXPECT_FALSE(at::allclose(model->forward(tokens), expected));
    EXPECT_EQ(at::equal(model->named_parameters()["embed.weight"], frozen), !spec.full);
  }
}

TEST(LanguageModelRun, UnknownPresetOptimizerAndUnwritableDirectory) {
  expect_input_error([] { lm::preset("huge"); }, "unknown preset 'huge'; valid presets are tiny");
  expect_input_error([] { lm::finetune_spec("qlora"); },
                     "unknown method 'qlora'; valid methods are full-adamw");
  expect_input_error([] { lm::optimizer_spec("sgd"); },
                     "unknown optimizer 'sgd'; valid optimizers are adamw");
  expect_input_error([] { lm::ensure_writable_dir("/proc/gwt-results"); }, "not writable");
}

TEST(LanguageModelRun, CosineScheduleWarmsUpAndFloorsAtATenth) {
  EXPECT_DOUBLE_EQ(lm::cosine_lr(1.0, 0, 10, 100), 0.1);
  EXPECT_DOUBLE_EQ(lm::cosine_lr(1.0, 9, 10, 100), 1.0);
  EXPECT_DOUBLE_EQ(lm::cosine_lr(1.0, 10, 10, 100), 1.0);
  EXPECT_NEAR(lm::cosine_lr(1.0, 55, 10, 100), 0.55, 1e-12);
  EXPECT_NEAR(lm::cosine_lr(1.0, 100, 10, 100), 0.1, 1e-12);
}

TEST(LanguageModelReport, CsvRoundTripAndTable) {
  const std::string csv = temp_path("run.csv"), summary = temp_path("run.summary");
  const std::vector<lm::EvalPoint> points = {{50, 0.003, 2.5, 2.4, 10.0},
                                             {100, 0.001, 2.1, 2.0, 20.5}};
  lm::write_csv(csv, points);
  const auto back = lm::read_csv(csv);
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[1].step, 100);
  EXPECT_DOUBLE_EQ(back[1].val_loss, 2.0);
  std::ifstream in(csv);
  std::string header;
  std::getline(in, header);
  EXPECT_EQ(header, "step,lr,train_loss,val_loss,val_ppl,seconds");

  lm::RunSummary adamw{"adamw", "AdamW", 0.003,     1,    2.0, std::exp(2.0),
                       8000,    0,       100 << 20, 50.0, 100};
  lm::RunSummary wavelet{"wavelet-haar-l2",
                         "WaveletAdam haar L=2",
                         0.003,
                         1,
                         2.02,
                         std::exp(2.02),
                         2400,
                         1600,
                         90 << 20,
                         40.0,
                         100};
  lm::write_summary(summary, wavelet);
  const lm::RunSummary read = lm::read_summary(summary);
  EXPECT_EQ(read.label, wavelet.label);
  EXPECT_EQ(read.state_bytes, 2400);
  const std::string table = lm::results_table({adamw, read});
  EXPECT_NE(table.find("| AdamW | 0.003 | 1 | 2.0000 |"), std::string::npos) << table;
  EXPECT_NE(table.find("+1.00%"), std::string::npos) << table;
  EXPECT_NE(table.find("30.0%"), std::string::npos) << table;
  std::remove(csv.c_str()), std::remove(summary.c_str());
}

}  // namespace
