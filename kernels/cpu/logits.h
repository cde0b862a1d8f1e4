// The window logits q . k of the CPU backend without a BLAS call, where AVX-512F allows it.
//
// At the head dimensions of small models (d = 64) the logits of a KV group are a GEMM of
// [G * w, d] queries by [chunk, d] keys with a short inner dimension, and the library sgemm spends
// a fifth of its time outside its kernel: it packs the same queries again for every chunk of keys
// and first zeroes the output (beta = 0). Here the keys of a chunk are transposed once into
// panels of 16 keys ([d, 16] floats each) and a tile of 12 query rows by one panel is 12 zmm
// accumulators, each written once to its row of the output.
#ifndef LAPROX_KERNELS_CPU_LOGITS_H_
#define LAPROX_KERNELS_CPU_LOGITS_H_

#include <cstdint>
#include <vector>

namespace laprox::kernels::cpu {

// c[r * ldc + j] = sum_k q[r * ldq + k] * keys[j * ldk + k] (k < d) in fp32, for r < rows and
// j < count, the products added in increasing k. Returns false, writing nothing, where the CPU
// backend would not use this kernel (no AVX-512F, cpu/vector_ops.h's UseAvx512()): the caller then
// calls sgemm. `packed` is scratch (resized as needed).
bool QueryKeyLogits(const float* q, int64_t ldq, int64_t rows, const float* keys, int64_t ldk,
                    int64_t count, int64_t d, float* c, int64_t ldc, std::vector<float>& packed);

}  // namespace laprox::kernels::cpu

#endif  // LAPROX_KERNELS_CPU_LOGITS_H_
