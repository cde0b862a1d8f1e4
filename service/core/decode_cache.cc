#include "service/core/decode_cache.h"

#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

namespace laprox::service {

absl::Status CheckCachePositions(const std::vector<CacheLayer>& cache, int64_t num_kv_heads,
                                 int64_t window_rows) {
  int64_t window_start = -1;
  for (size_t l = 0; l < cache.size(); ++l) {
    const CacheLayer& layer = cache[l];
    const int64_t n = layer.entries;
    if (static_cast<int64_t>(layer.positions.size()) != num_kv_heads * n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cache.layers[", l, "].positions has ", layer.positions.size(), " values, expected ",
          num_kv_heads, " KV heads x ", n, " entries = ", num_kv_heads * n));
    }
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      const int32_t* row = layer.positions.data() + g * n;
      const std::string head = absl::StrCat("cache.layers[", l, "].positions, KV head ", g);
      for (int64_t i = 0; i < n; ++i) {
        if (row[i] < 0 || row[i] == std::numeric_limits<int32_t>::max()) {
          return absl::InvalidArgumentError(absl::StrCat(head, ", entry ", i, ": position ", row[i],
                                                         " is outside [0, 2^31 - 1)"));
        }
        if (i > 0 && row[i] <= row[i - 1]) {
          return absl::InvalidArgumentError(absl::StrCat(
              head, ", entries ", i - 1, " and ", i, ": positions ", row[i - 1], " and ", row[i],
              row[i] == row[i - 1] ? " repeat a token" : " are out of order",
              "; they must be strictly ascending"));
        }
      }
      // Strictly ascending, so the last wq are consecutive exactly when they span wq - 1.
      const int64_t start = row[n - window_rows];
      if (row[n - 1] - start != window_rows - 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            head, ": the last ", window_rows, " entries (the window's tokens) hold positions ",
            start, " .. ", row[n - 1], ", not ", window_rows, " consecutive ones"));
      }
      if (window_start < 0) window_start = start;
      if (start != window_start) {
        return absl::InvalidArgumentError(absl::StrCat(
            head, ": the window's tokens start at position ", start, ", but at ", window_start,
            " in cache.layers[0], KV head 0; every head holds the same most recent tokens"));
      }
    }
  }
  return absl::OkStatus();
}

void ToTokenPositions(const std::vector<CacheLayer>& cache, kernels::KeepPlan& plan) {
  if (plan.positions.empty()) return;
  const int64_t Hkv = plan.num_kv_heads;
  for (int64_t lg = 0; lg < static_cast<int64_t>(plan.counts.size()); ++lg) {
    const CacheLayer& layer = cache[static_cast<size_t>(lg / Hkv)];
    const int32_t* row = layer.positions.data() + (lg % Hkv) * layer.entries;
    for (int64_t k = plan.offsets[lg]; k < plan.offsets[lg + 1]; ++k) {
      plan.positions[k] = row[plan.positions[k]];
    }
  }
}

}  // namespace laprox::service
