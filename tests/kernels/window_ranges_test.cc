// BackendOptions::cpu_window_bytes and cpu_l2_bytes. LAPROX on the CPU computes the window rows in
// ranges when a worker may hold fewer bytes of probabilities than [G * w, n]. Every score must be
// the same float as with one range, for every GQA value mode, pool target and attention source
// (queries and keys, the engine's LSE, KVPRESS_COMPAT), and bad inputs must be refused alike.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cblas.h>

#include "absl/strings/str_cat.h"
#include "cpu/vector_ops.h"
#include "laprox/kernels/registry.h"
#include "tiny_model.h"

namespace laprox::kernels {
namespace {

using testing::TinyCase;

constexpr int L = 2, H = 6, Hkv = 2, d = 8, D = 24, kRows = 12;
constexpr int64_t kN = 150;

struct Variant {
  std::string name;
  PolicySpec policy;
  bool lse = false;
};

std::vector<Variant> Variants() {
  std::vector<Variant> variants;
  for (const GqaValue gqa : {GqaValue::kMeanHeadNorm, GqaValue::kSummedProjection,
                             GqaValue::kMeanHeadProduct, GqaValue::kExactBlock}) {
    for (const PoolTarget target : {PoolTarget::kAttention, PoolTarget::kScore}) {
      PolicySpec policy;
      policy.window = 10;
      policy.budget = Budget::TokensPerHead(40);
      policy.gqa_value = gqa;
      policy.pool_target = target;
      variants.push_back(
          {absl::StrCat("gqa", static_cast<int>(gqa), "_target", static_cast<int>(target)),
           policy});
    }
  }
  Variant lse = variants.front();
  lse.name = "lse";
  lse.lse = true;
  variants.push_back(lse);
  Variant compat = variants.front();
  compat.name = "kvpress_compat";
  compat.policy.numeric_mode = NumericMode::kKvpressCompat;
  variants.push_back(compat);
  return variants;
}

// The plan's scores with workers holding `window_bytes` of window probabilities.
absl::StatusOr<KeepPlan> Plan(TinyCase& c, const Variant& v, int64_t window_bytes,
                              std::vector<float>* lse_storage, int64_t l2_bytes = 0) {
  auto backend = CreateBackend(
      "cpu", {.threads = 2, .cpu_window_bytes = window_bytes, .cpu_l2_bytes = l2_bytes});
  if (!backend.ok()) return backend.status();
  PrepareOptions prepare;
  prepare.cross_grams = true;
  auto model = (*backend)->PrepareModel(c.geometry, c.OProjViews(), prepare);
  if (!model.ok()) return model.status();
  c.policy = v.policy;
  KeepPlanRequest request = c.Request();
  request.outputs.scores = true;
  if (v.lse) {
    // The true log-sum-exp of each window row's causal logits: scale * q . k over k <= row.
    lse_storage->assign(H * kRows, 0.f);
    const double scale = c.geometry.EffectiveScale();
    for (int l = 0; l < L; ++l) {
      for (int h = 0; h < H; ++h) {
        for (int r = 0; r < kRows; ++r) {
          const int64_t last = kN - kRows + r;
          double max = -1e300, sum = 0.0;
          std::vector<double> logits(last + 1);
          for (int64_t j = 0; j <= last; ++j) {
            double dot = 0.0;
            for (int k = 0; k < d; ++k) {
              dot += double{c.queries[l][(h * kRows + r) * d + k]} *
                     c.keys[l][((h / (H / Hkv)) * kN + j) * d + k];
            }
            logits[j] = scale * dot;
            max = std::max(max, logits[j]);
          }
          for (const double x : logits) sum += std::exp(x - max);
          (*lse_storage)[h * kRows + r] = static_cast<float>(max + std::log(sum));
        }
      }
      request.layers[l].window_lse = TensorView(lse_storage->data(), DType::kF32, {H, kRows});
    }
  }
  return (*backend)->ComputeKeepPlan(**model, request);
}

TEST(WindowRangesTest, RangesGiveTheSameScoresAsOnePass) {
  for (const Variant& v : Variants()) {
    TinyCase c(L, H, Hkv, d, D, kN, kRows);
    c.Randomize(5);
    std::vector<float> lse_one, lse_ranged;
    const absl::StatusOr<KeepPlan> one = Plan(c, v, int64_t{1} << 40, &lse_one);
    ASSERT_TRUE(one.ok()) << v.name << ": " << one.status();
    // 3 heads * 150 tokens * 4 bytes * 4 rows: ranges of 4, 3 and 3 window rows; 1: one row each.
    for (const int64_t bytes : {int64_t{3 * kN * 4 * 4}, int64_t{1}}) {
      const absl::StatusOr<KeepPlan> ranged = Plan(c, v, bytes, &lse_ranged);
      ASSERT_TRUE(ranged.ok()) << v.name << ": " << ranged.status();
      ASSERT_EQ(one->scores.size(), ranged->scores.size());
      for (size_t i = 0; i < one->scores.size(); ++i) {
        ASSERT_EQ(one->scores[i], ranged->scores[i])
            << v.name << ", window_bytes " << bytes << ", entry " << i;
      }
      EXPECT_EQ(one->positions, ranged->positions) << v.name;
    }
  }
}

// Whether every product of variant `v` comes from laprox's own kernels (cpu/logits.h where the
// CPU has AVX-512F, cpu/triangular.h), whose bits do not depend on how rows are chunked. The
// rest go through OpenBLAS's sgemm: EXACT_BLOCK's cross forms, CRITICAL_ADAKV's V W_O^h, and
// the logits without AVX-512F. OpenBLAS does not promise the same bits for a row whatever the
// matrix around it: with OPENBLAS_CORETYPE=Haswell (a user's choice laproxd keeps) an
// EXACT_BLOCK score differs in its last bit between chunk sizes.
bool OwnKernelsOnly(const Variant& v) {
  return cpu::UseAvx512() && v.policy.gqa_value != GqaValue::kExactBlock &&
         v.policy.kind != PolicyKind::kCriticalAdaKv;
}

// BackendOptions::cpu_l2_bytes sizes the chunks of keys and values (cpu/window.h): 1 byte gives
// the smallest chunks (128 or 1024 keys, 32 values: several over 150 tokens), 2^40 one chunk.
// Chunks only split the work: where laprox's own kernels compute (OwnKernelsOnly), every score
// is the same float; where OpenBLAS's sgemm does, every score is within 1e-6 relative (a few
// fp32 ulp) and the kept positions are the same.
TEST(WindowRangesTest, ChunkSizesGiveTheSameScores) {
  std::vector<Variant> variants = Variants();
  Variant baseline = variants.front();
  baseline.name = "critical_adakv";
  baseline.policy = PolicySpec();
  baseline.policy.kind = PolicyKind::kCriticalAdaKv;
  baseline.policy.window = 10;
  baseline.policy.budget = Budget::TokensPerHead(40);
  variants.push_back(baseline);
  for (const Variant& v : variants) {
    TinyCase c(L, H, Hkv, d, D, kN, kRows);
    c.Randomize(8);
    std::vector<float> lse_one, lse_chunked;
    const absl::StatusOr<KeepPlan> one = Plan(c, v, int64_t{1} << 40, &lse_one, int64_t{1} << 40);
    ASSERT_TRUE(one.ok()) << v.name << ": " << one.status();
    const absl::StatusOr<KeepPlan> chunked = Plan(c, v, int64_t{1} << 40, &lse_chunked, 1);
    ASSERT_TRUE(chunked.ok()) << v.name << ": " << chunked.status();
    ASSERT_EQ(one->scores.size(), chunked->scores.size());
    const bool exact = OwnKernelsOnly(v);
    for (size_t i = 0; i < one->scores.size(); ++i) {
      if (exact || one->scores[i] == chunked->scores[i]) {  // forced tokens: +inf in both
        ASSERT_EQ(one->scores[i], chunked->scores[i]) << v.name << ", entry " << i;
      } else {
        ASSERT_NEAR(one->scores[i], chunked->scores[i], 1e-6f * std::abs(one->scores[i]))
            << v.name << " (OpenBLAS " << openblas_get_corename() << "), entry " << i;
      }
    }
    EXPECT_EQ(one->positions, chunked->positions) << v.name;
  }
}

TEST(WindowRangesTest, ABadQueryInALaterRangeIsRefusedAlike) {
  TinyCase c(L, H, Hkv, d, D, kN, kRows);
  c.Randomize(6);
  c.queries[1][(4 * kRows + kRows - 1) * d + 3] = std::nanf("");  // head 4, the last window row
  std::vector<float> unused;
  const Variant v = Variants().front();
  const absl::StatusOr<KeepPlan> one = Plan(c, v, int64_t{1} << 40, &unused);
  const absl::StatusOr<KeepPlan> ranged = Plan(c, v, 1, &unused);
  ASSERT_FALSE(one.ok());
  EXPECT_EQ(one.status(), ranged.status());
}

TEST(WindowRangesTest, ABadKeyWithTheEnginesAttentionIsRefusedAlike) {
  // With the engine's attention rows the keys are only checked, once, with the first range.
  TinyCase c(L, H, Hkv, d, D, kN, kRows);
  c.Randomize(7);
  std::vector<float> attention(H * kRows * kN, 1.f / kN);
  std::vector<float> unused;
  for (const int64_t bytes : {int64_t{1} << 40, int64_t{1}}) {
    auto backend = CreateBackend("cpu", {.threads = 2, .cpu_window_bytes = bytes});
    ASSERT_TRUE(backend.ok());
    auto model = (*backend)->PrepareModel(c.geometry, c.OProjViews());
    ASSERT_TRUE(model.ok());
    c.policy = Variants().front().policy;
    KeepPlanRequest request = c.Request();
    for (auto& layer : request.layers) {
      layer.window_queries = TensorView();
      layer.window_attention = TensorView(attention.data(), DType::kF32, {H, kRows, kN});
    }
    EXPECT_TRUE((*backend)->ComputeKeepPlan(**model, request).ok()) << bytes;
    c.keys[1][(1 * kN + 99) * d + 2] = std::nanf("");
    EXPECT_THAT((*backend)->ComputeKeepPlan(**model, request).status().message(),
                ::testing::HasSubstr("layers[1].keys"))
        << bytes;
    c.keys[1][(1 * kN + 99) * d + 2] = 0.5f;
  }
}

}  // namespace
}  // namespace laprox::kernels
