// RequestShape: everything a keep-plan request fixes before any tensor data is read — the sizes,
// the effective window and sinks, the per-head quota. Backend::ComputeKeepPlan derives it once
// from a validated request (policy::DeriveBudget fills the budget fields) and hands it to the
// backend's Impl, the scorers and the selection. Plain data: no behaviour, no dependencies.
#ifndef LAPROX_KERNELS_REQUEST_SHAPE_H_
#define LAPROX_KERNELS_REQUEST_SHAPE_H_

#include <cstdint>

namespace laprox::kernels {

// The selections index (layer, head, position) with 32 bits: one request scores fewer than
// 2^32 tokens, L * Hkv * n < kMaxPlanEntries (Backend::ComputeKeepPlan answers OUT_OF_RANGE).
inline constexpr int64_t kMaxPlanEntries = int64_t{1} << 32;

// Whether L * Hkv * n stays below kMaxPlanEntries, without overflow for any non-negative sizes.
constexpr bool FitsPlanEntries(int64_t layers, int64_t kv_heads, int64_t n) {
  if (layers <= 0 || kv_heads <= 0 || n <= 0) return true;
  return layers <= kMaxPlanEntries / kv_heads && layers * kv_heads <= (kMaxPlanEntries - 1) / n;
}

// The derived shape of one validated request.
struct RequestShape {
  int64_t n = 0;
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t group_size = 0;
  int32_t head_dim = 0;
  int32_t window_rows = 0;       // wq, rows given per query head
  int32_t window = 0;            // we = min(w, n), rows used (the last we of wq); 0 for
                                 // STREAMING_LLM, which reads no window
  int32_t sinks = 0;             // se = min(sinks, n - we) (LAPROX, STREAMING_LLM; else 0)
  int64_t candidates = 0;        // m = n - we - se per (layer, head)
  int64_t quota = 0;             // q = clamp(B - we - se, 0, m)
  int64_t kept_per_head = 0;     // n_kept = min(B, n), the baselines' per-head budget
  int64_t tokens_per_head = 0;   // B the budget asks for at this n, before any clamping
  int64_t block_size = 0;        // bs of a block-shaped plan (policy or keys' table); else 0
  int64_t num_blocks = 0;        // nb = ceil(n / bs) logical blocks; 0 unless block-shaped
  bool attention_given = false;  // window_attention instead of window_queries
  bool lse_given = false;
};

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_REQUEST_SHAPE_H_
