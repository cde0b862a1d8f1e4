// BaselineHead: the per-(layer, KV head) statistics of the baseline policies on the CPU — the
// pooled window-attention scores of SnapKV and CAKE, CAKE's entropy and variance sums and the
// projected value L1 norms of CriticalKV — from which policy/baselines.cc selects.
#ifndef LAPROX_KERNELS_CPU_BASELINE_STATS_H_
#define LAPROX_KERNELS_CPU_BASELINE_STATS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "cpu/window.h"
#include "laprox/kernels/backend.h"
#include "laprox/kernels/tensor_view.h"

namespace laprox::kernels::cpu {

// Where BaselineHead writes, for one (layer, KV head).
struct BaselineHeadOutput {
  float* scores = nullptr;       // [n]: pooled group score written at [0, n - we)
  float* value_norms = nullptr;  // [n]: u_i = mean_h ||v_i W_O^h||_1, or null when not needed
  double* entropy = nullptr;     // CAKE: sum of -a log(a + 1e-10) over heads, rows, prefix keys
  double* variance = nullptr;    // CAKE: sum over heads and prefix keys of the row variance
};

// Computes the statistics `policy.kind` needs for `task` and checks every input element of the
// task (NaN/Inf, probability rows), answering INVALID_ARGUMENT naming the tensor and element on
// bad data. Window attention elements a are rounded to `attention_dtype` first (kF32: not
// rounded). Per query head h of the group, over the window rows t and prefix keys i < n - we:
//   SnapKV kinds: mean_t a_t,i;  CAKE: mean_t a_t,i + gamma * var_t a_t,i (unbiased, 0 for
//   one row), and the entropy and variance sums from the unrounded a;
// pooled with the policy's pooling and averaged over the group into out.scores. STREAMING_LLM
// only checks. value_norms needs task.o_proj and task.hidden_size.
// With task.kvpress_compat (KVPRESS_COMPAT, SnapKV kinds only; T = task.compat_dtype) the
// window attention comes from rounded logits (window.h), and the row mean (fp32 sum / we), the
// pooled score (AVG: sum / k), the group mean (sum / G), every element of v_i W_O^h, each head's
// L1 norm and the norms' group mean are rounded to T, as kvpress computes them in the model dtype.
absl::Status BaselineHead(const RequestShape& shape, const PolicySpec& policy, const HeadTask& task,
                          DType attention_dtype, ScoreWorkspace& ws, const BaselineHeadOutput& out);

}  // namespace laprox::kernels::cpu

#endif  // LAPROX_KERNELS_CPU_BASELINE_STATS_H_
