// Building blocks checked against straightforward definitions: 16-bit float conversion, view
// extents, the exact threshold select, budget arithmetic and the vectorised element loops.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/half.h"
#include "cpu/vector_ops.h"
#include "cpu/window.h"
#include "laprox/kernels/tensor_view.h"
#include "policy/budget.h"
#include "policy/select.h"

namespace laprox::kernels {
namespace {

// IEEE binary16 by its definition: sign, 5-bit exponent (bias 15), 10-bit mantissa.
double F16ByDefinition(uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  if (exponent == 0x1f) return mantissa ? std::nan("") : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

TEST(HalfTest, F16ConversionsAreExactForEveryPattern) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const double expected = F16ByDefinition(h);
    const float got = F16ToFloat(h);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << bits;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), expected) << bits;
    EXPECT_EQ(FloatToF16(got), h) << bits;  // round trip
  }
}

TEST(HalfTest, FloatToF16RoundsToNearestEven) {
  // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: ties to even (1.0 = 0x3c00).
  EXPECT_EQ(FloatToF16(1.f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(FloatToF16(1.f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_EQ(FloatToF16(65519.f), 0x7bff);   // largest finite
  EXPECT_EQ(FloatToF16(65520.f), 0x7c00);   // halfway to 2^16: infinity
  EXPECT_EQ(FloatToF16(0x1p-25f), 0x0000);  // half the smallest subnormal: ties to zero
  EXPECT_EQ(FloatToF16(3 * 0x1p-25f), 0x0002);
  EXPECT_EQ(FloatToF16(-0x1p-14f), 0x8400);  // smallest normal
}

TEST(HalfTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(FloatToBf16(1.00390625f), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1.0078125 (odd) and 1.015625 (even).
  EXPECT_EQ(FloatToBf16(1.01171875f), 0x3f82);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-2.5f)), -2.5f);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
}

TEST(TensorViewTest, ExtentOfStridedViews) {
  int64_t extent = 0;
  ASSERT_TRUE(TensorView(nullptr, DType::kF32, {2, 3, 4}).ElementExtent(&extent).ok());
  EXPECT_EQ(extent, 24);
  // [n, Hkv, d] memory seen as [Hkv, n, d]: strides {d, Hkv*d, 1}.
  ASSERT_TRUE(TensorView(nullptr, DType::kBF16, {2, 5, 4}, {4, 8, 1}).ElementExtent(&extent).ok());
  EXPECT_EQ(extent, 40);
  ASSERT_TRUE(TensorView(nullptr, DType::kF32, {3, 0}).ElementExtent(&extent).ok());
  EXPECT_EQ(extent, 0);
  const int64_t big = std::numeric_limits<int64_t>::max() / 2;
  EXPECT_EQ(TensorView(nullptr, DType::kF32, {4}, {big}).ElementExtent(&extent).code(),
            absl::StatusCode::kOutOfRange);
}

TEST(SelectTest, PartitionBestMatchesFullSortWithTies) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> few_values(0, 9);  // many ties
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<policy::ScoredToken> tokens(1 + rng() % 300);
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = {static_cast<float>(few_values(rng)), static_cast<uint32_t>(rng() % 100000)};
    }
    std::vector<policy::ScoredToken> sorted = tokens;
    std::sort(sorted.begin(), sorted.end(), policy::SelectedBefore);
    const int64_t k = rng() % (tokens.size() + 2);
    policy::PartitionBest(absl::MakeSpan(tokens), k);
    const int64_t kept = std::min<int64_t>(k, tokens.size());
    std::vector<uint64_t> got, want;
    for (int64_t i = 0; i < kept; ++i) {
      got.push_back(uint64_t{tokens[i].index} << 8 | static_cast<uint64_t>(tokens[i].score));
      want.push_back(uint64_t{sorted[i].index} << 8 | static_cast<uint64_t>(sorted[i].score));
    }
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want) << "trial " << trial << " k " << k;
  }
}

TEST(BudgetTest, DerivesWindowSinksAndQuota) {
  PolicySpec p;
  p.window = 32;
  p.sinks = 4;
  p.budget = Budget::TokensPerHead(128);
  RequestShape s{.n = 1000, .window_rows = 32};
  policy::DeriveBudget(p, s);
  EXPECT_EQ(s.window, 32);
  EXPECT_EQ(s.sinks, 4);
  EXPECT_EQ(s.candidates, 964);
  EXPECT_EQ(s.quota, 92);

  s = {.n = 20, .window_rows = 32};  // n < w: all window, no sinks, no candidates
  policy::DeriveBudget(p, s);
  EXPECT_EQ(s.window, 20);
  EXPECT_EQ(s.sinks, 0);
  EXPECT_EQ(s.candidates, 0);
  EXPECT_EQ(s.quota, 0);

  EXPECT_EQ(policy::BudgetTokensPerHead(Budget::CompressionRatio(0.9), 1000), 99);
  EXPECT_EQ(policy::BudgetTokensPerHead(Budget::CompressionRatio(0.0), 1000), 1000);
  EXPECT_EQ(policy::BudgetTokensPerHead(Budget::CompressionRatio(0.5), 7), 3);
}

// Every vector op runs twice: the AVX2 version (where the CPU has it) and the portable one.
class VectorOpsTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { cpu::ForcePortableVectorOps(GetParam()); }
  void TearDown() override { cpu::ForcePortableVectorOps(false); }
};
INSTANTIATE_TEST_SUITE_P(Isa, VectorOpsTest, ::testing::Values(false, true),
                         [](const auto& param_info) {
                           return param_info.param ? "Portable" : "Best";
                         });

TEST_P(VectorOpsTest, ExpShiftedMatchesLibm) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-100.f, 20.f);
  std::vector<float> x(1000);
  for (float& v : x) v = u(rng);
  std::vector<float> y = x;
  const double sum = cpu::ExpShiftedInPlace(y.data(), static_cast<int64_t>(y.size()));
  const float max = *std::max_element(x.begin(), x.end());
  double want_sum = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    // The shift itself is an fp32 subtraction, as in any fp32 softmax; the exp is what is tested.
    const double want = std::exp(static_cast<double>(x[i] - max));
    want_sum += want;
    if (x[i] - max > -80.f) {
      EXPECT_NEAR(y[i], want, 3e-7 * want) << x[i];
    }
  }
  EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum);
}

// The AVX-512 versions compute lane by lane what the AVX2 ones do and add in the same order: the
// same bits, at every length (full blocks of 256, vectors of 16 and of 8, scalar tails).
TEST(VectorOpsIsaTest, Avx512GivesTheAvx2Bits) {
  if (!cpu::UseAvx512()) GTEST_SKIP() << "no AVX-512F on this CPU";
  std::mt19937 rng(17);
  // Exps of similar size, so that adding in another order changes the sum's last bits.
  std::uniform_real_distribution<float> u(-4.f, 4.f);
  std::normal_distribution<float> normal(0.f, 1.f);
  const auto both = [](auto&& run) {
    const auto avx2 = [&] {
      const cpu::ScopedAvx2Limit limit;
      return run();
    }();
    return std::make_pair(avx2, run());
  };
  for (int64_t len : {1, 7, 8, 9, 15, 16, 17, 24, 31, 255, 256, 257, 264, 272, 1000, 4099}) {
    std::vector<float> x(len);
    for (float& v : x) v = u(rng);
    const auto [exp2, exp512] = both([&] {
      std::vector<float> y = x;
      const double sum = cpu::ExpShiftedInPlace(y.data(), len);
      return std::make_pair(y, sum);
    });
    EXPECT_EQ(exp2.first, exp512.first) << len;
    EXPECT_EQ(exp2.second, exp512.second) << len;

    std::vector<float> rows(3 * len), acc(len);
    for (float& v : rows) v = normal(rng);
    for (float& v : acc) v = normal(rng);
    const float* row_ptrs[3] = {rows.data(), rows.data() + len, rows.data() + 2 * len};
    const float scales[3] = {0.3f, -1.7f, 2.9f};
    const auto [acc2, acc512] = both([&] {
      std::vector<float> out = acc;
      cpu::AccumulateSquaredSum(row_ptrs, scales, 3, len, out.data());
      return out;
    });
    EXPECT_EQ(acc2, acc512) << len;
  }
}

TEST_P(VectorOpsTest, SumsAndDotsMatchDouble) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t len : {1, 7, 8, 9, 64, 129, 1000}) {
    std::vector<float> a(len), b(len), acc(len, 0.5f), rows(3 * len);
    for (float& v : a) v = normal(rng);
    for (float& v : b) v = normal(rng);
    for (float& v : rows) v = normal(rng);
    double dot = 0.0;
    for (int64_t k = 0; k < len; ++k) dot += double{a[k]} * b[k];
    EXPECT_NEAR(cpu::Dot(a.data(), b.data(), len), dot, 1e-5 * len);

    const float* row_ptrs[3] = {rows.data(), rows.data() + len, rows.data() + 2 * len};
    const float scales[3] = {0.5f, -2.f, 3.f};
    cpu::AccumulateSquaredSum(row_ptrs, scales, 3, len, acc.data());
    cpu::AccumulateProduct(a.data(), b.data(), 2.f, len, acc.data());
    for (int64_t i = 0; i < len; ++i) {
      double s = 0.0;
      for (int r = 0; r < 3; ++r) s += double{scales[r]} * row_ptrs[r][i];
      const double want = 0.5 + s * s + 2.0 * a[i] * b[i];
      EXPECT_NEAR(acc[i], want, 1e-5 * (1 + std::abs(want))) << len << " " << i;
    }
  }
}

TEST_P(VectorOpsTest, MaxAbsFindsTheLargestMagnitudeAndNonFinite) {
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t len : {0, 1, 7, 8, 15, 16, 17, 100}) {
    for (int64_t at = 0; at < len; at += 5) {
      std::vector<float> x(len);
      for (float& v : x) v = normal(rng);
      x[at] = -1e30f;
      EXPECT_EQ(cpu::MaxAbs(x.data(), len), 1e30f) << len << " " << at;
      x[at] = std::numeric_limits<float>::infinity();
      EXPECT_EQ(cpu::MaxAbs(x.data(), len), std::numeric_limits<float>::infinity());
      x[at] = -std::nanf("");
      EXPECT_TRUE(std::isnan(cpu::MaxAbs(x.data(), len)));
    }
  }
  EXPECT_EQ(cpu::MaxAbs(nullptr, 0), 0.f);
}

// exp(x - shift) is capped at 1: an engine LSE below a logit gives probability 1, not e^88.
TEST_P(VectorOpsTest, ExpInPlaceIsAtMostOne) {
  std::vector<float> x = {-3.f, 0.f, 2.f, 50.f, 3e38f, -3e38f, 1.f, 0.5f, 100.f};
  cpu::ExpInPlace(x.data(), static_cast<int64_t>(x.size()), 1.f);
  const std::vector<float> want = {
      std::exp(-4.f), std::exp(-1.f), 1.f, 1.f, 1.f, 0.f, 1.f, std::exp(-0.5f), 1.f};
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_NEAR(x[i], want[i], 3e-7f * want[i] + 2e-38f) << i;  // -3e38: e^-87 at most
    EXPECT_LE(x[i], 1.f) << i;
  }
}

// AVG pooling adds each window's own terms: windows of tiny values after huge ones keep their
// full relative precision (a difference of prefix sums would leave rounding noise of ~1e-16
// times the huge values, far above the tiny ones, and reorder them).
TEST(PoolTest, AveragePoolKeepsTinyWindowsAfterHugeValues) {
  for (int64_t kernel : {1, 3, 7, 31}) {
    const int64_t len = 300;
    std::vector<float> x(len);
    for (int64_t i = 0; i < len; ++i) {
      x[i] = i < 100 ? 1e30f : std::ldexp(1.f + static_cast<float>(i % 7), -100 - (i % 23));
    }
    std::vector<float> out(len, -1.f);
    std::vector<double> scratch;
    cpu::Pool(Pooling::kAvg, kernel, x.data(), len, 2, out.data(), scratch);
    EXPECT_EQ(out[1], -1.f);  // before `begin`: untouched
    for (int64_t i = 2; i < len; ++i) {
      double want = 0.0;  // zero padding counted, always divided by the kernel
      for (int64_t j = std::max<int64_t>(0, i - kernel / 2); j <= std::min(len - 1, i + kernel / 2);
           ++j) {
        want += x[j];
      }
      want /= static_cast<double>(kernel);
      EXPECT_NEAR(out[i], want, 1e-6 * want) << "kernel " << kernel << " i " << i;
    }
  }
}

// AVG_PEAK is the zero-padded average, raised to the position's own value where that is larger
// (SEMANTICS.md, "pool"): an isolated peak keeps its value, its neighbours get the average.
TEST(PoolTest, AvgPeakNeverGoesBelowThePositionsOwnValue) {
  const std::vector<float> x = {9.f, 0.f, 0.f, 3.f, 3.f, 3.f, 0.f};
  std::vector<float> out(x.size(), -1.f);
  std::vector<double> scratch;
  cpu::Pool(Pooling::kAvgPeak, 3, x.data(), static_cast<int64_t>(x.size()), 0, out.data(), scratch);
  // avg k=3: [3, 3, 1, 2, 3, 2, 1]; own values [9, 0, 0, 3, 3, 3, 0]
  const std::vector<float> want = {9.f, 3.f, 1.f, 3.f, 3.f, 3.f, 1.f};
  for (size_t i = 0; i < x.size(); ++i) EXPECT_FLOAT_EQ(out[i], want[i]) << "i " << i;
}

TEST_P(VectorOpsTest, AllFiniteFindsNaNAndInfAnywhere) {
  std::vector<float> x(37, 1.f);
  EXPECT_TRUE(cpu::AllFinite(x.data(), 37));
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    for (int at : {0, 17, 36}) {
      x[at] = bad;
      EXPECT_FALSE(cpu::AllFinite(x.data(), 37));
      x[at] = 1.f;
    }
  }
}

// The 16-bit round trips agree bit for bit with the scalar conversions (tested above) on every
// kind of fp32 pattern, ties, overflow and NaN included, at every offset of a vector loop.
TEST_P(VectorOpsTest, RoundTripsMatchTheScalarConversions) {
  std::mt19937 rng(17);
  std::vector<float> x = {1.f + 0x1p-8f,
                          1.f + 3 * 0x1p-8f,
                          1.f + 0x1p-11f,
                          1.f + 3 * 0x1p-11f,
                          65519.f,
                          65520.f,
                          -65536.f,
                          0x1p-25f,
                          0x1.8p-24f,
                          0x1p-130f,
                          3.4e38f,
                          -0.f,
                          std::numeric_limits<float>::infinity(),
                          std::nanf("")};
  while (x.size() < 4099) x.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  for (int64_t offset : {0, 1, 5}) {
    std::vector<float> bf16(x.begin() + offset, x.end()), f16 = bf16;
    cpu::RoundToBf16(bf16.data(), static_cast<int64_t>(bf16.size()));
    cpu::RoundToF16(f16.data(), static_cast<int64_t>(f16.size()));
    for (size_t i = 0; i < bf16.size(); ++i) {
      const float v = x[offset + i];
      const float want_bf16 = Bf16ToFloat(FloatToBf16(v)), want_f16 = F16ToFloat(FloatToF16(v));
      if (std::isnan(v)) {
        EXPECT_TRUE(std::isnan(bf16[i]) && std::isnan(f16[i])) << i;
        continue;
      }
      EXPECT_EQ(std::bit_cast<uint32_t>(bf16[i]), std::bit_cast<uint32_t>(want_bf16)) << v;
      EXPECT_EQ(std::bit_cast<uint32_t>(f16[i]), std::bit_cast<uint32_t>(want_f16)) << v;
    }
  }
  // Ties to even, overflow.
  float t[6] = {1.f + 0x1p-8f, 1.f + 3 * 0x1p-8f, 3.4e38f, 1.f + 0x1p-11f, 65519.f, 65520.f};
  cpu::RoundToBf16(t, 3);
  cpu::RoundToF16(t + 3, 3);
  EXPECT_EQ(t[0], 1.f);
  EXPECT_EQ(t[1], 1.f + 0x1p-6f);
  EXPECT_EQ(t[2], std::numeric_limits<float>::infinity());
  EXPECT_EQ(t[3], 1.f);
  EXPECT_EQ(t[4], 65504.f);
  EXPECT_EQ(t[5], std::numeric_limits<float>::infinity());
}

// Shapes from the wire may be huge: contiguous strides and element counts saturate instead of
// overflowing (signed overflow is undefined), and the extent check then refuses the view.
TEST(TensorViewTest, ContiguousStridesOfHugeShapesSaturate) {
  const Dims shape = {4, int64_t{1} << 40, int64_t{1} << 30};  // strides 2^70, 2^30, 1
  const Dims strides = ContiguousStrides(shape);
  EXPECT_EQ(strides[2], 1);
  EXPECT_EQ(strides[1], int64_t{1} << 30);
  EXPECT_EQ(strides[0], std::numeric_limits<int64_t>::max());
  const TensorView view(nullptr, DType::kF32, shape);
  EXPECT_EQ(view.num_elements(), std::numeric_limits<int64_t>::max());
  int64_t extent = 0;
  EXPECT_EQ(view.ElementExtent(&extent).code(), absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace laprox::kernels
