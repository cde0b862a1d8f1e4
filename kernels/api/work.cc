#include "laprox/kernels/work.h"

#include <algorithm>

#include "common/saturating.h"

namespace laprox::kernels {
namespace {

int64_t NonNegative(int64_t x) { return std::max<int64_t>(x, 0); }

// Flops per token and KV head of the value factor: what ScoreHead's value statistics (cpu/
// score.cc) or a baseline's value norms (cpu/baseline_stats.cc) compute for one value row.
int64_t ValueFlopsPerToken(const ModelGeometry& g, const PolicySpec& policy) {
  const int64_t d = NonNegative(g.head_dim), D = NonNegative(g.hidden_size);
  const int64_t G = g.num_kv_heads > 0 ? NonNegative(g.num_heads / g.num_kv_heads) : 0;
  const int64_t triangle = SatMul(d, d + 1);  // ||v T||^2 with T triangular: d(d+1)/2 FMAs
  switch (policy.kind) {
    case PolicyKind::kLaprox:
      switch (policy.indicator) {
        case Indicator::kAttention:
          return 0;
        case Indicator::kAttentionXValue:
          return SatMul(2, d);
        case Indicator::kAttentionXProjectedValue:
          break;
      }
      switch (policy.EffectiveGqaValue()) {
        case GqaValue::kSummedProjection:
          return triangle;
        case GqaValue::kMeanHeadNorm:
        case GqaValue::kMeanHeadProduct:
          return SatMul(G, triangle);
        case GqaValue::kExactBlock:  // G diagonal triangles and G(G-1)/2 full cross forms
          return SatAdd(SatMul(G, triangle), SatMul({G, NonNegative(G - 1), d, d}));
      }
      return SatMul(G, triangle);
    case PolicyKind::kCriticalKv:
    case PolicyKind::kCriticalAdaKv:  // v W_O^h for every query head, then its L1 norm
      return SatMul({G, SatAdd(SatMul(2, d), 1), D});
    default:
      return 0;
  }
}

}  // namespace

int64_t WorkEstimate::total() const { return SatAdd(NonNegative(flops), NonNegative(bytes_read)); }

WorkEstimate KeepPlanWork(const ModelGeometry& g, const PolicySpec& policy,
                          const KeepPlanWorkShape& s) {
  const int64_t L = NonNegative(g.num_layers), H = NonNegative(g.num_heads),
                Hkv = NonNegative(g.num_kv_heads), d = NonNegative(g.head_dim);
  const int64_t n = NonNegative(s.n), we = NonNegative(s.window),
                wq = std::max(NonNegative(s.window_rows), we);
  // Per layer: every key and value element, the window tensor given.
  const int64_t kv_elements = SatMul({Hkv, n, d});
  int64_t layer_bytes = SatAdd(SatMul(kv_elements, NonNegative(s.key_bytes)),
                               SatMul(kv_elements, NonNegative(s.value_bytes)));
  const int64_t window_elements = s.attention_given ? SatMul({H, wq, n}) : SatMul({H, wq, d});
  layer_bytes = SatAdd(layer_bytes, SatMul(window_elements, NonNegative(s.window_bytes)));

  // Per layer: the window rows (logits q.k when computed, softmax and statistics), the value
  // factor of every token, pooling and the selection's passes over every entry.
  const int64_t window_entries = SatMul({H, we, n});
  int64_t layer_flops = SatMul(window_entries, kSoftmaxOps);
  if (!s.attention_given) layer_flops = SatAdd(layer_flops, SatMul({2, d, window_entries}));
  layer_flops = SatAdd(layer_flops, SatMul({Hkv, n, ValueFlopsPerToken(g, policy)}));
  const int64_t pool = policy.pooling == Pooling::kMax ? NonNegative(policy.pool_kernel) : 8;
  layer_flops = SatAdd(layer_flops, SatMul({Hkv, n, SatAdd(pool, 32)}));

  return {.flops = SatMul(L, layer_flops), .bytes_read = SatMul(L, layer_bytes)};
}

WorkEstimate PrepareWork(const ModelGeometry& g, bool cross_grams, int64_t o_proj_bytes) {
  const int64_t L = NonNegative(g.num_layers), H = NonNegative(g.num_heads),
                Hkv = NonNegative(g.num_kv_heads), d = NonNegative(g.head_dim),
                D = NonNegative(g.hidden_size);
  const int64_t G = Hkv > 0 ? H / Hkv : 0;
  // 1 + G Grams of D x d columns (2 D d^2) and their Cholesky factors (d^3), per KV head; the
  // cross-Grams W_h^T W_h' (2 D d^2 each).
  const int64_t gram = SatAdd(SatMul({2, D, d, d}), SatMul({d, d, d}));
  int64_t per_head = SatMul(1 + G, gram);
  if (cross_grams) per_head = SatAdd(per_head, SatMul({G, NonNegative(G - 1), D, d, d}));
  const int64_t flops = SatMul({L, Hkv, per_head});
  return {.flops = flops, .bytes_read = SatMul({L, D, H, d, NonNegative(o_proj_bytes)})};
}

}  // namespace laprox::kernels
