// Magnitude checks: which finite inputs can be scored in fp32 without an intermediate overflowing
// (tests/reference/SEMANTICS.md, "Finite inputs too large to score").
//
// A finite input can still overflow the fp32 arithmetic of the scoring: keys = queries = 3e38
// make every logit q . k infinite, values of 1e20 make v M v^T infinite. Instead of testing each
// intermediate after the fact (the arithmetic, and so the exact point of overflow, differs between
// backends), each check bounds a family of intermediates by the largest magnitudes of the tensors
// they come from and rejects the request with INVALID_ARGUMENT, naming the tensor, when the bound
// exceeds kMagnitudeLimit. Every backend takes the same maxima (the largest |x| of each head's
// inputs, exact: a maximum does not depend on the order it is taken in), so every backend accepts
// and rejects the same requests with the same message. Below the limit every intermediate of the
// scoring (logits, GEMM partial sums, quadratic forms, squared scores, L1 norms) is finite, with
// 2^8 of headroom to fp32's largest value for sums of a few bounded terms.
//
// The bounds are far above anything a model produces (Llama-scale logits stay below 1e3 and
// value factors below 1e6), so a rejection means the inputs are not activations of a model.
#ifndef LAPROX_KERNELS_POLICY_MAGNITUDE_H_
#define LAPROX_KERNELS_POLICY_MAGNITUDE_H_

#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "laprox/kernels/geometry.h"
#include "laprox/kernels/policy.h"
#include "laprox/kernels/request_shape.h"

namespace laprox::kernels::policy {

// 2^120 = 1.33e36, 2^8 below fp32's largest finite value (3.4e38).
inline constexpr double kMagnitudeLimit = 0x1p120;

// Logits scale * q . k of one (layer, KV head), where the window attention is computed from
// window_queries: every logit and every partial sum of the dot products (with q scaled first or
// the product scaled afterwards) is at most
//   head_dim * max_queries * max(1, max_keys) * max(1, scale),
// max_queries over the window_queries of the KV head's G query heads (every given row),
// max_keys over the head's keys (every position). INVALID_ARGUMENT
// "layers[l].keys: the logits scale * q . k of KV head g may reach ..." above the limit.
absl::Status CheckLogitMagnitude(int64_t layer, int64_t kv_head, int64_t head_dim, double scale,
                                 double max_queries, double max_keys);

// The bound hidden_size * G^2 * max_o_proj^2 on every element of a layer's factor matrices
// (kernels/cpu/factors.h: W_O^h W_O^h'^T and the summed block S S^T) and on every partial sum of
// the GEMMs that form them; max_o_proj = the largest |o_proj[l]| element.
double FactorBound(const ModelGeometry& geometry, double max_o_proj);

// PrepareModel: INVALID_ARGUMENT "o_proj[l]: the factors W_O^h W_O^h'^T may reach ..." when
// FactorBound(geometry, max_o_proj) is above the limit.
absl::Status CheckFactorMagnitude(const ModelGeometry& geometry, int64_t layer, double max_o_proj);

// What the values of one (layer, KV head) feed, for the policy of `shape` (max_values over the
// head's values at every position, max_o_proj over o_proj[l]):
//   LAPROX, ATTENTION_X_VALUE:            ||v||^2 <= V = head_dim * max_values^2;
//   LAPROX, ATTENTION_X_PROJECTED_VALUE:  v M v^T <= V = head_dim^2 * max_values^2 * FactorBound;
//     either way a squared score (attention factors are at most sqrt(1.03 * we) for probability
//     rows that sum to at most 1.01) is at most G^2 * 1.03 * max(we, 1) * V, which must be below
//     the limit ("layers[l].values: the squared scores of KV head g may reach ...");
//   CRITICALKV, CRITICAL_ADAKV: ||v W_O^h||_1 <= hidden_size * head_dim * max_values * max_o_proj
//     ("layers[l].values: ||v W_O^h||_1 of KV head g may reach ...");
//   every other policy (LAPROX with indicator ATTENTION, the SnapKV and CAKE kinds,
//   STREAMING_LLM) reads values only for the NaN/Inf check: OK.
absl::Status CheckValueMagnitude(const RequestShape& shape, const PolicySpec& policy,
                                 int64_t hidden_size, int64_t layer, int64_t kv_head,
                                 double max_values, double max_o_proj);

// x as fp32, +-inf beyond fp32's range (a plain conversion of such a double is undefined).
inline float SaturatedFloat(double x) {
  constexpr double kMax = std::numeric_limits<float>::max();
  if (x > kMax) return std::numeric_limits<float>::infinity();
  if (x < -kMax) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(x);
}

}  // namespace laprox::kernels::policy

#endif  // LAPROX_KERNELS_POLICY_MAGNITUDE_H_
