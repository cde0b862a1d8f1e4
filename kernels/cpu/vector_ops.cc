#include "cpu/vector_ops.h"

#include <atomic>
#include <bit>
#include <cstring>

#include "common/half.h"

#include "cpu/simd.h"

#if LAPROX_HAVE_X86
#include <cpuid.h>
#endif

// Each operation has a portable scalar version and, on x86-64, an AVX2+FMA version written with
// intrinsics (GCC at -O2 vectorises none of these loops: the exp needs fast-math to vectorise
// and the reductions need reassociation). The AVX2 versions carry a target attribute instead of
// file-wide -mavx2, so nothing compiled for AVX2 can leak into code that runs on other CPUs;
// the public functions pick one at run time.

namespace laprox::kernels::cpu {
namespace {

// ---- Portable versions ------------------------------------------------------------------------

// The exp of every version (ExpScalar, Exp8, Exp16): x = n ln2 + r with ln 2 split in a high
// part exact in few bits and a low part, exp(r) by a polynomial, 2^n by the exponent bits.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;
constexpr float kExpP0 = 1.9875691500e-4f, kExpP1 = 1.3981999507e-3f, kExpP2 = 8.3334519073e-3f,
                kExpP3 = 4.1665795894e-2f, kExpP4 = 1.6666665459e-1f, kExpP5 = 5.0000001201e-1f;

// Cephes-style expf: range reduction by ln 2, degree-6 polynomial, exponent by bit shift.
// Inputs below -87 give ~2^-126 (far below fp32 precision of a softmax row sum); inputs here are
// never above 0 (shifted by the row maximum).
inline float ExpScalar(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  float fx = x * kLog2e + 0.5f;
  const float t = static_cast<float>(static_cast<int32_t>(fx));
  fx = t > fx ? t - 1.0f : t;  // floor
  x -= fx * kLn2High;
  x -= fx * kLn2Low;
  const float z = x * x;
  float y = kExpP0;
  y = y * x + kExpP1;
  y = y * x + kExpP2;
  y = y * x + kExpP3;
  y = y * x + kExpP4;
  y = y * x + kExpP5;
  y = y * z + x + 1.0f;
  const int32_t e = (static_cast<int32_t>(fx) + 127) << 23;
  return y * std::bit_cast<float>(e);
}

bool AllFiniteScalar(const float* values, int64_t count) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, 4);
    bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

// The largest |x| as a bit pattern (sign cleared): for non-negative floats the bit patterns
// order like the values, +inf above every finite value and NaN above +inf.
uint32_t MaxAbsBitsScalar(const float* values, int64_t begin, int64_t count) {
  uint32_t max = 0;
  for (int64_t i = begin; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, 4);
    bits &= 0x7fffffffu;
    max = bits > max ? bits : max;
  }
  return max;
}

float MaxScalar(const float* x, int64_t count) {
  float max = x[0];
  for (int64_t i = 1; i < count; ++i) max = x[i] > max ? x[i] : max;
  return max;
}

void ExpInPlaceScalar(float* x, int64_t count, float shift) {
  for (int64_t i = 0; i < count; ++i) {
    const float y = x[i] - shift;
    x[i] = ExpScalar(y < 0.f ? y : 0.f);
  }
}

// Sum in blocks of 256 floats combined in double: accurate without a double per element.
double SumScalar(const float* x, int64_t count) {
  double sum = 0.0;
  for (int64_t b = 0; b < count; b += 256) {
    const int64_t end = b + 256 < count ? b + 256 : count;
    float part = 0.f;
    for (int64_t i = b; i < end; ++i) part += x[i];
    sum += part;
  }
  return sum;
}

void AccumulateSquaredSumScalar(const float* const* rows, const float* scales, int num_rows,
                                int64_t begin, int64_t count, float* acc) {
  for (int64_t i = begin; i < count; ++i) {
    float s = rows[0][i] * scales[0];
    for (int r = 1; r < num_rows; ++r) s += rows[r][i] * scales[r];
    acc[i] += s * s;
  }
}

void AccumulateProductScalar(const float* a, const float* b, float scale, int64_t begin,
                             int64_t count, float* acc) {
  for (int64_t i = begin; i < count; ++i) acc[i] += a[i] * scale * b[i];
}

float DotScalar(const float* a, const float* b, int64_t begin, int64_t d) {
  float sum = 0.f;
  for (int64_t k = begin; k < d; ++k) sum += a[k] * b[k];
  return sum;
}

float AbsSumScalar(const float* x, int64_t begin, int64_t count) {
  float sum = 0.f;
  for (int64_t i = begin; i < count; ++i) sum += x[i] < 0.f ? -x[i] : x[i];
  return sum;
}

void RoundToBf16Scalar(float* x, int64_t begin, int64_t count) {
  for (int64_t i = begin; i < count; ++i) x[i] = Bf16ToFloat(FloatToBf16(x[i]));
}

void RoundToF16Scalar(float* x, int64_t begin, int64_t count) {
  for (int64_t i = begin; i < count; ++i) x[i] = F16ToFloat(FloatToF16(x[i]));
}

// ---- AVX2 + FMA versions ----------------------------------------------------------------------

#if LAPROX_HAVE_X86

// The same polynomial as ExpScalar, eight lanes at a time.
LAPROX_AVX2 inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2High), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Low), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(kExpP0);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP1));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP2));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP3));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP4));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpP5));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

LAPROX_AVX2 bool AllFiniteAvx2(const float* values, int64_t count) {
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  __m256i bad = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i));
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(bits, exponent), exponent));
  }
  return _mm256_testz_si256(bad, bad) && AllFiniteScalar(values + i, count - i);
}

LAPROX_AVX2 float MaxAbsAvx2(const float* values, int64_t count) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  __m256i max0 = _mm256_setzero_si256(), max1 = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i + 8));
    max0 = _mm256_max_epu32(max0, _mm256_and_si256(a, magnitude));
    max1 = _mm256_max_epu32(max1, _mm256_and_si256(b, magnitude));
  }
  for (; i + 8 <= count; i += 8) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i));
    max0 = _mm256_max_epu32(max0, _mm256_and_si256(a, magnitude));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_max_epu32(max0, max1));
  uint32_t max = MaxAbsBitsScalar(values, i, count);
  for (uint32_t lane : lanes) max = lane > max ? lane : max;
  return std::bit_cast<float>(max);
}

LAPROX_AVX2 float MaxAvx2(const float* x, int64_t count) {
  if (count < 8) return MaxScalar(x, count);
  __m256 max = _mm256_loadu_ps(x);
  int64_t i = 8;
  for (; i + 8 <= count; i += 8) max = _mm256_max_ps(max, _mm256_loadu_ps(x + i));
  float m = HorizontalMax(max);
  for (; i < count; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

LAPROX_AVX2 void ExpInPlaceAvx2(float* x, int64_t count, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  int64_t i = 0;
  const __m256 zero = _mm256_setzero_ps();
  for (; i + 8 <= count; i += 8) {
    const __m256 y = _mm256_min_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), s), zero);
    _mm256_storeu_ps(x + i, Exp8(y));
  }
  ExpInPlaceScalar(x + i, count - i, shift);
}

// x[i] = exp(min(x[i] - shift, 0)) and their sum in one pass: the exps of ExpInPlaceAvx2, added
// as SumScalar does (blocks of 256 floats in fp32, here in eight lanes; the blocks in double).
LAPROX_AVX2 double ExpSumInPlaceAvx2(float* x, int64_t count, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  const __m256 zero = _mm256_setzero_ps();
  double sum = 0.0;
  int64_t i = 0;
  while (i + 8 <= count) {
    __m256 part = _mm256_setzero_ps();
    const int64_t end = i + 256 < count ? i + 256 : count;
    for (; i + 8 <= end; i += 8) {
      const __m256 e = Exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), s), zero));
      _mm256_storeu_ps(x + i, e);
      part = _mm256_add_ps(part, e);
    }
    sum += HorizontalSum(part);
  }
  ExpInPlaceScalar(x + i, count - i, shift);
  for (; i < count; ++i) sum += x[i];
  return sum;
}

// From element `begin` on (the AVX-512 version's tail; a multiple of 8 keeps the blocks).
LAPROX_AVX2 void AccumulateSquaredSumAvx2(const float* const* rows, const float* scales,
                                          int num_rows, int64_t begin, int64_t count, float* acc) {
  int64_t i = begin;
  for (; i + 8 <= count; i += 8) {
    __m256 s = _mm256_mul_ps(_mm256_loadu_ps(rows[0] + i), _mm256_set1_ps(scales[0]));
    for (int r = 1; r < num_rows; ++r) {
      s = _mm256_fmadd_ps(_mm256_loadu_ps(rows[r] + i), _mm256_set1_ps(scales[r]), s);
    }
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(s, s, _mm256_loadu_ps(acc + i)));
  }
  AccumulateSquaredSumScalar(rows, scales, num_rows, i, count, acc);
}

LAPROX_AVX2 void AccumulateProductAvx2(const float* a, const float* b, float scale, int64_t count,
                                       float* acc) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 as = _mm256_mul_ps(_mm256_loadu_ps(a + i), s);
    _mm256_storeu_ps(acc + i,
                     _mm256_fmadd_ps(as, _mm256_loadu_ps(b + i), _mm256_loadu_ps(acc + i)));
  }
  AccumulateProductScalar(a, b, scale, i, count, acc);
}

LAPROX_AVX2 float DotAvx2(const float* a, const float* b, int64_t d) {
  __m256 sum = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), sum);
  }
  return HorizontalSum(sum) + DotScalar(a, b, k, d);
}

LAPROX_AVX2 float AbsSumAvx2(const float* x, int64_t count) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    sum = _mm256_add_ps(sum, _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
  }
  return HorizontalSum(sum) + AbsSumScalar(x, i, count);
}

// FloatToBf16 eight lanes at a time: add 0x7fff plus the lowest kept bit, clear the low half
// (a carry into the exponent rounds up to the next binade or to infinity); NaN is only quieted.
LAPROX_AVX2 void RoundToBf16Avx2(float* x, int64_t count) {
  const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  const __m256i quiet = _mm256_set1_epi32(0x00400000);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    const __m256i rounded =
        _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(bias, odd)), high);
    const __m256i nan = _mm256_and_si256(_mm256_or_si256(bits, quiet), high);
    const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    _mm256_storeu_ps(
        x + i, _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(nan), is_nan));
  }
  RoundToBf16Scalar(x, i, count);
}

// F16C converts with the current rounding mode overridden to nearest even.
__attribute__((target("avx2,fma,f16c"))) void RoundToF16F16c(float* x, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(half));
  }
  RoundToF16Scalar(x, i, count);
}

// ---- AVX-512F versions -------------------------------------------------------------------------
//
// Sixteen lanes doing, lane by lane, what the AVX2 versions do in eight, and adding in the same
// order, so their results are the same bits (primitives_test checks it): which kernel ran does
// not change a score.
LAPROX_AVX512_BEGIN

// Exp8, sixteen lanes (the same operations on every lane).
LAPROX_AVX512 inline __m512 Exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2High), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Low), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(kExpP0);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP1));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP2));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP3));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP4));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpP5));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// The halves of a zmm register (masked extracts: see HorizontalSum in cpu/simd.h).
LAPROX_AVX512 inline __m256 Half(__m512 v, int high) {
  return high ? _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xff, _mm512_castps_pd(v), 1))
              : _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xff, _mm512_castps_pd(v), 0));
}

// ExpSumInPlaceAvx2 with the exp on sixteen lanes; the eight-lane partial sums take the two
// halves in order, as the AVX2 loop takes two vectors.
LAPROX_AVX512 double ExpSumInPlaceAvx512(float* x, int64_t count, float shift) {
  const __m512 s = _mm512_set1_ps(shift);
  const __m512 zero = _mm512_setzero_ps();
  double sum = 0.0;
  int64_t i = 0;
  while (i + 8 <= count) {
    __m256 part = _mm256_setzero_ps();
    const int64_t end = i + 256 < count ? i + 256 : count;
    for (; i + 16 <= end; i += 16) {
      const __m512 e = Exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), s), zero));
      _mm512_storeu_ps(x + i, e);
      part = _mm256_add_ps(_mm256_add_ps(part, Half(e, 0)), Half(e, 1));
    }
    if (i + 8 <= end) {  // one vector of eight left in the block: as in the AVX2 loop
      const __m256 e =
          Exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), Half(s, 0)), Half(zero, 0)));
      _mm256_storeu_ps(x + i, e);
      part = _mm256_add_ps(part, e);
      i += 8;
    }
    sum += HorizontalSum(part);
  }
  ExpInPlaceScalar(x + i, count - i, shift);
  for (; i < count; ++i) sum += x[i];
  return sum;
}

LAPROX_AVX512 void AccumulateSquaredSumAvx512(const float* const* rows, const float* scales,
                                              int num_rows, int64_t count, float* acc) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(rows[0] + i), _mm512_set1_ps(scales[0]));
    for (int r = 1; r < num_rows; ++r) {
      s = _mm512_fmadd_ps(_mm512_loadu_ps(rows[r] + i), _mm512_set1_ps(scales[r]), s);
    }
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(s, s, _mm512_loadu_ps(acc + i)));
  }
  AccumulateSquaredSumAvx2(rows, scales, num_rows, i, count, acc);  // the last 0-15
}

LAPROX_AVX512_END

#endif  // LAPROX_HAVE_X86

std::atomic<bool> force_portable{false};
std::atomic<bool> limit_to_avx2{false};

}  // namespace

CpuVectors DetectCpuVectors() {
  CpuVectors cpu;
#if LAPROX_HAVE_X86
  cpu.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  // __builtin_cpu_supports reads CPUID only; the OS must also save the zmm state (XCR0 bits 5-7
  // with the AVX bits 1-2).
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__builtin_cpu_supports("avx512f") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 &&
      (ecx & bit_OSXSAVE) != 0) {
    unsigned xcr0 = 0, xcr0_high = 0;
    __asm__("xgetbv" : "=a"(xcr0), "=d"(xcr0_high) : "c"(0));
    cpu.avx512f = (xcr0 & 0xe6) == 0xe6;
  }
  cpu.avx512_bw_dq_vl = cpu.avx512f && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#endif
  return cpu;
}

bool UseAvx2() {
  static const bool avx2 = DetectCpuVectors().avx2_fma;
  return avx2 && !force_portable.load(std::memory_order_relaxed);
}

bool UseAvx512() {
  static const bool avx512 = DetectCpuVectors().avx512f;
  return avx512 && UseAvx2() && !limit_to_avx2.load(std::memory_order_relaxed);
}

namespace {

#if LAPROX_HAVE_X86
bool UseF16c() {
  // CPUID leaf 1, ECX bit 29 (not every compiler's __builtin_cpu_supports knows "f16c").
  static const bool f16c = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  }();
  return f16c && UseAvx2();
}
#endif

}  // namespace

void ForcePortableVectorOps(bool portable) { force_portable.store(portable); }

void LimitVectorOpsToAvx2(bool limit) { limit_to_avx2.store(limit); }

#if LAPROX_HAVE_X86
#define LAPROX_DISPATCH(avx2_call, scalar_call) return UseAvx2() ? (avx2_call) : (scalar_call)
#else
#define LAPROX_DISPATCH(avx2_call, scalar_call) return (scalar_call)
#endif

bool AllFinite(const float* values, int64_t count) {
  LAPROX_DISPATCH(AllFiniteAvx2(values, count), AllFiniteScalar(values, count));
}

float MaxAbs(const float* values, int64_t count) {
  LAPROX_DISPATCH(MaxAbsAvx2(values, count),
                  std::bit_cast<float>(MaxAbsBitsScalar(values, 0, count)));
}

static float Max(const float* x, int64_t count) {
  LAPROX_DISPATCH(MaxAvx2(x, count), MaxScalar(x, count));
}

double ExpShiftedInPlace(float* x, int64_t count) {
  const float max = Max(x, count);
#if LAPROX_HAVE_X86
  if (UseAvx512()) return ExpSumInPlaceAvx512(x, count, max);
#endif
  LAPROX_DISPATCH(ExpSumInPlaceAvx2(x, count, max),
                  (ExpInPlaceScalar(x, count, max), SumScalar(x, count)));
}

void ExpInPlace(float* x, int64_t count, float shift) {
  LAPROX_DISPATCH(ExpInPlaceAvx2(x, count, shift), ExpInPlaceScalar(x, count, shift));
}

void AccumulateSquaredSum(const float* const* rows, const float* scales, int num_rows,
                          int64_t count, float* acc) {
#if LAPROX_HAVE_X86
  if (UseAvx512()) return AccumulateSquaredSumAvx512(rows, scales, num_rows, count, acc);
#endif
  LAPROX_DISPATCH(AccumulateSquaredSumAvx2(rows, scales, num_rows, 0, count, acc),
                  AccumulateSquaredSumScalar(rows, scales, num_rows, 0, count, acc));
}

void AccumulateProduct(const float* a, const float* b, float scale, int64_t count, float* acc) {
  LAPROX_DISPATCH(AccumulateProductAvx2(a, b, scale, count, acc),
                  AccumulateProductScalar(a, b, scale, 0, count, acc));
}

float Dot(const float* a, const float* b, int64_t d) {
  LAPROX_DISPATCH(DotAvx2(a, b, d), DotScalar(a, b, 0, d));
}

float AbsSum(const float* x, int64_t count) {
  LAPROX_DISPATCH(AbsSumAvx2(x, count), AbsSumScalar(x, 0, count));
}

void RoundToBf16(float* x, int64_t count) {
  LAPROX_DISPATCH(RoundToBf16Avx2(x, count), RoundToBf16Scalar(x, 0, count));
}

void RoundToF16(float* x, int64_t count) {
  LAPROX_DISPATCH(UseF16c() ? RoundToF16F16c(x, count) : RoundToF16Scalar(x, 0, count),
                  RoundToF16Scalar(x, 0, count));
}

}  // namespace laprox::kernels::cpu
