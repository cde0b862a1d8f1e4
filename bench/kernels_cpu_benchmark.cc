// kernels_cpu_benchmark: the CPU backend's keep-plan time against this machine's floor.
//
// What it measures. For each case (a model geometry and a prompt length n) it times
// Backend::ComputeKeepPlan of the CPU backend (2 worker threads, single-threaded OpenBLAS
// inside) on random-normal fp32 keys, values and window queries, with the LaProx policy that
// bench/numpy_laprox.py implements (GLOBAL_NORMALIZED, ATTENTION_X_PROJECTED_VALUE,
// MEAN_HEAD_NORM, w = 32, avg pool 7 of the attention factor: the default before bench/quality's
// dev grid, set explicitly) and a budget of B = 128 tokens per KV head. PrepareModel (the d x d
// factors of o_proj) runs once, untimed, as it does when a model is registered. Every case is
// warmed up with one untimed call.
//
// Beside each time it reports the floor of this machine, measured in the same process
// (docs/design.md §8):
//   floor = max(FLOPs / sgemm rate, fp32 K+V bytes / read bandwidth)
//   FLOPs = L * (2*H*w*n*d  [Q.K^T]  +  2*H*n*d*d  [V times one d x d factor per query head])
//   bytes = 2 * L * Hkv * n * d * 4  [K and V read once]
// and, as a second column, the floor of the least work (issue 16): the same with the value
// factor's FLOPs at L * H * n * d * (d + 1), the triangular form's multiply-adds (least_ms,
// x_least). The backend computes the value factor that way since issue 16, so the first floor
// no longer bounds it from below.
// The sgemm rate is two threads each running a single-threaded 1024^3 sgemm at the same time,
// summed (the backend runs single-threaded BLAS on two workers). The bandwidth is two threads
// summing the halves of a 1 GiB array. Both are measured at start-up and again before each case,
// and the best trial so far is used (the machine may be shared; the floor is what it can do, so
// a busy moment must not lower the bar). For diagnosis it also measures, at start-up, the rate
// of the kernel shapes the backend runs (qk_GFLOPs for the Q.K^T sgemm chunks, tri_GFLOPs for
// the triangular value kernel in least-work FLOPs, and vm_GFLOPs for the V.M sgemm chunks the
// value factor used before); those do not enter the floor.
//
// Counters per case (--benchmark_counters_tabular=true prints them as columns): GFLOP, KV_MB,
// flop_ms, byte_ms, floor_ms, x_floor (time / floor), least_GFLOP, least_ms, x_least (time /
// least-work floor), x_floor_paired and x_least_paired (the median over the calls of each call
// against the floors of the sgemm rate measured just before it), ours_GFLOPs (achieved, in the
// first floor's FLOPs), sgemm_GFLOPs, read_GBs, qk_GFLOPs, vm_GFLOPs, tri_GFLOPs. The Time column
// is the mean of the timed calls.
//
// Memory: peak_extra_MB is the peak resident size during the timed calls beyond the resident
// size before them (Linux VmHWM after a clear_refs reset), estimate_MB the backend's
// EstimateKeepPlanMemory bound (what laproxd reserves against --max_request_memory_bytes);
// work_G the work units of EstimateKeepPlanWork (what laproxd checks against
// --max_request_work), in billions, and work_G_per_s their rate in the best call.
// LAPROX_BENCH_STOP=1 gives every call a kernels::StopSignal as laproxd does (it never fires), to
// measure the cost of the cancellation checks.
// --laprox_long_context runs SmolLM2 at 128K and its 6-layer geometry at 64K..512K instead.
// --laprox_small runs SmolLM2 at n = 256 and 1024 instead, 200 calls each: plans of a few ms,
// where the cost of handing work to the worker threads shows.
//
// Running it:
//   bench/run_cpu_bench.sh BUILD_DIR   # this benchmark + the numpy timing, one table
//   BUILD_DIR/bench/kernels_cpu_benchmark --benchmark_counters_tabular=true
// With LAPROX_BENCH_DUMP=DIR set, each case writes its inputs and the kept bitmask of its plan
// to DIR/<case>/ (raw little-endian fp32 / uint8 files and meta.json), which
// bench/numpy_laprox.py reads so that both sides score identical inputs.
#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <benchmark/benchmark.h>
#include <cblas.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_stats.h"
#include "cpu/triangular.h"
#include "laprox/kernels/backend.h"
#include "laprox/kernels/openblas_core.h"
#include "laprox/kernels/registry.h"

namespace laprox::kernels {
namespace {

using Clock = std::chrono::steady_clock;
using laprox::bench::Median;

constexpr int kThreads = 2;
constexpr int kWindow = 32;
constexpr int64_t kTokensPerHead = 128;
constexpr int kPoolKernel = 7;
constexpr uint64_t kSeed = 20261130;
// Iterations per case: the Llama and 32K cases take seconds per call on 2 cores, and the whole
// C++ run should stay within a few minutes.
constexpr int kIterations = 5;
constexpr int kSmallIterations = 200;  // --laprox_small

struct Geometry {
  const char* name;
  int L, H, Hkv, d, D;
};
constexpr Geometry kSmolLM2{"SmolLM2-135M", 30, 9, 3, 64, 576};
constexpr Geometry kLlama{"Llama-3.1-8B", 32, 32, 8, 128, 4096};
// SmolLM2's layer geometry with 6 of its 30 layers: the long-context series reaches 512K tokens
// with it (30 layers' fp32 K and V at 512K are 47 GB, beyond this machine's 24 GB).
constexpr Geometry kSmolLM2Layers6{"SmolLM2-135M-6layers", 6, 9, 3, 64, 576};

struct Case {
  Geometry geometry;
  int64_t n;
  // 0: keys and values contiguous [Hkv, n, d] per layer. Otherwise paged, as vLLM's
  // FlashAttention pool [num_blocks, block_size, Hkv, d] per layer and tensor, the sequence's
  // blocks at shuffled ids (one table for every layer): the same numbers, read through the table.
  int64_t block_size = 0;
  std::string Name() const {
    return absl::StrCat(geometry.name, "_n", n,
                        block_size ? absl::StrCat("_paged", block_size) : std::string());
  }
  double Flops() const {
    const Geometry& g = geometry;
    const double per_layer = 2.0 * g.H * kWindow * n * g.d + 2.0 * g.H * n * g.d * g.d;
    return per_layer * g.L;
  }
  // The least arithmetic the scores need: Q.K^T as above, and ||v T_h||^2 with T_h triangular,
  // d(d+1)/2 multiply-adds per value row and query head (kernels/cpu/triangular.h).
  double LeastFlops() const {
    const Geometry& g = geometry;
    const double per_layer = 2.0 * g.H * kWindow * n * g.d + 1.0 * g.H * n * g.d * (g.d + 1.0);
    return per_layer * g.L;
  }
  double KvBytes() const { return 2.0 * geometry.L * geometry.Hkv * n * geometry.d * 4; }
};

// ---------------------------------------------------------------------------------------------
// Random data. Counter-based (each value depends only on seed, stream and index) so the inputs
// do not depend on the thread count, and fast enough to make ~1e9 values in seconds.

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Runs fn(thread) on kThreads threads and waits for all of them.
template <typename Fn>
void OnThreads(Fn&& fn) {
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(fn, t);
  for (std::thread& t : threads) t.join();
}

// Fills out[0, count) with N(0, stddev^2) values (Box-Muller on pairs of 24-bit uniforms).
void FillNormal(float* out, int64_t count, uint64_t stream, float stddev) {
  const int64_t pairs = (count + 1) / 2;
  const uint64_t key = SplitMix64(kSeed ^ SplitMix64(stream));
  OnThreads([&](int t) {
    const int64_t begin = pairs * t / kThreads, end = pairs * (t + 1) / kThreads;
    for (int64_t p = begin; p < end; ++p) {
      const uint64_t bits = SplitMix64(key + static_cast<uint64_t>(p));
      const float u1 = static_cast<float>((bits >> 40) + 1) * 0x1p-24f;  // (0, 1]
      const float u2 = static_cast<float>(bits & 0xFFFFFF) * 0x1p-24f;   // [0, 1)
      const float r = stddev * std::sqrt(-2.f * std::log(u1));
      const float theta = 6.2831853f * u2;
      out[2 * p] = r * std::cos(theta);
      if (2 * p + 1 < count) out[2 * p + 1] = r * std::sin(theta);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The machine's floor.

// Wall seconds of fn(thread) run on kThreads threads released together.
template <typename Fn>
double TimeConcurrent(Fn&& fn) {
  std::barrier start(kThreads + 1);
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      fn(t);
    });
  }
  start.arrive_and_wait();
  const Clock::time_point begin = Clock::now();
  for (std::thread& t : threads) t.join();
  return std::chrono::duration<double>(Clock::now() - begin).count();
}

// Summed FLOP rate of kThreads threads each repeating call(t), flops_per_call FLOPs a call, at
// the same time (about 1 GFLOP per thread per trial: long enough to time, short enough to
// repeat); best of `trials` after a warm-up.
template <typename Call>
double ConcurrentRate(double flops_per_call, int trials, Call&& call) {
  const int reps = std::max(1, static_cast<int>(1e9 / flops_per_call));
  auto run = [&](int t) {
    for (int r = 0; r < reps; ++r) call(t);
  };
  TimeConcurrent(run);  // warm-up: OpenBLAS allocates its buffers on the first call
  double best = 0.0;
  for (int trial = 0; trial < trials; ++trial) {
    best = std::max(best, kThreads * reps * flops_per_call / TimeConcurrent(run));
  }
  return best;
}

// Summed FLOP rate of kThreads threads each calling single-threaded sgemm C[m,n] = A[m,k] B
// concurrently, B given as [k, n] or transposed as [n, k]; the operands are made once, so that
// Rate can be measured again between the calls of a case.
class SgemmProbe {
 public:
  SgemmProbe(int m, int n, int k, bool transpose_b)
      : m_(m), n_(n), k_(k), transpose_b_(transpose_b), buffers_(kThreads) {
    for (int t = 0; t < kThreads; ++t) {
      buffers_[t].a.resize(int64_t{m} * k);
      buffers_[t].b.resize(int64_t{k} * n);
      buffers_[t].c.resize(int64_t{m} * n);
      FillNormal(buffers_[t].a.data(), int64_t{m} * k, 1000 + t, 1.f);
      FillNormal(buffers_[t].b.data(), int64_t{k} * n, 2000 + t, 1.f);
    }
  }

  // Best of `trials` after a warm-up.
  double Rate(int trials) {
    return ConcurrentRate(2.0 * m_ * n_ * k_, trials, [&](int t) {
      Buffers& buf = buffers_[t];
      cblas_sgemm(CblasRowMajor, CblasNoTrans, transpose_b_ ? CblasTrans : CblasNoTrans, m_, n_, k_,
                  1.f, buf.a.data(), k_, buf.b.data(), transpose_b_ ? k_ : n_, 0.f, buf.c.data(),
                  n_);
    });
  }

 private:
  struct Buffers {
    std::vector<float> a, b, c;
  };
  int m_, n_, k_;
  bool transpose_b_;
  std::vector<Buffers> buffers_;
};

double SgemmRate(int m, int n, int k, bool transpose_b, int trials) {
  return SgemmProbe(m, n, k, transpose_b).Rate(trials);
}

// Sum of x[0, count); several independent accumulators so the loads, not the add latency,
// limit it.
float SumFloats(const float* x, int64_t count) {
  int64_t i = 0;
#if defined(__SSE2__)
  const int64_t vector_end = count - count % 16;
  __m128 s0 = _mm_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (; i < vector_end; i += 16) {
    s0 = _mm_add_ps(s0, _mm_loadu_ps(x + i));
    s1 = _mm_add_ps(s1, _mm_loadu_ps(x + i + 4));
    s2 = _mm_add_ps(s2, _mm_loadu_ps(x + i + 8));
    s3 = _mm_add_ps(s3, _mm_loadu_ps(x + i + 12));
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_add_ps(_mm_add_ps(s0, s1), _mm_add_ps(s2, s3)));
  float sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
  float sum = 0.f;
#endif
  for (; i < count; ++i) sum += x[i];
  return sum;
}

// Read bandwidth in bytes/s: kThreads threads each summing half of a 1 GiB array (far larger
// than the caches), best of `trials`.
double ReadBandwidth(int trials) {
  constexpr int64_t kCount = (int64_t{1} << 30) / sizeof(float);
  std::unique_ptr<float[]> data(new float[kCount]);
  // Each thread touches its own half first so that the pages exist before timing.
  OnThreads([&](int t) {
    const int64_t begin = kCount * t / kThreads, end = kCount * (t + 1) / kThreads;
    std::fill(data.get() + begin, data.get() + end, 1.f);
  });
  std::vector<float> sums(kThreads);
  double best = 0.0;
  for (int trial = 0; trial < trials; ++trial) {
    const double seconds = TimeConcurrent([&](int t) {
      const int64_t begin = kCount * t / kThreads, end = kCount * (t + 1) / kThreads;
      sums[t] = SumFloats(data.get() + begin, end - begin);
    });
    benchmark::DoNotOptimize(sums.data());
    best = std::max(best, kCount * sizeof(float) / seconds);
  }
  return best;
}

struct MachineRates {
  double sgemm_flops = 0;  // FLOP/s, large sgemm, both threads
  double read_bytes = 0;   // bytes/s, both threads
};

// Summed rate of kThreads threads each running the CPU backend's triangular value kernel
// (cpu/triangular.h) on `rows` rows and G factors of d x d, counted in the least-work FLOPs it
// stands for (d(d+1) per row and factor); best of `trials`.
double TriangleRate(int rows, int G, int d, int trials) {
  struct Buffers {
    std::vector<float> v, t, packed, out;
  };
  std::vector<Buffers> buffers(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    buffers[t].v.resize(int64_t{rows} * d);
    buffers[t].t.assign(int64_t{d} * G * d, 0.f);
    buffers[t].packed.resize(G * cpu::PackedTriangleSize(d));
    buffers[t].out.resize(int64_t{rows} * G);
    FillNormal(buffers[t].v.data(), int64_t{rows} * d, 3000 + t, 1.f);
    FillNormal(buffers[t].t.data(), int64_t{d} * G * d, 4000 + t, 1.f);
    cpu::PackTriangles(buffers[t].t.data(), int64_t{G} * d, d, G, buffers[t].packed.data());
  }
  return ConcurrentRate(static_cast<double>(rows) * G * d * (d + 1.0), trials, [&](int t) {
    Buffers& buf = buffers[t];
    cpu::TriangularSquaredNorms(buf.v.data(), d, rows, d, buf.packed.data(), G, buf.out.data(),
                                rows);
  });
}

// Rates of the kernel shapes of one geometry (kernels/cpu/window.cc and score.cc: Q.K^T is
// [G*w, d] x [1024, d]^T in sgemm; the value factor was [256, d] x [d, G*d] in sgemm before the
// triangular kernel replaced it, and is the triangular kernel on 256 rows now).
struct ShapedRates {
  double qk_flops = 0;
  double vm_flops = 0;   // the former V.M sgemm shape, for comparison
  double tri_flops = 0;  // the triangular kernel, in least-work FLOPs
};

ShapedRates MeasureShaped(const Geometry& g) {
  const int G = g.H / g.Hkv, chunk = 256;
  return {SgemmRate(G * kWindow, 1024, g.d, /*transpose_b=*/true, /*trials=*/5),
          SgemmRate(chunk, G * g.d, g.d, /*transpose_b=*/false, /*trials=*/5),
          TriangleRate(chunk, G, g.d, /*trials=*/5)};
}

// ---------------------------------------------------------------------------------------------
// Inputs of one case, built when its benchmark first runs (only one case lives at a time: the
// Llama and 32K cases are more than a gigabyte each).

void WriteRaw(const std::filesystem::path& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) {
    std::fprintf(stderr, "kernels_cpu_benchmark: cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

// LAPROX_BENCH_DUMP, or empty when inputs are not to be written.
std::string DumpRoot() {
  const char* dir = std::getenv("LAPROX_BENCH_DUMP");
  return dir == nullptr ? std::string() : std::string(dir);
}

class CaseData {
 public:
  CaseData(const Case& c, Backend& backend) : case_(c) {
    const Geometry& g = c.geometry;
    const int64_t kv = int64_t{g.L} * g.Hkv * c.n * g.d;
    const int64_t q = int64_t{g.L} * g.H * kWindow * g.d;
    const int64_t o = int64_t{g.L} * g.D * g.H * g.d;
    keys_.resize(kv);
    values_.resize(kv);
    queries_.resize(q);
    // Streams are fixed per tensor kind and geometry, so 4K and 32K share nothing but the method.
    const uint64_t stream = static_cast<uint64_t>(c.n) * 16 + (g.d == 128 ? 8 : 0);
    FillNormal(keys_.data(), kv, stream + 1, 1.f);
    FillNormal(values_.data(), kv, stream + 2, 1.f);
    FillNormal(queries_.data(), q, stream + 3, 1.f);
    // Weight scale as a typical initialisation; only ratios of value factors matter.
    std::vector<float> o_proj(o);
    FillNormal(o_proj.data(), o, stream + 4, 0.02f);

    ModelGeometry geometry;
    geometry.num_layers = g.L;
    geometry.num_heads = g.H;
    geometry.num_kv_heads = g.Hkv;
    geometry.head_dim = g.d;
    geometry.hidden_size = g.D;
    std::vector<TensorView> o_views;
    o_views.reserve(g.L);
    for (int l = 0; l < g.L; ++l) {
      o_views.emplace_back(o_proj.data() + int64_t{l} * g.D * g.H * g.d, DType::kF32,
                           Dims{g.D, int64_t{g.H} * g.d});
    }
    auto model = backend.PrepareModel(geometry, o_views);
    if (!model.ok()) {
      status_ = model.status();
      return;
    }
    model_ = *std::move(model);

    request_.n = c.n;
    // LAPROX_BENCH_STOP=1: the calls carry a stop signal as laproxd's do (a deadline an hour
    // away, a cancellation callback that takes a mutex as grpc's IsCancelled does), to measure
    // what the checks cost.
    if (const char* stop = std::getenv("LAPROX_BENCH_STOP"); stop != nullptr && stop[0] == '1') {
      stop_ =
          std::make_unique<StopSignal>(StopSignal::Clock::now() + std::chrono::hours(1), [this] {
            std::lock_guard<std::mutex> lock(cancel_mu_);
            return false;
          });
      request_.stop = stop_.get();
    }
    request_.policy.window = kWindow;
    request_.policy.gqa_value = GqaValue::kMeanHeadNorm;
    request_.policy.pool_kernel = kPoolKernel;
    request_.policy.budget = Budget::TokensPerHead(kTokensPerHead);
    if (c.block_size > 0) Page(c);
    for (int l = 0; l < g.L; ++l) {
      LayerInputs in;
      const int64_t kv_offset = int64_t{l} * g.Hkv * c.n * g.d;
      if (table_) {
        const PagedLayout layout = {&*table_, c.block_size * g.Hkv * g.d, int64_t{g.Hkv} * g.d, g.d,
                                    1};
        const int64_t pool_offset = int64_t{l} * blocks_ * c.block_size * g.Hkv * g.d;
        in.keys = TensorView::Paged(keys_.data() + pool_offset, DType::kF32, Dims{g.Hkv, c.n, g.d},
                                    layout);
        in.values = TensorView::Paged(values_.data() + pool_offset, DType::kF32,
                                      Dims{g.Hkv, c.n, g.d}, layout);
      } else {
        in.keys = TensorView(keys_.data() + kv_offset, DType::kF32, Dims{g.Hkv, c.n, g.d});
        in.values = TensorView(values_.data() + kv_offset, DType::kF32, Dims{g.Hkv, c.n, g.d});
      }
      in.window_queries = TensorView(queries_.data() + int64_t{l} * g.H * kWindow * g.d,
                                     DType::kF32, Dims{g.H, kWindow, g.d});
      request_.layers.push_back(in);
    }

    // Warm-up call, which also gives the bitmask numpy compares its kept set with.
    KeepPlanRequest warm = request_;
    warm.outputs.bitmask = true;
    absl::StatusOr<KeepPlan> plan = backend.ComputeKeepPlan(*model_, warm);
    if (!plan.ok()) {
      status_ = plan.status();
      return;
    }
    // numpy reads contiguous dumps; a paged case holds the same numbers as its contiguous twin.
    if (const std::string root = DumpRoot(); !root.empty() && !table_) Dump(root, o_proj, *plan);
  }

  const absl::Status& status() const { return status_; }
  const PreparedModel& model() const { return *model_; }
  const KeepPlanRequest& request() const { return request_; }

 private:
  // Moves keys_ and values_ into per-layer pools of whole blocks (the last one padded with
  // zeros), logical block b at physical block table_->ids()[b].
  void Page(const Case& c) {
    const Geometry& g = c.geometry;
    const int64_t bs = c.block_size, row = int64_t{g.Hkv} * g.d;
    blocks_ = (c.n + bs - 1) / bs;
    std::vector<int32_t> ids(blocks_);
    for (int64_t b = 0; b < blocks_; ++b) ids[b] = static_cast<int32_t>(b);
    for (int64_t b = blocks_ - 1; b > 0; --b) {  // Fisher-Yates on the benchmark's own stream
      std::swap(ids[b], ids[SplitMix64(kSeed + static_cast<uint64_t>(b)) % (b + 1)]);
    }
    for (std::vector<float>* tensor : {&keys_, &values_}) {
      std::vector<float> pool(static_cast<size_t>(g.L) * blocks_ * bs * row, 0.f);
      for (int64_t l = 0; l < g.L; ++l) {
        const float* src = tensor->data() + l * g.Hkv * c.n * g.d;
        float* dst = pool.data() + l * blocks_ * bs * row;
        for (int64_t h = 0; h < g.Hkv; ++h) {
          for (int64_t i = 0; i < c.n; ++i) {
            std::copy_n(src + (h * c.n + i) * g.d, g.d,
                        dst + ids[i / bs] * bs * row + (i % bs) * row + h * g.d);
          }
        }
      }
      *tensor = std::move(pool);
    }
    table_ = *BlockTable::Create(std::move(ids), bs);
  }

  void Dump(const std::string& root, const std::vector<float>& o_proj, const KeepPlan& plan) {
    const std::filesystem::path dir = std::filesystem::path(root) / case_.Name();
    std::filesystem::create_directories(dir);
    WriteRaw(dir / "keys.f32", keys_.data(), keys_.size() * sizeof(float));
    WriteRaw(dir / "values.f32", values_.data(), values_.size() * sizeof(float));
    WriteRaw(dir / "queries.f32", queries_.data(), queries_.size() * sizeof(float));
    WriteRaw(dir / "o_proj.f32", o_proj.data(), o_proj.size() * sizeof(float));
    WriteRaw(dir / "kept_bitmask.u8", plan.bitmask.data(), plan.bitmask.size());
    const Geometry& g = case_.geometry;
    const std::string meta = absl::StrFormat(
        "{\"case\": \"%s\", \"model\": \"%s\", \"L\": %d, \"H\": %d, \"Hkv\": %d, \"d\": %d, "
        "\"D\": %d, \"n\": %d, \"w\": %d, \"tokens_per_head\": %d, \"pool_kernel\": %d, "
        "\"seed\": %d,\n \"files\": {\"keys\": \"[L, Hkv, n, d]\", \"values\": \"[L, Hkv, n, d]\", "
        "\"queries\": \"[L, H, w, d]\", \"o_proj\": \"[L, D, H*d]\", "
        "\"kept_bitmask\": \"[L, Hkv, ceil(n/8)] LSB first\"}}\n",
        case_.Name(), g.name, g.L, g.H, g.Hkv, g.d, g.D, case_.n, kWindow, kTokensPerHead,
        kPoolKernel, kSeed);
    WriteRaw(dir / "meta.json", meta.data(), meta.size());
  }

  Case case_;
  absl::Status status_;
  std::vector<float> keys_, values_, queries_;
  std::shared_ptr<const PreparedModel> model_;
  KeepPlanRequest request_;
  std::mutex cancel_mu_;
  std::unique_ptr<StopSignal> stop_;
  std::optional<BlockTable> table_;  // paged cases
  int64_t blocks_ = 0;
};

struct Globals {
  std::unique_ptr<Backend> backend;
  MachineRates rates;
  std::vector<std::pair<std::string, ShapedRates>> shaped;  // by geometry name
  std::unique_ptr<CaseData> current;
  std::string current_name;
};

Globals& Global() {
  static Globals* globals = new Globals;
  return *globals;
}

// Measures the floor's two rates again and keeps the best seen in this run: the floor is what
// the machine can do, and a shared machine is sometimes busy while one measurement runs.
void RefreshRates(int trials) {
  MachineRates& rates = Global().rates;
  rates.sgemm_flops = std::max(rates.sgemm_flops, SgemmRate(1024, 1024, 1024, false, trials));
  rates.read_bytes = std::max(rates.read_bytes, ReadBandwidth(trials));
}

CaseData& GetCase(const Case& c) {
  Globals& s = Global();
  if (s.current_name != c.Name()) {
    s.current.reset();  // free the previous case before building the next
    s.current = std::make_unique<CaseData>(c, *s.backend);
    s.current_name = c.Name();
  }
  return *s.current;
}

// A "VmRSS:"/"VmHWM:" line of /proc/self/status, in bytes (-1 when unreadable).
double ProcStatusBytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::atof(line.c_str() + std::strlen(key)) * 1024.0;
  }
  return -1.0;
}

// Resets the peak resident size (VmHWM) to the current one (Linux: clear_refs, value 5).
bool ResetPeakResident() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

void BM_KeepPlan(benchmark::State& state, const Case& c) {
  CaseData& data = GetCase(c);
  if (!data.status().ok()) {
    state.SkipWithError(data.status().ToString().c_str());
    return;
  }
  RefreshRates(/*trials=*/3);
  Backend& backend = *Global().backend;
  // Peak memory of the calls beyond what the process holds before them (inputs, the model).
  const bool peak_known = ResetPeakResident();
  const double resident_before = ProcStatusBytes("VmRSS:");
  double total = 0.0;
  double best = std::numeric_limits<double>::infinity();
  // The sgemm rate again right before each call (untimed), for ratios of calls to floors taken
  // in the same seconds: on a shared machine whose clock moves, the best call and the best rate of
  // a run may come from moments that differ by a third. These rates stay out of the best rates
  // (x_floor), which so remain comparable with runs before them.
  SgemmProbe probe(1024, 1024, 1024, /*transpose_b=*/false);
  std::vector<double> paired_floor, paired_least;
  const MachineRates& rates = Global().rates;
  const double byte_s = c.KvBytes() / rates.read_bytes;
  for (auto _ : state) {  // NOLINT(clang-analyzer-deadcode.DeadStores): Google Benchmark idiom
    const double rate = probe.Rate(/*trials=*/1);
    const Clock::time_point begin = Clock::now();
    absl::StatusOr<KeepPlan> plan = backend.ComputeKeepPlan(data.model(), data.request());
    const double seconds = std::chrono::duration<double>(Clock::now() - begin).count();
    if (!plan.ok()) {
      state.SkipWithError(plan.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(plan->positions.data());
    state.SetIterationTime(seconds);
    total += seconds;
    best = std::min(best, seconds);
    paired_floor.push_back(seconds / std::max(c.Flops() / rate, byte_s));
    paired_least.push_back(seconds / std::max(c.LeastFlops() / rate, byte_s));
  }
  if (state.iterations() == 0) return;
  if (peak_known && resident_before >= 0) {
    state.counters["peak_extra_MB"] = (ProcStatusBytes("VmHWM:") - resident_before) * 1e-6;
  }
  if (absl::StatusOr<MemoryEstimate> estimate =
          backend.EstimateKeepPlanMemory(data.model(), data.request());
      estimate.ok()) {
    state.counters["estimate_MB"] = static_cast<double>(estimate->total()) * 1e-6;
  }
  // The work laproxd charges this call against --max_request_work (kernels/work.h), and the
  // rate the best call achieved in those units: the calibration of the work budget.
  if (absl::StatusOr<WorkEstimate> work =
          backend.EstimateKeepPlanWork(data.model(), data.request());
      work.ok()) {
    state.counters["work_G"] = static_cast<double>(work->total()) * 1e-9;
    state.counters["work_G_per_s"] = static_cast<double>(work->total()) * 1e-9 / best;
  }

  const double mean = total / static_cast<double>(state.iterations());
  const double flop_s = c.Flops() / rates.sgemm_flops;
  const double floor_s = std::max(flop_s, byte_s);
  const double least_s = std::max(c.LeastFlops() / rates.sgemm_flops, byte_s);
  state.counters["GFLOP"] = c.Flops() * 1e-9;
  state.counters["KV_MB"] = c.KvBytes() * 1e-6;
  state.counters["flop_ms"] = flop_s * 1e3;
  state.counters["byte_ms"] = byte_s * 1e3;
  state.counters["floor_ms"] = floor_s * 1e3;
  // The best call is compared with the floor, as the floor uses the best rates measured: on a
  // shared machine both are the least disturbed figures (the mean is reported beside them).
  state.counters["best_ms"] = best * 1e3;
  state.counters["mean_ms"] = mean * 1e3;
  state.counters["x_floor"] = best / floor_s;
  state.counters["least_GFLOP"] = c.LeastFlops() * 1e-9;
  state.counters["least_ms"] = least_s * 1e3;
  state.counters["x_least"] = best / least_s;
  // Each call against the floor of the sgemm rate measured just before it: the median.
  state.counters["x_floor_paired"] = Median(paired_floor);
  state.counters["x_least_paired"] = Median(paired_least);
  state.counters["ours_GFLOPs"] = c.Flops() / best * 1e-9;
  state.counters["sgemm_GFLOPs"] = rates.sgemm_flops * 1e-9;
  state.counters["read_GBs"] = rates.read_bytes * 1e-9;
  for (const auto& [name, shaped] : Global().shaped) {
    if (name != c.geometry.name) continue;
    state.counters["qk_GFLOPs"] = shaped.qk_flops * 1e-9;
    state.counters["vm_GFLOPs"] = shaped.vm_flops * 1e-9;
    state.counters["tri_GFLOPs"] = shaped.tri_flops * 1e-9;
  }
}

int Run(int argc, char** argv) {
  // The floor is OpenBLAS's sgemm: with the kernels this CPU's vectors call for.
  RestartWithOpenBlasCore("kernels_cpu_benchmark", argv);
  // --laprox_long_context: the long-context series instead of the standard cases;
  // --laprox_small: the small cases instead.
  bool long_context = false, small = false;
  for (int i = 1; i < argc;) {
    bool* flag = std::strcmp(argv[i], "--laprox_long_context") == 0 ? &long_context
                 : std::strcmp(argv[i], "--laprox_small") == 0      ? &small
                                                                    : nullptr;
    if (flag == nullptr) {
      ++i;
      continue;
    }
    *flag = true;
    std::copy(argv + i + 1, argv + argc, argv + i);
    --argc;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  Globals& s = Global();
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu", {.threads = kThreads});
  if (!backend.ok()) {
    std::fprintf(stderr, "kernels_cpu_benchmark: %s\n", backend.status().ToString().c_str());
    return 1;
  }
  s.backend = *std::move(backend);
  // The backend already set this process-wide; say it again because the floor depends on it.
  openblas_set_num_threads(1);

  // Each paged case right after its contiguous twin, so the two see the same machine.
  std::vector<Case> cases = {{kSmolLM2, 4096},      {kSmolLM2, 4096, 16}, {kSmolLM2, 32768},
                             {kSmolLM2, 32768, 16}, {kLlama, 4096},       {kLlama, 4096, 16}};
  // Time and peak memory against n (issue 16, item 4): all 30 layers up to 128K, then the
  // 6-layer geometry from 64K to 512K, so that four sizes of one geometry can be fitted.
  if (long_context) {
    cases = {{kSmolLM2, 131072},
             {kSmolLM2Layers6, 65536},
             {kSmolLM2Layers6, 131072},
             {kSmolLM2Layers6, 262144},
             {kSmolLM2Layers6, 524288}};
  }
  if (small) cases = {{kSmolLM2, 256}, {kSmolLM2, 1024}};

  // The floor, measured before the cases so that no case's memory is in the way.
  RefreshRates(/*trials=*/5);
  for (const Geometry& g : {kSmolLM2, kLlama}) s.shaped.emplace_back(g.name, MeasureShaped(g));

  std::printf("Machine floor at start-up (%d threads, single-threaded OpenBLAS each)\n", kThreads);
  std::printf("  sgemm 1024^3:     %7.1f GFLOP/s\n", s.rates.sgemm_flops * 1e-9);
  std::printf("  read bandwidth:   %7.1f GB/s\n", s.rates.read_bytes * 1e-9);
  for (const auto& [name, shaped] : s.shaped) {
    std::printf(
        "  %s: Q.K^T sgemm chunk %.1f GFLOP/s; value factor: former V.M sgemm chunk %.1f "
        "GFLOP/s, triangular kernel %.1f least-work GFLOP/s\n",
        name.c_str(), shaped.qk_flops * 1e-9, shaped.vm_flops * 1e-9, shaped.tri_flops * 1e-9);
  }
  std::printf("  backend:          %s\n\n", s.backend->Describe().c_str());
  std::fflush(stdout);
  benchmark::AddCustomContext("laprox_backend", s.backend->Describe());
  benchmark::AddCustomContext("laprox_openblas_core", openblas_get_corename());
  benchmark::AddCustomContext("laprox_sgemm_gflops", absl::StrCat(s.rates.sgemm_flops * 1e-9));
  benchmark::AddCustomContext("laprox_read_gbs", absl::StrCat(s.rates.read_bytes * 1e-9));

  for (const Case& c : cases) {
    benchmark::RegisterBenchmark(
        absl::StrCat(c.block_size ? "KeepPlanPaged/" : "KeepPlan/", c.geometry.name, "/n:", c.n,
                     c.block_size ? absl::StrCat("/block:", c.block_size) : std::string())
            .c_str(),
        [c](benchmark::State& state) { BM_KeepPlan(state, c); })
        ->Iterations(long_context ? 3
                     : small      ? kSmallIterations
                                  : kIterations)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  Global().current.reset();
  return 0;
}

}  // namespace
}  // namespace laprox::kernels

int main(int argc, char** argv) { return laprox::kernels::Run(argc, argv); }
