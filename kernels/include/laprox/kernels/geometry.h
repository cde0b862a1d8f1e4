// ModelGeometry: the shape of a decoder-only transformer as far as KV eviction cares.
#ifndef LAPROX_KERNELS_GEOMETRY_H_
#define LAPROX_KERNELS_GEOMETRY_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace laprox::kernels {

struct ModelGeometry {
  int32_t num_layers = 0;     // L
  int32_t num_heads = 0;      // H, query heads per layer
  int32_t num_kv_heads = 0;   // Hkv, key/value heads per layer; H must be a multiple of Hkv
  int32_t head_dim = 0;       // d
  int32_t hidden_size = 0;    // D, rows of o_proj.weight [D, H*d]
  float softmax_scale = 0.f;  // logit scale; 0 means the default 1/sqrt(d)

  // G = H / Hkv, query heads per KV head (Hugging Face repeat_kv order: head h is in group h/G).
  int32_t group_size() const { return num_heads / num_kv_heads; }
  // softmax_scale, or 1/sqrt(d) when it is 0.
  float EffectiveScale() const;

  // OK, or INVALID_ARGUMENT naming the first field out of range: every count positive and at
  // most 1<<20 (hidden size and head dim at most 1<<16), H a multiple of Hkv, the scale finite
  // and non-negative.
  absl::Status Validate() const;
  std::string DebugString() const;
};

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_GEOMETRY_H_
