// Per-(layer, KV head) value factors of the CPU backend, prepared once per model.
//
// For KV head g with query heads h in g, the factor matrix is row-major [d, blocks * d]:
//   block 0            T_sum, T_sum T_sum^T = S S^T with S = sum_h W_O^h    (SUMMED_PROJECTION)
//   blocks 1 .. G      T_h,   T_h T_h^T     = W_O^h W_O^h^T                  (MEAN_HEAD_*)
//   blocks G+1 ..      C_hh' = W_O^h W_O^h'^T for h < h', pairs in (0,1),(0,2),..,(1,2),..
//                      order (EXACT_BLOCK; only with PrepareOptions::cross_grams)
// The T blocks are lower-triangular Cholesky factors (cpu/triangular.h, zeros above the
// diagonal), so that ||v W_O^h||^2 = ||v T_h||^2 costs d(d+1)/2 multiply-adds per row; the
// cross-Grams stay full d x d matrices for v C_hh' v^T (one sgemm of V with their column range).
//
// With PrepareOptions::output_projection it also keeps each layer's o_proj.weight [D, H*d] in
// fp32 (L * D * H * d * 4 bytes), which the CriticalKV baselines need for ||v W_O^h||_1.
#ifndef LAPROX_KERNELS_CPU_FACTORS_H_
#define LAPROX_KERNELS_CPU_FACTORS_H_

#include <cstdint>
#include <vector>

#include "laprox/kernels/backend.h"

namespace laprox::kernels::cpu {

class CpuPreparedModel final : public PreparedModel {
 public:
  CpuPreparedModel(const ModelGeometry& geometry, const PrepareOptions& options);

  int64_t ByteSize() const override {
    return static_cast<int64_t>(factors_.size() + output_projection_.size()) * 4;
  }
  // Blocks per (layer, KV head): 1 + G (+ G(G-1)/2 with cross-Grams).
  int64_t blocks() const { return blocks_; }
  // Row stride of a factor matrix in floats: blocks() * d.
  int64_t row_stride() const { return blocks_ * geometry().head_dim; }
  const float* factors(int64_t layer, int64_t kv_head) const {
    return factors_.data() + (layer * geometry().num_kv_heads + kv_head) * matrix_size();
  }
  float* mutable_factors(int64_t layer, int64_t kv_head) {
    return factors_.data() + (layer * geometry().num_kv_heads + kv_head) * matrix_size();
  }
  // o_proj.weight of `layer`, row-major [D, H*d]; null without PrepareOptions::output_projection.
  const float* output_projection(int64_t layer) const {
    return output_projection_.empty() ? nullptr
                                      : output_projection_.data() + layer * projection_size();
  }
  float* mutable_output_projection(int64_t layer) {
    return output_projection_.data() + layer * projection_size();
  }
  // The largest |o_proj[layer]| element (policy/magnitude.h bounds the scores with it).
  float max_o_proj(int64_t layer) const { return max_o_proj_[layer]; }
  void set_max_o_proj(int64_t layer, float value) { max_o_proj_[layer] = value; }
  // Floats of one (layer, KV head) factor matrix: d * row_stride().
  int64_t matrix_size() const { return int64_t{geometry().head_dim} * row_stride(); }

 private:
  int64_t projection_size() const {
    return int64_t{geometry().hidden_size} * geometry().num_heads * geometry().head_dim;
  }

  int64_t blocks_;
  std::vector<float> factors_;
  std::vector<float> output_projection_;
  std::vector<float> max_o_proj_;
};

}  // namespace laprox::kernels::cpu

#endif  // LAPROX_KERNELS_CPU_FACTORS_H_
