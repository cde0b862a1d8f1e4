#include "policy/score_modes.h"

#include "laprox/kernels/policy.h"

namespace laprox::kernels {

ScoreModes ChooseScoreModes(const PolicySpec& policy, int64_t group) {
  const int64_t pairs = group * (group - 1) / 2;
  switch (policy.indicator) {
    case Indicator::kAttention:
      return {AttentionStat::kGroupMean, ValueStat::kNone, 0, 0};
    case Indicator::kAttentionXValue:
      return {AttentionStat::kGroupMean, ValueStat::kNorm, 0, 0};
    case Indicator::kAttentionXProjectedValue:
      break;
  }
  switch (policy.EffectiveGqaValue()) {
    case GqaValue::kMeanHeadNorm:
      return {AttentionStat::kGroupMean, ValueStat::kPerHead, 1, group};
    case GqaValue::kSummedProjection:
      return {AttentionStat::kGroupMean, ValueStat::kSummed, 0, 1};
    case GqaValue::kMeanHeadProduct:
      return {AttentionStat::kPerHead, ValueStat::kPerHead, 1, group};
    case GqaValue::kExactBlock:
      return {AttentionStat::kHeadGram, ValueStat::kExact, 1, group + pairs};
  }
  return {AttentionStat::kGroupMean, ValueStat::kNone, 0, 0};
}

}  // namespace laprox::kernels
