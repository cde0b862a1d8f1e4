// KeepPlan: the answer to one keep-plan request — which positions each (layer, KV head) keeps.
#ifndef LAPROX_KERNELS_KEEP_PLAN_H_
#define LAPROX_KERNELS_KEEP_PLAN_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"

namespace laprox::kernels {

// Which optional outputs a request wants. Counts, offsets and layer sums are always returned.
struct OutputOptions {
  bool positions = true;  // kept positions, ascending, concatenated in (layer, head) order
  bool bitmask = false;   // [L, Hkv, ceil(n/8)] bytes, bit i%8 of byte i/8 (LSB first)
  bool scores = false;    // [L, Hkv, n] fp32 competing scores; +inf for sinks and window
                          // (baselines: the score they rank by, with their sentinels)
};

// Where a keep-plan's arrays go instead of (positions, bitmask, scores) or besides (counts,
// offsets) the response: byte offsets into one registered, writable region of the service
// (laprox.v1 OutputDestination). An array without an offset is not written there.
struct OutputDestination {
  uint64_t region_id = 0;
  // int32 [L * Hkv]; also in the returned plan.
  std::optional<int64_t> counts_offset = std::nullopt;
  // int64 [L * Hkv + 1]; also in the returned plan.
  std::optional<int64_t> offsets_offset = std::nullopt;
  // int32, every kept position in (layer, head) order; L * Hkv * n of them always fit.
  std::optional<int64_t> positions_offset = std::nullopt;
  // uint8 [L, Hkv, ceil(n / 8)], bit i % 8 of byte i / 8.
  std::optional<int64_t> bitmask_offset = std::nullopt;
  // float32 [L, Hkv, n].
  std::optional<int64_t> scores_offset = std::nullopt;
};

// Where the time of one ComputeKeepPlan went (seconds, steady clock).
struct PlanTiming {
  double validate_seconds = 0;  // checks before any tensor data is read (see checks_started)
  double score_seconds = 0;     // reading the inputs and scoring every (layer, head, token)
  double select_seconds = 0;    // allocating the budget and selecting (0 when fused into score)
};

// The blocks a block-shaped plan keeps (PlanShape kBlocksShared and kBlocksPerLayer;
// tests/reference/SEMANTICS.md, "Plan shapes"). A unit is the whole model (kBlocksShared) or
// one layer (kBlocksPerLayer); every (layer, KV head) of a unit keeps every position of the
// unit's kept blocks.
struct BlockPlan {
  int64_t block_size = 0;
  int64_t num_blocks = 0;        // logical blocks, ceil(n / block_size)
  int32_t units = 0;             // 1 (kBlocksShared) or L (kBlocksPerLayer)
  std::vector<int64_t> offsets;  // [units + 1] into kept and new_table
  std::vector<int32_t> kept;     // kept logical block indices, ascending within each unit
  std::vector<double> scores;    // [units, num_blocks] when scores are requested; +inf for
                                 // forced blocks (STREAMING_LLM: 1 kept, 0 evicted)
  // When the unit's keys are paged (unit u reads layers[u].keys' table; kBlocksShared
  // layers[0].keys'), from that table; empty otherwise:
  std::vector<int32_t> new_table;      // the physical ids of the kept blocks, offsets as kept
  std::vector<int64_t> freed_offsets;  // [units + 1] into freed
  std::vector<int32_t> freed;          // the physical ids of the evicted blocks, logical order

  bool paged() const { return !freed_offsets.empty(); }
  absl::Span<const int32_t> kept_blocks(int unit) const {
    return absl::MakeConstSpan(kept).subspan(offsets[unit], offsets[unit + 1] - offsets[unit]);
  }
  absl::Span<const int32_t> new_block_table(int unit) const {
    return absl::MakeConstSpan(new_table).subspan(offsets[unit], offsets[unit + 1] - offsets[unit]);
  }
  absl::Span<const int32_t> freed_ids(int unit) const {
    return absl::MakeConstSpan(freed).subspan(freed_offsets[unit],
                                              freed_offsets[unit + 1] - freed_offsets[unit]);
  }
};

struct KeepPlan {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int64_t n = 0;
  int32_t window = 0;          // effective window min(w, n)
  int32_t sinks = 0;           // effective sinks min(sinks, n - window)
  int64_t quota = 0;           // q: selected candidates per head under a uniform split
  int64_t selected_total = 0;  // K = L * Hkv * q (baselines: kept positions in [sinks, n - window))
  int64_t tokens_per_head = 0;  // B the budget asked for at this n (a compression ratio
                                // resolved), before clamping to [window + sinks, n]

  std::vector<int32_t> counts;      // [L * Hkv] kept tokens per (layer, head)
  std::vector<int64_t> offsets;     // [L * Hkv + 1] into positions (filled even without positions)
  std::vector<int32_t> positions;   // kept positions, when requested
  std::vector<uint8_t> bitmask;     // when requested
  std::vector<float> scores;        // when requested
  std::vector<double> layer_sums;   // [L] sum of raw scores p over the layer's candidates
                                    // (CAKE: layer preference P_l; other baselines: 0)
  std::optional<BlockPlan> blocks;  // block-shaped plans only
  PlanTiming timing;

  int32_t count(int layer, int kv_head) const { return counts[layer * num_kv_heads + kv_head]; }
  // Kept positions of one (layer, head); requires OutputOptions::positions.
  absl::Span<const int32_t> kept(int layer, int kv_head) const {
    const int64_t i = int64_t{layer} * num_kv_heads + kv_head;
    return absl::MakeConstSpan(positions).subspan(offsets[i], offsets[i + 1] - offsets[i]);
  }
};

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_KEEP_PLAN_H_
