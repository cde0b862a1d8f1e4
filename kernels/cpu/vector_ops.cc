#include "cpu/vector_ops.h"

#include <bit>
#include <cstring>

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define LAPROX_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define LAPROX_VECTOR_CLONES
#endif

namespace laprox::kernels::cpu {
namespace {

// Cephes-style expf: range reduction by ln 2, degree-6 polynomial, exponent by bit shift.
// Branch-free so that it vectorises; inputs below -87 give ~0 (well under fp32's precision of
// any softmax row sum), inputs are never above 0 here (shifted by the row maximum).
inline float ExpApprox(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  float fx = x * 1.44269504088896341f + 0.5f;
  // floor() without libm so that it vectorises on baseline x86-64.
  float t = static_cast<float>(static_cast<int32_t>(fx));
  fx = t > fx ? t - 1.0f : t;
  x -= fx * 0.693359375f;
  x -= fx * -2.12194440e-4f;
  const float z = x * x;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const int32_t e = (static_cast<int32_t>(fx) + 127) << 23;
  return y * std::bit_cast<float>(e);
}

}  // namespace

LAPROX_VECTOR_CLONES bool AllFinite(const float* values, int64_t count) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, 4);
    bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

LAPROX_VECTOR_CLONES double ExpShiftedInPlace(float* x, int64_t count) {
  float max = x[0];
  for (int64_t i = 1; i < count; ++i) max = x[i] > max ? x[i] : max;
  ExpInPlace(x, count, max);
  // Blocked partial sums in float, combined in double: accurate and still vectorised.
  double sum = 0.0;
  constexpr int64_t kBlock = 256;
  for (int64_t b = 0; b < count; b += kBlock) {
    const int64_t end = b + kBlock < count ? b + kBlock : count;
    float part = 0.f;
    for (int64_t i = b; i < end; ++i) part += x[i];
    sum += part;
  }
  return sum;
}

LAPROX_VECTOR_CLONES void ExpInPlace(float* x, int64_t count, float shift) {
  for (int64_t i = 0; i < count; ++i) x[i] = ExpApprox(x[i] - shift);
}

LAPROX_VECTOR_CLONES void AccumulateSquaredSum(const float* const* rows, const float* scales,
                                               int num_rows, int64_t count, float* acc) {
  constexpr int64_t kBlock = 1024;
  float sum[kBlock];
  for (int64_t b = 0; b < count; b += kBlock) {
    const int64_t len = b + kBlock < count ? kBlock : count - b;
    for (int64_t i = 0; i < len; ++i) sum[i] = rows[0][b + i] * scales[0];
    for (int r = 1; r < num_rows; ++r) {
      const float* row = rows[r] + b;
      const float s = scales[r];
      for (int64_t i = 0; i < len; ++i) sum[i] += row[i] * s;
    }
    for (int64_t i = 0; i < len; ++i) acc[b + i] += sum[i] * sum[i];
  }
}

LAPROX_VECTOR_CLONES void AccumulateProduct(const float* a, const float* b, float scale,
                                            int64_t count, float* acc) {
  for (int64_t i = 0; i < count; ++i) acc[i] += a[i] * b[i] * scale;
}

LAPROX_VECTOR_CLONES float Dot(const float* a, const float* b, int64_t d) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    for (int j = 0; j < 8; ++j) part[j] += a[k + j] * b[k + j];
  }
  float tail = 0.f;
  for (; k < d; ++k) tail += a[k] * b[k];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7])) +
         tail;
}

}  // namespace laprox::kernels::cpu
