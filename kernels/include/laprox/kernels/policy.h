// PolicySpec: every option of the LaProx keep-plan (docs/design.md §2) and of the baseline
// policies it is compared with (docs/design.md §3: StreamingLLM, SnapKV, PyramidKV, Ada-KV,
// CriticalKV, CriticalAdaKV, CAKE, with NVIDIA kvpress semantics).
//
// The exact meaning of each option, including the points docs/design.md leaves open, is written in
// tests/reference/SEMANTICS.md; the float64 oracle in tests/reference/ implements the same text.
#ifndef LAPROX_KERNELS_POLICY_H_
#define LAPROX_KERNELS_POLICY_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace laprox::kernels {

// The eviction method. Values are in laprox.v1 PolicyKind order (wire value = value + 1).
enum class PolicyKind {
  kLaprox,         // docs/design.md §2
  kStreamingLlm,   // `sinks` first positions + the most recent ones, the same for every head
  kSnapKv,         // mean window attention, pooled, top n_kept per head (window included)
  kPyramidKv,      // SnapKV scores, linearly decreasing per-layer counts (pyramid_beta)
  kAdaKv,          // SnapKV scores, heads of a layer share Hkv * n_kept (alpha_safeguard)
  kCriticalKv,     // SnapKV first stage, then (score + epsilon) * ||v W_O||_1 per head
  kCriticalAdaKv,  // Ada-KV head budgets, then the CriticalKV stages inside each head
  kCake,           // per-layer budgets from attention entropy and variance, mean + gamma * var
};

// How the baselines round intermediate values. LAPROX ignores it (always fp32 / fp64 sums).
enum class NumericMode {
  kExact,          // window attention kept in fp32
  kKvpressCompat,  // kvpress 0.5.5's arithmetic in the model dtype T (the keys' dtype): the
                   // SnapKV kinds round logits, scaled logits (1/sqrt(head_dim)), softmax, row
                   // mean, pool, group mean and sentinel to T and ignore a window_lse;
                   // CriticalKV rounds v W_O^h, its L1 norms, their group mean and the stage-2
                   // score; safeguard values are T's maximum; a compression ratio keeps at
                   // least 1 token (laprox.proto NUMERIC_MODE_KVPRESS_COMPAT has the list).
                   // CAKE only rounds its computed window attention after the softmax.
};

// How the model-wide budget is spread over layers and heads.
enum class Allocation {
  kGlobalNormalized,  // scores normalised per layer, one model-wide top-K (LaProx)
  kGlobalRaw,         // no per-layer normalisation (the paper's failing ablation)
  kPerLayer,          // each layer gets Hkv*(B - forced); heads compete inside the layer
  kUniform,           // each head keeps its own B - forced
};

// What a token's importance is made of.
enum class Indicator {
  kAttentionXProjectedValue,  // ||A col|| * ||v W_O||  (LaProx)
  kAttentionXValue,           // ||A col|| * ||v||
  kAttention,                 // ||A col||
};

// How query heads that share a KV head combine their value factors (GQA).
enum class GqaValue {
  kMeanHeadNorm,      // mean_h ||v W_O^h||
  kSummedProjection,  // ||v sum_h W_O^h||
  kMeanHeadProduct,   // mean_h ||A^h col|| * ||v W_O^h||
  kExactBlock,        // ||sum_h A^h col (outer) v W_O^h||_F, needs PrepareOptions::cross_grams
};

// kAvgPeak: kAvg, but never below the position's own value (max(x_i, avg(x)_i)), so that an
// isolated high score (an attention sink, a heavy hitter) is not averaged away by its neighbours.
// Appended last: the wire enum is this one plus 1.
enum class Pooling { kAvg, kMax, kNone, kAvgPeak };

// Where pooling applies in a LAPROX score, with c^h = ||A^h col||, r^h = ||v W_O^h||, c and r the
// group's attention and value factors (SEMANTICS.md, "Scores").
enum class PoolTarget {
  kAttention,  // pool(c) * r; MEAN_HEAD_PRODUCT mean_h pool(c^h) * r^h; EXACT_BLOCK each c^h
               // pooled, the heads' attention correlations and value Grams kept at the token
  kScore,      // pool(c * r); MEAN_HEAD_PRODUCT pool(mean_h c^h * r^h); EXACT_BLOCK pool(||.||_F)
};

// The shape of keep-set a plan has, so that an engine can apply it (SEMANTICS.md, "Plan
// shapes"). Values are in laprox.v1 PlanShape order (wire value = value + 1).
enum class PlanShape {
  kRagged,          // a keep-set per (layer, KV head)
  kLayerUniform,    // one count per layer, spread evenly over its heads (head_uniform_layers)
  kBlocksShared,    // whole logical blocks, the same ones in every layer and KV head (vLLM)
  kBlocksPerLayer,  // whole logical blocks per layer, the same ones in every KV head
};

inline bool IsBlockShape(PlanShape shape) {
  return shape == PlanShape::kBlocksShared || shape == PlanShape::kBlocksPerLayer;
}

// Budget: average kept tokens per KV head (window and sinks included), or a compression ratio.
struct Budget {
  enum class Kind { kTokensPerHead, kCompressionRatio };
  Kind kind = Kind::kTokensPerHead;
  int64_t tokens_per_head = 128;   // B, in [0, 2^31 - 1]
  double compression_ratio = 0.0;  // cr in [0, 1): keep int((1 - cr) * n) per head

  static Budget TokensPerHead(int64_t tokens) { return {Kind::kTokensPerHead, tokens, 0.0}; }
  static Budget CompressionRatio(double cr) { return {Kind::kCompressionRatio, 0, cr}; }
};

// Parameters of the baseline policies (kvpress defaults). LAPROX ignores them.
struct BaselineParams {
  double pyramid_beta = 20.0;      // PYRAMIDKV pyramid steepness, finite and >= 1
  double alpha_safeguard = 0.2;    // ADAKV, CRITICAL_ADAKV: share of n_kept each head keeps, [0, 1]
  double epsilon = 1e-4;           // CRITICALKV, CRITICAL_ADAKV: score offset, finite and >= 0
  double first_stage_ratio = 0.5;  // CRITICALKV, CRITICAL_ADAKV: stage-1 share, [0, 1]
  double cake_tau1 = 1.6;          // CAKE entropy exponent 1/tau1, finite and > 0
  double cake_tau2 = 0.6;          // CAKE variance exponent 1/tau2, finite and > 0
  double cake_gamma = 200.0;       // CAKE eviction score mean + gamma * variance, finite, >= 0
};

// Every option of a keep-plan request. The baselines use kind, numeric_mode, window, pooling,
// pool_kernel, budget, plan_shape, block_size and `baseline` (STREAMING_LLM: sinks and budget
// only); they ignore allocation, indicator, gqa_value, pool_target, min_per_head and
// head_uniform_layers.
struct PolicySpec {
  PolicyKind kind = PolicyKind::kLaprox;
  NumericMode numeric_mode = NumericMode::kExact;
  Allocation allocation = Allocation::kGlobalNormalized;
  Indicator indicator = Indicator::kAttentionXProjectedValue;
  std::optional<GqaValue> gqa_value;      // unset: the indicator's default (EffectiveGqaValue)
  int32_t window = 32;                    // w: observation window, 1 <= w <= rows given
  Pooling pooling = Pooling::kAvgPeak;    // LAPROX's; the baselines' (ForKind) kAvg
  int32_t pool_kernel = 31;               // odd, 1..kMaxPoolKernel
  std::optional<PoolTarget> pool_target;  // unset: the mode's placement (EffectivePoolTarget)
  int32_t sinks = 0;                      // first positions always kept, outside the competition
  int32_t min_per_head = 0;          // candidates each head reserves before the global competition
  bool head_uniform_layers = false;  // keep the layer's share but spread it evenly over heads
                                     // (LAPROX; the older spelling of kLayerUniform)
  // A cap on one layer's share of the model-wide selection (LAPROX, GLOBAL_NORMALIZED and
  // GLOBAL_RAW): a layer selects at most floor(s * Hkv * q) candidates, the slots it cannot use
  // going to the next best candidates of other layers (SEMANTICS.md, "Selection"). Unset: no
  // cap. Finite and >= 1; ignored by PER_LAYER and UNIFORM; invalid with a block shape or
  // another kind. Backends read LayerSelectionCap, never this field.
  std::optional<double> max_layer_share;
  PlanShape plan_shape = PlanShape::kRagged;
  int32_t block_size = 0;  // tokens per block of the block shapes, in [1, kMaxBlockSize];
                           // 0: the block size of layers[0].keys' block table
  Budget budget;
  BaselineParams baseline;

  static constexpr int32_t kMaxWindow = 4096;
  static constexpr int32_t kMaxPoolKernel = 1025;
  static constexpr int64_t kMaxTokensPerHead = (int64_t{1} << 31) - 1;
  static constexpr int32_t kMaxBlockSize = int32_t{1} << 16;  // BlockTable::kMaxBlockSize

  // The defaults of `kind`: LAPROX as above (window 32, gqa_value unset: MEAN_HEAD_PRODUCT with
  // the default indicator, AVG_PEAK pool 31 of the score, no sinks); STREAMING_LLM sinks 4
  // (window 32 and avg pool 7, which it does not use); SNAPKV, PYRAMIDKV, ADAKV, CRITICALKV,
  // CRITICAL_ADAKV window 64, avg pool 5; CAKE window 32, avg pool 5. The budget is the default
  // budget.
  static PolicySpec ForKind(PolicyKind kind);

  // OK, or INVALID_ARGUMENT naming the option and its value: ranges above (baseline parameters
  // whatever the kind) and, for LAPROX, the indicator / gqa_value combination (ATTENTION and
  // ATTENTION_X_VALUE take only MEAN_HEAD_NORM, or gqa_value unset); the plan shape with the
  // kind (block shapes: LAPROX, STREAMING_LLM, SNAPKV, ADAKV; LAYER_UNIFORM: every kind but
  // ADAKV and CRITICAL_ADAKV), with head_uniform_layers (not with a block shape) and with
  // block_size (0 or in [1, kMaxBlockSize]; set only with a block shape); max_layer_share
  // (finite and >= 1; LAPROX only, not with a block shape).
  absl::Status Validate() const;

  // The plan shape applied: plan_shape, or kLayerUniform when it is kRagged and LAPROX's
  // head_uniform_layers is set. Every backend reads this, never the two fields.
  PlanShape EffectivePlanShape() const;

  // The most candidates one layer may select when max_layer_share applies (set, LAPROX, a global
  // allocation): min(floor(max_layer_share * (num_kv_heads * quota)), num_layers * num_kv_heads
  // * quota), the product in IEEE double; nullopt when it does not apply (no cap). Call it on a
  // validated policy.
  std::optional<int64_t> LayerSelectionCap(int64_t num_layers, int64_t num_kv_heads,
                                           int64_t quota) const;

  // The GQA value combination: gqa_value, or when it is unset kMeanHeadProduct for LAPROX with
  // ATTENTION_X_PROJECTED_VALUE and kMeanHeadNorm otherwise (the only one the other indicators
  // take; the baselines ignore it). Every backend reads this, never gqa_value itself.
  GqaValue EffectiveGqaValue() const;

  // Where LAPROX pools: pool_target, or when it is unset the historic placement of the mode,
  // kScore for ATTENTION_X_PROJECTED_VALUE with MEAN_HEAD_PRODUCT or EXACT_BLOCK (the effective
  // gqa_value), kAttention otherwise. The placement makes no difference with Pooling::kNone or
  // Indicator::kAttention.
  PoolTarget EffectivePoolTarget() const;
};

// Upper-case names as in laprox.v1 without the enum prefix ("SNAPKV", "KVPRESS_COMPAT").
absl::string_view PolicyKindName(PolicyKind k);
absl::string_view NumericModeName(NumericMode m);
absl::string_view AllocationName(Allocation a);
absl::string_view IndicatorName(Indicator i);
absl::string_view GqaValueName(GqaValue g);
absl::string_view PoolingName(Pooling p);
absl::string_view PoolTargetName(PoolTarget t);
absl::string_view PlanShapeName(PlanShape s);

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_POLICY_H_
