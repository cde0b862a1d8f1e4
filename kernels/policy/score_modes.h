// Which statistics a LAPROX score needs, decided once for every backend: from the indicator and
// the effective gqa_value (SEMANTICS.md, "Indicators" and "GQA"), how the window attention of a
// KV group is summarised per token and how the values enter, and which blocks of the prepared
// factors the value product reads. The CPU scorer (cpu/score.cc) and both CUDA scorers
// (cuda/gemm_scorer.cc, cuda/fused_scorer.cc) and the device launchers (cuda/score_kernels.h) all
// read this table.
//
// Plain data and a declaration only (PolicySpec is forward-declared): includable from .cu files.
#ifndef LAPROX_KERNELS_POLICY_SCORE_MODES_H_
#define LAPROX_KERNELS_POLICY_SCORE_MODES_H_

#include <cstdint>

namespace laprox::kernels {

struct PolicySpec;

// How the attention columns of a KV group are summarised per token. S statistics per token.
enum class AttentionStat : int {
  kGroupMean = 0,  // ||mean_h A^h[:, i]||^2 * G^2, S = 1
  kPerHead = 1,    // ||A^h[:, i]||^2, S = G
  kHeadGram = 2,   // <A^h[:, i], A^h'[:, i]> for h <= h': G diagonal, then G(G-1)/2 cross; S = G+P
};

// How values enter the score.
enum class ValueStat : int {
  kNone = 0,     // ATTENTION
  kNorm = 1,     // ||v_i||
  kSummed = 2,   // ||v_i sum_h W_O^h||, factor block 0
  kPerHead = 3,  // ||v_i W_O^h||, factor blocks 1..G
  kExact = 4,    // v_i M_h v_i^T and v_i C_hh' v_i^T, factor blocks 1..G+P (raw quadratic forms)
};

struct ScoreModes {
  AttentionStat attention = AttentionStat::kGroupMean;
  ValueStat value = ValueStat::kNone;
  int64_t first_block = 0;    // first factor block the value product reads
  int64_t factor_blocks = 0;  // factor blocks it reads (0 without a value product)

  // Value statistics per (group, token): the factor blocks, or 1 for the plain norm.
  int64_t value_forms() const { return value == ValueStat::kNorm ? 1 : factor_blocks; }
  // Attention statistics per (group, token), S above.
  int64_t attention_stats(int64_t group) const {
    if (attention == AttentionStat::kGroupMean) return 1;
    return attention == AttentionStat::kPerHead ? group : group + group * (group - 1) / 2;
  }
  bool value_product() const {
    return value == ValueStat::kSummed || value == ValueStat::kPerHead ||
           value == ValueStat::kExact;
  }
};

// The modes of a LAPROX policy for KV groups of `group` query heads (kernels/policy/
// score_modes.cc).
ScoreModes ChooseScoreModes(const PolicySpec& policy, int64_t group);

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_POLICY_SCORE_MODES_H_
