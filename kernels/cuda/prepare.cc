#include "cuda/prepare.h"

#include <climits>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "cuda/check_kernels.h"
#include "cuda/cuda_status.h"
#include "cuda/device_util.h"
#include "cuda/prepare_kernels.h"
#include "policy/magnitude.h"

namespace laprox::kernels::cuda {
namespace {

constexpr unsigned long long kNoBadElement = ~0ull;

bool FitsInt(int64_t value) { return value >= 0 && value <= INT_MAX; }

// C = X_b X_a^T per KV group, in cuBLAS column-major terms, which is the row-major [d, d] block
// C[i][j] = sum_r A[r][i] B[r][j] of the CPU backend (cblas_sgemm(RowMajor, Trans, NoTrans, ...)
// with A = W_a, B = W_b, both [D, d] with leading dimension `ld`): the column-major d x D matrix
// with leading dimension `ld` at `a` is W_a^T, so C_cm = W_b^T (W_a^T)^T, stored at `c` with the
// factor row stride as leading dimension. Batched over the KV groups of a layer.
absl::Status GroupGram(const DeviceContext& context, int64_t d, int64_t D, const float* a,
                       const float* b, int64_t ld, int64_t group_stride, float* c, int64_t ldc,
                       int64_t c_stride, int64_t groups) {
  const float one = 1.f, zero = 0.f;
  return CublasStatus(cublasGemmStridedBatchedEx(
                          context.cublas, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(d),
                          static_cast<int>(d), static_cast<int>(D), &one, b, CUDA_R_32F,
                          static_cast<int>(ld), group_stride, a, CUDA_R_32F, static_cast<int>(ld),
                          group_stride, &zero, c, CUDA_R_32F, static_cast<int>(ldc), c_stride,
                          static_cast<int>(groups), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                      "computing the factor matrices (cublasGemmStridedBatchedEx)");
}

}  // namespace

absl::StatusOr<std::shared_ptr<CudaPreparedModel>> PrepareFactors(
    const DeviceContext& context, const ModelGeometry& geometry,
    absl::Span<const TensorView> o_proj, const PrepareOptions& options) {
  auto model = std::make_shared<CudaPreparedModel>(geometry, options);
  const int64_t L = geometry.num_layers, Hkv = geometry.num_kv_heads, G = geometry.group_size(),
                d = geometry.head_dim, D = geometry.hidden_size,
                Hd = int64_t{geometry.num_heads} * d;
  const int64_t ld = model->row_stride(), matrix = model->matrix_size();
  if (!FitsInt(Hd) || !FitsInt(ld) || !FitsInt(Hkv)) {
    return absl::InvalidArgumentError(absl::StrCat("geometry ", geometry.DebugString(),
                                                   " is too large for the CUDA backend's GEMMs"));
  }
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(model->mutable_buffer().Reserve(static_cast<size_t>(model->total_floats()) * 4),
                 "allocating the factor matrices"));

  // One layer at a time: its o_proj in dense fp32 and the group sums S of its KV groups.
  WorkspaceLayout layout;
  const size_t dense_at = layout.Add<float>(static_cast<size_t>(D * Hd));
  const size_t summed_at = layout.Add<float>(static_cast<size_t>(Hkv * D * d));
  const size_t bad_at = layout.Add<unsigned long long>(static_cast<size_t>(L + 1));
  const size_t max_at = layout.Add<unsigned int>(static_cast<size_t>(L));
  DeviceBuffer scratch;
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(scratch.Reserve(layout.total()), "allocating the factor scratch memory"));
  auto* base = scratch.as<std::byte>();
  auto* dense = reinterpret_cast<float*>(base + dense_at);
  auto* summed = reinterpret_cast<float*>(base + summed_at);
  auto* bad = reinterpret_cast<unsigned long long*>(base + bad_at);  // [L] o_proj, [1] factors
  auto* max_bits = reinterpret_cast<unsigned int*>(base + max_at);
  cudaStream_t stream = context.stream;
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(bad, 0xff, (L + 1) * sizeof(unsigned long long), stream),
                 "clearing the o_proj check"));
  LAPROX_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(max_bits, 0, L * sizeof(unsigned int), stream),
                                    "clearing the o_proj maxima"));

  // Layers with a bad element get garbage factors; the model is discarded below, so there is no
  // synchronisation per layer.
  for (int64_t l = 0; l < L; ++l) {
    const TensorView& w = o_proj[l];
    LAPROX_RETURN_IF_ERROR(CudaStatus(
        LaunchConvertProjection(w.data(), static_cast<int>(w.dtype()), D, Hd, w.stride(0),
                                w.stride(1), dense, bad + l, max_bits + l, stream),
        "converting o_proj"));
    LAPROX_RETURN_IF_ERROR(
        CudaStatus(LaunchGroupSum(dense, D, Hkv, G, d, summed, stream), "summing o_proj heads"));
    float* f = model->mutable_buffer().as<float>() + l * Hkv * matrix;
    // Block 0: S^T S, S = the group's head blocks summed ([D, d], dense).
    LAPROX_RETURN_IF_ERROR(GroupGram(context, d, D, summed, summed, d, D * d, f, ld, matrix, Hkv));
    // Blocks 1..G: W_a^T W_a; then the cross pairs W_a^T W_b, a < b, in the CPU's order.
    int64_t block = 1;
    for (int64_t a = 0; a < G; ++a, ++block) {
      LAPROX_RETURN_IF_ERROR(GroupGram(context, d, D, dense + a * d, dense + a * d, Hd, G * d,
                                       f + block * d, ld, matrix, Hkv));
    }
    if (!options.cross_grams) continue;
    for (int64_t a = 0; a < G; ++a) {
      for (int64_t b = a + 1; b < G; ++b, ++block) {
        LAPROX_RETURN_IF_ERROR(GroupGram(context, d, D, dense + a * d, dense + b * d, Hd, G * d,
                                         f + block * d, ld, matrix, Hkv));
      }
    }
  }

  // The factors must be finite (the magnitude check below guarantees it; this is the defence).
  KernelTensor factors;
  factors.data = model->mutable_buffer().as<float>();
  factors.dtype = static_cast<int>(DType::kF32);
  factors.dims[0] = L * Hkv;
  factors.dims[1] = d;
  factors.dims[2] = ld;
  factors.strides[0] = matrix;
  factors.strides[1] = ld;
  factors.strides[2] = 1;
  LAPROX_RETURN_IF_ERROR(CudaStatus(LaunchFindNonFinite(factors, bad + L, nullptr, stream),
                                    "checking the factor matrices"));

  std::vector<unsigned long long> h_bad(static_cast<size_t>(L + 1));
  std::vector<float> h_max(static_cast<size_t>(L));
  LAPROX_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(h_bad.data(), bad, (L + 1) * sizeof(h_bad[0]),
                                                    cudaMemcpyDeviceToHost, stream),
                                    "reading the o_proj check"));
  static_assert(sizeof(float) == sizeof(unsigned int));
  LAPROX_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(h_max.data(), max_bits, L * sizeof(float), cudaMemcpyDeviceToHost, stream),
      "reading the o_proj maxima"));
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(stream), "computing the factor matrices"));
  for (int64_t l = 0; l < L; ++l) {
    model->set_max_o_proj(l, h_max[l]);
    if (h_bad[l] == kNoBadElement) {
      // The CPU backend's order: a layer's NaN/Inf check, then its magnitude check.
      LAPROX_RETURN_IF_ERROR(policy::CheckFactorMagnitude(geometry, l, h_max[l]));
      continue;
    }
    const auto flat = static_cast<int64_t>(h_bad[l]);
    const int64_t r = flat / Hd, c = flat % Hd;
    const TensorView& w = o_proj[l];
    LAPROX_ASSIGN_OR_RETURN(
        const float value, ReadDeviceElement(w.data(), w.dtype(), r * w.stride(0) + c * w.stride(1),
                                             "reading a bad o_proj element"));
    // The CPU backend's words (kernels/cpu/rows.cc).
    return absl::InvalidArgumentError(
        absl::StrCat("o_proj[", l, "] has a non-finite value (", value, ") at [", r, ", ", c, "]"));
  }
  if (h_bad[L] != kNoBadElement) {
    const auto flat = static_cast<int64_t>(h_bad[L]);
    const int64_t layer = flat / (Hkv * d * ld);
    return absl::InvalidArgumentError(absl::StrCat(
        "o_proj[", layer, "]: the factor matrices computed from it are not finite (max |o_proj[",
        layer, "]| = ", h_max[layer], ")"));
  }
  return model;
}

}  // namespace laprox::kernels::cuda
