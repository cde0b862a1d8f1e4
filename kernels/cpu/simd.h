// What the CPU backend's AVX2+FMA and AVX-512 kernels (cpu/vector_ops.cc, cpu/triangular.cc)
// share: whether this is an x86-64 build, the target attributes that compile one function for
// AVX2+FMA or AVX-512F (not the whole file, so nothing compiled for them runs on a CPU without
// them: callers check UseAvx2() / UseAvx512() first), and the horizontal reductions of a register.
#ifndef LAPROX_KERNELS_CPU_SIMD_H_
#define LAPROX_KERNELS_CPU_SIMD_H_

#if defined(__x86_64__)
#include <immintrin.h>
#define LAPROX_HAVE_X86 1
#define LAPROX_AVX2 __attribute__((target("avx2,fma")))
// One function for AVX-512F (callers check UseAvx512() first, as for AVX2).
#define LAPROX_AVX512 __attribute__((target("avx512f,avx2,fma")))

// Around AVX-512 code: GCC 12's intrinsics pass _mm512_undefined_ps() as the unused merge source
// of their masked builtins, and GCC's -W(maybe-)uninitialized reports it inside every function
// that inlines one. (Clang knows no -Wmaybe-uninitialized and does not warn there.)
#if defined(__clang__)
#define LAPROX_AVX512_BEGIN
#define LAPROX_AVX512_END
#else
#define LAPROX_AVX512_BEGIN                                                            \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define LAPROX_AVX512_END _Pragma("GCC diagnostic pop")
#endif

namespace laprox::kernels::cpu {

LAPROX_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// (Not _mm512_reduce_add_ps nor _mm512_castps512_ps256: GCC 12 warns inside them,
// -Wuninitialized on the _mm256_undefined_pd they pass to an extract; the masked extracts have no
// undefined operand.)
LAPROX_AVX512 inline float HorizontalSum(__m512 v) {
  const __m512d x = _mm512_castps_pd(v);
  const __m256 low = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xff, x, 0));
  const __m256 high = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xff, x, 1));
  return HorizontalSum(_mm256_add_ps(low, high));
}

LAPROX_AVX2 inline float HorizontalMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

}  // namespace laprox::kernels::cpu

#else
#define LAPROX_HAVE_X86 0
#endif

#endif  // LAPROX_KERNELS_CPU_SIMD_H_
