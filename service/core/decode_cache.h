// A decode re-plan's cache (laprox.proto DecodeCache): the checks of its token positions, and
// the plan's entry indices turned into those positions. Part of Core (service/core/core.cc),
// in a file of its own.
#ifndef LAPROX_SERVICE_CORE_DECODE_CACHE_H_
#define LAPROX_SERVICE_CORE_DECODE_CACHE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "laprox/kernels/keep_plan.h"
#include "service/core/core.h"

namespace laprox::service {

// The token positions of a decode re-plan's cache (laprox.proto, DecodeCacheLayer), after the
// backend checked the entry counts and shapes: Hkv * n_l of them per layer, each in
// [0, 2^31 - 1), strictly ascending along every head, and the last wq entries of every head the
// same consecutive positions (the window queries' tokens).
absl::Status CheckCachePositions(const std::vector<CacheLayer>& cache, int64_t num_kv_heads,
                                 int64_t window_rows);

// A decode re-plan's plan positions are entry indices: the token positions of those entries.
void ToTokenPositions(const std::vector<CacheLayer>& cache, kernels::KeepPlan& plan);

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_DECODE_CACHE_H_
