// The fused scorer: per layer a factor split, the window LSE (given or pass 1), the fused pass and
// the pooling kernel, all on context.stream (kernel design in fused_kernels.h and the
// fused_*.cu files).
//
// Supports: LAPROX with window_queries (not window_attention), keys / values / queries all bf16
// or all fp16 in device memory, keys and values [Hkv, n, d] with unit innermost stride and
// 16-byte aligned rows, any query strides, head_dim 64 or 128, G <= 16, the padded window rows
// fitting shared memory (Gp = G rounded up to a power of two; d = 128: Gp * we <= 336, e.g. G 4
// with w <= 84; d = 64: Gp * we <= 976),
// indicator ATTENTION, ATTENTION_X_VALUE, or ATTENTION_X_PROJECTED_VALUE with MEAN_HEAD_NORM or
// SUMMED_PROJECTION; any pooling, kernel, pool_target, sinks, allocation; window_lse (any dtype)
// or not.
// Everything else (MEAN_HEAD_PRODUCT, the default gqa_value, EXACT_BLOCK, fp32 inputs, ...) runs
// on the GEMM scorer.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "cuda/cuda_status.h"
#include "cuda/device_buffer.h"
#include "cuda/fused_kernels.h"
#include "cuda/scorer.h"
#include "policy/score_modes.h"

namespace laprox::kernels::cuda {
namespace {

// The value factor of the policy, or false when the fused scorer does not implement the
// combination.
bool ChooseValueMode(const PolicySpec& policy, FusedValueMode* mode) {
  // The fused kernel keeps one group-mean attention statistic per token. It takes the indicators
  // without projected values only at the default gqa_value, as it always has (the score ignores
  // gqa_value there, so other values go to the GEMM scorer only for caution).
  if (policy.indicator != Indicator::kAttentionXProjectedValue &&
      policy.EffectiveGqaValue() != GqaValue::kMeanHeadNorm) {
    return false;
  }
  const ScoreModes modes = ChooseScoreModes(policy, /*group=*/1);
  if (modes.attention != AttentionStat::kGroupMean) return false;  // per-head statistics: gemm
  switch (modes.value) {
    case ValueStat::kNone:
      *mode = FusedValueMode::kNone;
      return true;
    case ValueStat::kNorm:
      *mode = FusedValueMode::kNorm;
      return true;
    case ValueStat::kPerHead:
      *mode = FusedValueMode::kMeanHead;
      return true;
    case ValueStat::kSummed:
      *mode = FusedValueMode::kSummed;
      return true;
    case ValueStat::kExact:
      return false;
  }
  return false;
}

bool Projected(FusedValueMode mode) {
  return mode == FusedValueMode::kMeanHead || mode == FusedValueMode::kSummed;
}

int DeviceDTypeOf(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 0;
    case DType::kF16:
      return 1;
    case DType::kBF16:
      return 2;
  }
  return 0;
}

// Rows of 16-bit elements the kernels copy in 16-byte pieces: unit innermost stride, 16-byte
// aligned base and row starts.
bool VectorRows(const TensorView& v, int64_t head_dim) {
  return v.rank() == 3 && v.space() == MemorySpace::kDevice && v.dim(2) == head_dim &&
         v.stride(2) == 1 && v.stride(0) % 8 == 0 && v.stride(1) % 8 == 0 &&
         reinterpret_cast<uintptr_t>(v.data()) % 16 == 0;
}

int PoolingCode(Pooling pooling) {
  switch (pooling) {
    case Pooling::kNone:
      return 0;
    case Pooling::kMax:
      return 1;
    case Pooling::kAvg:
      return 2;
    case Pooling::kAvgPeak:
      return 3;
  }
  return 0;
}

class FusedScorer final : public Scorer {
 public:
  bool Supports(const RequestShape& shape, const PolicySpec& policy,
                const std::vector<LayerInputs>& layers) const override {
    FusedValueMode mode;
    if (policy.kind != PolicyKind::kLaprox || !ChooseValueMode(policy, &mode)) return false;
    if (shape.attention_given || (shape.head_dim != 64 && shape.head_dim != 128)) return false;
    if (shape.group_size < 1 || shape.group_size > 16 || shape.window < 1) return false;
    if (shape.num_kv_heads > 65535 || static_cast<int64_t>(layers.size()) != shape.num_layers) {
      return false;
    }
    const int rows = PaddedRows(shape.group_size, shape.window);
    if (FusedSmemBytes(shape.head_dim, rows, mode) > kFusedMaxSmemBytes) return false;
    if (!shape.lse_given && WindowLseSmemBytes(shape.head_dim, rows) > kFusedMaxSmemBytes) {
      return false;
    }
    for (const LayerInputs& layer : layers) {
      const DType dtype = layer.keys.dtype();
      if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
      if (layer.values.dtype() != dtype || layer.window_queries.empty() ||
          layer.window_queries.dtype() != dtype || layer.window_queries.rank() != 3 ||
          layer.window_queries.space() != MemorySpace::kDevice) {
        return false;
      }
      if (!VectorRows(layer.keys, shape.head_dim) || !VectorRows(layer.values, shape.head_dim)) {
        return false;
      }
      if (shape.lse_given &&
          (layer.window_lse.rank() != 2 || layer.window_lse.space() != MemorySpace::kDevice)) {
        return false;
      }
    }
    return true;
  }

  absl::Status Score(const DeviceContext& context, const CudaPreparedModel& model,
                     const std::vector<LayerInputs>& layers, const RequestShape& shape,
                     const PolicySpec& policy, float* d_raw) override {
    FusedValueMode mode = FusedValueMode::kNone;
    if (!ChooseValueMode(policy, &mode)) {
      return absl::InternalError(
          "FusedScorer: called for an option combination it does not support");
    }
    const int64_t n = shape.n, we = shape.window, prefix = n - we;
    const int hkv = shape.num_kv_heads, group = shape.group_size, d = shape.head_dim;
    if (prefix <= 0) return absl::OkStatus();  // no candidates, nothing to write
    const int rows = PaddedRows(group, static_cast<int>(we));
    const int blocks = mode == FusedValueMode::kMeanHead ? group : 1;
    const bool pool_score = policy.EffectivePoolTarget() == PoolTarget::kScore;
    const int first_block = mode == FusedValueMode::kMeanHead ? 1 : 0;

    // One CTA per SM (the fused CTA takes most of an SM's shared memory), split over the heads.
    const int sms = std::max(context.multiprocessors, 1);
    const int64_t pass2_tiles = (prefix + kFusedTileTokens - 1) / kFusedTileTokens;
    const int64_t pass1_tiles = (n + kFusedTileTokens - 1) / kFusedTileTokens;
    const int per_head = std::max(1, sms / hkv);
    const int ctas2 = static_cast<int>(std::min<int64_t>(per_head, pass2_tiles));
    const int ctas1 = static_cast<int>(std::min<int64_t>(per_head, pass1_tiles));

    WorkspaceLayout layout;
    const size_t lse_at = layout.Add<float>(static_cast<size_t>(hkv) * rows);
    const size_t partial_at = layout.Add<float2>(WindowLsePartialCount(hkv, ctas1, rows));
    const size_t c_at = layout.Add<float>(static_cast<size_t>(hkv) * n);
    const size_t r_at = layout.Add<float>(mode == FusedValueMode::kNone ? 0 : size_t{1} * hkv * n);
    const size_t split_elements =
        Projected(mode) ? static_cast<size_t>(hkv) * blocks * kFactorTerms * d * d : 0;
    const size_t split_at = layout.Add<uint16_t>(split_elements);
    const size_t inv_at = layout.Add<float>(Projected(mode) ? size_t{1} * hkv * blocks : 0);
    LAPROX_RETURN_IF_ERROR(
        CudaStatus(workspace_.Reserve(layout.total()), "FusedScorer: allocating the workspace"));
    auto* base = workspace_.as<unsigned char>();
    auto* lse = reinterpret_cast<float*>(base + lse_at);
    auto* partials = reinterpret_cast<float2*>(base + partial_at);
    auto* c = reinterpret_cast<float*>(base + c_at);
    auto* r = reinterpret_cast<float*>(base + r_at);
    void* split = base + split_at;
    auto* inv_scale = reinterpret_cast<float*>(base + inv_at);

    const float scale = model.geometry().EffectiveScale();
    for (int l = 0; l < shape.num_layers; ++l) {
      const LayerInputs& in = layers[l];
      FusedLayerArgs args;
      args.keys = in.keys.data();
      args.key_head_stride = in.keys.stride(0);
      args.key_token_stride = in.keys.stride(1);
      args.values = in.values.data();
      args.value_head_stride = in.values.stride(0);
      args.value_token_stride = in.values.stride(1);
      args.queries = in.window_queries.data();
      args.query_head_stride = in.window_queries.stride(0);
      args.query_row_stride = in.window_queries.stride(1);
      args.query_col_stride = in.window_queries.stride(2);
      args.dtype = DeviceDTypeOf(in.keys.dtype());
      args.n = n;
      args.head_dim = d;
      args.num_kv_heads = hkv;
      args.group = group;
      args.window_rows = shape.window_rows;
      args.window = static_cast<int>(we);
      args.scale = scale;
      const std::string where = absl::StrCat("FusedScorer layer ", l);

      if (Projected(mode)) {
        LAPROX_RETURN_IF_ERROR(
            CudaStatus(LaunchSplitFactors(model.factors(l, 0), model.matrix_size(),
                                          model.row_stride(), first_block, blocks, d, hkv,
                                          args.dtype, split, inv_scale, context.stream),
                       absl::StrCat(where, ": factor split")));
      }
      if (shape.lse_given) {
        const TensorView& view = in.window_lse;
        LAPROX_RETURN_IF_ERROR(CudaStatus(
            LaunchLoadLse(view.data(), DeviceDTypeOf(view.dtype()), view.stride(0), view.stride(1),
                          hkv, group, shape.window_rows, args.window, lse, context.stream),
            absl::StrCat(where, ": window LSE")));
      } else {
        LAPROX_RETURN_IF_ERROR(
            CudaStatus(LaunchWindowLse(args, ctas1, partials, lse, context.stream),
                       absl::StrCat(where, ": LSE pass")));
      }
      LAPROX_RETURN_IF_ERROR(CudaStatus(
          LaunchFusedScore(args, mode, lse, split, inv_scale, ctas2, c, r, context.stream),
          absl::StrCat(where, ": fused pass")));
      float* raw = d_raw + static_cast<int64_t>(l) * hkv * n;
      LAPROX_RETURN_IF_ERROR(CudaStatus(
          LaunchPoolScore(c, r, mode, pool_score, PoolingCode(policy.pooling), policy.pool_kernel,
                          n, shape.sinks, prefix, hkv, raw, context.stream),
          absl::StrCat(where, ": pooling")));
    }
    return absl::OkStatus();
  }

 private:
  DeviceBuffer workspace_;  // lse, LSE partials, c, r, split factors; grown once, reused
};

}  // namespace

std::unique_ptr<Scorer> NewFusedScorer() { return std::make_unique<FusedScorer>(); }

}  // namespace laprox::kernels::cuda
