// kernels_cuda_benchmark: the CUDA backend's keep-plan time against this GPU's floor.
//
// What it measures (issue "CUDA backend", docs/design.md §8). Llama-3.1-8B geometry (L32,
// H32, Hkv8, d128, D4096), bf16 keys, values and window queries in device memory (as cuda_ipc
// regions give them), the LaProx policy of bench/cuda_reference.py (MEAN_HEAD_NORM, avg pool 7
// of the attention factor: the default before bench/quality's dev grid, set explicitly so that
// fused takes it) with window w, budget B = 1024 tokens per head.
// For each n, w and kernel version it times Backend::ComputeKeepPlan — a synchronous call, so
// the time is the wall time from the call to the plan in host memory (input checks, scoring,
// selection, the copy of the plan back), measured with steady_clock after a device
// synchronisation; the median of --iters (>= 20) timed calls after 2 untimed warm-ups, each on
// fresh random data (regenerated untimed before every call; never zeros).
//
// The floor of this GPU, measured in the same process before the cases:
//   bandwidth  device-to-device cudaMemcpy of 4 GiB, bytes read + written / time, best of 10
//   gemm rate  cublasGemmEx bf16 x bf16 -> fp32 accumulate, 8192^3, median of 10
//   floor      max(K+V bytes / bandwidth, FLOPs / gemm rate) with
//              bytes = 2 * L * Hkv * n * d * 2, FLOPs = L * (2*H*w*n*d + 2*H*n*d*d)
//              (Q.K^T of the window rows, V times one d x d factor per query head)
//
// Prints one table row per case and, with --json=FILE, writes the rows and the measured rates
// for tests/gpu/run.sh's summary. Exits 0 with "skipped" when no CUDA device is visible.
//
//   build/bench/kernels_cuda_benchmark --n=4096,32768,131072 --windows=32,64 --kernels=gemm,fused
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_stats.h"
#include "cuda/random_fill.h"
#include "laprox/kernels/registry.h"

namespace {

using laprox::bench::Median;
using laprox::kernels::Backend;
using laprox::kernels::Dims;
using laprox::kernels::DType;
using laprox::kernels::KeepPlanRequest;
using laprox::kernels::MemorySpace;
using laprox::kernels::ModelGeometry;
using laprox::kernels::TensorView;

constexpr int kL = 32, kH = 32, kHkv = 8, kD = 128, kHidden = 4096, kWindowRows = 64;

bool Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return true;
  std::fprintf(stderr, "kernels_cuda_benchmark: %s: %s\n", what, cudaGetErrorString(error));
  return false;
}

// Device-to-device copy bandwidth (read + written bytes per second), best of 10.
double CopyBandwidth() {
  const size_t bytes = size_t{4} << 30;
  void *a = nullptr, *b = nullptr;
  if (!Check(cudaMalloc(&a, bytes), "cudaMalloc") || !Check(cudaMalloc(&b, bytes), "cudaMalloc")) {
    return 0;
  }
  laprox::kernels::cuda::LaunchFillRandom(a, 0, bytes / 4, 1, 1.f, nullptr);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  double best = 0;
  for (int i = 0; i < 12; ++i) {
    cudaEventRecord(start);
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 2) best = std::max(best, 2.0 * static_cast<double>(bytes) / (ms * 1e-3));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(a);
  cudaFree(b);
  return best;
}

// bf16 GEMM rate with fp32 accumulation (FLOP/s), median of 10 after 3 warm-ups.
double GemmRate() {
  const int m = 8192;
  const size_t elems = size_t{m} * m;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  if (!Check(cudaMalloc(&a, elems * 2), "cudaMalloc") ||
      !Check(cudaMalloc(&b, elems * 2), "cudaMalloc") ||
      !Check(cudaMalloc(&c, elems * 4), "cudaMalloc")) {
    return 0;
  }
  laprox::kernels::cuda::LaunchFillRandom(a, 2, static_cast<int64_t>(elems), 2, 1.f, nullptr);
  laprox::kernels::cuda::LaunchFillRandom(b, 2, static_cast<int64_t>(elems), 3, 1.f, nullptr);
  cublasHandle_t handle;
  cublasCreate(&handle);
  const float alpha = 1.f, beta = 0.f;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> rates;
  for (int i = 0; i < 13; ++i) {
    cudaEventRecord(start);
    cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, &alpha, a, CUDA_R_16BF, m, b,
                 CUDA_R_16BF, m, &beta, c, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 3) rates.push_back(2.0 * m * double{m} * m / (ms * 1e-3));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return Median(rates);
}

std::vector<int64_t> ParseList(const std::string& text) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int64_t v = 0;
    if (absl::SimpleAtoi(part, &v)) out.push_back(v);
  }
  return out;
}

struct Row {
  int64_t n;
  int w;
  std::string kernels;
  double median_ms, min_ms, max_ms, floor_ms, byte_ms, flop_ms;
};

}  // namespace

int main(int argc, char** argv) {
  std::string n_list = "4096,32768,131072", w_list = "32,64", kernel_list = "gemm,fused", json;
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* flag) {
      const std::string prefix = absl::StrCat("--", flag, "=");
      return arg.rfind(prefix, 0) == 0 ? arg.substr(prefix.size()) : std::string();
    };
    if (!value("n").empty()) n_list = value("n");
    if (!value("windows").empty()) w_list = value("windows");
    if (!value("kernels").empty()) kernel_list = value("kernels");
    if (!value("json").empty()) json = value("json");
    if (!value("iters").empty()) iters = std::max(20, std::stoi(value("iters")));
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("kernels_cuda_benchmark: skipped: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const double bandwidth = CopyBandwidth(), gemm_rate = GemmRate();
  std::printf("device %s: copy bandwidth %.0f GB/s (read + written), bf16 GEMM %.0f TFLOP/s\n",
              prop.name, bandwidth / 1e9, gemm_rate / 1e12);

  const ModelGeometry geometry{.num_layers = kL,
                               .num_heads = kH,
                               .num_kv_heads = kHkv,
                               .head_dim = kD,
                               .hidden_size = kHidden};
  std::vector<Row> rows;
  for (absl::string_view kernels : absl::StrSplit(kernel_list, ',')) {
    auto created =
        laprox::kernels::CreateBackend("cuda", {.device = 0, .cuda_kernels = std::string{kernels}});
    if (!created.ok()) {
      std::fprintf(stderr, "kernels_cuda_benchmark: %s\n", created.status().ToString().c_str());
      return 1;
    }
    std::unique_ptr<Backend> backend = *std::move(created);
    // o_proj [D, H*d] bf16 per layer, prepared once (untimed, as at registration).
    const int64_t o_elems = int64_t{kHidden} * kH * kD;
    void* o_proj = nullptr;
    if (!Check(cudaMalloc(&o_proj, o_elems * kL * 2), "cudaMalloc o_proj")) return 1;
    laprox::kernels::cuda::LaunchFillRandom(o_proj, 2, o_elems * kL, 7, 0.02f, nullptr);
    cudaDeviceSynchronize();
    std::vector<TensorView> o_views;
    o_views.reserve(kL);
    for (int l = 0; l < kL; ++l) {
      o_views.emplace_back(static_cast<const uint16_t*>(o_proj) + l * o_elems, DType::kBF16,
                           Dims{kHidden, int64_t{kH} * kD}, MemorySpace::kDevice);
    }
    auto model = backend->PrepareModel(geometry, o_views, {.output_projection = false});
    if (!model.ok()) {
      std::fprintf(stderr, "kernels_cuda_benchmark: %s\n", model.status().ToString().c_str());
      return 1;
    }
    for (int64_t n : ParseList(n_list)) {
      const int64_t kv_elems = int64_t{kHkv} * n * kD, q_elems = int64_t{kH} * kWindowRows * kD;
      void *keys = nullptr, *values = nullptr, *queries = nullptr;
      if (!Check(cudaMalloc(&keys, kv_elems * kL * 2), "cudaMalloc keys") ||
          !Check(cudaMalloc(&values, kv_elems * kL * 2), "cudaMalloc values") ||
          !Check(cudaMalloc(&queries, q_elems * kL * 2), "cudaMalloc queries")) {
        return 1;
      }
      for (int64_t w : ParseList(w_list)) {
        KeepPlanRequest request;
        request.n = n;
        request.policy.window = static_cast<int32_t>(w);
        request.policy.gqa_value = laprox::kernels::GqaValue::kMeanHeadNorm;
        request.policy.pool_kernel = 7;
        request.policy.budget = laprox::kernels::Budget::TokensPerHead(1024);
        for (int l = 0; l < kL; ++l) {
          laprox::kernels::LayerInputs layer;
          layer.keys = TensorView(static_cast<const uint16_t*>(keys) + l * kv_elems, DType::kBF16,
                                  Dims{kHkv, n, kD}, MemorySpace::kDevice);
          layer.values = TensorView(static_cast<const uint16_t*>(values) + l * kv_elems,
                                    DType::kBF16, Dims{kHkv, n, kD}, MemorySpace::kDevice);
          layer.window_queries =
              TensorView(static_cast<const uint16_t*>(queries) + l * q_elems, DType::kBF16,
                         Dims{kH, kWindowRows, kD}, MemorySpace::kDevice);
          request.layers.push_back(layer);
        }
        std::vector<double> times;
        for (int i = 0; i < iters + 2; ++i) {
          const uint64_t seed = 1000 * static_cast<uint64_t>(n) + 10 * w + i;
          laprox::kernels::cuda::LaunchFillRandom(keys, 2, kv_elems * kL, seed, 1.f, nullptr);
          laprox::kernels::cuda::LaunchFillRandom(values, 2, kv_elems * kL, seed + 1, 1.f, nullptr);
          laprox::kernels::cuda::LaunchFillRandom(queries, 2, q_elems * kL, seed + 2, 1.f, nullptr);
          if (!Check(cudaDeviceSynchronize(), "filling inputs")) return 1;
          const auto start = std::chrono::steady_clock::now();
          auto plan = backend->ComputeKeepPlan(**model, request);
          const double ms =
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                  .count();
          if (!plan.ok()) {
            std::fprintf(stderr, "kernels_cuda_benchmark: %s\n", plan.status().ToString().c_str());
            return 1;
          }
          if (i >= 2) times.push_back(ms);
        }
        const double bytes = 2.0 * kL * kHkv * n * kD * 2;
        const double flops = kL * (2.0 * kH * w * n * kD + 2.0 * kH * n * kD * kD);
        Row row{n,
                static_cast<int>(w),
                std::string{kernels},
                Median(times),
                *std::min_element(times.begin(), times.end()),
                *std::max_element(times.begin(), times.end()),
                0,
                bytes / bandwidth * 1e3,
                flops / gemm_rate * 1e3};
        row.floor_ms = std::max(row.byte_ms, row.flop_ms);
        std::printf(
            "n=%-7lld w=%-3d %s  median %9.3f ms  [%8.3f, %8.3f]  floor %7.3f ms "
            "(bytes %.3f, flops %.3f)  x_floor %.2f\n",
            static_cast<long long>(n), row.w, row.kernels.c_str(), row.median_ms, row.min_ms,
            row.max_ms, row.floor_ms, row.byte_ms, row.flop_ms, row.median_ms / row.floor_ms);
        std::fflush(stdout);
        rows.push_back(row);
      }
      cudaFree(keys);
      cudaFree(values);
      cudaFree(queries);
    }
    model->reset();
    cudaFree(o_proj);
  }
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\"device\": \"" << prop.name << "\", \"copy_bandwidth_Bps\": " << bandwidth
        << ", \"bf16_gemm_flops\": " << gemm_rate << ", \"iters\": " << iters << ", \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      out << (i ? ", " : "") << "{\"n\": " << r.n << ", \"w\": " << r.w << ", \"kernels\": \""
          << r.kernels << "\", \"median_ms\": " << r.median_ms << ", \"min_ms\": " << r.min_ms
          << ", \"max_ms\": " << r.max_ms << ", \"floor_ms\": " << r.floor_ms
          << ", \"byte_ms\": " << r.byte_ms << ", \"flop_ms\": " << r.flop_ms << "}";
    }
    out << "]}\n";
  }
  return 0;
}
