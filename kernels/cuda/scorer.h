// Scorer: raw LaProx scores p of every (layer, KV head, candidate) on the device.
//
// Two implementations share this interface (docs/design.md §5):
//   gemm   cuBLAS batched GEMMs for Q.K^T and V.[factor blocks], simple kernels for the softmax,
//       group statistics, quadratic forms and pooling (gemm_scorer.cc, score_kernels.cu);
//   fused  one fused kernel per layer that reads K and V once per (KV head, token tile) with
//       Q.K^T and V.R on tensor cores, after a normaliser pass (or the engine's window LSE)
//       (fused_scorer.cc, fused_kernels.h). bf16 / fp16 inputs only; the GEMM scorer handles the
//       rest.
// Both compute what kernels/cpu/score.cc computes (tests/reference/SEMANTICS.md, "Scores"),
// in fp32 with fp32 accumulation, and are compared with it by tests/cuda/.
#ifndef LAPROX_KERNELS_CUDA_SCORER_H_
#define LAPROX_KERNELS_CUDA_SCORER_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "cuda/context.h"
#include "cuda/prepared_model.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels::cuda {

class Scorer {
 public:
  virtual ~Scorer() = default;

  // Whether Score handles this request (every LAPROX option for the GEMM scorer; the fused one
  // needs a group-mean gqa_value, not MEAN_HEAD_PRODUCT (the default) or EXACT_BLOCK, bf16 or fp16
  // keys, values and queries with unit innermost stride, and window_queries, not window_attention).
  virtual bool Supports(const RequestShape& shape, const PolicySpec& policy,
                        const std::vector<LayerInputs>& layers) const = 0;

  // Writes p[(l * Hkv + g) * n + i] for every layer l, KV head g and candidate position
  // i in [shape.sinks, shape.n - shape.window) into d_raw (device, L * Hkv * n floats); other
  // entries are left as they are. Enqueued on context.stream; may synchronise.
  // Preconditions: Supports(...) is true; policy.kind == LAPROX and validated; the model was
  // prepared with cross_grams when gqa_value is EXACT_BLOCK; every view is in
  // MemorySpace::kDevice, shaped as Backend::ComputeKeepPlan checked, and InputChecker found
  // no bad value. RESOURCE_EXHAUSTED when the device is full; INTERNAL for CUDA / cuBLAS errors.
  // Not thread-safe: a Scorer keeps its workspace between calls.
  virtual absl::Status Score(const DeviceContext& context, const CudaPreparedModel& model,
                             const std::vector<LayerInputs>& layers, const RequestShape& shape,
                             const PolicySpec& policy, float* d_raw) = 0;
};

std::unique_ptr<Scorer> NewGemmScorer();
std::unique_ptr<Scorer> NewFusedScorer();

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_SCORER_H_
