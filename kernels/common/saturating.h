// Saturating int64 arithmetic for sizes computed from untrusted shapes: a product or sum that
// would overflow is INT64_MAX, which every budget refuses. Operands must be >= 0.
#ifndef LAPROX_KERNELS_COMMON_SATURATING_H_
#define LAPROX_KERNELS_COMMON_SATURATING_H_

#include <cstdint>
#include <initializer_list>
#include <limits>

namespace laprox::kernels {

inline int64_t SatMul(int64_t a, int64_t b) {
  int64_t out;
  return __builtin_mul_overflow(a, b, &out) ? std::numeric_limits<int64_t>::max() : out;
}

inline int64_t SatMul(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (int64_t f : factors) out = SatMul(out, f);
  return out;
}

inline int64_t SatAdd(int64_t a, int64_t b) {
  int64_t out;
  return __builtin_add_overflow(a, b, &out) ? std::numeric_limits<int64_t>::max() : out;
}

inline int64_t SatAdd(std::initializer_list<int64_t> terms) {
  int64_t out = 0;
  for (int64_t t : terms) out = SatAdd(out, t);
  return out;
}

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_COMMON_SATURATING_H_
