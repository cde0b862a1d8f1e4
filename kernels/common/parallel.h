// ParallelFor: a fixed number of std::threads over a range of independent work items.
#ifndef LAPROX_KERNELS_COMMON_PARALLEL_H_
#define LAPROX_KERNELS_COMMON_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace laprox::kernels {

// Calls fn(item, worker) for every item in [0, count) on min(threads, count) workers, the
// calling thread being worker 0. Items are claimed in increasing order. Returns when every item
// is done. `fn` must not throw.
template <typename Fn>
void ParallelFor(int64_t count, int threads, Fn&& fn) {
  const int workers = static_cast<int>(std::clamp<int64_t>(count, 1, std::max(threads, 1)));
  std::atomic<int64_t> next{0};
  auto run = [&](int worker) {
    for (int64_t item = next.fetch_add(1); item < count; item = next.fetch_add(1)) {
      fn(item, worker);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int w = 1; w < workers; ++w) pool.emplace_back(run, w);
  run(0);
  for (std::thread& t : pool) t.join();
}

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_COMMON_PARALLEL_H_
