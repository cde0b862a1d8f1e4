// Small statistics shared by the benchmarks.
#ifndef LAPROX_BENCH_BENCH_STATS_H_
#define LAPROX_BENCH_BENCH_STATS_H_

#include <algorithm>
#include <vector>

namespace laprox::bench {

// The upper median of `v` (the middle value of an odd count); 0 when empty.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace laprox::bench

#endif  // LAPROX_BENCH_BENCH_STATS_H_
