#include "cuda/select.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "cuda/cuda_status.h"
#include "cuda/select_kernels.h"
#include "policy/select.h"

namespace laprox::kernels::cuda {
namespace {

// A step of policy::SelectionSteps as the device runs it: candidates compete in segments of
// `segment_size` consecutive candidate indices (m per head, Hkv * m per layer, C for the model),
// each segment selecting its best `k` among the candidates not selected yet; or the
// head_uniform_layers recount.
struct SelectStep {
  uint64_t segment_size = 0;
  uint32_t k = 0;
  bool head_uniform = false;
};

// policy::SelectionSteps (the order SelectKeepPlan takes too) in device segments. A capped step
// (max_layer_share) does not reach here: Select refuses it first.
std::vector<SelectStep> PlanSteps(const RequestShape& shape, const PolicySpec& policy) {
  const uint64_t m = static_cast<uint64_t>(shape.candidates);
  const uint64_t heads = static_cast<uint64_t>(shape.num_kv_heads);
  const uint64_t rows = static_cast<uint64_t>(shape.num_layers) * heads;
  std::vector<SelectStep> steps;
  for (const policy::SelectionStep& step : policy::SelectionSteps(shape, policy)) {
    if (step.kind == policy::SelectionStep::Kind::kHeadUniformRecount) {
      steps.push_back({m, 0, true});
      continue;
    }
    const uint64_t segment_size = step.scope == policy::SelectionScope::kHead    ? m
                                  : step.scope == policy::SelectionScope::kLayer ? heads * m
                                                                                 : rows * m;
    // Quotas fit in uint32: every k <= C < 2^32 (checked by the caller).
    steps.push_back({segment_size, static_cast<uint32_t>(step.k), false});
  }
  return steps;
}

}  // namespace

absl::StatusOr<KeepPlan> DeviceSelector::Select(const DeviceContext& context,
                                                const RequestShape& shape, const PolicySpec& policy,
                                                const float* d_raw, const OutputOptions& outputs,
                                                SelectAlgorithm algorithm) {
  const int64_t num_layers = shape.num_layers, heads = shape.num_kv_heads, n = shape.n;
  const int64_t window = shape.window, sinks = shape.sinks, m = shape.candidates;
  const int64_t q = shape.quota;
  // Preconditions from Backend::ComputeKeepPlan: a shape that breaks them is our bug (INTERNAL).
  if (num_layers < 0 || heads < 0 || n < 1 || window < 0 || sinks < 0 || m < 0 ||
      sinks + window + m != n || q < 0 || q > m || !FitsPlanEntries(num_layers, heads, n)) {
    return absl::InternalError(absl::StrCat(
        "DeviceSelector: inconsistent plan shape: L = ", num_layers, ", Hkv = ", heads, ", n = ", n,
        ", window = ", window, ", sinks = ", sinks, ", candidates = ", m, ", quota = ", q));
  }
  if (policy.min_per_head < 0) {
    return absl::InternalError(
        absl::StrCat("DeviceSelector: min_per_head = ", policy.min_per_head, " is negative"));
  }
  const uint64_t rows = static_cast<uint64_t>(num_layers) * static_cast<uint64_t>(heads);
  const uint64_t total = rows * static_cast<uint64_t>(n);
  if (total > 0 && d_raw == nullptr) {
    return absl::InternalError("DeviceSelector: raw scores are null");
  }

  // max_layer_share: the capped walk (SelectKeepPlan's TakeCapped) has no device version; the
  // backend selects such plans on the host (CudaBackend::ComputeKeepPlanImpl).
  if (policy.LayerSelectionCap(num_layers, heads, q).has_value()) {
    return absl::UnimplementedError(
        "DeviceSelector: policy.max_layer_share has no device selection (the CUDA backend "
        "selects such plans on the host)");
  }

  KeepPlan plan = policy::PlanHeader(shape);
  plan.selected_total = num_layers * heads * q;
  plan.layer_sums.assign(static_cast<size_t>(num_layers), 0.0);
  plan.counts.assign(rows, 0);
  plan.offsets.assign(rows + 1, 0);
  if (total == 0) return plan;  // no heads: nothing to select, every layer sum is 0

  SelectGeometry geometry;
  geometry.num_layers = static_cast<uint32_t>(num_layers);
  geometry.num_kv_heads = static_cast<uint32_t>(heads);
  geometry.n = static_cast<uint32_t>(n);
  geometry.sinks = static_cast<uint32_t>(sinks);
  geometry.candidates = static_cast<uint32_t>(m);
  const uint64_t candidate_total = geometry.candidate_total();
  const uint32_t forced = static_cast<uint32_t>(sinks + window);
  // Every allocation selects exactly L * Hkv * q candidates (reservations plus the rest of the
  // quota; head_uniform_layers only moves selections between the heads of a layer), so the
  // number of kept positions is known before the selection runs.
  const uint64_t expected_kept = rows * (forced + static_cast<uint64_t>(q));
  const uint64_t mask_bytes = rows * ((static_cast<uint64_t>(n) + 7) / 8);
  const bool radix = algorithm == SelectAlgorithm::kRadixSort;
  const std::vector<SelectStep> steps =
      candidate_total > 0 ? PlanSteps(shape, policy) : std::vector<SelectStep>{};

  // Workspace: one allocation, carved in this order.
  WorkspaceLayout layout;
  const size_t at_partials = layout.Add<double>(num_layers * kLayerSumSlots);
  const size_t at_sums = layout.Add<double>(num_layers);
  const size_t at_scores = layout.Add<float>(total);
  const size_t at_kept = layout.Add<uint8_t>(total);
  const size_t at_selected = layout.Add<uint32_t>(rows);
  const size_t at_k = layout.Add<uint32_t>(rows);
  const size_t at_offsets = layout.Add<int64_t>(rows + 1);
  const size_t at_positions = layout.Add<int32_t>(outputs.positions ? expected_kept : 0);
  const size_t at_bitmask = layout.Add<uint8_t>(outputs.bitmask ? mask_bytes : 0);
  const uint64_t keys = radix && !steps.empty() ? candidate_total : 0;
  const size_t at_keys_a = layout.Add<uint64_t>(keys);
  const size_t at_keys_b = layout.Add<uint64_t>(keys);
  const size_t at_segment_offsets = layout.Add<int>(radix ? rows + 1 : 0);
  const size_t at_histograms = layout.Add<uint32_t>(radix ? 0 : rows * 256);
  const size_t at_states = layout.Add<RadixSelectState>(radix ? 0 : rows);
  const size_t at_non_finite = layout.Add<unsigned long long>(1);

  size_t temp_bytes = 0;
  LAPROX_RETURN_IF_ERROR(CudaStatus(RowOffsetsTempBytes(geometry, &temp_bytes),
                                    "DeviceSelector: sizing the offsets scan"));
  if (radix) {
    for (const SelectStep& step : steps) {
      size_t bytes = 0;
      LAPROX_RETURN_IF_ERROR(
          CudaStatus(RadixSortSelectTempBytes(geometry, step.segment_size, &bytes),
                     "DeviceSelector: sizing the radix sort"));
      temp_bytes = std::max(temp_bytes, bytes);
    }
  }
  LAPROX_RETURN_IF_ERROR(CudaStatus(
      workspace_.Reserve(layout.total()),
      absl::StrCat("DeviceSelector: allocating ", layout.total(), " bytes of workspace")));
  LAPROX_RETURN_IF_ERROR(CudaStatus(
      sort_temp_.Reserve(std::max<size_t>(temp_bytes, 1)),
      absl::StrCat("DeviceSelector: allocating ", temp_bytes, " bytes of CUB temporary storage")));

  std::byte* const base = workspace_.as<std::byte>();
  auto* const d_partials = reinterpret_cast<double*>(base + at_partials);
  auto* const d_sums = reinterpret_cast<double*>(base + at_sums);
  auto* const d_scores = reinterpret_cast<float*>(base + at_scores);
  auto* const d_kept = reinterpret_cast<uint8_t*>(base + at_kept);
  auto* const d_selected = reinterpret_cast<uint32_t*>(base + at_selected);
  auto* const d_k = reinterpret_cast<uint32_t*>(base + at_k);
  auto* const d_offsets = reinterpret_cast<int64_t*>(base + at_offsets);
  auto* const d_positions = reinterpret_cast<int32_t*>(base + at_positions);
  auto* const d_bitmask = reinterpret_cast<uint8_t*>(base + at_bitmask);
  auto* const d_keys_a = reinterpret_cast<uint64_t*>(base + at_keys_a);
  auto* const d_keys_b = reinterpret_cast<uint64_t*>(base + at_keys_b);
  auto* const d_segment_offsets = reinterpret_cast<int*>(base + at_segment_offsets);
  auto* const d_histograms = reinterpret_cast<uint32_t*>(base + at_histograms);
  auto* const d_states = reinterpret_cast<RadixSelectState*>(base + at_states);
  auto* const d_non_finite = reinterpret_cast<unsigned long long*>(base + at_non_finite);
  void* const d_temp = sort_temp_.data();
  const size_t temp_capacity = sort_temp_.capacity();
  cudaStream_t stream = context.stream;

  LAPROX_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(d_non_finite, 0xff, sizeof(unsigned long long), stream),
                 "DeviceSelector: clearing the raw score check"));
  LAPROX_RETURN_IF_ERROR(CudaStatus(LaunchLayerSums(geometry, d_raw, d_partials, d_sums, stream),
                                    "DeviceSelector: layer sums"));
  LAPROX_RETURN_IF_ERROR(CudaStatus(
      LaunchNormalizeScores(geometry, d_raw, d_sums, policy.allocation == Allocation::kGlobalRaw,
                            d_scores, d_kept, d_non_finite, stream),
      "DeviceSelector: normalising scores"));

  auto select = [&](uint64_t segment_size) -> cudaError_t {
    if (radix) {
      return LaunchRadixSortSelect(geometry, d_scores, segment_size, d_k, d_keys_a, d_keys_b,
                                   d_segment_offsets, d_temp, temp_capacity, d_kept, stream);
    }
    return LaunchHistogramSelect(geometry, d_scores, segment_size, d_k, d_histograms, d_states,
                                 d_kept, stream);
  };
  for (const SelectStep& step : steps) {
    if (step.head_uniform) {
      LAPROX_RETURN_IF_ERROR(CudaStatus(LaunchCountSelected(geometry, d_kept, d_selected, stream),
                                        "DeviceSelector: counting the selection per head"));
      LAPROX_RETURN_IF_ERROR(CudaStatus(LaunchHeadUniformQuota(geometry, d_selected, d_k, stream),
                                        "DeviceSelector: head-uniform quotas"));
      LAPROX_RETURN_IF_ERROR(CudaStatus(LaunchResetCandidates(geometry, d_kept, stream),
                                        "DeviceSelector: clearing the selection"));
    } else {
      LAPROX_RETURN_IF_ERROR(
          CudaStatus(LaunchFillU32(d_k, candidate_total / step.segment_size, step.k, stream),
                     "DeviceSelector: segment quotas"));
    }
    LAPROX_RETURN_IF_ERROR(
        CudaStatus(select(step.segment_size),
                   absl::StrCat("DeviceSelector: ", radix ? "radix sort" : "histogram",
                                " select over segments of ", step.segment_size)));
  }

  LAPROX_RETURN_IF_ERROR(CudaStatus(LaunchCountSelected(geometry, d_kept, d_selected, stream),
                                    "DeviceSelector: counting the selection per head"));
  if (outputs.positions) {
    LAPROX_RETURN_IF_ERROR(CudaStatus(
        LaunchRowOffsets(geometry, d_selected, forced, d_offsets, d_temp, temp_capacity, stream),
        "DeviceSelector: position offsets"));
    LAPROX_RETURN_IF_ERROR(CudaStatus(
        LaunchCompactPositions(geometry, d_kept, d_offsets, expected_kept, d_positions, stream),
        "DeviceSelector: compacting positions"));
  }
  if (outputs.bitmask) {
    LAPROX_RETURN_IF_ERROR(CudaStatus(LaunchPackBitmask(geometry, d_kept, d_bitmask, stream),
                                      "DeviceSelector: packing the bitmask"));
  }

  // Results to the host. The host vectors are pageable, so these copies are staged; the one
  // synchronisation below covers them all.
  std::vector<uint32_t> selected(rows);
  auto copy = [stream](void* h_dst, const void* d_src, size_t bytes) {
    return bytes == 0 ? cudaSuccess
                      : cudaMemcpyAsync(h_dst, d_src, bytes, cudaMemcpyDeviceToHost, stream);
  };
  unsigned long long non_finite = 0;
  LAPROX_RETURN_IF_ERROR(CudaStatus(copy(&non_finite, d_non_finite, sizeof(non_finite)),
                                    "DeviceSelector: copying the raw score check"));
  LAPROX_RETURN_IF_ERROR(CudaStatus(copy(selected.data(), d_selected, rows * sizeof(uint32_t)),
                                    "DeviceSelector: copying counts"));
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(copy(plan.layer_sums.data(), d_sums, plan.layer_sums.size() * sizeof(double)),
                 "DeviceSelector: copying layer sums"));
  if (outputs.positions) {
    plan.positions.resize(expected_kept);
    LAPROX_RETURN_IF_ERROR(
        CudaStatus(copy(plan.positions.data(), d_positions, expected_kept * sizeof(int32_t)),
                   "DeviceSelector: copying positions"));
  }
  if (outputs.bitmask) {
    plan.bitmask.resize(mask_bytes);
    LAPROX_RETURN_IF_ERROR(CudaStatus(copy(plan.bitmask.data(), d_bitmask, mask_bytes),
                                      "DeviceSelector: copying the bitmask"));
  }
  if (outputs.scores) {
    plan.scores.resize(total);
    LAPROX_RETURN_IF_ERROR(CudaStatus(copy(plan.scores.data(), d_scores, total * sizeof(float)),
                                      "DeviceSelector: copying scores"));
  }
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(stream), "DeviceSelector: synchronising the stream"));
  // A non-finite raw score (the scorers' inputs were checked, so a broken invariant) made the
  // selection meaningless, though memory-safe: report it as SelectKeepPlan does.
  if (non_finite != ~0ull) {
    float value = 0.f;
    LAPROX_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy(&value, d_raw + non_finite, sizeof(value), cudaMemcpyDeviceToHost),
                   "DeviceSelector: reading a non-finite raw score"));
    return policy::NonFiniteScoreError(shape, non_finite, value, "raw score");
  }

  uint64_t selected_sum = 0;
  for (uint64_t row = 0; row < rows; ++row) {
    const int64_t count = int64_t{forced} + selected[row];
    plan.counts[row] = static_cast<int32_t>(count);
    plan.offsets[row + 1] = plan.offsets[row] + count;
    selected_sum += selected[row];
  }
  // A broken invariant would also have dropped positions past the buffer: report, never return
  // a wrong plan.
  if (selected_sum != rows * static_cast<uint64_t>(q)) {
    return absl::InternalError(
        absl::StrCat("DeviceSelector: ", selected_sum,
                     " candidates selected, expected L * Hkv * q = ", plan.selected_total));
  }
  return plan;
}

}  // namespace laprox::kernels::cuda
