#include "paged_pool.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "common/half.h"

namespace laprox::kernels::testing {

Pool BuildPool(const std::vector<float>& k, const std::vector<float>& v, int64_t Hkv, int64_t n,
               int64_t d, const BlockTable& table, int64_t physical_blocks, Layout layout,
               DType dtype) {
  const int64_t bs = table.block_size();
  Pool pool;
  pool.dtype = dtype;
  const int64_t block = bs * Hkv * d;  // elements of one block of K (or of V)
  const int64_t total = 2 * physical_blocks * block;
  pool.words.assign((total * DTypeSize(dtype) + 3) / 4, 0x7fc00000u);  // NaN garbage (fp32)
  if (layout == Layout::kFlashAttention) {
    pool.keys = {&table, block, Hkv * d, d, 1};
    pool.values = pool.keys;
    pool.values_offset = physical_blocks * block;
  } else {
    pool.keys = {&table, 2 * block, d, bs * d, 1};
    pool.values = pool.keys;
    pool.values_offset = block;
  }
  auto store = [&](int64_t offset, float x) {
    if (dtype == DType::kF32) {
      std::memcpy(reinterpret_cast<char*>(pool.words.data()) + offset * 4, &x, 4);
    } else {
      const uint16_t bits = FloatToBf16(x);
      std::memcpy(reinterpret_cast<char*>(pool.words.data()) + offset * 2, &bits, 2);
    }
  };
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = table.ids()[i / bs];
      const int64_t at = id * pool.keys.block_stride + (i % bs) * pool.keys.slot_stride +
                         h * pool.keys.head_stride;
      for (int64_t c = 0; c < d; ++c) {
        store(at + c, k[(h * n + i) * d + c]);
        store(pool.values_offset + at + c, v[(h * n + i) * d + c]);
      }
    }
  }
  return pool;
}

std::vector<int32_t> ShuffledIds(int64_t blocks, int64_t physical, uint32_t seed) {
  std::vector<int32_t> ids(physical);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(seed));
  ids.resize(blocks);
  return ids;
}

std::vector<float> RoundedToBf16(const std::vector<float>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = Bf16ToFloat(FloatToBf16(x[i]));
  return out;
}

}  // namespace laprox::kernels::testing
