// Small statistics shared by the benchmarks.
#ifndef LAPROX_BENCH_BENCH_STATS_H_
#define LAPROX_BENCH_BENCH_STATS_H_

#include <algorithm>
#include <cstddef>
#include <vector>

namespace laprox::bench {

// The upper median of `v` (the middle value of an odd count); 0 when empty.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// The element at rank floor(p * (size - 1)) of the sorted `v`, for p in [0, 1] (so p = 0.5 is the
// lower median); 0 when empty.
inline double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

}  // namespace laprox::bench

#endif  // LAPROX_BENCH_BENCH_STATS_H_
