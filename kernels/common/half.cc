#include "common/half.h"

#include <bit>
#include <cmath>

namespace laprox::kernels {

uint16_t FloatToBf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

uint16_t FloatToF16(float value) {
  // GCC and Clang implement _Float16 conversions with IEEE round-to-nearest-even.
  return std::bit_cast<uint16_t>(static_cast<_Float16>(value));
}

}  // namespace laprox::kernels
