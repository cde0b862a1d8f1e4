// ScoreHead: raw LaProx scores p of one (layer, KV head) on the CPU (SEMANTICS.md, "Scores").
#ifndef LAPROX_KERNELS_CPU_SCORE_H_
#define LAPROX_KERNELS_CPU_SCORE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels::cpu {

// Scratch memory of one worker thread, reused across (layer, head) tasks and requests.
struct ScoreWorkspace {
  std::vector<float> queries;    // [G * we, d], scaled
  std::vector<float> probs;      // [G * we, n], logits, then unnormalised probabilities
  std::vector<float> row_scale;  // [G * we], 1 / row sum
  std::vector<float> rows;       // converted key / value / attention rows
  std::vector<float> projected;  // [chunk, F * d], V times factor blocks
  std::vector<float> attention;  // attention statistics [S, n - we]
  std::vector<float> value;      // value statistics [F, n - we]
  std::vector<float> pre_pool;   // [n - we]
  std::vector<double> prefix_sum;
};

struct HeadTask {
  const LayerInputs* inputs = nullptr;
  int64_t layer = 0;
  int64_t kv_head = 0;
  const float* factors = nullptr;  // CpuPreparedModel::factors(layer, kv_head)
  int64_t factor_ld = 0;           // CpuPreparedModel::row_stride()
  float scale = 0.f;               // softmax scale
};

// Writes p for the candidates [sinks, n - we) of `task` into raw[0..n) (other entries are left
// as they are) and checks every input element of the task for NaN/Inf (and, for window
// attention, that rows are probability rows). Returns INVALID_ARGUMENT naming the tensor and
// element on bad data.
absl::Status ScoreHead(const PlanShape& shape, const PolicySpec& policy, const HeadTask& task,
                       ScoreWorkspace& ws, float* raw);

}  // namespace laprox::kernels::cpu

#endif  // LAPROX_KERNELS_CPU_SCORE_H_
