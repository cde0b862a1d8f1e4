// batch_benchmark: S sequences of n tokens planned in one ComputeKeepPlans call against the same
// S sequences planned one call after the other, in one run, in-process (Backend) and served
// (laproxd in this process on a Unix socket, as laproxd runs by default: 2 workers, 2 CPU
// threads each), plus the S calls sent at once from S client threads (an engine that does not
// wait for one plan before asking for the next).
//
// SmolLM2-135M geometry (L30, H9, Hkv3, d64, D576), fp32, w = 32, budget 128, LAPROX defaults,
// kept positions in the response; every sequence has its own random inputs in one shared
// buffer, registered once. Cases: 16 x 512 and 4 x 4096. Each round runs every mode once, in
// rotating order; the counters are the medians over the rounds of the wall time of the whole
// set of S plans, and the speed-ups are sequential / batch on the same medians.
//
//   build/bench/batch_benchmark [--benchmark_filter=...]
#include <algorithm>
#include <chrono>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "bench/bench_stats.h"
#include "laprox/client/client.h"
#include "laprox/kernels/registry.h"
#include "service/core/core.h"
#include "service/core/work_queue.h"
#include "service/grpc/laprox_service.h"
#include "tests/common/test_server.h"

namespace laprox {
namespace {

using Clock = std::chrono::steady_clock;
using bench::Median;
constexpr int kL = 30, kH = 9, kHkv = 3, kD = 64, kHidden = 576, kWindow = 32;
constexpr int kRounds = 7;

double MillisSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void BM_Batch(benchmark::State& state) {
  const int64_t sequences = state.range(0), n = state.range(1);
  service::Core core(*kernels::CreateBackend("cpu", {.threads = 2}), {});
  service::WorkQueue work(2, 256);
  service::LaproxService service(core, work, "bench", testing::ActAsLaproxd());
  auto server = testing::TestServer::Start(&service, "laprox-batch-bench", 256 << 20);
  auto client = *client::Client::Connect(server->target());

  const int64_t kv = int64_t{kHkv} * n * kD, q = int64_t{kH} * kWindow * kD;
  const int64_t layer = 2 * kv + q, sequence_floats = kL * layer;
  auto buffer = client->ShareHostBuffer(absl::StrCat("laprox-batch-bench-", getpid(), "-", n),
                                        sequences * sequence_floats * sizeof(float));
  if (!buffer.ok()) {
    state.SkipWithError(buffer.status().ToString().c_str());
    return;
  }
  auto* floats = reinterpret_cast<float*>(buffer->data());
  std::mt19937 rng(20261202);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t i = 0; i < sequences * sequence_floats; ++i) floats[i] = normal(rng);
  std::vector<std::vector<float>> o_proj(kL, std::vector<float>(kHidden * kH * kD));
  for (auto& w : o_proj) {
    for (float& x : w) x = normal(rng) * 0.02f;
  }
  const kernels::ModelGeometry geometry{kL, kH, kHkv, kD, kHidden, 0.f};
  std::vector<client::TensorRef> o_refs;
  std::vector<kernels::TensorView> o_views;
  for (const auto& w : o_proj) {
    o_refs.push_back(client::TensorRef::Inline(w.data(), kernels::DType::kF32, {kHidden, kH * kD}));
    o_views.emplace_back(w.data(), kernels::DType::kF32, kernels::Dims{kHidden, kH * kD});
  }
  auto registered = client->RegisterModel("bench", geometry, o_refs);
  if (!registered.ok()) {
    state.SkipWithError(registered.status().ToString().c_str());
    return;
  }
  const uint64_t model = *registered;
  auto backend = *kernels::CreateBackend("cpu", {.threads = 2});
  auto prepared = *backend->PrepareModel(geometry, o_views);

  kernels::PolicySpec policy;
  policy.budget = kernels::Budget::TokensPerHead(128);
  std::vector<client::SequenceRequest> served(sequences);
  std::vector<kernels::KeepPlanRequest> direct(sequences);
  for (int64_t s = 0; s < sequences; ++s) {
    served[s] = {.n = n, .policy = policy};
    direct[s].n = n;
    direct[s].policy = policy;
    for (int l = 0; l < kL; ++l) {
      const int64_t base = s * sequence_floats + l * layer;
      const uint64_t region = buffer->region_id();
      served[s].layers.push_back(
          {.keys =
               client::TensorRef::InRegion(region, base * 4, kernels::DType::kF32, {kHkv, n, kD}),
           .values = client::TensorRef::InRegion(region, (base + kv) * 4, kernels::DType::kF32,
                                                 {kHkv, n, kD}),
           .window_queries = client::TensorRef::InRegion(region, (base + 2 * kv) * 4,
                                                         kernels::DType::kF32, {kH, kWindow, kD})});
      kernels::LayerInputs& in = direct[s].layers.emplace_back();
      in.keys = {floats + base, kernels::DType::kF32, {kHkv, n, kD}};
      in.values = {floats + base + kv, kernels::DType::kF32, {kHkv, n, kD}};
      in.window_queries = {floats + base + 2 * kv, kernels::DType::kF32, {kH, kWindow, kD}};
    }
  }

  // Each mode returns the positions of every plan, which must agree across modes.
  using Positions = std::vector<std::vector<int32_t>>;
  auto in_process_sequential = [&]() -> Positions {
    Positions out;
    for (const auto& request : direct) {
      out.push_back(backend->ComputeKeepPlan(*prepared, request)->positions);
    }
    return out;
  };
  auto in_process_batch = [&]() -> Positions {
    Positions out;
    auto plans = backend->ComputeKeepPlans(*prepared, direct);
    for (auto& plan : *plans) out.push_back(plan.positions);
    return out;
  };
  auto served_sequential = [&]() -> Positions {
    Positions out;
    for (const auto& sequence : served) {
      out.push_back(client->ComputeKeepPlan(model, sequence)->positions);
    }
    return out;
  };
  auto served_batch = [&]() -> Positions {
    Positions out;
    auto plans = client->ComputeKeepPlans(model, served);
    for (auto& plan : *plans) out.push_back(plan.positions);
    return out;
  };
  auto served_concurrent = [&]() -> Positions {
    Positions out(sequences);
    std::vector<std::thread> threads;
    for (int64_t s = 0; s < sequences; ++s) {
      threads.emplace_back(
          [&, s] { out[s] = client->ComputeKeepPlan(model, served[s])->positions; });
    }
    for (std::thread& t : threads) t.join();
    return out;
  };
  struct Mode {
    const char* name;
    std::function<Positions()> run;
    std::vector<double> millis;
  };
  std::vector<Mode> modes = {{"in_process_sequential", in_process_sequential, {}},
                             {"in_process_batch", in_process_batch, {}},
                             {"served_sequential", served_sequential, {}},
                             {"served_batch", served_batch, {}},
                             {"served_concurrent", served_concurrent, {}}};
  const Positions expected = in_process_sequential();
  for (auto _ : state) {  // NOLINT(clang-analyzer-deadcode.DeadStores): Google Benchmark idiom
    for (int round = -1; round < kRounds; ++round) {  // one warm-up round
      for (size_t m = 0; m < modes.size(); ++m) {
        Mode& mode = modes[(m + static_cast<size_t>(round + 1)) % modes.size()];
        const auto t0 = Clock::now();
        const Positions got = mode.run();
        const double millis = MillisSince(t0);
        if (got != expected) {
          state.SkipWithError(absl::StrCat(mode.name, ": the plans differ").c_str());
          return;
        }
        if (round >= 0) mode.millis.push_back(millis);
      }
    }
  }
  for (const Mode& mode : modes) {
    state.counters[absl::StrCat(mode.name, "_ms")] = Median(mode.millis);
  }
  state.counters["speedup_in_process"] = Median(modes[0].millis) / Median(modes[1].millis);
  state.counters["speedup_served"] = Median(modes[2].millis) / Median(modes[3].millis);
  state.counters["speedup_concurrent"] = Median(modes[2].millis) / Median(modes[4].millis);
  server.reset();
}

BENCHMARK(BM_Batch)
    ->Args({16, 512})
    ->Args({4, 4096})
    ->ArgNames({"sequences", "n"})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace laprox

BENCHMARK_MAIN();
