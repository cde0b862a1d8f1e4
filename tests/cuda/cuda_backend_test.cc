// The CUDA backend against the CPU backend (the reference) over a grid of random requests.
//
// Every case builds seeded random keys, values, window queries and o_proj (fp32, fp16 or bf16;
// contiguous [Hkv, n, d], engine-style [n, Hkv, d] or padded rows), prepares the model on both
// backends and compares the plans:
//   - candidate scores: |s_cuda - s_cpu| <= 1e-4 |s_cpu| + 1e-6 max s (fp32 math in both, in
//     different orders);
//   - kept sets: equal, except swaps between tokens whose CPU scores lie within a relative 1e-5
//     of the selection threshold of their competition (docs/design.md §13);
//   - counts add up, layer sums agree to 1e-4, the bitmask matches the positions.
// With LAPROX_CUDA_TEST_SMALL set, cases above n = 4096 are left out (for compute-sanitizer).
// Runs with both kernel versions (fused falls back to gemm for requests it does not take, among
// them the default MEAN_HEAD_PRODUCT), with host inputs (staged by the backend) and with device
// inputs (copies in the client library's DeviceAllocation).
//
// Without a CUDA device every test is skipped with the reason. Run on a GPU machine through
// tests/gpu/run.sh, or directly: build/tests/cuda/laprox_cuda_backend_test. To add a case,
// append to Cases(); a failure prints the case and its seed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "laprox/client/cuda_export.h"
#include "laprox/kernels/registry.h"

namespace laprox::kernels {
namespace {

enum class Layout { kContiguous, kTokenMajor, kPadded };

struct Case {
  int L = 2, H = 4, Hkv = 1, d = 64, D = 96;
  int64_t n = 256;
  int wq = 32;  // window rows given
  DType dtype = DType::kBF16;
  Layout layout = Layout::kContiguous;
  PolicySpec policy;
  bool cross_grams = false;
  bool lse = false;
  // Window LSE replaced by this value (far below the logits: every probability is capped at 1).
  float lse_value = std::numeric_limits<float>::quiet_NaN();
  // Logits ~ 15 * z_j in every window row and head (z_j random, rising or falling along the
  // positions), so that most attention lies between 1e-38 and 1e-19 (TinyAttentionCases).
  enum class Tiny { kNone, kRandom, kRise, kFall } tiny = Tiny::kNone;
  uint32_t seed = 1;

  std::string Name() const {
    return absl::StrCat(
        "L", L, " H", H, " Hkv", Hkv, " d", d, " D", D, " n", n, " wq", wq, " w", policy.window,
        " ", DTypeName(dtype), " layout ", static_cast<int>(layout), " ",
        AllocationName(policy.allocation), " ", IndicatorName(policy.indicator), " ",
        GqaValueName(policy.EffectiveGqaValue()), " ", PoolingName(policy.pooling),
        policy.pool_kernel, " pool ", PoolTargetName(policy.EffectivePoolTarget()), " sinks ",
        policy.sinks, " min ", policy.min_per_head, policy.head_uniform_layers ? " uniform" : "",
        policy.max_layer_share ? absl::StrCat(" max_layer_share ", *policy.max_layer_share) : "",
        " B ", policy.budget.tokens_per_head, lse ? " lse" : "",
        std::isnan(lse_value) ? "" : absl::StrCat(" lse_value ", lse_value),
        tiny == Tiny::kNone ? "" : absl::StrCat(" tiny ", static_cast<int>(tiny)), " seed ", seed);
  }
};

// Host buffers of one case in its dtype and layout, plus views over them.
class Inputs {
 public:
  explicit Inputs(const Case& c) : c_(c) {
    std::mt19937 rng(c.seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    const int64_t kv_rows = int64_t{c.Hkv} * c.n, pad = c.layout == Layout::kPadded ? 8 : 0;
    kv_ld_ = c.d + pad;
    for (int l = 0; l < c.L; ++l) {
      if (c.tiny == Case::Tiny::kNone) {
        keys_.push_back(Fill(kv_rows * kv_ld_, 1.f, rng, normal));
      } else {
        keys_.push_back(TinyKeys(rng, normal));
      }
      values_.push_back(Fill(kv_rows * kv_ld_, 1.f, rng, normal));
      if (c.tiny == Case::Tiny::kNone) {
        queries_.push_back(Fill(int64_t{c.H} * c.wq * c.d, 1.f, rng, normal));
      } else {
        queries_.push_back(TinyQueries(rng, normal));
      }
      o_proj_.push_back(Fill(int64_t{c.D} * c.H * c.d, 0.05f, rng, normal));
      if (c.lse) lse_.push_back(std::vector<float>(int64_t{c.H} * c.wq));
    }
    if (c.lse) ComputeLse();
    if (c.lse && !std::isnan(c.lse_value)) {
      for (auto& lse : lse_) std::fill(lse.begin(), lse.end(), c.lse_value);
    }
  }

  // Element i of the host tensor (kind 0 keys, 1 values, 2 queries, 4 o_proj) of layer l set to
  // x (rounded to the dtype), for the magnitude tests.
  void Set(int kind, int l, int64_t i, float x) {
    std::vector<uint8_t>& t = kind == 0   ? keys_[l]
                              : kind == 1 ? values_[l]
                              : kind == 2 ? queries_[l]
                                          : o_proj_[l];
    Store(t, i, x);
  }
  int64_t Elements(int kind, int l) const {
    const auto& t = kind == 0   ? keys_[l]
                    : kind == 1 ? values_[l]
                    : kind == 2 ? queries_[l]
                                : o_proj_[l];
    return static_cast<int64_t>(t.size() / DTypeSize(c_.dtype));
  }

  std::vector<TensorView> OProj(const std::vector<const void*>& data, MemorySpace space) const {
    std::vector<TensorView> views;
    for (int l = 0; l < c_.L; ++l) {
      views.emplace_back(data[l], c_.dtype, Dims{c_.D, int64_t{c_.H} * c_.d}, space);
    }
    return views;
  }

  KeepPlanRequest Request(const std::vector<std::vector<const void*>>& data,
                          MemorySpace space) const {
    KeepPlanRequest request;
    request.n = c_.n;
    request.policy = c_.policy;
    request.outputs = {.positions = true, .bitmask = true, .scores = true};
    const Dims kv_shape = {c_.Hkv, c_.n, c_.d};
    const Dims kv_strides = c_.layout == Layout::kTokenMajor ? Dims{kv_ld_, c_.Hkv * kv_ld_, 1}
                                                             : Dims{c_.n * kv_ld_, kv_ld_, 1};
    for (int l = 0; l < c_.L; ++l) {
      LayerInputs layer;
      layer.keys = TensorView(data[0][l], c_.dtype, kv_shape, kv_strides, space);
      layer.values = TensorView(data[1][l], c_.dtype, kv_shape, kv_strides, space);
      layer.window_queries = TensorView(data[2][l], c_.dtype, Dims{c_.H, c_.wq, c_.d}, space);
      if (c_.lse) layer.window_lse = TensorView(data[3][l], DType::kF32, Dims{c_.H, c_.wq}, space);
      request.layers.push_back(layer);
    }
    return request;
  }

  // Pointers per tensor kind (keys, values, queries, lse, o_proj) and layer.
  std::vector<std::vector<const void*>> HostPointers() const {
    std::vector<std::vector<const void*>> out(5);
    for (int l = 0; l < c_.L; ++l) {
      out[0].push_back(keys_[l].data());
      out[1].push_back(values_[l].data());
      out[2].push_back(queries_[l].data());
      out[3].push_back(c_.lse ? static_cast<const void*>(lse_[l].data()) : nullptr);
      out[4].push_back(o_proj_[l].data());
    }
    return out;
  }

  std::vector<std::vector<size_t>> Bytes() const {
    std::vector<std::vector<size_t>> out(5);
    for (int l = 0; l < c_.L; ++l) {
      out[0].push_back(keys_[l].size());
      out[1].push_back(values_[l].size());
      out[2].push_back(queries_[l].size());
      out[3].push_back(c_.lse ? lse_[l].size() * 4 : 0);
      out[4].push_back(o_proj_[l].size());
    }
    return out;
  }

 private:
  void Store(std::vector<uint8_t>& bytes, int64_t i, float x) const {
    if (c_.dtype == DType::kF32) {
      std::memcpy(bytes.data() + i * 4, &x, 4);
    } else {
      const uint16_t h = c_.dtype == DType::kBF16 ? FloatToBf16(x) : FloatToF16(x);
      std::memcpy(bytes.data() + i * 2, &h, 2);
    }
  }

  // Seeded normal values times `scale`, stored in the case's dtype (bytes).
  std::vector<uint8_t> Fill(int64_t count, float scale, std::mt19937& rng,
                            std::normal_distribution<float>& normal) const {
    std::vector<uint8_t> bytes(count * DTypeSize(c_.dtype));
    for (int64_t i = 0; i < count; ++i) Store(bytes, i, normal(rng) * scale);
    return bytes;
  }

  // Case::tiny: every key is z_j * u plus noise orthogonal to u (u = (1, .., 1) / sqrt(d)), every
  // query 15 * sqrt(d) * u plus a little noise: logits ~ 15 * z_j / (scale * sqrt(d)) in every
  // row and head (scale 1/sqrt(d) here).
  std::vector<uint8_t> TinyKeys(std::mt19937& rng, std::normal_distribution<float>& normal) const {
    const int64_t rows = int64_t{c_.Hkv} * c_.n;
    std::vector<uint8_t> bytes(rows * kv_ld_ * DTypeSize(c_.dtype), 0);
    const float u = 1.f / std::sqrt(static_cast<float>(c_.d));
    for (int64_t row = 0; row < rows; ++row) {
      // Row `row` of the [Hkv, n] (or [n, Hkv]) layout: its position j.
      const int64_t j = c_.layout == Layout::kTokenMajor ? row / c_.Hkv : row % c_.n;
      const float ramp =
          4.f * static_cast<float>(j) / static_cast<float>(std::max<int64_t>(c_.n - 1, 1)) - 2.f;
      const float z = c_.tiny == Case::Tiny::kRandom ? normal(rng)
                      : c_.tiny == Case::Tiny::kRise ? ramp + 0.3f * normal(rng)
                                                     : -ramp + 0.3f * normal(rng);
      std::vector<float> k(c_.d);
      float along = 0.f;
      for (int x = 0; x < c_.d; ++x) {
        k[x] = normal(rng);
        along += k[x] * u;
      }
      for (int x = 0; x < c_.d; ++x) Store(bytes, row * kv_ld_ + x, k[x] + (z - along) * u);
    }
    return bytes;
  }
  std::vector<uint8_t> TinyQueries(std::mt19937& rng,
                                   std::normal_distribution<float>& normal) const {
    const int64_t count = int64_t{c_.H} * c_.wq * c_.d;
    std::vector<uint8_t> bytes(count * DTypeSize(c_.dtype));
    // 15 * sqrt(d) * u has every component 15.
    for (int64_t i = 0; i < count; ++i) Store(bytes, i, 15.f + 0.05f * normal(rng));
    return bytes;
  }

  float Load(const std::vector<uint8_t>& t, int64_t i) const {
    if (c_.dtype == DType::kF32) {
      float x;
      std::memcpy(&x, t.data() + i * 4, 4);
      return x;
    }
    uint16_t h;
    std::memcpy(&h, t.data() + i * 2, 2);
    return c_.dtype == DType::kBF16 ? Bf16ToFloat(h) : F16ToFloat(h);
  }

  // The engine's window LSE, in double: log sum_j<=n-wq+t exp(scale q_t . k_j).
  void ComputeLse() {
    const int G = c_.H / c_.Hkv;
    const double scale = 1.0 / std::sqrt(static_cast<double>(c_.d));
    for (int l = 0; l < c_.L; ++l) {
      for (int h = 0; h < c_.H; ++h) {
        const int g = h / G;
        for (int t = 0; t < c_.wq; ++t) {
          const int64_t last = c_.n - c_.wq + t;
          std::vector<double> logits;  // last >= 0: never empty
          logits.reserve(last + 1);
          for (int64_t j = 0; j <= last; ++j) {
            double dot = 0;
            for (int k = 0; k < c_.d; ++k) {
              const int64_t ki = c_.layout == Layout::kTokenMajor ? (j * c_.Hkv + g) * kv_ld_ + k
                                                                  : (g * c_.n + j) * kv_ld_ + k;
              dot += double{Load(queries_[l], (int64_t{h} * c_.wq + t) * c_.d + k)} *
                     Load(keys_[l], ki);
            }
            logits.push_back(dot * scale);
          }
          double m = -std::numeric_limits<double>::infinity();
          for (double x : logits) m = std::max(m, x);
          double sum = 0;
          for (double x : logits) sum += std::exp(x - m);
          lse_[l][int64_t{h} * c_.wq + t] = static_cast<float>(m + std::log(sum));
        }
      }
    }
  }

  const Case& c_;
  int64_t kv_ld_;
  std::vector<std::vector<uint8_t>> keys_, values_, queries_, o_proj_;
  std::vector<std::vector<float>> lse_;
};

// Device copies of every input buffer of a case, freed on destruction.
class DeviceCopies {
 public:
  explicit DeviceCopies(const Inputs& inputs) {
    const auto host = inputs.HostPointers();
    const auto bytes = inputs.Bytes();
    pointers_.resize(host.size());
    for (size_t kind = 0; kind < host.size(); ++kind) {
      for (size_t l = 0; l < host[kind].size(); ++l) {
        const void* d = nullptr;
        if (bytes[kind][l] > 0) {
          auto allocation = client::DeviceAllocation::Allocate(bytes[kind][l]);
          EXPECT_TRUE(allocation.ok()) << allocation.status();
          if (allocation.ok()) {
            EXPECT_TRUE(allocation->CopyFromHost(0, host[kind][l], bytes[kind][l]).ok());
            d = allocation->data();
            owned_.push_back(*std::move(allocation));
          }
        }
        pointers_[kind].push_back(d);
      }
    }
  }
  const std::vector<std::vector<const void*>>& pointers() const { return pointers_; }

 private:
  std::vector<std::vector<const void*>> pointers_;
  std::vector<client::DeviceAllocation> owned_;  // freed on destruction
};

// Segment of a flat (layer, head, position) index for the threshold of its competition.
int64_t Segment(const Case& c, int64_t flat) {
  const int64_t lg = flat / c.n;
  if (c.policy.allocation == Allocation::kUniform || c.policy.head_uniform_layers) return lg;
  if (c.policy.allocation == Allocation::kPerLayer) return lg / c.Hkv;
  return 0;
}

void ExpectSamePlan(const Case& c, const KeepPlan& cpu, const KeepPlan& gpu) {
  SCOPED_TRACE(c.Name());
  ASSERT_EQ(gpu.counts.size(), cpu.counts.size());
  ASSERT_EQ(gpu.scores.size(), cpu.scores.size());
  EXPECT_EQ(gpu.window, cpu.window);
  EXPECT_EQ(gpu.sinks, cpu.sinks);
  EXPECT_EQ(gpu.quota, cpu.quota);
  EXPECT_EQ(gpu.selected_total, cpu.selected_total);
  ASSERT_EQ(gpu.layer_sums.size(), cpu.layer_sums.size());
  for (size_t l = 0; l < cpu.layer_sums.size(); ++l) {
    EXPECT_NEAR(gpu.layer_sums[l], cpu.layer_sums[l], 1e-4 * std::abs(cpu.layer_sums[l]))
        << "layer " << l;
  }

  // Scores: forced tokens +inf on both; candidates close.
  float max_score = 0;
  for (float s : cpu.scores) {
    if (std::isfinite(s)) max_score = std::max(max_score, s);
  }
  int64_t bad_scores = 0;
  for (size_t i = 0; i < cpu.scores.size(); ++i) {
    const float a = cpu.scores[i], b = gpu.scores[i];
    const bool ok =
        std::isinf(a) ? a == b : std::abs(a - b) <= 1e-4f * std::abs(a) + 1e-6f * max_score;
    if (!ok && ++bad_scores <= 5) {
      ADD_FAILURE() << "score " << i << " (layer " << i / (c.Hkv * c.n) << ", head "
                    << (i / c.n) % c.Hkv << ", position " << i % c.n << "): cpu " << a << ", cuda "
                    << b;
    }
  }
  EXPECT_EQ(bad_scores, 0);

  // Kept sets: flat membership of both plans.
  const int64_t total = int64_t{c.L} * c.Hkv * c.n;
  std::vector<uint8_t> in_cpu(total, 0), in_gpu(total, 0);
  for (int64_t lg = 0; lg < int64_t{c.L} * c.Hkv; ++lg) {
    for (int64_t k = cpu.offsets[lg]; k < cpu.offsets[lg + 1]; ++k) {
      in_cpu[lg * c.n + cpu.positions[k]] = 1;
    }
    ASSERT_EQ(gpu.offsets[lg + 1] - gpu.offsets[lg], gpu.counts[lg]);
    for (int64_t k = gpu.offsets[lg]; k < gpu.offsets[lg + 1]; ++k) {
      if (k > gpu.offsets[lg]) {
        ASSERT_LT(gpu.positions[k - 1], gpu.positions[k]);
      }
      in_gpu[lg * c.n + gpu.positions[k]] = 1;
    }
  }
  for (int64_t i = 0; i < total; ++i) {
    const int64_t lg = i / c.n, pos = i % c.n;
    const bool bit = (gpu.bitmask[lg * ((c.n + 7) / 8) + pos / 8] >> (pos % 8)) & 1;
    ASSERT_EQ(bit, in_gpu[i] != 0) << "bitmask disagrees with positions at " << i;
  }
  // Each head's candidates in the selection order of the CPU scores (descending, then position).
  const int64_t heads = int64_t{c.L} * c.Hkv;
  std::vector<std::vector<int64_t>> order(heads);
  std::vector<int64_t> rank(total, -1);
  for (int64_t lg = 0; lg < heads; ++lg) {
    for (int64_t pos = 0; pos < c.n; ++pos) {
      if (std::isfinite(cpu.scores[lg * c.n + pos])) order[lg].push_back(pos);
    }
    std::stable_sort(order[lg].begin(), order[lg].end(), [&](int64_t x, int64_t y) {
      return cpu.scores[lg * c.n + x] > cpu.scores[lg * c.n + y];
    });
    for (size_t k = 0; k < order[lg].size(); ++k) rank[lg * c.n + order[lg][k]] = k;
  }
  // min_per_head: each head first reserves its best r candidates (SEMANTICS.md, Selection), so
  // the r-th best of a head is a threshold of its own, and the reserved picks (possibly far below
  // the competition's threshold in a weak head) must not set the competition's threshold.
  const bool reserves =
      c.policy.allocation != Allocation::kUniform && !c.policy.head_uniform_layers;
  const int64_t r = reserves ? std::min<int64_t>(c.policy.min_per_head, cpu.quota) : 0;
  std::vector<float> reserve_threshold(heads, std::numeric_limits<float>::quiet_NaN());
  for (int64_t lg = 0; lg < heads; ++lg) {
    if (r > 0 && r <= static_cast<int64_t>(order[lg].size())) {
      reserve_threshold[lg] = cpu.scores[lg * c.n + order[lg][r - 1]];
    }
  }
  // The threshold of each competition: the lowest CPU score the CPU selected in it, reserved
  // picks left out.
  std::vector<float> threshold(heads, std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < total; ++i) {
    if (in_cpu[i] && std::isfinite(cpu.scores[i]) && rank[i] >= r) {
      float& t = threshold[Segment(c, i)];
      t = std::min(t, cpu.scores[i]);
    }
  }
  // head_uniform_layers: a near tie in the selection before the spreading may move one token of
  // share between layers; each head of such a layer then keeps one more or one fewer candidate
  // than on the CPU: its boundary candidates (ranks T/Hkv - 1 .. T/Hkv + 1) may differ.
  std::vector<int64_t> share_low(c.L, -1), share_high(c.L, -1);
  if (c.policy.head_uniform_layers) {
    for (int l = 0; l < c.L; ++l) {
      int64_t t_cpu = 0, t_gpu = 0;
      for (int h = 0; h < c.Hkv; ++h) {
        t_cpu += cpu.counts[l * c.Hkv + h];
        t_gpu += gpu.counts[l * c.Hkv + h];
      }
      if (t_cpu == t_gpu) continue;
      EXPECT_LE(std::abs(t_cpu - t_gpu), 1) << "layer " << l << " kept counts";
      const int64_t forced = int64_t{c.Hkv} * (cpu.window + cpu.sinks);
      share_low[l] = (std::min(t_cpu, t_gpu) - forced) / c.Hkv - 1;
      share_high[l] = (std::max(t_cpu, t_gpu) - forced) / c.Hkv + 1;
    }
  }
  const auto close = [](float s, float t) {
    return std::isfinite(t) && std::abs(s - t) <= 1e-5f * std::abs(t);
  };
  int64_t swaps = 0, bad_swaps = 0;
  for (int64_t i = 0; i < total; ++i) {
    if (in_cpu[i] == in_gpu[i]) continue;
    ++swaps;
    const int64_t lg = i / c.n, layer = lg / c.Hkv;
    const float t = threshold[Segment(c, i)], s = cpu.scores[i];
    const bool near_tie =
        std::isfinite(s) &&
        (close(s, t) || close(s, reserve_threshold[lg]) ||
         (rank[i] >= share_low[layer] && rank[i] <= share_high[layer] && share_high[layer] >= 0));
    if (!near_tie && ++bad_swaps <= 5) {
      ADD_FAILURE() << (in_cpu[i] ? "cpu" : "cuda") << " alone keeps layer " << i / (c.Hkv * c.n)
                    << " head " << (i / c.n) % c.Hkv << " position " << i % c.n << ": cpu score "
                    << s << ", threshold " << t;
    }
  }
  EXPECT_EQ(bad_swaps, 0) << swaps << " differing tokens";
  int64_t cpu_kept = 0, gpu_kept = 0;
  for (int32_t k : cpu.counts) cpu_kept += k;
  for (int32_t k : gpu.counts) gpu_kept += k;
  EXPECT_EQ(gpu_kept, cpu_kept);
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  uint32_t seed = 1000;
  // A case that leaves gqa_value unset runs twice: with the default (MEAN_HEAD_PRODUCT, which the
  // fused kernels hand to gemm) and with MEAN_HEAD_NORM, so that fused still sees every shape and
  // option.
  auto add = [&](Case c) {
    c.seed = ++seed;
    cases.push_back(c);
    if (!c.policy.gqa_value && c.policy.indicator == Indicator::kAttentionXProjectedValue) {
      c.seed = ++seed;
      c.policy.gqa_value = GqaValue::kMeanHeadNorm;
      cases.push_back(c);
    }
  };
  // GQA 1 / 4 / 8, dtypes, layouts, windows, n from 1 up.
  for (int G : {1, 4, 8}) {
    for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (int64_t n : {1, 2, 33, 300, 2049}) {
        for (int w : {1, 32, 64}) {
          Case c;
          c.Hkv = 2;
          c.H = 2 * G;
          c.n = n;
          c.wq = 64;
          c.dtype = dtype;
          c.policy.window = w;
          c.policy.budget = Budget::TokensPerHead(std::max<int64_t>(w + 8, n / 4));
          c.layout = static_cast<Layout>((n + w + G) % 3);
          add(c);
        }
      }
    }
  }
  // Every allocation, indicator and gqa_value, pooling, sinks, min_per_head, head-uniform layers.
  for (Allocation a : {Allocation::kGlobalNormalized, Allocation::kGlobalRaw, Allocation::kPerLayer,
                       Allocation::kUniform}) {
    for (GqaValue q : {GqaValue::kMeanHeadNorm, GqaValue::kSummedProjection,
                       GqaValue::kMeanHeadProduct, GqaValue::kExactBlock}) {
      Case c;
      c.L = 3;
      c.Hkv = 2;
      c.H = 8;
      c.n = 777;
      c.policy.allocation = a;
      c.policy.gqa_value = q;
      c.cross_grams = q == GqaValue::kExactBlock;
      c.policy.budget = Budget::TokensPerHead(100);
      add(c);
    }
  }
  for (Indicator i : {Indicator::kAttention, Indicator::kAttentionXValue}) {
    Case c;
    c.policy.indicator = i;
    c.n = 1500;
    add(c);
  }
  // Both pool targets with every attention summary and value factor (fused runs the group-mean
  // modes, gemm the rest).
  for (PoolTarget target : {PoolTarget::kAttention, PoolTarget::kScore}) {
    for (auto [i, q] : {std::pair{Indicator::kAttentionXProjectedValue, GqaValue::kMeanHeadNorm},
                        {Indicator::kAttentionXProjectedValue, GqaValue::kSummedProjection},
                        {Indicator::kAttentionXProjectedValue, GqaValue::kMeanHeadProduct},
                        {Indicator::kAttentionXProjectedValue, GqaValue::kExactBlock},
                        {Indicator::kAttentionXValue, GqaValue::kMeanHeadNorm},
                        {Indicator::kAttention, GqaValue::kMeanHeadNorm}}) {
      for (Pooling p : {Pooling::kAvg, Pooling::kMax, Pooling::kAvgPeak}) {
        Case c;
        c.Hkv = 2;
        c.H = 8;
        c.n = 777;
        c.policy.indicator = i;
        c.policy.gqa_value = q;
        c.policy.pooling = p;
        c.policy.pool_target = target;
        c.policy.sinks = 3;
        c.cross_grams = q == GqaValue::kExactBlock;
        c.policy.budget = Budget::TokensPerHead(100);
        add(c);
      }
    }
  }
  for (Pooling p : {Pooling::kAvg, Pooling::kMax, Pooling::kNone, Pooling::kAvgPeak}) {
    for (int k : {1, 5, 7, 31}) {
      Case c;
      c.policy.pooling = p;
      c.policy.pool_kernel = k;
      c.n = 600;
      add(c);
    }
  }
  {
    Case c;
    c.policy.sinks = 4;
    c.policy.min_per_head = 3;
    c.Hkv = 4;
    c.H = 16;
    c.n = 1000;
    add(c);
    c.policy.head_uniform_layers = true;
    add(c);
    c.lse = true;
    add(c);
    c.policy.budget = Budget::CompressionRatio(0.9);
    add(c);
  }
  {
    Case c;  // max_layer_share: selected on the host from the device's raw scores
    c.L = 4;
    c.Hkv = 2;
    c.H = 8;
    c.n = 900;
    c.policy.max_layer_share = 1.25;
    add(c);
    c.policy.min_per_head = 3;
    c.policy.head_uniform_layers = true;
    add(c);
    c.policy.allocation = Allocation::kGlobalRaw;
    add(c);
  }
  {
    Case c;  // budget below the window: only forced tokens; and above n: everything
    c.policy.budget = Budget::TokensPerHead(8);
    add(c);
    c.policy.budget = Budget::TokensPerHead(100000);
    add(c);
  }
  {
    Case c;  // Llama-like head geometry at 64K tokens (one layer pair), bf16, engine layout
    c.L = 2;
    c.H = 32;
    c.Hkv = 8;
    c.d = 128;
    c.D = 256;
    c.n = 65536;
    c.wq = 64;
    c.policy.window = 64;
    c.layout = Layout::kTokenMajor;
    c.policy.budget = Budget::TokensPerHead(2048);
    add(c);
  }
  // Under compute-sanitizer (tests/gpu/run.sh sets LAPROX_CUDA_TEST_SMALL) only the small
  // cases: the instrumented kernels run 10-100 times slower.
  if (std::getenv("LAPROX_CUDA_TEST_SMALL") != nullptr) {
    std::erase_if(cases, [](const Case& c) { return c.n > 4096; });
  }
  return cases;
}

// Window attention far below 1e-19 (tests/reference/compare_test.py, build_tiny_attention_grid):
// the selection threshold among tokens whose attention is 1e-24 to 1e-29 in every row. In fp32
// their squares flush to 0 and they tie; both backends must follow the true order (fp64 squares,
// AVG windows summed from their own terms).
std::vector<Case> TinyAttentionCases() {
  std::vector<Case> cases;
  uint32_t seed = 5000;
  const GqaValue gqas[] = {GqaValue::kMeanHeadNorm, GqaValue::kMeanHeadProduct,
                           GqaValue::kExactBlock};
  struct Variant {
    Case::Tiny tiny;
    Pooling pooling;
    double share;
  } variants[] = {{Case::Tiny::kRandom, Pooling::kNone, 0.85},
                  {Case::Tiny::kRise, Pooling::kMax, 0.95},
                  {Case::Tiny::kFall, Pooling::kAvg, 0.85}};
  int i = 0;
  for (const Variant& v : variants) {
    for (int w : {1, 8}) {
      for (bool lse : {false, true}) {
        Case c;
        c.seed = ++seed;
        c.tiny = v.tiny;
        c.Hkv = 2;
        c.H = 4;
        c.n = 300;
        c.wq = w;
        c.lse = lse;
        c.dtype = i % 2 == 0 ? DType::kBF16 : DType::kF32;
        c.policy.window = w;
        c.policy.pooling = v.pooling;
        c.policy.gqa_value = gqas[i % 3];
        c.cross_grams = c.policy.gqa_value == GqaValue::kExactBlock;
        c.policy.budget = Budget::TokensPerHead(w + static_cast<int64_t>(v.share * (300 - w)));
        cases.push_back(c);
        ++i;
      }
    }
  }
  return cases;
}

class CudaBackendTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    auto cuda = CreateBackend("cuda", {.device = 0, .cuda_kernels = GetParam()});
    if (!cuda.ok()) GTEST_SKIP() << "no usable CUDA device: " << cuda.status();
    cuda_ = *std::move(cuda);
    cpu_ = *CreateBackend("cpu", {.threads = 8});
  }

  // The CPU plan and the CUDA plan of `c`, inputs on the host or on the device.
  void Compare(const Case& c, bool device_inputs) {
    SCOPED_TRACE(absl::StrCat(c.Name(), device_inputs ? " (device inputs)" : " (host inputs)"));
    Inputs inputs(c);
    const PrepareOptions options{.cross_grams = c.cross_grams, .output_projection = false};
    const auto host = inputs.HostPointers();
    auto cpu_model =
        cpu_->PrepareModel(*Geometry(c), inputs.OProj(host[4], MemorySpace::kHost), options);
    ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
    auto cpu_plan = cpu_->ComputeKeepPlan(**cpu_model, inputs.Request(host, MemorySpace::kHost));
    ASSERT_TRUE(cpu_plan.ok()) << cpu_plan.status();

    std::unique_ptr<DeviceCopies> copies;
    const MemorySpace space = device_inputs ? MemorySpace::kDevice : MemorySpace::kHost;
    if (device_inputs) copies = std::make_unique<DeviceCopies>(inputs);
    const auto& pointers = device_inputs ? copies->pointers() : host;
    auto gpu_model = cuda_->PrepareModel(*Geometry(c), inputs.OProj(pointers[4], space), options);
    ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();
    auto gpu_plan = cuda_->ComputeKeepPlan(**gpu_model, inputs.Request(pointers, space));
    ASSERT_TRUE(gpu_plan.ok()) << gpu_plan.status();
    ExpectSamePlan(c, *cpu_plan, *gpu_plan);
    EXPECT_TRUE(cuda_->Health().ok()) << cuda_->Health();
  }

  static std::unique_ptr<ModelGeometry> Geometry(const Case& c) {
    return std::make_unique<ModelGeometry>(ModelGeometry{.num_layers = c.L,
                                                         .num_heads = c.H,
                                                         .num_kv_heads = c.Hkv,
                                                         .head_dim = c.d,
                                                         .hidden_size = c.D});
  }

  std::unique_ptr<Backend> cuda_, cpu_;
};

TEST_P(CudaBackendTest, MatchesCpuWithHostInputs) {
  for (const Case& c : Cases()) Compare(c, /*device_inputs=*/false);
}

TEST_P(CudaBackendTest, MatchesCpuOnTinyAttention) {
  for (const Case& c : TinyAttentionCases()) Compare(c, /*device_inputs=*/false);
}

// An engine LSE far below the logits caps every probability at 1 on both backends (fp32 expf
// of the difference would be +inf on the device).
TEST_P(CudaBackendTest, MatchesCpuWithAnLseBelowTheLogits) {
  for (GqaValue gqa : {GqaValue::kMeanHeadNorm, GqaValue::kExactBlock}) {
    Case c;
    c.lse = true;
    c.lse_value = -1e30f;
    c.n = 500;
    c.policy.gqa_value = gqa;
    c.cross_grams = gqa == GqaValue::kExactBlock;
    c.policy.budget = Budget::TokensPerHead(100);
    Compare(c, /*device_inputs=*/false);
  }
}

TEST_P(CudaBackendTest, MatchesCpuWithDeviceInputs) {
  const std::vector<Case> cases = Cases();
  for (size_t i = 0; i < cases.size(); i += 3) Compare(cases[i], /*device_inputs=*/true);
}

// Bad values in device memory are found and named like the CPU backend names them, and the
// backend stays healthy and answers the next request.
TEST_P(CudaBackendTest, RejectsNonFiniteValuesAndStaysHealthy) {
  Case c;
  c.dtype = DType::kF32;
  Inputs inputs(c);
  auto host = inputs.HostPointers();
  std::vector<float> poisoned(static_cast<const float*>(host[1][1]),
                              static_cast<const float*>(host[1][1]) + int64_t{c.Hkv} * c.n * c.d);
  poisoned[5 * c.d + 3] = std::numeric_limits<float>::quiet_NaN();
  auto bad = host;
  bad[1][1] = poisoned.data();
  auto model = cuda_->PrepareModel(*Geometry(c), inputs.OProj(host[4], MemorySpace::kHost), {});
  ASSERT_TRUE(model.ok()) << model.status();
  auto cpu_model = cpu_->PrepareModel(*Geometry(c), inputs.OProj(host[4], MemorySpace::kHost), {});
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  auto plan = cuda_->ComputeKeepPlan(**model, inputs.Request(bad, MemorySpace::kHost));
  auto cpu_plan = cpu_->ComputeKeepPlan(**cpu_model, inputs.Request(bad, MemorySpace::kHost));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.status().message(), cpu_plan.status().message());
  EXPECT_TRUE(cuda_->Health().ok());
  EXPECT_TRUE(cuda_->ComputeKeepPlan(**model, inputs.Request(host, MemorySpace::kHost)).ok());
}

// Finite inputs too large to score: the CUDA backend rejects exactly what the CPU rejects, in
// the same words (policy/magnitude.h), stays healthy, and gives the same plan as before to the
// next valid request.
TEST_P(CudaBackendTest, RejectsOverflowingInputsLikeTheCpu) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Case c;
    c.dtype = dtype;
    c.Hkv = 2;
    c.H = 8;
    c.policy.budget = Budget::TokensPerHead(64);
    // The CPU's and the CUDA backend's answers to the same request.
    const auto plans = [&](const Inputs& inputs) {
      const auto host = inputs.HostPointers();
      std::vector<absl::StatusOr<KeepPlan>> out;
      for (Backend* backend : {cpu_.get(), cuda_.get()}) {
        auto model = backend->PrepareModel(*Geometry(c), inputs.OProj(host[4], MemorySpace::kHost),
                                           {.output_projection = false});
        if (!model.ok()) {
          out.push_back(model.status());
          continue;
        }
        out.push_back(backend->ComputeKeepPlan(**model, inputs.Request(host, MemorySpace::kHost)));
      }
      return out;
    };
    Inputs good(c);
    const auto want = plans(good);
    ASSERT_TRUE(want[0].ok()) << want[0].status();
    ASSERT_TRUE(want[1].ok()) << want[1].status();
    struct Bad {
      const char* what;
      std::function<void(Inputs&)> poison;
      const char* message;
    } bad_cases[] = {
        {"keys = queries = 3e38",
         [&](Inputs& in) {
           for (int kind : {0, 2}) {
             for (int64_t i = 0; i < in.Elements(kind, 1); ++i) in.Set(kind, 1, i, 3e38f);
           }
         },
         "layers[1].keys: the logits scale * q . k of KV head 0 may reach"},
        {"values 1e20", [&](Inputs& in) { in.Set(1, 0, (c.n + 5) * c.d + 3, 1e20f); },
         "layers[0].values: the squared scores of KV head 1 may reach"},
        {"o_proj 1e20", [&](Inputs& in) { in.Set(4, 1, 17, 1e20f); },
         "o_proj[1]: the factors W_O^h W_O^h'^T may reach"},
    };
    for (Bad& b : bad_cases) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), ", ", b.what));
      Inputs poisoned(c);
      b.poison(poisoned);
      const auto got = plans(poisoned);
      EXPECT_EQ(got[0].status().code(), absl::StatusCode::kInvalidArgument) << got[0].status();
      EXPECT_NE(got[0].status().message().find(b.message), std::string::npos) << got[0].status();
      EXPECT_EQ(got[1].status(), got[0].status());
      EXPECT_TRUE(cuda_->Health().ok()) << cuda_->Health();
      const auto again = plans(good);
      ASSERT_TRUE(again[1].ok()) << again[1].status();
      ExpectSamePlan(c, *want[0], *again[1]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, CudaBackendTest, ::testing::Values("gemm", "fused"),
                         [](const ::testing::TestParamInfo<const char*>& param) {
                           return std::string(param.param);
                         });

}  // namespace
}  // namespace laprox::kernels
