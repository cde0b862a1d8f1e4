// The sample tests/cuda/ipc_test.cc computes over CUDA IPC: generated from a seed, so the
// exporter process (ipc_exporter.cc, which puts it in device memory) and the test (which
// recomputes the plan on the CPU backend from host copies) hold the same bytes. No CUDA here.
#ifndef LAPROX_TESTS_CUDA_IPC_SAMPLE_H_
#define LAPROX_TESTS_CUDA_IPC_SAMPLE_H_

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "common/half.h"

namespace laprox::ipc_test {

// L=2, H=8, Hkv=2, d=64, D=256, n=1000, w=32; keys, values and queries bf16.
constexpr int kL = 2, kH = 8, kHkv = 2, kD = 64, kHidden = 256, kWindow = 32;
constexpr int64_t kN = 1000;
constexpr int64_t kKvElements = int64_t{kHkv} * kN * kD;        // one layer's keys or values
constexpr int64_t kQueryElements = int64_t{kH} * kWindow * kD;  // one layer's queries
// The exporter puts the KV tensors kKvPad bytes into their allocation, so the exported region
// starts at a non-zero offset from the allocation's base (as a caching allocator's blocks do).
constexpr int64_t kKvPad = 512;
// Size of the exporter's region for plans the server writes (ipc_test's written-plan case).
constexpr size_t kOutBytes = 4096;

struct Sample {
  std::vector<uint16_t> kv;                // per layer: keys [Hkv,n,d], then values [Hkv,n,d]
  std::vector<uint16_t> queries;           // per layer: [H,w,d]
  std::vector<std::vector<float>> o_proj;  // per layer [D, H*d], fp32 (sent inline)

  static int64_t KeysElement(int l) { return 2 * l * kKvElements; }
  static int64_t ValuesElement(int l) { return (2 * l + 1) * kKvElements; }
  static int64_t QueriesElement(int l) { return l * kQueryElements; }
};

inline Sample MakeSample(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  Sample s;
  s.kv.resize(2 * kL * kKvElements);
  s.queries.resize(kL * kQueryElements);
  for (uint16_t& x : s.kv) x = kernels::FloatToBf16(normal(rng));
  for (uint16_t& x : s.queries) x = kernels::FloatToBf16(normal(rng) * 0.5f);
  for (int l = 0; l < kL; ++l) {
    std::vector<float>& w = s.o_proj.emplace_back(int64_t{kHidden} * kH * kD);
    for (float& x : w) x = normal(rng) * 0.05f;
  }
  return s;
}

}  // namespace laprox::ipc_test

#endif  // LAPROX_TESTS_CUDA_IPC_SAMPLE_H_
