// service_benchmark: what laproxd adds on top of the compute, for a register-once,
// reference-many request over a Unix socket, against calling the backend in-process on the same
// inputs, in one run.
//
// SmolLM2-135M geometry (L30, H9, Hkv3, d64, D576), n = 4096, w = 32, fp32, budget 128, kept
// positions as output. The region and the model are registered once; each timed request sends
// only references. Calls alternate (in-process, served) so both see the same machine state; the
// overhead of each pair is served - in-process, and the p50/p99 of those differences are
// reported beside the p50 of each side. That difference is noisy where the compute is long and
// shares the cores with gRPC's threads, so the overhead is also split per call with the server's
// own stage times (the response's Timing):
//   transport = what the client saw - the server's total: (de)serialization on both sides, the
//               socket, gRPC's threads and the wake-ups between them;
//   in-server = the server's total - its score and select stages: queue (the hop to a worker),
//               validate (request conversion and checks), respond, bookkeeping.
// Beside them, floors measured on the same connection: a GetServerInfo round trip (answered on
// gRPC's thread), a ComputeKeepMask the worker refuses at once (unknown model: transport plus
// the worker hop, no compute), the transport of a plan without positions (counts only), and of
// a plan whose positions the server writes into a registered region (ComputeKeepPlanInto).
// n = 256 (compute a few ms) and n = 4096 (~100-180 ms on 2 cores).
//
//   build/bench/service_benchmark [--benchmark_filter=...]
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <grpcpp/grpcpp.h>
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
using bench::Percentile;
constexpr int kL = 30, kH = 9, kHkv = 3, kD = 64, kHidden = 576, kWindow = 32;
constexpr int kRounds = 30;

void BM_ServiceOverhead(benchmark::State& state) {
  const int64_t n = state.range(0);
  // The server, in this process, on a private Unix socket.
  service::Core core(*kernels::CreateBackend("cpu"), {});
  service::WorkQueue work(1, 16);
  service::LaproxService service(core, work, "bench", testing::ActAsLaproxd());
  // laproxd's default --max_request_bytes.
  auto server = testing::TestServer::Start(&service, "laprox-bench", 256 << 20);
  auto client = *client::Client::Connect(server->target());

  // Inputs in one shared buffer: per layer keys, values, queries.
  const int64_t kv = int64_t{kHkv} * n * kD, q = int64_t{kH} * kWindow * kD;
  const int64_t layer = 2 * kv + q;
  auto buffer = client->ShareHostBuffer(absl::StrCat("laprox-bench-", getpid(), "-", n),
                                        kL * layer * sizeof(float));
  if (!buffer.ok()) {
    state.SkipWithError(buffer.status().ToString().c_str());
    return;
  }
  auto* floats = reinterpret_cast<float*>(buffer->data());
  std::mt19937 rng(20261130);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t i = 0; i < kL * layer; ++i) floats[i] = normal(rng);
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
  auto backend = *kernels::CreateBackend("cpu");
  auto prepared = *backend->PrepareModel(geometry, o_views);

  kernels::PolicySpec policy;
  policy.budget = kernels::Budget::TokensPerHead(128);
  std::vector<client::LayerRefs> refs;
  kernels::KeepPlanRequest request;
  request.n = n;
  request.policy = policy;
  for (int l = 0; l < kL; ++l) {
    const int64_t base = l * layer;
    client::LayerRefs& r = refs.emplace_back();
    r.keys = client::TensorRef::InRegion(buffer->region_id(), base * 4, kernels::DType::kF32,
                                         {kHkv, n, kD});
    r.values = client::TensorRef::InRegion(buffer->region_id(), (base + kv) * 4,
                                           kernels::DType::kF32, {kHkv, n, kD});
    r.window_queries = client::TensorRef::InRegion(buffer->region_id(), (base + 2 * kv) * 4,
                                                   kernels::DType::kF32, {kH, kWindow, kD});
    kernels::LayerInputs& in = request.layers.emplace_back();
    in.keys = {floats + base, kernels::DType::kF32, {kHkv, n, kD}};
    in.values = {floats + base + kv, kernels::DType::kF32, {kHkv, n, kD}};
    in.window_queries = {floats + base + 2 * kv, kernels::DType::kF32, {kH, kWindow, kD}};
  }

  std::vector<double> direct, served, overhead, transport, in_server, queue, validate, respond;
  for (auto _ : state) {  // NOLINT(clang-analyzer-deadcode.DeadStores): Google Benchmark idiom
    for (auto* v :
         {&direct, &served, &overhead, &transport, &in_server, &queue, &validate, &respond}) {
      v->clear();
    }
    for (int round = -2; round < kRounds; ++round) {  // two warm-up rounds
      auto t0 = Clock::now();
      auto local = backend->ComputeKeepPlan(*prepared, request);
      auto t1 = Clock::now();
      client::ServerTiming server_timing;
      auto remote = client->ComputeKeepPlan(model, n, refs, policy, {}, &server_timing);
      auto t2 = Clock::now();
      if (!local.ok() || !remote.ok() || local->positions != remote->positions) {
        state.SkipWithError("plans differ or failed");
        return;
      }
      if (round < 0) continue;
      const double a = std::chrono::duration<double, std::micro>(t1 - t0).count();
      const double b = std::chrono::duration<double, std::micro>(t2 - t1).count();
      direct.push_back(a);
      served.push_back(b);
      overhead.push_back(b - a);
      const double server_total = server_timing.total_seconds * 1e6;
      transport.push_back(b - server_total);
      in_server.push_back(server_total -
                          (remote->timing.score_seconds + remote->timing.select_seconds) * 1e6);
      queue.push_back(server_timing.queue_seconds * 1e6);
      validate.push_back(remote->timing.validate_seconds * 1e6);
      respond.push_back(server_timing.respond_seconds * 1e6);
    }
  }
  // Floors on the same connection.
  auto micros_since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  };
  std::vector<double> rpc, refused, counts_only, into_region;
  for (int i = 0; i < 200; ++i) {
    auto t0 = Clock::now();
    if (!client->GetServerInfo().ok()) state.SkipWithError("GetServerInfo failed");
    rpc.push_back(micros_since(t0));
  }
  for (int i = 0; i < 200; ++i) {
    auto t0 = Clock::now();
    if (client->ComputeKeepPlan(model + 1000, n, refs, policy).ok()) {
      state.SkipWithError("a plan for an unknown model");
    }
    refused.push_back(micros_since(t0));
  }
  for (int i = 0; i < kRounds; ++i) {
    client::ServerTiming server_timing;
    auto t0 = Clock::now();
    if (!client->ComputeKeepPlan(model, n, refs, policy, {.positions = false}, &server_timing)
             .ok()) {
      state.SkipWithError("counts-only plan failed");
    }
    counts_only.push_back(micros_since(t0) - server_timing.total_seconds * 1e6);
  }
  // The positions written into a writable region instead of the response.
  auto out = client->ShareHostBuffer(absl::StrCat("laprox-bench-out-", getpid(), "-", n),
                                     static_cast<size_t>(kL * kHkv * n * 4), /*writable=*/true);
  if (!out.ok()) {
    state.SkipWithError(out.status().ToString().c_str());
    return;
  }
  for (int i = 0; i < kRounds; ++i) {
    client::ServerTiming server_timing;
    auto t0 = Clock::now();
    if (!client
             ->ComputeKeepPlanInto(model, n, refs, policy,
                                   {.region_id = out->region_id(), .positions_offset = 0},
                                   &server_timing)
             .ok()) {
      state.SkipWithError("plan into a region failed");
    }
    into_region.push_back(micros_since(t0) - server_timing.total_seconds * 1e6);
  }
  state.counters["empty_rpc_p50_us"] = Percentile(rpc, 0.5);
  state.counters["transport_into_region_p50_us"] = Percentile(into_region, 0.5);
  state.counters["refused_rpc_p50_us"] = Percentile(refused, 0.5);
  state.counters["transport_counts_only_p50_us"] = Percentile(counts_only, 0.5);
  state.counters["queue_p50_us"] = Percentile(queue, 0.5);
  state.counters["validate_p50_us"] = Percentile(validate, 0.5);
  state.counters["respond_p50_us"] = Percentile(respond, 0.5);
  state.counters["in_process_p50_us"] = Percentile(direct, 0.5);
  state.counters["served_p50_us"] = Percentile(served, 0.5);
  state.counters["overhead_p50_us"] = Percentile(overhead, 0.5);
  state.counters["overhead_p99_us"] = Percentile(overhead, 0.99);
  state.counters["transport_p50_us"] = Percentile(transport, 0.5);
  state.counters["transport_p99_us"] = Percentile(transport, 0.99);
  state.counters["in_server_p50_us"] = Percentile(in_server, 0.5);
  state.counters["in_server_p99_us"] = Percentile(in_server, 0.99);
  server.reset();
}

BENCHMARK(BM_ServiceOverhead)->Arg(256)->Arg(4096)->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace laprox

BENCHMARK_MAIN();
