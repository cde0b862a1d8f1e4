// Warp-level helpers of the fused scorer's kernels: shared-memory addresses, ldmatrix,
// mma.sync m16n8k16 (bf16 / fp16 in, fp32 accumulation), 16-bit conversions and cp.async, as
// inline PTX. Every lane of the warp must call the ldmatrix and mma wrappers together (.sync).
// Included only from the fused_*.cu files.
#ifndef LAPROX_KERNELS_CUDA_FUSED_WARP_CUH_
#define LAPROX_KERNELS_CUDA_FUSED_WARP_CUH_

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace laprox::kernels::cuda::fused {

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(p)));
}

__device__ __forceinline__ void Ldsm4Trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(p)));
}

// c += a (16x16, row) * b (16x8, col), fp32 accumulation.
template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1);

template <>
__device__ __forceinline__ void Mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                   uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void Mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two packed 16-bit values (low half = lower address) as floats.
template <typename T>
__device__ __forceinline__ float2 Unpack(uint32_t v);
template <>
__device__ __forceinline__ float2 Unpack<__nv_bfloat16>(uint32_t v) {
  __nv_bfloat162 h;
  memcpy(&h, &v, sizeof(h));
  return __bfloat1622float2(h);
}
template <>
__device__ __forceinline__ float2 Unpack<__half>(uint32_t v) {
  __half2 h;
  memcpy(&h, &v, sizeof(h));
  return __half22float2(h);
}

template <typename T>
__device__ __forceinline__ float ToFloat(T v);
template <>
__device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float ToFloat<__half>(__half v) {
  return __half2float(v);
}
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

// 16-byte async copy global -> shared; src_bytes 0 zero-fills the destination.
__device__ __forceinline__ void CpAsync16(void* smem, const void* global, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(smem)),
               "l"(global), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ int PaddedGroupDevice(int group) {
  int gp = 1;
  while (gp < group) gp *= 2;
  return gp;
}

}  // namespace laprox::kernels::cuda::fused

#endif  // LAPROX_KERNELS_CUDA_FUSED_WARP_CUH_
