// Conversions from the 16-bit float formats (IEEE fp16, bfloat16) to fp32, on raw bit patterns.
// Branch-free so that loops over them vectorise.
#ifndef LAPROX_KERNELS_COMMON_HALF_H_
#define LAPROX_KERNELS_COMMON_HALF_H_

#include <bit>
#include <cstdint>

namespace laprox::kernels {

inline float Bf16ToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// Exact for every fp16 value, subnormals, infinities and NaN included.
inline float F16ToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t magnitude = bits & 0x7fffu;
  // Normal numbers: rebias the exponent by multiplying with 2^112 after a plain shift; this also
  // turns subnormals into the right value since the shifted pattern is an fp32 subnormal times
  // 2^112 exactly.
  const float scaled = std::bit_cast<float>(magnitude << 13) * 0x1p112f;
  // Infinity and NaN: exponent all ones.
  const uint32_t special = (magnitude << 13) | 0x7f800000u;
  const uint32_t value = magnitude >= 0x7c00u ? special : std::bit_cast<uint32_t>(scaled);
  return std::bit_cast<float>(sign | value);
}

// Round-to-nearest-even fp32 -> bf16 / fp16, used by tests and benchmarks to make inputs.
uint16_t FloatToBf16(float value);
uint16_t FloatToF16(float value);

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_COMMON_HALF_H_
