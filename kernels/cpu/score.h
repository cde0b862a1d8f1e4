// ScoreHead: raw LaProx scores p of one (layer, KV head) on the CPU (SEMANTICS.md, "Scores").
#ifndef LAPROX_KERNELS_CPU_SCORE_H_
#define LAPROX_KERNELS_CPU_SCORE_H_

#include "absl/status/status.h"
#include "cpu/window.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels::cpu {

// Writes p for the candidates [sinks, n - we) of `task` into raw[0..n) (other entries are left
// as they are) and checks every input element of the task for NaN/Inf (and, for window
// attention, that rows are probability rows). Returns INVALID_ARGUMENT naming the tensor and
// element on bad data, and naming the tensor when finite keys, queries or values could overflow
// the scores (policy/magnitude.h; task.hidden_size and task.max_o_proj must be set). Every p
// written is finite, and attention far below 1e-19 keeps its order (the attention statistics
// are scaled by a power of two so that their squares stay normal fp32: score.cc).
absl::Status ScoreHead(const RequestShape& shape, const PolicySpec& policy, const HeadTask& task,
                       ScoreWorkspace& ws, float* raw);

}  // namespace laprox::kernels::cpu

#endif  // LAPROX_KERNELS_CPU_SCORE_H_
