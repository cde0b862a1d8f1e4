// Every malformed request is answered with the status docs/style.md names and a message that names
// the field and the offending values; nothing crashes, and the backend answers the next good
// request.
#include <cmath>
#include <limits>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "laprox/kernels/registry.h"
#include "tiny_model.h"

namespace laprox::kernels {
namespace {

using testing::TinyCase;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

class BadInputTest : public ::testing::Test {
 protected:
  BadInputTest() : case_(2, 4, 2, 8, 16, 64, 8) {
    case_.Randomize(3);
    case_.policy.window = 8;
    case_.policy.budget = Budget::TokensPerHead(20);
  }

  absl::Status Compute(const KeepPlanRequest& request) {
    auto model = backend_->PrepareModel(case_.geometry, case_.OProjViews());
    if (!model.ok()) return model.status();
    return backend_->ComputeKeepPlan(**model, request).status();
  }
  absl::Status Compute() { return Compute(case_.Request()); }

  void TearDown() override {
    // Whatever failed before, a fresh valid request still succeeds.
    TinyCase good(2, 4, 2, 8, 16, 64, 8);
    good.Randomize(4);
    good.policy.window = 8;
    auto model = backend_->PrepareModel(good.geometry, good.OProjViews());
    ASSERT_TRUE(model.ok()) << model.status();
    auto plan = backend_->ComputeKeepPlan(**model, good.Request());
    EXPECT_TRUE(plan.ok()) << plan.status();
  }

  std::unique_ptr<Backend> backend_ = *CreateBackend("cpu");
  TinyCase case_;
};

MATCHER_P2(IsStatus, code, substring, "") {
  *result_listener << "status " << arg;
  return arg.code() == code && absl::StrContains(arg.message(), substring);
}

TEST_F(BadInputTest, RejectsKeysWithWrongShape) {
  KeepPlanRequest r = case_.Request();
  r.layers[1].keys = TensorView(case_.keys[1].data(), DType::kF32, {2, 64, 7});
  EXPECT_THAT(Compute(r),
              IsStatus(absl::StatusCode::kInvalidArgument, "layers[1].keys has shape [2, 64, 7]"));
  EXPECT_THAT(Compute(r), IsStatus(absl::StatusCode::kInvalidArgument, "expected [2, 64, 8]"));
}

TEST_F(BadInputTest, RejectsHeadsNotAMultipleOfKvHeads) {
  case_.geometry.num_kv_heads = 3;
  EXPECT_THAT(Compute(), IsStatus(absl::StatusCode::kInvalidArgument,
                                  "num_heads = 4 is not a multiple of num_kv_heads = 3"));
}

TEST_F(BadInputTest, RejectsWrongLayerCount) {
  KeepPlanRequest r = case_.Request();
  r.layers.pop_back();
  EXPECT_THAT(Compute(r), IsStatus(absl::StatusCode::kInvalidArgument,
                                   "request has 1 layers, the model has 2"));
}

TEST_F(BadInputTest, RejectsNaNAndInfInEveryTensor) {
  struct Plant {
    std::vector<std::vector<float>>* tensor;
    int64_t layer, index;
    float value;
    const char* expected;
  } plants[] = {
      {&case_.keys, 1, 8 * 64 + 8 * 5 + 3, kNaN,
       "layers[1].keys has a non-finite value (nan) at [1, 5, 3]"},
      {&case_.keys, 0, 8 * 63, kInf, "layers[0].keys has a non-finite value (inf) at [0, 63, 0]"},
      {&case_.values, 0, 8 * 10 + 1, -kInf,
       "layers[0].values has a non-finite value (-inf) at [0, 10, 1]"},
      {&case_.values, 1, 8 * 62, kNaN,
       "layers[1].values has a non-finite value (nan) at [0, 62, 0]"},
      {&case_.queries, 0, 8 * 8 * 3 + 2, kNaN,
       "layers[0].window_queries has a non-finite value (nan) at [3, 0, 2]"},
      {&case_.o_proj, 1, 5, kInf, "o_proj[1] has a non-finite value (inf) at [0, 5]"},
  };
  for (const Plant& p : plants) {
    float& slot = (*p.tensor)[p.layer][p.index];
    const float saved = slot;
    slot = p.value;
    EXPECT_THAT(Compute(), IsStatus(absl::StatusCode::kInvalidArgument, p.expected));
    slot = saved;
  }
  EXPECT_TRUE(Compute().ok());
}

TEST_F(BadInputTest, RejectsNonFiniteWindowLse) {
  std::vector<float> lse(4 * 8, 1.f);
  lse[9] = kNaN;
  KeepPlanRequest r = case_.Request();
  for (auto& layer : r.layers) layer.window_lse = TensorView(lse.data(), DType::kF32, {4, 8});
  EXPECT_THAT(Compute(r), IsStatus(absl::StatusCode::kInvalidArgument,
                                   "layers[0].window_lse has a non-finite value (nan) at [1, 1]"));
}

TEST_F(BadInputTest, RejectsBadBudgets) {
  case_.policy.budget = Budget::TokensPerHead(-1);
  EXPECT_THAT(Compute(), IsStatus(absl::StatusCode::kInvalidArgument,
                                  "budget.tokens_per_head = -1 is outside"));
  case_.policy.budget = Budget::TokensPerHead(int64_t{1} << 40);
  EXPECT_THAT(Compute(), IsStatus(absl::StatusCode::kInvalidArgument,
                                  "budget.tokens_per_head = 1099511627776 is outside"));
  for (double cr : {1.0, -0.1, 2.0, std::nan("")}) {
    case_.policy.budget = Budget::CompressionRatio(cr);
    EXPECT_THAT(Compute(), IsStatus(absl::StatusCode::kInvalidArgument, "budget.compression_ratio"))
        << cr;
  }
}

TEST_F(BadInputTest, RejectsWindowLargerThanQueriesGiven) {
  case_.policy.window = 9;
  EXPECT_THAT(Compute(), IsStatus(absl::StatusCode::kInvalidArgument,
                                  "policy.window = 9 is larger than the 8 window rows given"));
}

TEST_F(BadInputTest, RejectsBadPolicyOptions) {
  case_.policy.pool_kernel = 4;
  EXPECT_THAT(Compute(), IsStatus(absl::StatusCode::kInvalidArgument, "policy.pool_kernel = 4"));
  case_.policy.pool_kernel = 7;
  case_.policy.sinks = -2;
  EXPECT_THAT(Compute(), IsStatus(absl::StatusCode::kInvalidArgument, "policy.sinks = -2"));
  case_.policy.sinks = 0;
  case_.policy.window = 0;
  EXPECT_THAT(Compute(), IsStatus(absl::StatusCode::kInvalidArgument, "policy.window = 0"));
  case_.policy.window = 8;
  case_.policy.indicator = Indicator::kAttention;
  case_.policy.gqa_value = GqaValue::kSummedProjection;
  EXPECT_THAT(Compute(), IsStatus(absl::StatusCode::kInvalidArgument,
                                  "gqa_value = SUMMED_PROJECTION needs indicator"));
}

TEST_F(BadInputTest, RejectsAttentionRowsThatAreNotProbabilities) {
  const int64_t H = 4, wq = 8, n = 64;
  std::vector<float> attention(H * wq * n, 1.f / n);
  KeepPlanRequest r = case_.Request();
  for (auto& layer : r.layers) {
    layer.window_queries = TensorView();
    layer.window_attention = TensorView(attention.data(), DType::kF32, {H, wq, n});
  }
  EXPECT_TRUE(Compute(r).ok());
  attention[(2 * wq + 5) * n + 7] = 0.5f;  // row [2, 5] sums to ~1.48
  EXPECT_THAT(Compute(r), IsStatus(absl::StatusCode::kInvalidArgument,
                                   "layers[0].window_attention row [2, 5] sums to 1.48"));
  attention[(2 * wq + 5) * n + 7] = 1.f / n;
  attention[(3 * wq) * n + 1] = -1e-3f;
  EXPECT_THAT(Compute(r), IsStatus(absl::StatusCode::kInvalidArgument,
                                   "window_attention has a negative value (-0.001) at [3, 0, 1]"));
  attention[(3 * wq) * n + 1] = 1.f / n;
  // Keys are not needed with given attention, but a NaN anywhere still rejects the request.
  case_.keys[1][(1 * n + 9) * 8 + 2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(Compute(r), IsStatus(absl::StatusCode::kInvalidArgument,
                                   "layers[1].keys has a non-finite value (nan) at [1, 9, 2]"));
}

TEST_F(BadInputTest, RejectsMixedOrMissingWindowInputs) {
  KeepPlanRequest r = case_.Request();
  r.layers[1].window_queries = TensorView();
  EXPECT_THAT(Compute(r),
              IsStatus(absl::StatusCode::kInvalidArgument, "layers[1].window_queries is missing"));
  r = case_.Request();
  std::vector<float> lse(4 * 8, 1.f);
  r.layers[1].window_lse = TensorView(lse.data(), DType::kF32, {4, 8});
  EXPECT_THAT(Compute(r), IsStatus(absl::StatusCode::kInvalidArgument,
                                   "window_lse must be given for every layer or for none"));
}

TEST_F(BadInputTest, RejectsExtentThatOverflows) {
  KeepPlanRequest r = case_.Request();
  const int64_t huge = std::numeric_limits<int64_t>::max() - 10;
  r.layers[0].values = TensorView(case_.values[0].data(), DType::kF32, {2, 64, 8}, {huge, 8, 1});
  EXPECT_THAT(Compute(r), IsStatus(absl::StatusCode::kOutOfRange, "layers[0].values: extent"));
}

TEST_F(BadInputTest, RejectsNegativeStrides) {
  KeepPlanRequest r = case_.Request();
  r.layers[0].keys = TensorView(case_.keys[0].data(), DType::kF32, {2, 64, 8}, {512, -8, 1});
  EXPECT_THAT(Compute(r), IsStatus(absl::StatusCode::kInvalidArgument, "negative size or stride"));
}

TEST_F(BadInputTest, RejectsExactBlockWithoutCrossGrams) {
  case_.policy.gqa_value = GqaValue::kExactBlock;
  EXPECT_THAT(Compute(), IsStatus(absl::StatusCode::kFailedPrecondition, "cross_grams"));
}

TEST_F(BadInputTest, CpuBackendCannotReadDeviceMemory) {
  KeepPlanRequest r = case_.Request();
  r.layers[0].keys =
      TensorView(case_.keys[0].data(), DType::kF32, {2, 64, 8}, MemorySpace::kDevice);
  EXPECT_THAT(Compute(r), IsStatus(absl::StatusCode::kUnimplemented, "cannot read"));
}

TEST_F(BadInputTest, RejectsBadSequenceLength) {
  KeepPlanRequest r = case_.Request();
  r.n = 0;
  EXPECT_THAT(Compute(r), IsStatus(absl::StatusCode::kInvalidArgument, "n = 0 must be at least 1"));
}

TEST(RegistryTest, NamesBackends) {
  EXPECT_TRUE(CreateBackend("cpu").ok());
  EXPECT_TRUE(CreateBackend("auto").ok());
  EXPECT_THAT(CreateBackend("tpu").status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "unknown backend \"tpu\""));
  // Without a GPU (CI, build machines) the CUDA backend is unavailable, never a crash.
  auto cuda = CreateBackend("cuda");
  if (!cuda.ok()) {
    EXPECT_THAT(cuda.status().code(),
                ::testing::AnyOf(absl::StatusCode::kUnimplemented, absl::StatusCode::kUnavailable,
                                 absl::StatusCode::kInternal));
  }
}

// --cuda_kernels names the CUDA kernels by method; the former names still work, flagged.
TEST(RegistryTest, NamesCudaKernelsByMethod) {
  bool deprecated = true;
  EXPECT_EQ(CanonicalCudaKernels("gemm", &deprecated).value(), "gemm");
  EXPECT_FALSE(deprecated);
  EXPECT_EQ(CanonicalCudaKernels("fused", &deprecated).value(), "fused");
  EXPECT_FALSE(deprecated);
  EXPECT_EQ(CanonicalCudaKernels("v0", &deprecated).value(), "gemm");
  EXPECT_TRUE(deprecated);
  EXPECT_EQ(CanonicalCudaKernels("v1", &deprecated).value(), "fused");
  EXPECT_TRUE(deprecated);
  EXPECT_THAT(CanonicalCudaKernels("v2").status(),
              IsStatus(absl::StatusCode::kInvalidArgument,
                       "unknown CUDA kernels \"v2\"; expected gemm or fused"));
  // Checked for every backend, so a misspelt value fails on a machine without a GPU too.
  EXPECT_THAT(CreateBackend("cpu", {.cuda_kernels = "v2"}).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "unknown CUDA kernels \"v2\""));
  EXPECT_TRUE(CreateBackend("cpu", {.cuda_kernels = "v1"}).ok());
}

}  // namespace
}  // namespace laprox::kernels
