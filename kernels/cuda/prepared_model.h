// CudaPreparedModel: a model's per-(layer, KV head) value factors in device memory.
//
// Same layout as the CPU backend's factors (kernels/cpu/factors.h): for KV head g the factor
// matrix is row-major fp32 [d, blocks * d] with
//   block 0            M_sum = S S^T, S = sum_h W_O^h              (SUMMED_PROJECTION)
//   blocks 1 .. G      M_h   = W_O^h W_O^h^T                        (MEAN_HEAD_*)
//   blocks G+1 ..      C_hh' = W_O^h W_O^h'^T, h < h' in (0,1),(0,2),..,(1,2),.. order
//                      (EXACT_BLOCK; only with PrepareOptions::cross_grams)
// and the matrices of (layer, g) follow each other: factors(l, g) = base + (l*Hkv + g) *
// matrix_size(). The CUDA backend does not keep o_proj itself (it implements LAPROX only), so
// PrepareOptions::output_projection costs no device memory here.
#ifndef LAPROX_KERNELS_CUDA_PREPARED_MODEL_H_
#define LAPROX_KERNELS_CUDA_PREPARED_MODEL_H_

#include <cstdint>
#include <vector>

#include "cuda/device_buffer.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels::cuda {

class CudaPreparedModel final : public PreparedModel {
 public:
  CudaPreparedModel(const ModelGeometry& geometry, const PrepareOptions& options)
      : PreparedModel(geometry, options, BackendKind::kCuda),
        blocks_(1 + geometry.group_size() +
                (options.cross_grams
                     ? int64_t{geometry.group_size()} * (geometry.group_size() - 1) / 2
                     : 0)),
        max_o_proj_(static_cast<size_t>(geometry.num_layers), 0.f) {}

  int64_t ByteSize() const override { return static_cast<int64_t>(factors_.capacity()); }

  // Blocks per (layer, KV head): 1 + G (+ G(G-1)/2 with cross-Grams).
  int64_t blocks() const { return blocks_; }
  // Row stride of a factor matrix in floats: blocks() * d.
  int64_t row_stride() const { return blocks_ * geometry().head_dim; }
  // Floats per (layer, KV head) matrix: d * row_stride().
  int64_t matrix_size() const { return int64_t{geometry().head_dim} * row_stride(); }
  // Floats of all matrices: L * Hkv * matrix_size().
  int64_t total_floats() const {
    return int64_t{geometry().num_layers} * geometry().num_kv_heads * matrix_size();
  }
  // Device pointer to the factor matrix of (layer, kv_head).
  const float* factors(int64_t layer, int64_t kv_head) const {
    return factors_.as<float>() + (layer * geometry().num_kv_heads + kv_head) * matrix_size();
  }
  const float* factors_base() const { return factors_.as<float>(); }
  // The largest |o_proj[layer]| element (host value; policy/magnitude.h bounds the scores by it).
  float max_o_proj(int64_t layer) const { return max_o_proj_[static_cast<size_t>(layer)]; }
  // For PrepareFactors only.
  DeviceBuffer& mutable_buffer() { return factors_; }
  void set_max_o_proj(int64_t layer, float value) {
    max_o_proj_[static_cast<size_t>(layer)] = value;
  }

 private:
  int64_t blocks_;
  DeviceBuffer factors_;
  std::vector<float> max_o_proj_;
};

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_PREPARED_MODEL_H_
