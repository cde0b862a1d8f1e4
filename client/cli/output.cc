#include "client/cli/output.h"

#include <cstdint>
#include <cstdio>
#include <vector>

#include <nlohmann/json.hpp>

namespace laprox::cli {

using nlohmann::json;

void PrintJson(const kernels::KeepPlan& plan) {
  json counts = json::array(), kept = json::array();
  for (int l = 0; l < plan.num_layers; ++l) {
    json c = json::array(), k = json::array();
    for (int h = 0; h < plan.num_kv_heads; ++h) {
      c.push_back(plan.count(l, h));
      auto positions = plan.kept(l, h);
      k.push_back(std::vector<int32_t>(positions.begin(), positions.end()));
    }
    counts.push_back(c);
    kept.push_back(k);
  }
  json out = {{"counts", counts}, {"kept", kept}, {"layer_sums", plan.layer_sums}};
  if (plan.blocks) {
    json units = json::array();
    for (int32_t u = 0; u < plan.blocks->units; ++u) {
      const auto blocks = plan.blocks->kept_blocks(u);
      units.push_back(std::vector<int32_t>(blocks.begin(), blocks.end()));
    }
    out["kept_blocks"] = units;
    out["block_size"] = plan.blocks->block_size;
  }
  std::printf("%s\n", out.dump().c_str());
}

void PrintTable(const kernels::KeepPlan& plan) {
  const double uniform = plan.window + plan.sinks + static_cast<double>(plan.quota);
  std::printf("n=%lld window=%d sinks=%d uniform share=%.0f tokens per head\n",
              static_cast<long long>(plan.n), plan.window, plan.sinks, uniform);
  std::printf("layer  budget share per KV head%*s| layer\n", plan.num_kv_heads * 6 - 24, "");
  for (int l = 0; l < plan.num_layers; ++l) {
    double sum = 0;
    std::printf("%5d ", l);
    for (int h = 0; h < plan.num_kv_heads; ++h) {
      const double share = plan.count(l, h) / uniform;
      sum += share;
      std::printf(" %5.2f", share);
    }
    std::printf(" | %5.2f\n", sum / plan.num_kv_heads);
  }
  int64_t kept = 0;
  for (int32_t c : plan.counts) kept += c;
  const int64_t entries = plan.n * plan.num_layers * plan.num_kv_heads;
  std::printf(
      "kept %lld of %lld (layer, KV head, token) entries (%.1f%%): the budget went where "
      "the shares above are > 1.00\n",
      static_cast<long long>(kept), static_cast<long long>(entries),
      entries > 0 ? 100.0 * static_cast<double>(kept) / static_cast<double>(entries) : 0.0);
}

}  // namespace laprox::cli
