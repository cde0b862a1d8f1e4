// TinyCase: owned fp32 buffers for a small keep-plan request, with views over them. Lets a test
// write the few numbers a hand-checked case needs and mutate single elements for bad-input
// tests.
#ifndef LAPROX_TESTS_KERNELS_TINY_MODEL_H_
#define LAPROX_TESTS_KERNELS_TINY_MODEL_H_

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "laprox/kernels/backend.h"

namespace laprox::kernels::testing {

struct TinyCase {
  ModelGeometry geometry;
  int64_t n = 0;
  int64_t window_rows = 0;
  // Per layer, row-major: keys/values [Hkv, n, d], queries [H, wq, d], o_proj [D, H*d].
  std::vector<std::vector<float>> keys, values, queries, o_proj;
  PolicySpec policy;

  // All-zero keys and queries (uniform attention), o_proj = identity-like ones, values zero.
  TinyCase(int L, int H, int Hkv, int d, int D, int64_t n, int64_t window_rows);

  // Fills every tensor with seeded normal values.
  void Randomize(uint32_t seed);

  std::vector<TensorView> OProjViews() const;
  KeepPlanRequest Request() const;
};

}  // namespace laprox::kernels::testing

#endif  // LAPROX_TESTS_KERNELS_TINY_MODEL_H_
