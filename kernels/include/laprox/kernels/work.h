// Work estimates: what a keep-plan request or a model preparation costs in arithmetic and in
// memory reads, computed from shapes alone (nothing is read), so that a server can refuse or
// schedule a request before it runs. The memory a request needs is Backend::
// EstimateKeepPlanMemory's business; a request can need little memory and much work (a view
// that reads a few bytes of a region through zero strides as a million tokens), hence this.
//
// Work is counted in "work units": floating-point operations plus bytes read, each input
// element read counting once per logical element (an element a view repeats through zero or
// overlapping strides is charged as often as it is read). Each entry of a window row (query
// row x key) costs kSoftmaxOps besides its logit's 2d: the exp, the row sum and the attention
// statistics, passes that stream the probabilities through memory once the rows outgrow the
// caches. The estimate follows the CPU backend's algorithm within a small factor; it is a
// measure of size, not a promise of time: on the 2-vCPU machine of bench/RESULTS.md ("Work
// budget") the CPU backend ran 1.0e11 to 1.9e11 units a second (a 4096-row window at d = 8 the
// slowest, Llama-3.1-8B's geometry at 4K tokens the fastest).
//
// All arithmetic saturates at INT64_MAX (operands from the wire are untrusted); every input
// may be any value (negative sizes count as 0), so a caller may estimate before validating.
#ifndef LAPROX_KERNELS_WORK_H_
#define LAPROX_KERNELS_WORK_H_

#include <cstdint>

#include "laprox/kernels/geometry.h"
#include "laprox/kernels/policy.h"

namespace laprox::kernels {

struct WorkEstimate {
  int64_t flops = 0;       // floating-point operations (and their equivalents, see above)
  int64_t bytes_read = 0;  // input bytes read, logical elements times element size

  int64_t total() const;  // flops + bytes_read, saturating
};

// What a keep-plan's work follows from, beyond the model's geometry and the policy.
struct KeepPlanWorkShape {
  int64_t n = 0;                 // tokens
  int64_t window = 0;            // window rows the scoring uses (we = min(w, n); 0: none read)
  int64_t window_rows = 0;       // window rows given per query head (wq >= we)
  bool attention_given = false;  // window_attention [H, wq, n] instead of window_queries
  int64_t key_bytes = 4;         // element sizes of the keys, values and window tensors
  int64_t value_bytes = 4;
  int64_t window_bytes = 4;
};

// Work units per window-row entry for the softmax and the attention statistics (calibrated on
// the CPU backend: a 4096-row window over 131072 tokens at d = 8 took 1.6 ns per entry and core,
// bench/RESULTS.md, "Work budget").
inline constexpr int64_t kSoftmaxOps = 64;

// The work of one keep-plan of `shape` under `policy` on a model of `geometry`.
WorkEstimate KeepPlanWork(const ModelGeometry& geometry, const PolicySpec& policy,
                          const KeepPlanWorkShape& shape);

// The work of preparing a model's factors (Backend::PrepareModel): per layer and KV head the
// 1 + G Gram matrices of D x d columns in fp64 and their Cholesky factors, the cross-Grams on
// request, and reading o_proj once (elements of `o_proj_bytes` each).
WorkEstimate PrepareWork(const ModelGeometry& geometry, bool cross_grams, int64_t o_proj_bytes);

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_WORK_H_
