#include "policy/blocks.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "policy/select.h"

namespace laprox::kernels::policy {

template <typename Score>
absl::StatusOr<KeepPlan> SelectBlockPlan(const RequestShape& shape, const BlockRule& rule,
                                         absl::Span<const Score> token_scores,
                                         std::vector<float> output_scores,
                                         const OutputOptions& outputs) {
  const int64_t L = shape.num_layers, Hkv = shape.num_kv_heads, n = shape.n;
  const int64_t bs = shape.block_size, nb = shape.num_blocks;
  const bool shared = rule.plan_shape == PlanShape::kBlocksShared;
  const int64_t units = shared ? 1 : L;
  const auto block_begin = [&](int64_t b) { return b * bs; };
  const auto block_end = [&](int64_t b) { return std::min((b + 1) * bs, n); };
  // A block is forced when it holds a forced position: it starts before forced_begin or ends
  // after forced_end.
  const auto forced = [&](int64_t b) {
    return block_begin(b) < rule.forced_begin || block_end(b) > rule.forced_end;
  };
  int64_t forced_blocks = 0;
  for (int64_t b = 0; b < nb; ++b) forced_blocks += forced(b) ? 1 : 0;
  const bool keep_all = shape.kept_per_head >= n;
  const int64_t quota = keep_all ? nb - forced_blocks
                                 : std::clamp<int64_t>(shape.kept_per_head / bs - forced_blocks, 0,
                                                       nb - forced_blocks);

  // Block scores [units, nb], +inf for forced blocks; sums in (layer, head, position) order.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<double> scores(units * nb, kInf);
  for (int64_t u = 0; u < units; ++u) {
    for (int64_t b = 0; b < nb; ++b) {
      if (!forced(b)) scores[u * nb + b] = rule.by_recency ? static_cast<double>(b) : 0.0;
    }
  }
  for (int64_t l = 0; l < L && !rule.by_recency; ++l) {
    double* unit = scores.data() + (shared ? 0 : l) * nb;
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t base = (l * Hkv + g) * n;
      for (int64_t b = 0; b < nb; ++b) {
        if (forced(b)) continue;
        for (int64_t i = block_begin(b); i < block_end(b); ++i) {
          const double s = static_cast<double>(token_scores[base + i]);
          if (std::isnan(s)) {
            return NonFiniteScoreError(shape, static_cast<uint64_t>(base + i), s, "ranking score");
          }
          unit[b] += s;
        }
      }
    }
  }

  // Candidate blocks compete by score, then (unit, block) index: one pool per competition.
  std::vector<uint8_t> kept_block(units * nb, 0);
  std::vector<Ranked<double>> pool;
  const auto compete = [&](int64_t first_unit, int64_t last_unit, int64_t k) {
    pool.clear();
    for (int64_t u = first_unit; u < last_unit; ++u) {
      for (int64_t b = 0; b < nb; ++b) {
        if (!forced(b)) pool.push_back({scores[u * nb + b], static_cast<uint32_t>(u * nb + b)});
      }
    }
    k = std::min<int64_t>(k, static_cast<int64_t>(pool.size()));
    PartitionBest(absl::MakeSpan(pool), k);
    for (int64_t j = 0; j < k; ++j) kept_block[pool[j].index] = 1;
  };
  if (rule.model_wide && !shared) {
    compete(0, units, units * quota);
  } else {
    for (int64_t u = 0; u < units; ++u) compete(u, u + 1, quota);
  }
  for (int64_t u = 0; u < units; ++u) {
    for (int64_t b = 0; b < nb; ++b) kept_block[u * nb + b] |= forced(b) ? 1 : 0;
  }

  // Every (layer, head) keeps every position of its unit's kept blocks.
  std::vector<uint8_t> kept(L * Hkv * n, 0);
  for (int64_t l = 0; l < L; ++l) {
    const uint8_t* unit = kept_block.data() + (shared ? 0 : l) * nb;
    for (int64_t b = 0; b < nb; ++b) {
      if (unit[b] == 0) continue;
      for (int64_t g = 0; g < Hkv; ++g) {
        std::fill(kept.begin() + (l * Hkv + g) * n + block_begin(b),
                  kept.begin() + (l * Hkv + g) * n + block_end(b), 1);
      }
    }
  }
  KeepPlan plan = BuildKeepPlan(shape, kept, std::move(output_scores), outputs);

  BlockPlan& blocks = plan.blocks.emplace();
  blocks.block_size = bs;
  blocks.num_blocks = nb;
  blocks.units = static_cast<int32_t>(units);
  blocks.offsets.assign(units + 1, 0);
  for (int64_t u = 0; u < units; ++u) {
    for (int64_t b = 0; b < nb; ++b) {
      if (kept_block[u * nb + b] != 0) blocks.kept.push_back(static_cast<int32_t>(b));
    }
    blocks.offsets[u + 1] = static_cast<int64_t>(blocks.kept.size());
  }
  if (outputs.scores) {
    if (rule.by_recency) {
      for (int64_t j = 0; j < units * nb; ++j) scores[j] = kept_block[j] != 0 ? 1.0 : 0.0;
    }
    blocks.scores = std::move(scores);
  }
  return plan;
}

template absl::StatusOr<KeepPlan> SelectBlockPlan<float>(const RequestShape&, const BlockRule&,
                                                         absl::Span<const float>,
                                                         std::vector<float>, const OutputOptions&);
template absl::StatusOr<KeepPlan> SelectBlockPlan<double>(const RequestShape&, const BlockRule&,
                                                          absl::Span<const double>,
                                                          std::vector<float>, const OutputOptions&);

void FillBlockTables(absl::Span<const BlockTable* const> unit_tables, BlockPlan& blocks) {
  blocks.new_table.clear();
  blocks.freed.clear();
  blocks.freed_offsets.clear();
  for (const BlockTable* table : unit_tables) {
    if (table == nullptr) return;  // unpaged keys: no physical ids to report
  }
  blocks.freed_offsets.assign(blocks.units + 1, 0);
  for (int32_t u = 0; u < blocks.units; ++u) {
    const std::vector<int32_t>& ids = unit_tables[u]->ids();
    int64_t next = 0;  // logical blocks are kept in ascending order
    for (int32_t b : blocks.kept_blocks(u)) {
      for (; next < b; ++next) blocks.freed.push_back(ids[next]);
      blocks.new_table.push_back(ids[b]);
      next = b + 1;
    }
    for (; next < blocks.num_blocks; ++next) blocks.freed.push_back(ids[next]);
    blocks.freed_offsets[u + 1] = static_cast<int64_t>(blocks.freed.size());
  }
}

}  // namespace laprox::kernels::policy
