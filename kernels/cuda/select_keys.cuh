// Pieces every device selection kernel shares: the launch shape (kThreads threads per block,
// grid-stride loops past kMaxBlocks blocks), the candidate index -> flat index map and the
// selection keys whose ascending order is the selection order (score descending, then flat
// index ascending; -0 and +0 equal). Host and device inline functions. Included only from the
// select_*.cu files.
//
// Index arithmetic: flat indices and candidate indices are < 2^32 (select_kernels.h), so they
// are computed in uint32; loop counters are uint64 so that `i += stride` cannot wrap.
#ifndef LAPROX_KERNELS_CUDA_SELECT_KEYS_CUH_
#define LAPROX_KERNELS_CUDA_SELECT_KEYS_CUH_

#include <cstdint>

#include "cuda/select_kernels.h"

namespace laprox::kernels::cuda::selection {

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 1u << 16;  // grid-stride loops cover the rest
constexpr uint64_t kSentinel = ~uint64_t{0};
constexpr uint32_t kHistogramTile = 4096;  // candidates per block and histogram pass

// kThreshold: select the eligible keys whose bits at and above `shift` are <= the prefix's.
enum SelectMode : int32_t { kSearching = 0, kNone = 1, kThreshold = 2 };

inline unsigned BlocksFor(uint64_t items) {
  const uint64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks);
}

inline unsigned CappedBlocks(uint64_t blocks) {
  return static_cast<unsigned>(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks);
}

// Bits needed for values 0..value (value >= 1 gives >= 1).
inline int BitWidth(uint64_t value) {
  int bits = 0;
  while (value != 0) {
    ++bits;
    value >>= 1;
  }
  return bits;
}

// The key index field: strictly more bits than needed for j < C, so that a real key is never
// all-ones in its low bits (the sort path's sentinel stays strictly last).
inline int IndexBits(uint64_t candidate_total) { return BitWidth(candidate_total); }

// The histogram select resolves 8 bits per pass: the index field is rounded up to whole bytes.
inline int HistogramIndexBits(uint64_t candidate_total) {
  return (IndexBits(candidate_total) + 7) / 8 * 8;
}

__device__ __forceinline__ uint64_t Min64(uint64_t a, uint64_t b) { return a < b ? a : b; }

// Flat index of candidate j.
__device__ __forceinline__ uint32_t CandidateFlat(const SelectGeometry& g, uint32_t j) {
  const uint32_t row = j / g.candidates;
  return row * g.n + g.sinks + (j - row * g.candidates);
}

// Unsigned key whose ascending order is the descending order of `score`; -0 and +0 map to the
// same key (they compare equal on the CPU).
__device__ __forceinline__ uint32_t DescendingScoreKey(float score) {
  uint32_t bits = __float_as_uint(score);
  if (score == 0.0f) bits = 0;
  const uint32_t ascending = (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
  return ~ascending;
}

// Unique selection key of candidate j: ascending key order = score descending, then j (= flat
// index) ascending. index_bits <= 32.
__device__ __forceinline__ uint64_t SelectionKey(float score, uint32_t j, int index_bits) {
  return (static_cast<uint64_t>(DescendingScoreKey(score)) << index_bits) | j;
}

// Whether the bits of `key` at and above `bit` equal / are <= those of `prefix`.
__device__ __forceinline__ bool HighBitsEqual(uint64_t key, uint64_t prefix, int bit) {
  return bit >= 64 || (key >> bit) == (prefix >> bit);
}
__device__ __forceinline__ bool HighBitsAtMost(uint64_t key, uint64_t prefix, int bit) {
  return bit >= 64 || (key >> bit) <= (prefix >> bit);
}

}  // namespace laprox::kernels::cuda::selection

#endif  // LAPROX_KERNELS_CUDA_SELECT_KEYS_CUH_
