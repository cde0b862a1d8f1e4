// Element loops of the CPU backend. Each has a portable version and an AVX2+FMA version, chosen
// at run time, so one binary runs everywhere and is fast where AVX2 exists. The two versions
// agree to fp32 rounding (FMA contraction and summation order differ), not bit for bit.
// All pointers are host memory; no function allocates or keeps a pointer.
#ifndef LAPROX_KERNELS_CPU_VECTOR_OPS_H_
#define LAPROX_KERNELS_CPU_VECTOR_OPS_H_

#include <cstdint>

namespace laprox::kernels::cpu {

// True when every one of `count` fp32 values is finite.
bool AllFinite(const float* values, int64_t count);

// max_i |values[i]| for i < count (0 when count is 0); +inf when a value is infinite and none is
// NaN, NaN when one is NaN (the largest magnitude bit pattern wins). So the result is finite
// exactly when every value is.
float MaxAbs(const float* values, int64_t count);

// x[i] = exp(x[i] - max(x)) in place for i < count; returns the sum of the new values (float64
// accumulation). Relative error of each exp below 2e-7.
double ExpShiftedInPlace(float* x, int64_t count);

// x[i] = exp(min(x[i] - shift, 0)) in place: at most 1, so a shift below some x[i] (an engine's
// window LSE that does not match the logits) cannot overflow what is computed from it.
void ExpInPlace(float* x, int64_t count, float shift);

// acc[i] += (sum_r rows[r][i] * scales[r])^2 for r < num_rows, i < count (fp32; callers scale
// to keep the squares of small values normal: kernels/cpu/score.cc).
void AccumulateSquaredSum(const float* const* rows, const float* scales, int num_rows,
                          int64_t count, float* acc);

// acc[i] += (a[i] * scale) * b[i]: scaled first, so that a scale above 1 keeps the product of two
// small factors from underflowing.
void AccumulateProduct(const float* a, const float* b, float scale, int64_t count, float* acc);

// Dot product of two length-d vectors in fp32.
float Dot(const float* a, const float* b, int64_t d);

// sum_i |x[i]| in fp32 (the L1 norm), i < count.
float AbsSum(const float* x, int64_t count);

// x[i] = x[i] rounded to the nearest bfloat16 / IEEE fp16 value (ties to even) and back to
// fp32, i < count: the round trip through the 16-bit type, without storing it. Exact (the same
// bits in both versions); subnormals are kept, values beyond the type's range become +-inf and
// NaN stays NaN.
void RoundToBf16(float* x, int64_t count);
void RoundToF16(float* x, int64_t count);

// What this CPU's vector units offer (CPUID, and XCR0 for the OS's zmm state); all false off x86.
struct CpuVectors {
  bool avx2_fma = false;
  bool avx512f = false;
  bool avx512_bw_dq_vl = false;  // with AVX-512F: what OpenBLAS's SkylakeX kernels use
};
CpuVectors DetectCpuVectors();

// Whether the AVX2+FMA versions run: the CPU has AVX2 and FMA and ForcePortableVectorOps is off.
// Other files with AVX2 kernels (cpu/triangular.cc) choose by it too.
bool UseAvx2();

// Whether AVX-512F kernels run (cpu/triangular.cc has one): UseAvx2(), the CPU (and the OS) have
// AVX-512F, and LimitVectorOps did not cap them at AVX2.
bool UseAvx512();

// Tests: true forces the portable versions on every thread (false restores the choice).
void ForcePortableVectorOps(bool portable);

// Tests: true runs the AVX2 kernels where there is an AVX-512 one too (false restores the choice).
void LimitVectorOpsToAvx2(bool limit);

// Tests: LimitVectorOpsToAvx2(true) for the guard's lifetime, undone by its destructor, so that a
// test that stops early (a failed ASSERT) does not leave the tests after it on the AVX2 kernels.
class ScopedAvx2Limit {
 public:
  ScopedAvx2Limit() { LimitVectorOpsToAvx2(true); }
  ~ScopedAvx2Limit() { LimitVectorOpsToAvx2(false); }
  ScopedAvx2Limit(const ScopedAvx2Limit&) = delete;
  ScopedAvx2Limit& operator=(const ScopedAvx2Limit&) = delete;
};

}  // namespace laprox::kernels::cpu

#endif  // LAPROX_KERNELS_CPU_VECTOR_OPS_H_
