// PolicySpec: every option of the LaProx keep-plan (DESIGN.md section 2).
//
// The exact meaning of each option, including the points DESIGN.md leaves open, is written in
// tests/reference/SEMANTICS.md; the float64 oracle in tests/reference/ implements the same text.
#ifndef LAPROX_KERNELS_POLICY_H_
#define LAPROX_KERNELS_POLICY_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace laprox::kernels {

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

enum class Pooling { kAvg, kMax, kNone };

// Budget: average kept tokens per KV head (window and sinks included), or a compression ratio.
struct Budget {
  enum class Kind { kTokensPerHead, kCompressionRatio };
  Kind kind = Kind::kTokensPerHead;
  int64_t tokens_per_head = 128;   // B, in [0, 2^31 - 1]
  double compression_ratio = 0.0;  // cr in [0, 1): keep int((1 - cr) * n) per head

  static Budget TokensPerHead(int64_t tokens) { return {Kind::kTokensPerHead, tokens, 0.0}; }
  static Budget CompressionRatio(double cr) { return {Kind::kCompressionRatio, 0, cr}; }
};

struct PolicySpec {
  Allocation allocation = Allocation::kGlobalNormalized;
  Indicator indicator = Indicator::kAttentionXProjectedValue;
  GqaValue gqa_value = GqaValue::kMeanHeadNorm;
  int32_t window = 32;  // w: observation window, 1 <= w <= rows given
  Pooling pooling = Pooling::kAvg;
  int32_t pool_kernel = 7;           // odd, 1..kMaxPoolKernel
  int32_t sinks = 0;                 // first positions always kept, outside the competition
  int32_t min_per_head = 0;          // candidates each head reserves before the global competition
  bool head_uniform_layers = false;  // keep the layer's share but spread it evenly over heads
  Budget budget;

  static constexpr int32_t kMaxWindow = 4096;
  static constexpr int32_t kMaxPoolKernel = 1025;
  static constexpr int64_t kMaxTokensPerHead = (int64_t{1} << 31) - 1;

  // OK, or INVALID_ARGUMENT naming the option and its value: ranges above, and the indicator /
  // gqa_value combination (ATTENTION and ATTENTION_X_VALUE take only MEAN_HEAD_NORM).
  absl::Status Validate() const;
};

absl::string_view AllocationName(Allocation a);
absl::string_view IndicatorName(Indicator i);
absl::string_view GqaValueName(GqaValue g);
absl::string_view PoolingName(Pooling p);

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_POLICY_H_
