#include "laprox/kernels/geometry.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace laprox::kernels {
namespace {

absl::Status CheckRange(const char* field, int64_t value, int64_t max) {
  if (value < 1 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.", field, " = ", value, " is outside [1, ", max, "]"));
  }
  return absl::OkStatus();
}

}  // namespace

float ModelGeometry::EffectiveScale() const {
  return softmax_scale > 0.f ? softmax_scale : 1.f / std::sqrt(static_cast<float>(head_dim));
}

absl::Status ModelGeometry::Validate() const {
  constexpr int64_t kMaxCount = int64_t{1} << 20;
  constexpr int64_t kMaxWidth = int64_t{1} << 16;
  if (auto s = CheckRange("num_layers", num_layers, kMaxCount); !s.ok()) return s;
  if (auto s = CheckRange("num_heads", num_heads, kMaxCount); !s.ok()) return s;
  if (auto s = CheckRange("num_kv_heads", num_kv_heads, kMaxCount); !s.ok()) return s;
  if (auto s = CheckRange("head_dim", head_dim, kMaxWidth); !s.ok()) return s;
  if (auto s = CheckRange("hidden_size", hidden_size, kMaxWidth); !s.ok()) return s;
  if (num_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.num_heads = ", num_heads, " is not a multiple of num_kv_heads = ", num_kv_heads));
  }
  if (!std::isfinite(softmax_scale) || softmax_scale < 0.f) {
    return absl::InvalidArgumentError(absl::StrCat("geometry.softmax_scale = ", softmax_scale,
                                                   " must be finite and >= 0 (0: 1/sqrt(d))"));
  }
  return absl::OkStatus();
}

std::string ModelGeometry::DebugString() const {
  return absl::StrCat("L=", num_layers, " H=", num_heads, " Hkv=", num_kv_heads, " d=", head_dim,
                      " D=", hidden_size, " scale=", EffectiveScale());
}

}  // namespace laprox::kernels
