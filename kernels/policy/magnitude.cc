#include "policy/magnitude.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace laprox::kernels::policy {
namespace {

// " above 2^120 = 1.32923e+36, the largest ... fp32 scoring allows: <what> finite but too large"
std::string Beyond(absl::string_view what) {
  return absl::StrCat(", above 2^120 = ", kMagnitudeLimit,
                      ", the most that scoring in fp32 allows: ", what, " finite but too large");
}

double FactorBoundOf(int64_t hidden_size, int64_t group, double max_o_proj) {
  const double G = static_cast<double>(group);
  return static_cast<double>(hidden_size) * G * G * max_o_proj * max_o_proj;
}

// A squared LAPROX score is at most this times the bound on its value factor squared (see
// magnitude.h): G^2 (the EXACT_BLOCK sum over head pairs) * 1.03 (attention rows that sum to at
// most 1.01) * we (window rows).
double SquaredScorePerValue(const RequestShape& shape) {
  const double G = shape.group_size;
  return G * G * 1.03 * std::max<double>(shape.window, 1.0);
}

}  // namespace

absl::Status CheckLogitMagnitude(int64_t layer, int64_t kv_head, int64_t head_dim, double scale,
                                 double max_queries, double max_keys) {
  const double bound =
      static_cast<double>(head_dim) * max_queries * std::max(1.0, max_keys) * std::max(1.0, scale);
  if (bound <= kMagnitudeLimit) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "layers[", layer, "].keys: the logits scale * q . k of KV head ", kv_head, " may reach ",
      bound, " (head_dim ", head_dim, ", max |window_queries| ", max_queries, ", max |keys| ",
      max_keys, ", scale ", scale, ")", Beyond("keys and window_queries are")));
}

double FactorBound(const ModelGeometry& geometry, double max_o_proj) {
  return FactorBoundOf(geometry.hidden_size, geometry.group_size(), max_o_proj);
}

absl::Status CheckFactorMagnitude(const ModelGeometry& geometry, int64_t layer, double max_o_proj) {
  const double bound = FactorBound(geometry, max_o_proj);
  if (bound <= kMagnitudeLimit) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "o_proj[", layer, "]: the factors W_O^h W_O^h'^T may reach ", bound, " (hidden_size ",
      geometry.hidden_size, ", group ", geometry.group_size(), ", max |o_proj[", layer, "]| ",
      max_o_proj, ")", Beyond(absl::StrCat("o_proj[", layer, "] is"))));
}

absl::Status CheckValueMagnitude(const RequestShape& shape, const PolicySpec& policy,
                                 int64_t hidden_size, int64_t layer, int64_t kv_head,
                                 double max_values, double max_o_proj) {
  const double d = shape.head_dim;
  const std::string name = absl::StrCat("layers[", layer, "].values: ");
  switch (policy.kind) {
    case PolicyKind::kLaprox: {
      double squared_value;
      std::string factor;
      switch (policy.indicator) {
        case Indicator::kAttention:
          return absl::OkStatus();
        case Indicator::kAttentionXValue:
          squared_value = d * max_values * max_values;
          break;
        case Indicator::kAttentionXProjectedValue: {
          squared_value = d * d * max_values * max_values *
                          FactorBoundOf(hidden_size, shape.group_size, max_o_proj);
          factor = absl::StrCat(", max |o_proj[", layer, "]| ", max_o_proj, ", hidden_size ",
                                hidden_size);
          break;
        }
        default:
          return absl::OkStatus();
      }
      const double bound = SquaredScorePerValue(shape) * squared_value;
      if (bound <= kMagnitudeLimit) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(
          name, "the squared scores of KV head ", kv_head, " may reach ", bound, " (max |values| ",
          max_values, ", head_dim ", shape.head_dim, ", group ", shape.group_size, ", window ",
          shape.window, factor, ")", Beyond("values are")));
    }
    case PolicyKind::kCriticalKv:
    case PolicyKind::kCriticalAdaKv: {
      const double bound = static_cast<double>(hidden_size) * d * max_values * max_o_proj;
      if (bound <= kMagnitudeLimit) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(
          name, "||v W_O^h||_1 of KV head ", kv_head, " may reach ", bound, " (hidden_size ",
          hidden_size, ", head_dim ", shape.head_dim, ", max |values| ", max_values,
          ", max |o_proj[", layer, "]| ", max_o_proj, ")", Beyond("values are")));
    }
    default:
      return absl::OkStatus();
  }
}

}  // namespace laprox::kernels::policy
