// DeviceSelector (kernels/cuda/select.h) against policy::SelectKeepPlan on the same raw scores.
//
// Run: ./build/tests/cuda/laprox_cuda_select_test (every test skips without a CUDA device).
// LAPROX_TEST_SEED=<n> replays another seed; the seed and the case are printed on failure.
//
// Exactness. Most raw scores here are dyadic (small integers times a power of two), so every
// layer sum is exact in fp64 whatever the order of the additions; the device plan must then equal
// the CPU plan bit for bit (scores, sums, positions, masks). With arbitrary floats the device adds
// the layer sums in another (fixed) order, the sum can differ in its last bit and a normalised
// score by one float ulp, which can swap two candidates whose scores differ by about 1e-7
// relative: GeneralFloatsAgreeUpToNearTies allows exactly such swaps (relative gap < 1e-5) and
// scores within 1e-6 relative.
//
// To extend: add shapes to RandomShapes / the fixed list, or raw-score kinds to FillLayer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/context.h"
#include "cuda/select.h"
#include "gtest/gtest.h"
#include "laprox/client/cuda_export.h"
#include "laprox/kernels/backend.h"
#include "laprox/kernels/keep_plan.h"
#include "laprox/kernels/policy.h"
#include "policy/budget.h"
#include "policy/select.h"

namespace laprox::kernels::cuda {
namespace {

constexpr SelectAlgorithm kAlgorithms[] = {SelectAlgorithm::kRadixSort,
                                           SelectAlgorithm::kHistogram};
constexpr Allocation kAllocations[] = {Allocation::kGlobalNormalized, Allocation::kGlobalRaw,
                                       Allocation::kPerLayer, Allocation::kUniform};

uint64_t BaseSeed() {
  const char* env = std::getenv("LAPROX_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 20240611u;
}

const char* AlgorithmName(SelectAlgorithm a) {
  return a == SelectAlgorithm::kRadixSort ? "radix_sort" : "histogram";
}

// How the raw scores of one layer are drawn.
enum class LayerKind { kTies, kDyadic, kZero, kHuge, kGeneral };

const char* LayerKindName(LayerKind k) {
  switch (k) {
    case LayerKind::kTies:
      return "ties";
    case LayerKind::kDyadic:
      return "dyadic";
    case LayerKind::kZero:
      return "zero";
    case LayerKind::kHuge:
      return "huge";
    case LayerKind::kGeneral:
      return "general";
  }
  return "?";
}

struct Case {
  int32_t layers = 1;
  int32_t heads = 1;
  int64_t n = 1;
  PolicySpec policy;
  std::vector<LayerKind> kinds;  // one per layer
  OutputOptions outputs;
  uint64_t seed = 0;

  std::string Describe(const RequestShape& shape) const {
    std::string kinds_text;
    for (LayerKind k : kinds) absl::StrAppend(&kinds_text, LayerKindName(k), " ");
    return absl::StrCat("seed ", seed, ": L ", layers, " Hkv ", heads, " n ", n, " window ",
                        shape.window, " sinks ", shape.sinks, " candidates ", shape.candidates,
                        " quota ", shape.quota, " allocation ", AllocationName(policy.allocation),
                        " min_per_head ", policy.min_per_head, " head_uniform_layers ",
                        static_cast<int>(policy.head_uniform_layers),
                        " outputs positions/bitmask/scores ", static_cast<int>(outputs.positions),
                        static_cast<int>(outputs.bitmask), static_cast<int>(outputs.scores),
                        " layers [", kinds_text, "]");
  }
};

RequestShape ShapeOf(const Case& c) {
  RequestShape shape;
  shape.n = c.n;
  shape.num_layers = c.layers;
  shape.num_kv_heads = c.heads;
  shape.group_size = 1;
  shape.head_dim = 64;
  shape.window_rows = c.policy.window;
  policy::DeriveBudget(c.policy, shape);
  return shape;
}

// Raw scores [L, Hkv, n]: candidates drawn per the layer's kind, every other position NaN (they
// must never be read).
std::vector<float> MakeRaw(const Case& c, const RequestShape& shape) {
  std::mt19937_64 rng(c.seed);
  std::vector<float> raw(static_cast<size_t>(c.layers) * c.heads * c.n,
                         std::numeric_limits<float>::quiet_NaN());
  for (int32_t l = 0; l < c.layers; ++l) {
    for (int32_t g = 0; g < c.heads; ++g) {
      float* row = raw.data() + (static_cast<int64_t>(l) * c.heads + g) * c.n;
      for (int64_t i = shape.sinks; i < shape.sinks + shape.candidates; ++i) {
        float v = 0.0f;
        switch (c.kinds[l]) {
          case LayerKind::kTies:  // 0..7 * 2^-10: many exact ties and zeros
            v = std::ldexp(static_cast<float>(rng() % 8), -10);
            if (rng() % 16 == 0) v = -0.0f;
            break;
          case LayerKind::kDyadic:  // 0..2^20-1 * 2^-30
            v = std::ldexp(static_cast<float>(rng() % (1u << 20)), -30);
            break;
          case LayerKind::kZero:
            v = rng() % 2 == 0 ? 0.0f : -0.0f;
            break;
          case LayerKind::kHuge:  // 1..2^20-1 * 2^100, with ties
            v = std::ldexp(static_cast<float>(1 + rng() % ((1u << 20) - 1)), 100);
            if (rng() % 4 == 0) v = std::ldexp(5.0f, 110);
            break;
          case LayerKind::kGeneral:
            v = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
            if (rng() % 8 == 0) v = 0.25f;
            break;
        }
        row[i] = v;
      }
    }
  }
  return raw;
}

template <typename T>
std::string FirstMismatch(const std::vector<T>& expected, const std::vector<T>& actual) {
  if (expected.size() != actual.size()) {
    return absl::StrCat("size ", actual.size(), ", expected ", expected.size());
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (std::memcmp(&expected[i], &actual[i], sizeof(T)) != 0) {
      return absl::StrCat("element ", i, ": ", actual[i], ", expected ", expected[i]);
    }
  }
  return "";
}

// Field by field, bitwise for floating point.
void ExpectSamePlan(const KeepPlan& expected, const KeepPlan& actual) {
  EXPECT_EQ(actual.num_layers, expected.num_layers);
  EXPECT_EQ(actual.num_kv_heads, expected.num_kv_heads);
  EXPECT_EQ(actual.n, expected.n);
  EXPECT_EQ(actual.window, expected.window);
  EXPECT_EQ(actual.sinks, expected.sinks);
  EXPECT_EQ(actual.quota, expected.quota);
  EXPECT_EQ(actual.selected_total, expected.selected_total);
  EXPECT_EQ(FirstMismatch(expected.counts, actual.counts), "") << "counts";
  EXPECT_EQ(FirstMismatch(expected.offsets, actual.offsets), "") << "offsets";
  EXPECT_EQ(FirstMismatch(expected.positions, actual.positions), "") << "positions";
  EXPECT_EQ(FirstMismatch(expected.bitmask, actual.bitmask), "") << "bitmask";
  EXPECT_EQ(FirstMismatch(expected.scores, actual.scores), "") << "scores";
  EXPECT_EQ(FirstMismatch(expected.layer_sums, actual.layer_sums), "") << "layer_sums";
}

class DeviceSelectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<DeviceContext> context = CreateDeviceContext(0);
    if (absl::IsUnavailable(context.status())) {
      GTEST_SKIP() << "no CUDA device visible (" << context.status()
                   << "): the device selection is tested on a GPU machine (tests/gpu/run.sh)";
    }
    ASSERT_TRUE(context.ok()) << context.status();
    context_ = *context;
    created_ = true;
  }
  void TearDown() override {
    raw_.reset();
    if (created_) DestroyDeviceContext(context_);
  }

  // Device copy of `raw` (kept in raw_ until the next call).
  const float* Upload(const std::vector<float>& raw) {
    const size_t bytes = raw.size() * sizeof(float);
    raw_.reset();
    absl::StatusOr<client::DeviceAllocation> allocation =
        client::DeviceAllocation::Allocate(std::max<size_t>(bytes, 1));
    EXPECT_TRUE(allocation.ok()) << allocation.status();
    if (!allocation.ok()) return nullptr;
    raw_ = *std::move(allocation);
    EXPECT_TRUE(raw_->CopyFromHost(0, raw.data(), bytes).ok());
    return static_cast<const float*>(raw_->data());
  }

  KeepPlan DeviceSelect(const RequestShape& shape, const PolicySpec& policy, const float* d_raw,
                        const OutputOptions& outputs, SelectAlgorithm algorithm) {
    absl::StatusOr<KeepPlan> plan =
        selector_.Select(context_, shape, policy, d_raw, outputs, algorithm);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *std::move(plan) : KeepPlan{};
  }

  // Both device algorithms against the host selection on the case's raw scores.
  void CheckBothAlgorithms(const Case& c) {
    const RequestShape shape = ShapeOf(c);
    const std::vector<float> raw = MakeRaw(c, shape);
    const absl::StatusOr<KeepPlan> host = policy::SelectKeepPlan(shape, c.policy, raw, c.outputs);
    ASSERT_TRUE(host.ok()) << host.status();
    const KeepPlan& expected = *host;
    const float* d_raw = Upload(raw);
    for (SelectAlgorithm algorithm : kAlgorithms) {
      SCOPED_TRACE(absl::StrCat(AlgorithmName(algorithm), ", ", c.Describe(shape)));
      ExpectSamePlan(expected, DeviceSelect(shape, c.policy, d_raw, c.outputs, algorithm));
    }
  }

  // Every allocation x min_per_head {0, 3} x head_uniform_layers {off, on} x both algorithms on
  // the case's raw scores, compared exactly with the CPU.
  void CheckAllOptions(Case c) {
    for (Allocation allocation : kAllocations) {
      for (int32_t min_per_head : {0, 3}) {
        for (bool head_uniform : {false, true}) {
          c.policy.allocation = allocation;
          c.policy.min_per_head = min_per_head;
          c.policy.head_uniform_layers = head_uniform;
          CheckBothAlgorithms(c);
          if (HasFailure()) return;  // one failing case is enough to read
        }
      }
    }
  }

  DeviceContext context_;
  DeviceSelector selector_;
  bool created_ = false;
  std::optional<client::DeviceAllocation> raw_;
};

OutputOptions AllOutputs() { return {true, true, true}; }

// A random case: shape, window, sinks, budget and layer kinds from `seed`.
Case RandomCase(uint64_t seed, bool general = false) {
  std::mt19937_64 rng(seed);
  Case c;
  c.seed = seed;
  c.layers = 1 + static_cast<int32_t>(rng() % 4);
  c.heads = 1 + static_cast<int32_t>(rng() % 8);
  const int64_t sizes[] = {1, 2, 7, 8, 33, 64, 100, 255, 256, 1000, 2048, 3000};
  c.n = rng() % 3 == 0 ? sizes[rng() % std::size(sizes)] : 1 + static_cast<int64_t>(rng() % 3000);
  c.policy.window = 1 + static_cast<int32_t>(rng() % 64);
  c.policy.sinks = rng() % 2 == 0 ? 0 : static_cast<int32_t>(rng() % 8);
  switch (rng() % 5) {
    case 0:  // quota 0 (only forced tokens kept)
      c.policy.budget = Budget::TokensPerHead(static_cast<int64_t>(rng() % 8));
      break;
    case 1:  // every candidate selected
      c.policy.budget = Budget::TokensPerHead(c.n + static_cast<int64_t>(rng() % 4));
      break;
    case 2:
      c.policy.budget = Budget::CompressionRatio(0.1 * static_cast<double>(rng() % 10));
      break;
    default:
      c.policy.budget = Budget::TokensPerHead(static_cast<int64_t>(rng() % (c.n + 64)));
      break;
  }
  const LayerKind kinds[] = {LayerKind::kTies, LayerKind::kDyadic, LayerKind::kZero,
                             LayerKind::kHuge};
  for (int32_t l = 0; l < c.layers; ++l) {
    c.kinds.push_back(general ? LayerKind::kGeneral : kinds[rng() % std::size(kinds)]);
  }
  switch (rng() % 4) {
    case 0:
      c.outputs = {true, false, false};
      break;
    case 1:
      c.outputs = {false, false, false};
      break;
    default:
      c.outputs = AllOutputs();
      break;
  }
  return c;
}

TEST_F(DeviceSelectTest, MatchesCpuOnRandomShapes) {
  const uint64_t base = BaseSeed();
  for (uint64_t i = 0; i < 48 && !HasFailure(); ++i) CheckAllOptions(RandomCase(base + i));
}

TEST_F(DeviceSelectTest, MatchesCpuOnEdgeShapes) {
  const uint64_t seed = BaseSeed();
  struct Edge {
    int32_t layers, heads;
    int64_t n;
    int32_t window, sinks;
    int64_t budget;
  };
  const Edge edges[] = {
      {1, 1, 1, 1, 0, 1},        // n = 1: the window is everything
      {2, 3, 10, 32, 4, 128},    // n <= w: no candidates
      {3, 2, 40, 8, 40, 64},     // sinks clamp: no candidates
      {2, 4, 100, 8, 2, 10},     // quota 0 (B = w + sinks)
      {2, 4, 100, 8, 2, 9},      // B < w + sinks
      {4, 8, 300, 16, 4, 300},   // quota = all candidates
      {4, 8, 300, 16, 4, 23},    // quota 3 = min_per_head
      {4, 8, 300, 16, 4, 21},    // quota 1 < min_per_head
      {1, 8, 3000, 32, 0, 128},  // one layer
      {4, 1, 3000, 1, 1, 2000},  // one head per layer
  };
  for (const Edge& e : edges) {
    Case c;
    c.seed = seed;
    c.layers = e.layers;
    c.heads = e.heads;
    c.n = e.n;
    c.policy.window = e.window;
    c.policy.sinks = e.sinks;
    c.policy.budget = Budget::TokensPerHead(e.budget);
    for (int32_t l = 0; l < c.layers; ++l) {
      c.kinds.push_back(l % 2 == 0 ? LayerKind::kTies : LayerKind::kDyadic);
    }
    if (c.layers >= 3) c.kinds[2] = LayerKind::kZero;
    if (c.layers >= 4) c.kinds[3] = LayerKind::kHuge;
    c.outputs = AllOutputs();
    CheckAllOptions(c);
    if (HasFailure()) return;
  }
}

// Llama-8B geometry at n = 65536: 16.7M flat scores, more than one radix/histogram tile per
// segment everywhere.
TEST_F(DeviceSelectTest, MatchesCpuOnLargeShape) {
  Case c;
  c.seed = BaseSeed();
  c.layers = 32;
  c.heads = 8;
  c.n = 65536;
  c.policy.window = 32;
  c.policy.budget = Budget::CompressionRatio(0.75);
  for (int32_t l = 0; l < c.layers; ++l) {
    c.kinds.push_back(l == 5 ? LayerKind::kZero
                             : (l == 9 ? LayerKind::kHuge
                                       : (l % 3 == 0 ? LayerKind::kTies : LayerKind::kDyadic)));
  }
  c.outputs = AllOutputs();
  for (Allocation allocation : {Allocation::kGlobalNormalized, Allocation::kPerLayer}) {
    c.policy.allocation = allocation;
    c.policy.min_per_head = 3;
    c.policy.head_uniform_layers = allocation == Allocation::kGlobalNormalized;
    CheckBothAlgorithms(c);
  }
}

// Two runs and a fresh selector give bit-identical plans (fp64 layer sums included) on
// arbitrary floats.
TEST_F(DeviceSelectTest, IsDeterministic) {
  Case c = RandomCase(BaseSeed() + 1000, /*general=*/true);
  c.layers = 4;
  c.heads = 8;
  c.n = 3000;
  c.kinds.assign(c.layers, LayerKind::kGeneral);
  c.policy.budget = Budget::TokensPerHead(512);
  c.outputs = AllOutputs();
  const RequestShape shape = ShapeOf(c);
  const float* d_raw = Upload(MakeRaw(c, shape));
  for (SelectAlgorithm algorithm : kAlgorithms) {
    SCOPED_TRACE(absl::StrCat(AlgorithmName(algorithm), ", ", c.Describe(shape)));
    const KeepPlan first = DeviceSelect(shape, c.policy, d_raw, c.outputs, algorithm);
    const KeepPlan second = DeviceSelect(shape, c.policy, d_raw, c.outputs, algorithm);
    DeviceSelector fresh;
    absl::StatusOr<KeepPlan> third =
        fresh.Select(context_, shape, c.policy, d_raw, c.outputs, algorithm);
    ASSERT_TRUE(third.ok()) << third.status();
    ExpectSamePlan(first, second);
    ExpectSamePlan(first, *third);
  }
  // Both algorithms select the same set.
  const KeepPlan radix =
      DeviceSelect(shape, c.policy, d_raw, c.outputs, SelectAlgorithm::kRadixSort);
  const KeepPlan histogram =
      DeviceSelect(shape, c.policy, d_raw, c.outputs, SelectAlgorithm::kHistogram);
  ExpectSamePlan(radix, histogram);
}

// Arbitrary floats: the layer sums are added in another order than on the CPU, so scores may
// differ by an ulp (checked at 1e-6 relative) and kept sets by swaps of near-ties (relative score
// gap < 1e-5, docs/design.md §13).
TEST_F(DeviceSelectTest, GeneralFloatsAgreeUpToNearTies) {
  const uint64_t base = BaseSeed() + 2000;
  for (uint64_t i = 0; i < 24 && !HasFailure(); ++i) {
    Case c = RandomCase(base + i, /*general=*/true);
    c.outputs = AllOutputs();
    for (Allocation allocation : kAllocations) {
      c.policy.allocation = allocation;
      c.policy.min_per_head = static_cast<int32_t>(i % 2) * 3;
      c.policy.head_uniform_layers = i % 4 >= 2;
      const RequestShape shape = ShapeOf(c);
      const std::vector<float> raw = MakeRaw(c, shape);
      const absl::StatusOr<KeepPlan> host = policy::SelectKeepPlan(shape, c.policy, raw, c.outputs);
      ASSERT_TRUE(host.ok()) << host.status();
      const KeepPlan& expected = *host;
      const float* d_raw = Upload(raw);
      for (SelectAlgorithm algorithm : kAlgorithms) {
        SCOPED_TRACE(absl::StrCat(AlgorithmName(algorithm), ", ", c.Describe(shape)));
        const KeepPlan actual = DeviceSelect(shape, c.policy, d_raw, c.outputs, algorithm);
        ASSERT_EQ(actual.scores.size(), expected.scores.size());
        ASSERT_EQ(actual.bitmask.size(), expected.bitmask.size());
        EXPECT_EQ(actual.selected_total, expected.selected_total);
        for (size_t l = 0; l < expected.layer_sums.size(); ++l) {
          EXPECT_NEAR(actual.layer_sums[l], expected.layer_sums[l],
                      1e-12 * std::abs(expected.layer_sums[l]))
              << "layer " << l;
        }
        for (size_t i2 = 0; i2 < expected.scores.size(); ++i2) {
          const float e = expected.scores[i2], a = actual.scores[i2];
          if (e == a) continue;
          ASSERT_LE(std::abs(a - e), 1e-6f * std::abs(e)) << "score " << i2;
        }
        // Kept sets may differ only by swaps of near-ties.
        std::vector<float> only_cpu, only_device;
        for (size_t b = 0; b < expected.bitmask.size(); ++b) {
          const uint8_t diff = expected.bitmask[b] ^ actual.bitmask[b];
          for (int bit = 0; bit < 8; ++bit) {
            if ((diff >> bit & 1) == 0) continue;
            const size_t row = b / ((shape.n + 7) / 8);
            const size_t pos = (b % ((shape.n + 7) / 8)) * 8 + bit;
            const float s = expected.scores[row * shape.n + pos];
            ((expected.bitmask[b] >> bit & 1) != 0 ? only_cpu : only_device).push_back(s);
          }
        }
        EXPECT_EQ(only_cpu.size(), only_device.size());
        // Each side of a swap needs a near-tie partner on the other side. Not every pair: swaps
        // in different heads or layers (UNIFORM, PER_LAYER) sit at unrelated thresholds.
        auto near_tie_partner = [](float a, const std::vector<float>& others) {
          return std::any_of(others.begin(), others.end(), [a](float b) {
            return std::abs(a - b) < 1e-5f * std::max(std::abs(a), std::abs(b));
          });
        };
        for (float a : only_cpu) {
          EXPECT_TRUE(near_tie_partner(a, only_device)) << "CPU-only " << a << " is not a near-tie";
        }
        for (float b : only_device) {
          EXPECT_TRUE(near_tie_partner(b, only_cpu)) << "device-only " << b << " is not a near-tie";
        }
      }
    }
  }
}

// A NaN or infinite raw score at a candidate is a broken invariant (the scorers' inputs were
// checked): both selections answer INTERNAL in the same words, naming the first one; NaN at
// non-candidate positions (MakeRaw's filler) is never read.
TEST_F(DeviceSelectTest, NonFiniteRawScoreIsInternal) {
  Case c = RandomCase(BaseSeed() + 77);
  c.layers = 2;
  c.heads = 3;
  c.n = 500;
  c.policy.window = 8;
  c.policy.sinks = 2;
  c.policy.budget = Budget::TokensPerHead(100);
  c.kinds.assign(2, LayerKind::kDyadic);  // exact layer sums: the plans must be equal
  c.outputs = AllOutputs();
  const RequestShape shape = ShapeOf(c);
  ASSERT_GT(shape.candidates, 300);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> raw = MakeRaw(c, shape);
    raw[(1 * c.heads + 2) * c.n + 300] = bad;  // layer 1, KV head 2, position 300
    raw[(1 * c.heads + 2) * c.n + 301] = bad;
    const absl::StatusOr<KeepPlan> host = policy::SelectKeepPlan(shape, c.policy, raw, c.outputs);
    ASSERT_EQ(host.status().code(), absl::StatusCode::kInternal) << host.status();
    EXPECT_NE(host.status().message().find("layers[1], KV head 2, position 300: the raw score"),
              std::string::npos)
        << host.status();
    const float* d_raw = Upload(raw);
    for (SelectAlgorithm algorithm : kAlgorithms) {
      SCOPED_TRACE(absl::StrCat(AlgorithmName(algorithm), ", raw score ", bad));
      const absl::StatusOr<KeepPlan> device =
          selector_.Select(context_, shape, c.policy, d_raw, c.outputs, algorithm);
      EXPECT_EQ(device.status(), host.status());
    }
    raw[(1 * c.heads + 2) * c.n + 300] = 0.5f;  // fixed: both select again, the same plan
    raw[(1 * c.heads + 2) * c.n + 301] = 0.5f;
    const absl::StatusOr<KeepPlan> fixed = policy::SelectKeepPlan(shape, c.policy, raw, c.outputs);
    ASSERT_TRUE(fixed.ok()) << fixed.status();
    d_raw = Upload(raw);
    for (SelectAlgorithm algorithm : kAlgorithms) {
      ExpectSamePlan(*fixed, DeviceSelect(shape, c.policy, d_raw, c.outputs, algorithm));
    }
  }
}

// The capped walk of max_layer_share has no device selection: the backend selects such plans
// on the host, and the device selector refuses them rather than ignore the cap.
TEST_F(DeviceSelectTest, RefusesMaxLayerShare) {
  RequestShape shape;
  shape.n = 10;
  shape.num_layers = 2;
  shape.num_kv_heads = 1;
  shape.window = 4;
  shape.candidates = 6;
  shape.quota = 2;
  PolicySpec policy;
  policy.max_layer_share = 1.5;
  const float* d_raw = Upload(std::vector<float>(20, 1.f));
  absl::StatusOr<KeepPlan> plan = selector_.Select(context_, shape, policy, d_raw, OutputOptions{},
                                                   SelectAlgorithm::kRadixSort);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kUnimplemented) << plan.status();
  EXPECT_NE(plan.status().message().find("max_layer_share"), std::string::npos);
}

TEST_F(DeviceSelectTest, RejectsInconsistentShape) {
  RequestShape shape;
  shape.n = 10;
  shape.num_layers = 1;
  shape.num_kv_heads = 1;
  shape.window = 4;
  shape.candidates = 3;  // 4 + 0 + 3 != 10
  const float* d_raw = Upload(std::vector<float>(10, 1.f));
  absl::StatusOr<KeepPlan> plan = selector_.Select(context_, shape, PolicySpec{}, d_raw,
                                                   OutputOptions{}, SelectAlgorithm::kRadixSort);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal) << plan.status();
}

}  // namespace
}  // namespace laprox::kernels::cuda
