// What the CPU backend's AVX2+FMA kernels (cpu/vector_ops.cc, cpu/triangular.cc) share: whether
// this is an x86-64 build, the target attribute that compiles one function for AVX2+FMA (not the
// whole file, so nothing compiled for AVX2 runs on a CPU without it: callers check UseAvx2()
// first), and the horizontal reductions of a register.
#ifndef LAPROX_KERNELS_CPU_SIMD_H_
#define LAPROX_KERNELS_CPU_SIMD_H_

#if defined(__x86_64__)
#include <immintrin.h>
#define LAPROX_HAVE_X86 1
#define LAPROX_AVX2 __attribute__((target("avx2,fma")))

namespace laprox::kernels::cpu {

LAPROX_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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
