#include "cuda/check.h"

#include <array>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "cuda/check_kernels.h"
#include "cuda/cuda_status.h"
#include "cuda/device_util.h"

namespace laprox::kernels::cuda {
namespace {

// The CPU backend's tolerance on given attention row sums (kernels/cpu/window.cc).
constexpr double kRowSumTolerance = 1e-2;
constexpr unsigned long long kNothingFound = ~0ull;

// The tensors of a layer in the order their errors are reported (check.h): lowest layer, then
// keys, values, window_queries / window_attention, window_lse, then the lowest element in
// row-major order (window_attention: the first bad row, and within it a non-finite value before
// a negative one before a wrong sum, as the CPU reads a row). With a single bad value the
// message is the CPU backend's word for word. With several, the CPU reports the first of its
// (layer, KV head) tasks and, within one, reads queries (or attention rows), the LSE, keys, then
// values, so it may name a different one: both are valid answers, and a one-pass device check
// in the CPU's order would need a (layer, KV head)-major key for every tensor.
enum Slot : int { kKeys = 0, kValues = 1, kWindow = 2, kLse = 3, kSlots = 4 };

// Element (a, b, c) of a device view, read back to the host as fp32 (for the message).
absl::StatusOr<float> ReadElement(const TensorView& view, int64_t a, int64_t b, int64_t c) {
  int64_t offset = a * view.stride(0) + b * view.stride(1);
  if (view.rank() == 3) offset += c * view.stride(2);
  return ReadDeviceElement(view.data(), view.dtype(), offset, "reading a bad input element");
}

absl::Status NonFiniteError(int64_t layer, const char* field, const TensorView& view,
                            unsigned long long key) {
  const auto flat = static_cast<int64_t>(key);
  if (view.rank() == 2) {
    const int64_t a = flat / view.dim(1), b = flat % view.dim(1);
    LAPROX_ASSIGN_OR_RETURN(const float value, ReadElement(view, a, b, 0));
    return absl::InvalidArgumentError(absl::StrCat("layers[", layer, "].", field,
                                                   " has a non-finite value (", value, ") at [", a,
                                                   ", ", b, "]"));
  }
  const int64_t c = flat % view.dim(2), ab = flat / view.dim(2);
  const int64_t a = ab / view.dim(1), b = ab % view.dim(1);
  LAPROX_ASSIGN_OR_RETURN(const float value, ReadElement(view, a, b, c));
  return absl::InvalidArgumentError(absl::StrCat("layers[", layer, "].", field,
                                                 " has a non-finite value (", value, ") at [", a,
                                                 ", ", b, ", ", c, "]"));
}

absl::Status AttentionError(int64_t layer, const TensorView& view, unsigned long long key,
                            const double* d_row_sums) {
  const auto wq = static_cast<unsigned long long>(view.dim(1));
  const auto n = static_cast<unsigned long long>(view.dim(2));
  const auto j = static_cast<int64_t>(key % n);
  const unsigned long long kind = (key / n) % 3, row = key / n / 3;
  const auto h = static_cast<int64_t>(row / wq), t = static_cast<int64_t>(row % wq);
  if (kind == 0) return NonFiniteError(layer, "window_attention", view, key / n / 3 * n + j);
  if (kind == 1) {
    LAPROX_ASSIGN_OR_RETURN(const float value, ReadElement(view, h, t, j));
    return absl::InvalidArgumentError(absl::StrCat("layers[", layer,
                                                   "].window_attention has a negative value (",
                                                   value, ") at [", h, ", ", t, ", ", j, "]"));
  }
  double sum = 0.0;
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpy(&sum, d_row_sums + row, sizeof(sum), cudaMemcpyDeviceToHost),
                 "reading a window attention row sum"));
  return absl::InvalidArgumentError(absl::StrCat("layers[", layer, "].window_attention row [", h,
                                                 ", ", t, "] sums to ", sum, ", not 1 (tolerance ",
                                                 kRowSumTolerance, ")"));
}

}  // namespace

absl::Status InputChecker::Check(const DeviceContext& context,
                                 const std::vector<LayerInputs>& layers, const RequestShape& shape,
                                 InputMagnitudes* magnitudes) {
  const auto L = static_cast<int64_t>(layers.size());
  if (L == 0) return absl::OkStatus();
  const int64_t H = int64_t{shape.num_kv_heads} * shape.group_size, wq = shape.window_rows;
  if (shape.attention_given) {
    // Keys of the attention rows must fit the 64-bit key space (kind and column included).
    unsigned long long keys = 0;
    if (__builtin_mul_overflow(
            static_cast<unsigned long long>(H) * static_cast<unsigned long long>(wq),
            3ull * static_cast<unsigned long long>(shape.n), &keys)) {
      return absl::InvalidArgumentError("window_attention is too large to check");
    }
  }
  const int64_t row_sums = shape.attention_given ? L * H * wq : 0;
  const int64_t Hkv = shape.num_kv_heads;
  // Largest |x| bits per head: keys [L][Hkv], values [L][Hkv], queries [L][H], one array.
  const int64_t maxima = L * (2 * Hkv + H);
  WorkspaceLayout layout;
  const size_t bad_at = layout.Add<unsigned long long>(static_cast<size_t>(L * kSlots));
  const size_t sums_at = layout.Add<double>(static_cast<size_t>(row_sums));
  const size_t maxima_at = layout.Add<unsigned int>(static_cast<size_t>(maxima));
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(scratch_.Reserve(layout.total()), "allocating the input check scratch"));
  auto* bad = reinterpret_cast<unsigned long long*>(scratch_.as<std::byte>() + bad_at);
  auto* sums = reinterpret_cast<double*>(scratch_.as<std::byte>() + sums_at);
  auto* max_bits = reinterpret_cast<unsigned int*>(scratch_.as<std::byte>() + maxima_at);
  unsigned int* key_max = max_bits;
  unsigned int* value_max = max_bits + L * Hkv;
  unsigned int* query_max = max_bits + 2 * L * Hkv;
  cudaStream_t stream = context.stream;
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(bad, 0xff, L * kSlots * sizeof(unsigned long long), stream),
                 "clearing the input check"));
  LAPROX_RETURN_IF_ERROR(CudaStatus(
      cudaMemsetAsync(max_bits, 0, static_cast<size_t>(maxima) * sizeof(unsigned int), stream),
      "clearing the input maxima"));

  for (int64_t l = 0; l < L; ++l) {
    const LayerInputs& in = layers[l];
    unsigned long long* slot = bad + l * kSlots;
    if (!in.keys.empty()) {
      LAPROX_RETURN_IF_ERROR(CudaStatus(
          LaunchFindNonFinite(ToKernelTensor(in.keys), slot + kKeys, key_max + l * Hkv, stream),
          "checking keys"));
    }
    if (!in.values.empty()) {
      LAPROX_RETURN_IF_ERROR(
          CudaStatus(LaunchFindNonFinite(ToKernelTensor(in.values), slot + kValues,
                                         value_max + l * Hkv, stream),
                     "checking values"));
    }
    if (!in.window_queries.empty()) {
      LAPROX_RETURN_IF_ERROR(
          CudaStatus(LaunchFindNonFinite(ToKernelTensor(in.window_queries), slot + kWindow,
                                         query_max + l * H, stream),
                     "checking window_queries"));
    }
    if (!in.window_attention.empty()) {
      LAPROX_RETURN_IF_ERROR(
          CudaStatus(LaunchCheckAttentionRows(ToKernelTensor(in.window_attention), kRowSumTolerance,
                                              slot + kWindow, sums + l * H * wq, stream),
                     "checking window_attention"));
    }
    if (!in.window_lse.empty()) {
      LAPROX_RETURN_IF_ERROR(CudaStatus(
          LaunchFindNonFinite(ToKernelTensor(in.window_lse), slot + kLse, nullptr, stream),
          "checking window_lse"));
    }
  }

  std::vector<unsigned long long> h_bad(static_cast<size_t>(L * kSlots));
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(h_bad.data(), bad, h_bad.size() * sizeof(h_bad[0]),
                                 cudaMemcpyDeviceToHost, stream),
                 "reading the input check"));
  std::vector<unsigned int> h_max(static_cast<size_t>(maxima));
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(h_max.data(), max_bits, h_max.size() * sizeof(h_max[0]),
                                 cudaMemcpyDeviceToHost, stream),
                 "reading the input maxima"));
  LAPROX_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "checking the inputs"));
  for (int64_t l = 0; l < L; ++l) {
    const LayerInputs& in = layers[l];
    const unsigned long long* slot = h_bad.data() + l * kSlots;
    if (slot[kKeys] != kNothingFound) return NonFiniteError(l, "keys", in.keys, slot[kKeys]);
    if (slot[kValues] != kNothingFound) {
      return NonFiniteError(l, "values", in.values, slot[kValues]);
    }
    if (slot[kWindow] != kNothingFound) {
      if (in.window_attention.empty()) {
        return NonFiniteError(l, "window_queries", in.window_queries, slot[kWindow]);
      }
      return AttentionError(l, in.window_attention, slot[kWindow], sums + l * H * wq);
    }
    if (slot[kLse] != kNothingFound) {
      return NonFiniteError(l, "window_lse", in.window_lse, slot[kLse]);
    }
  }
  if (magnitudes != nullptr) {
    const auto as_floats = [&](size_t begin, size_t count) {
      std::vector<float> out(count);
      std::memcpy(out.data(), h_max.data() + begin, count * sizeof(float));
      return out;
    };
    const auto kv = static_cast<size_t>(L * Hkv);
    magnitudes->keys = as_floats(0, kv);
    magnitudes->values = as_floats(kv, kv);
    magnitudes->queries = as_floats(2 * kv, static_cast<size_t>(L * H));
  }
  return absl::OkStatus();
}

}  // namespace laprox::kernels::cuda
