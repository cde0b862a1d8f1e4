// Paged KV pools for tests: one layer's keys and values laid out in a block pool as an engine
// keeps them (vLLM FlashAttention or an interleaved HND layout), at the physical ids of a block
// table, with spare blocks full of NaN so that a read outside the table cannot pass unnoticed.
#ifndef LAPROX_TESTS_KERNELS_PAGED_POOL_H_
#define LAPROX_TESTS_KERNELS_PAGED_POOL_H_

#include <cstdint>
#include <vector>

#include "laprox/kernels/tensor_view.h"

namespace laprox::kernels::testing {

// How one layer's K and V blocks lie in the pool.
enum class Layout {
  kFlashAttention,  // vLLM FlashAttention: [2, blocks, block_size, Hkv, d] (K pool, then V pool)
  kInterleavedHnd,  // [blocks, 2, Hkv, block_size, d]: a block's K then its V, heads outermost
};

// One layer's pool in `dtype` (fp32 or bf16 bits).
struct Pool {
  std::vector<uint32_t> words;  // the bytes, 4-aligned
  DType dtype = DType::kF32;
  PagedLayout keys, values;
  int64_t values_offset = 0;  // elements from the pool start to V's element 0
  const void* data() const { return words.data(); }
  const void* values_data() const {
    return static_cast<const char*>(data()) + values_offset * DTypeSize(dtype);
  }
};

// The pool of the contiguous [Hkv, n, d] keys `k` and values `v`, with the sequence's logical
// blocks at the table's physical ids among `physical_blocks` blocks (the others NaN).
Pool BuildPool(const std::vector<float>& k, const std::vector<float>& v, int64_t Hkv, int64_t n,
               int64_t d, const BlockTable& table, int64_t physical_blocks, Layout layout,
               DType dtype);

// A permutation of `blocks` ids drawn from [0, physical).
std::vector<int32_t> ShuffledIds(int64_t blocks, int64_t physical, uint32_t seed);

// Each value rounded to bf16 and back.
std::vector<float> RoundedToBf16(const std::vector<float>& x);

}  // namespace laprox::kernels::testing

#endif  // LAPROX_TESTS_KERNELS_PAGED_POOL_H_
