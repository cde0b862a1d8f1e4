// The fixed world the fuzz targets run in, shared with make_seeds.cc so that seeds name it: the
// shared-memory objects and their layout, the regions and models registered at start-up, and
// their ids. Constants only (no dependencies), so the seed generator needs nothing else.
//
// Input object: kInputBytes of finite pseudo-random numbers (fixed seed), in three sections by
// dtype, so that a tensor reference into the section of its dtype reads finite values:
//   [kF32Offset, +kF32Bytes)   fp32 N(0, 1)
//   [kF16Offset, +kF16Bytes)   fp16 N(0, 1)
//   [kBf16Offset, +kBf16Bytes) bf16 N(0, 1)
// Output object: kOutputBytes of zeros, registered writable (OutputDestination); the harness
// zeroes it again after every request that named a destination, so runs stay reproducible.
#ifndef LAPROX_TESTS_FUZZ_FUZZ_WORLD_H_
#define LAPROX_TESTS_FUZZ_FUZZ_WORLD_H_

#include <cstdint>

namespace laprox::fuzz {

// A shm name in a fuzz input that contains this string has it replaced by the name of the
// harness's own input object ("laprox-fuzz-<pid>"), so seeds and crash files replay in any
// process.
inline constexpr char kSelfShmName[] = "laprox-fuzz-self";

inline constexpr int64_t kF32Offset = 0;
inline constexpr int64_t kF32Bytes = int64_t{2} << 20;
inline constexpr int64_t kF16Offset = kF32Offset + kF32Bytes;
inline constexpr int64_t kF16Bytes = int64_t{1} << 20;
inline constexpr int64_t kBf16Offset = kF16Offset + kF16Bytes;
inline constexpr int64_t kBf16Bytes = int64_t{1} << 20;
inline constexpr int64_t kInputBytes = kBf16Offset + kBf16Bytes;
inline constexpr int64_t kOutputBytes = int64_t{1} << 20;

// Region ids as the targets that register regions at start-up get them (ids start at 1).
inline constexpr uint64_t kInputRegionId = 1;   // the whole input object, read-only
inline constexpr uint64_t kOutputRegionId = 2;  // the whole output object, writable

// The models compute_keep_mask_fuzzer registers at start-up, with ids 1, 2, 3 in this order.
// o_proj of layer l, element (row r, column c) = OProjValue(model, l, r, c).
struct FuzzModel {
  int32_t num_layers, num_heads, num_kv_heads, head_dim, hidden_size;
  float softmax_scale;
  bool cross_grams;
};
inline constexpr FuzzModel kModels[] = {
    {.num_layers = 2,
     .num_heads = 4,
     .num_kv_heads = 2,
     .head_dim = 8,
     .hidden_size = 16,
     .softmax_scale = 0.f,
     .cross_grams = true},
    {.num_layers = 1,
     .num_heads = 2,
     .num_kv_heads = 2,
     .head_dim = 4,
     .hidden_size = 8,
     .softmax_scale = 0.5f,
     .cross_grams = false},
    // Many heads, tiny ones: what a request allocates per (layer, head, token) dominates.
    {.num_layers = 2,
     .num_heads = 1024,
     .num_kv_heads = 512,
     .head_dim = 2,
     .hidden_size = 4,
     .softmax_scale = 0.f,
     .cross_grams = false},
};
inline constexpr int kNumModels = 3;

inline float OProjValue(int model, int layer, int64_t row, int64_t column) {
  // Small, distinct, finite; no random generator needed to agree between programs.
  const int64_t k = (model * 131 + layer * 31 + row * 7 + column * 3) % 17;
  return static_cast<float>(k - 8) / 16.f;
}

// compute_keep_mask_fuzzer: which model a request's model_id names. 0 to kNumModels stay as they
// are (0 is "not set", the others are the registered models); of the other ids, those that are 7
// modulo 8 stay too (unknown ids), the rest map to model 1 + id % kNumModels. So most mutations
// of the id still reach a model, and unknown ids are still tried.
inline uint64_t MapModelId(uint64_t id) {
  if (id <= kNumModels || id % 8 == 7) return id;
  return 1 + id % kNumModels;
}

}  // namespace laprox::fuzz

#endif  // LAPROX_TESTS_FUZZ_FUZZ_WORLD_H_
