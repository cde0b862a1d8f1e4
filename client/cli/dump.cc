#include "client/cli/dump.h"

#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/half.h"

namespace laprox::cli {

using nlohmann::json;

absl::StatusOr<Dump> LoadDump(SafeTensorsFile file, const std::string& geometry_file) {
  Dump dump;
  std::string geometry_text;
  if (!geometry_file.empty()) {
    std::ifstream in(geometry_file);
    if (!in) return absl::NotFoundError("cannot open " + geometry_file);
    std::getline(in, geometry_text, '\0');
  } else if (auto it = file.metadata.find("laprox.geometry"); it != file.metadata.end()) {
    geometry_text = it->second;
  } else {
    return absl::InvalidArgumentError(
        "no geometry: give --geometry=FILE or metadata \"laprox.geometry\"");
  }
  const json g = json::parse(geometry_text, nullptr, false);
  if (g.is_discarded()) return absl::InvalidArgumentError("the geometry is not valid JSON");
  dump.geometry = {g.value("num_layers", 0),   g.value("num_heads", 0),
                   g.value("num_kv_heads", 0), g.value("head_dim", 0),
                   g.value("hidden_size", 0),  g.value("softmax_scale", 0.f)};
  if (absl::Status s = dump.geometry.Validate(); !s.ok()) return s;
  dump.file = std::move(file);
  for (int l = 0; l < dump.geometry.num_layers; ++l) {
    for (const char* what : {"keys", "values", "o_proj"}) {
      if (dump.Find(l, what) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("the dump lacks layers.", l, ".", what));
      }
    }
    if (dump.Find(l, "window_queries") == nullptr && dump.Find(l, "window_attention") == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("the dump lacks layers.", l, ".window_queries (or .window_attention)"));
    }
  }
  const auto& keys = dump.Get(0, "keys").shape;
  if (keys.size() != 3) return absl::InvalidArgumentError("layers.0.keys is not [Hkv, n, d]");
  dump.n = keys[1];
  return dump;
}

SafeTensorsFile MakeDemo() {
  constexpr int L = 8, H = 9, Hkv = 3, d = 64, D = 576, w = 64;
  constexpr int64_t n = 2048;
  std::mt19937 rng(20261130);
  std::normal_distribution<float> normal(0.f, 1.f);
  SafeTensorsFile file;
  file.metadata["laprox.geometry"] = json{
      {"num_layers", L},
      {"num_heads", H},
      {"num_kv_heads", Hkv},
      {"head_dim", d},
      {"hidden_size", D}}.dump();
  auto tensor = [](std::vector<int64_t> shape, const std::vector<float>& values) {
    SafeTensor t;
    t.dtype = kernels::DType::kBF16;
    t.shape = std::move(shape);
    t.bytes.resize(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t b = kernels::FloatToBf16(values[i]);
      std::memcpy(&t.bytes[i * 2], &b, 2);
    }
    return t;
  };
  for (int l = 0; l < L; ++l) {
    std::vector<float> keys(Hkv * n * d), values(Hkv * n * d), queries(H * w * d),
        o_proj(D * H * d);
    for (float& x : keys) x = normal(rng);
    for (float& x : queries) x = normal(rng) * 0.5f;
    for (float& x : o_proj) x = normal(rng) * 0.04f;
    const float value_scale = 1.f + 2.f * l / L;
    for (float& x : values) x = normal(rng) * value_scale;
    std::uniform_int_distribution<int64_t> position(8, n - w - 1);
    for (int g = 0; g < Hkv; ++g) {
      // Sinks and heavy hitters: keys aligned with the group's last query (inside every window).
      std::vector<int64_t> special = {0, 1, 2, 3};
      for (int i = 0; i < 12 + 4 * l; ++i) special.push_back(position(rng));
      for (int64_t p : special) {
        for (int k = 0; k < d; ++k) {
          keys[(g * n + p) * d + k] = queries[(g * 3 * w + w - 1) * d + k] * 4;
        }
      }
    }
    file.tensors[absl::StrCat("layers.", l, ".keys")] = tensor({Hkv, n, d}, keys);
    file.tensors[absl::StrCat("layers.", l, ".values")] = tensor({Hkv, n, d}, values);
    file.tensors[absl::StrCat("layers.", l, ".window_queries")] = tensor({H, w, d}, queries);
    file.tensors[absl::StrCat("layers.", l, ".o_proj")] = tensor({D, H * d}, o_proj);
  }
  return file;
}

}  // namespace laprox::cli
