// RequestShape: everything a keep-plan request fixes before any tensor data is read — the sizes,
// the effective window and sinks, the per-head quota. Backend::ComputeKeepPlan derives it once
// from a validated request (policy::DeriveBudget fills the budget fields) and hands it to the
// backend's Impl, the scorers and the selection. Plain data: no behaviour, no dependencies.
#ifndef LAPROX_KERNELS_REQUEST_SHAPE_H_
#define LAPROX_KERNELS_REQUEST_SHAPE_H_

#include <cstdint>
#include <vector>

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
  // A decode re-plan's entries per layer (KeepPlanRequest::layer_entries; n is the largest,
  // window and sinks fit the shortest, candidates is the longest layer's); empty: n everywhere.
  std::vector<int64_t> layer_n;
};

// The entries every KV head of layer l holds: n_l of a decode re-plan, else n.
inline int64_t LayerEntries(const RequestShape& shape, int64_t layer) {
  return shape.layer_n.empty() ? shape.n : shape.layer_n[static_cast<size_t>(layer)];
}

// The shape one layer is scored with: a prefill of its own entries (n = n_l, candidates
// n_l - window - sinks), the rest as the request's.
inline RequestShape LayerShape(const RequestShape& shape, int64_t layer) {
  RequestShape layer_shape = shape;
  layer_shape.layer_n.clear();
  layer_shape.n = LayerEntries(shape, layer);
  layer_shape.candidates = layer_shape.n - layer_shape.window - layer_shape.sinks;
  return layer_shape;
}

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_REQUEST_SHAPE_H_
