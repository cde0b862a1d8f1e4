#include "tiny_model.h"

namespace laprox::kernels::testing {

TinyCase::TinyCase(int L, int H, int Hkv, int d, int D, int64_t n_tokens, int64_t rows)
    : n(n_tokens), window_rows(rows) {
  geometry = {.num_layers = L,
              .num_heads = H,
              .num_kv_heads = Hkv,
              .head_dim = d,
              .hidden_size = D,
              .softmax_scale = 1.f};
  for (int l = 0; l < L; ++l) {
    keys.emplace_back(int64_t{Hkv} * n * d, 0.f);
    values.emplace_back(int64_t{Hkv} * n * d, 0.f);
    queries.emplace_back(int64_t{H} * rows * d, 0.f);
    std::vector<float> w(int64_t{D} * H * d, 0.f);
    // W_O^h = identity padded: ||v W_O^h|| = ||v|| when D >= d.
    for (int h = 0; h < H; ++h) {
      for (int k = 0; k < d && k < D; ++k) w[int64_t{k} * H * d + h * d + k] = 1.f;
    }
    o_proj.push_back(std::move(w));
  }
}

void TinyCase::Randomize(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto* tensors : {&keys, &values, &queries, &o_proj}) {
    for (auto& t : *tensors) {
      for (float& x : t) x = normal(rng);
    }
  }
}

std::vector<TensorView> TinyCase::OProjViews() const {
  std::vector<TensorView> views;
  for (const auto& w : o_proj) {
    views.emplace_back(w.data(), DType::kF32,
                       Dims{geometry.hidden_size, int64_t{geometry.num_heads} * geometry.head_dim});
  }
  return views;
}

KeepPlanRequest TinyCase::Request() const {
  KeepPlanRequest request;
  request.n = n;
  request.policy = policy;
  request.outputs.bitmask = true;
  request.outputs.scores = true;
  const int64_t Hkv = geometry.num_kv_heads, H = geometry.num_heads, d = geometry.head_dim;
  for (size_t l = 0; l < keys.size(); ++l) {
    LayerInputs layer;
    layer.keys = TensorView(keys[l].data(), DType::kF32, {Hkv, n, d});
    layer.values = TensorView(values[l].data(), DType::kF32, {Hkv, n, d});
    layer.window_queries = TensorView(queries[l].data(), DType::kF32, {H, window_rows, d});
    request.layers.push_back(layer);
  }
  return request;
}

}  // namespace laprox::kernels::testing
