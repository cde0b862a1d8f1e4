// The memory estimates the service reserves before a request runs are upper bounds of what the
// CPU backend really allocates: this binary replaces the global operator new/delete with
// counting ones and measures the peak heap growth of PrepareModel and of ComputeKeepPlan for
// every policy kind and output option, against Backend::EstimatePrepareMemory and
// EstimateKeepPlanMemory. (Thread stacks and OpenBLAS's own buffers are mmap'd, not counted;
// they do not grow with the request.)
//
//   ctest --test-dir build -R MemoryEstimate --output-on-failure
//
// A new buffer in the CPU backend that the estimate (CpuBackend::KeepPlanWorkspaceBytes) does
// not cover makes a case here fail with the measured and estimated bytes.
#include <malloc.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "laprox/kernels/registry.h"
#include "tiny_model.h"

namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};

void* Allocate(size_t bytes, size_t alignment = alignof(std::max_align_t)) {
  void* p = alignment <= alignof(std::max_align_t)
                ? std::malloc(bytes == 0 ? 1 : bytes)
                : std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
  if (p == nullptr) throw std::bad_alloc();
  const int64_t live =
      g_live.fetch_add(static_cast<int64_t>(malloc_usable_size(p))) + malloc_usable_size(p);
  int64_t peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
  return p;
}

void Free(void* p) {
  if (p == nullptr) return;
  g_live.fetch_sub(static_cast<int64_t>(malloc_usable_size(p)));
  std::free(p);
}

}  // namespace

void* operator new(size_t bytes) { return Allocate(bytes); }
void* operator new[](size_t bytes) { return Allocate(bytes); }
void* operator new(size_t bytes, std::align_val_t a) {
  return Allocate(bytes, static_cast<size_t>(a));
}
void* operator new[](size_t bytes, std::align_val_t a) {
  return Allocate(bytes, static_cast<size_t>(a));
}
void operator delete(void* p) noexcept { Free(p); }
void operator delete[](void* p) noexcept { Free(p); }
void operator delete(void* p, size_t) noexcept { Free(p); }
void operator delete[](void* p, size_t) noexcept { Free(p); }
void operator delete(void* p, std::align_val_t) noexcept { Free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { Free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { Free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { Free(p); }

namespace laprox::kernels {
namespace {

using testing::TinyCase;

// Peak heap growth while `fn` runs, in bytes.
template <typename Fn>
int64_t PeakGrowth(Fn&& fn) {
  const int64_t before = g_live.load();
  g_peak.store(before);
  fn();
  return g_peak.load() - before;
}

struct Case {
  std::string name;
  PolicySpec policy;
  OutputOptions outputs;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  const OutputOptions everything{.positions = true, .bitmask = true, .scores = true};
  for (GqaValue gqa : {GqaValue::kMeanHeadNorm, GqaValue::kSummedProjection,
                       GqaValue::kMeanHeadProduct, GqaValue::kExactBlock}) {
    for (PoolTarget target : {PoolTarget::kAttention, PoolTarget::kScore}) {
      PolicySpec p;
      p.gqa_value = gqa;
      p.pool_target = target;
      cases.push_back(
          {absl::StrCat("laprox_gqa", static_cast<int>(gqa), "_", PoolTargetName(target)), p,
           everything});
    }
  }
  cases.push_back({"laprox_default", PolicySpec(), everything});  // MEAN_HEAD_PRODUCT, pool 31
  PolicySpec attention;                                           // gqa_value unset: MEAN_HEAD_NORM
  attention.indicator = Indicator::kAttention;
  cases.push_back({"laprox_attention_only", attention, {}});
  PolicySpec per_layer;
  per_layer.allocation = Allocation::kPerLayer;
  per_layer.min_per_head = 8;
  cases.push_back({"laprox_per_layer", per_layer, everything});
  // Block shapes at the paged cases' block size (their table's), with scores (block scores too).
  for (PlanShape shape : {PlanShape::kBlocksShared, PlanShape::kBlocksPerLayer}) {
    for (PolicyKind kind : {PolicyKind::kLaprox, PolicyKind::kSnapKv, PolicyKind::kStreamingLlm}) {
      PolicySpec p = PolicySpec::ForKind(kind);
      p.window = 32;
      p.plan_shape = shape;
      p.block_size = 20;
      cases.push_back(
          {absl::StrCat(PolicyKindName(kind), "_", PlanShapeName(shape)), p, everything});
    }
  }
  for (PolicyKind kind :
       {PolicyKind::kStreamingLlm, PolicyKind::kSnapKv, PolicyKind::kPyramidKv, PolicyKind::kAdaKv,
        PolicyKind::kCriticalKv, PolicyKind::kCriticalAdaKv, PolicyKind::kCake}) {
    PolicySpec p = PolicySpec::ForKind(kind);
    p.window = 32;
    cases.push_back({std::string(PolicyKindName(kind)), p, everything});
  }
  return cases;
}

TEST(MemoryEstimateTest, KeepPlanAllocatesAtMostTheEstimate) {
  auto backend = *CreateBackend("cpu", {.threads = 2});
  TinyCase tiny(/*L=*/4, /*H=*/8, /*Hkv=*/2, /*d=*/32, /*D=*/64, /*n=*/3000, /*rows=*/32);
  tiny.Randomize(7);
  const PrepareOptions options = {.cross_grams = true};
  std::shared_ptr<const PreparedModel> model;
  const auto prepare_estimate = backend->EstimatePrepareMemory(tiny.geometry, options);
  ASSERT_TRUE(prepare_estimate.ok()) << prepare_estimate.status();
  const int64_t prepare_peak = PeakGrowth(
      [&] { model = *backend->PrepareModel(tiny.geometry, tiny.OProjViews(), options); });
  EXPECT_EQ(model->ByteSize(), prepare_estimate->output_bytes);
  EXPECT_LE(prepare_peak, prepare_estimate->total());

  // Every case again with keys and values paged (blocks of 20 rows over the same memory, an
  // identity table): paged rows are converted through the row scratch even in fp32.
  std::vector<int32_t> ids(3000 / 20);
  std::iota(ids.begin(), ids.end(), 0);
  const BlockTable table = *BlockTable::Create(ids, 20);
  std::vector<Case> cases = Cases();
  const size_t contiguous = cases.size();
  for (size_t i = 0; i < contiguous; ++i) {
    cases.push_back(cases[i]);
    cases.back().name += "_paged";
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    KeepPlanRequest request = tiny.Request();
    if (i >= contiguous) {
      for (LayerInputs& in : request.layers) {
        for (TensorView* view : {&in.keys, &in.values}) {
          *view = TensorView::Paged(view->data(), DType::kF32, view->shape(),
                                    {&table, 20 * 32, 32, 3000 * 32, 1});
        }
      }
    }
    request.policy = c.policy;
    request.policy.budget = Budget::TokensPerHead(300);
    request.outputs = c.outputs;
    const auto estimate = backend->EstimateKeepPlanMemory(*model, request);
    ASSERT_TRUE(estimate.ok()) << c.name << ": " << estimate.status();
    absl::StatusOr<KeepPlan> plan;
    const int64_t peak = PeakGrowth([&] { plan = backend->ComputeKeepPlan(*model, request); });
    ASSERT_TRUE(plan.ok()) << c.name << ": " << plan.status();
    EXPECT_LE(peak, estimate->total()) << c.name << ": the estimate misses allocations";
    // An upper bound, but not so loose that honest requests are refused for nothing.
    EXPECT_GE(peak * 16, estimate->total())
        << c.name << ": peak " << peak << " of " << estimate->total();
    const int64_t outputs = static_cast<int64_t>(
        plan->counts.size() * 4 + plan->offsets.size() * 8 + plan->positions.size() * 4 +
        plan->bitmask.size() + plan->scores.size() * 4 + plan->layer_sums.size() * 8);
    EXPECT_LE(outputs, estimate->output_bytes) << c.name;
    std::printf("%-26s peak %9lld  estimate %9lld  (%.2fx)\n", c.name.c_str(),
                static_cast<long long>(peak), static_cast<long long>(estimate->total()),
                static_cast<double>(estimate->total()) / static_cast<double>(peak));
  }
}

// A batch allocates at most the sum of its sequences' estimates (what the service reserves).
TEST(MemoryEstimateTest, BatchAllocatesAtMostTheSumOfItsEstimates) {
  auto backend = *CreateBackend("cpu", {.threads = 2});
  TinyCase tiny(/*L=*/4, /*H=*/8, /*Hkv=*/2, /*d=*/32, /*D=*/64, /*n=*/2000, /*rows=*/32);
  tiny.Randomize(8);
  const auto model = *backend->PrepareModel(tiny.geometry, tiny.OProjViews());
  std::vector<KeepPlanRequest> requests;
  int64_t estimated = 0;
  for (PolicyKind kind : {PolicyKind::kLaprox, PolicyKind::kSnapKv, PolicyKind::kCake}) {
    KeepPlanRequest& request = requests.emplace_back(tiny.Request());
    request.policy = PolicySpec::ForKind(kind);
    request.policy.window = 32;
    request.policy.budget = Budget::TokensPerHead(200);
    const auto estimate = backend->EstimateKeepPlanMemory(*model, request);
    ASSERT_TRUE(estimate.ok()) << estimate.status();
    estimated += estimate->total();
  }
  absl::StatusOr<std::vector<KeepPlan>> plans;
  const int64_t peak = PeakGrowth([&] { plans = backend->ComputeKeepPlans(*model, requests); });
  ASSERT_TRUE(plans.ok()) << plans.status();
  EXPECT_LE(peak, estimated);
  std::printf("batch of 3: peak %lld, estimates %lld\n", static_cast<long long>(peak),
              static_cast<long long>(estimated));
}

// Estimates are computed from shapes alone and saturate instead of overflowing: the geometry of
// the RegisterModel attack (head_dim = 65536) is 32 GiB of factors, a number and no
// allocation.
TEST(MemoryEstimateTest, HugeShapesAreANumberNotAnAllocation) {
  auto backend = *CreateBackend("cpu");
  const ModelGeometry wide{
      .num_layers = 1, .num_heads = 1, .num_kv_heads = 1, .head_dim = 65536, .hidden_size = 1};
  int64_t bytes = 0;
  const int64_t peak = PeakGrowth([&] { bytes = backend->EstimatePrepareMemory(wide)->total(); });
  EXPECT_GE(bytes, int64_t{2 * 65536} * 65536 * 4);
  EXPECT_LT(peak, 4096);
  const ModelGeometry huge{.num_layers = 1 << 20,
                           .num_heads = 1 << 20,
                           .num_kv_heads = 1,
                           .head_dim = 1 << 16,
                           .hidden_size = 1 << 16};
  EXPECT_EQ(backend->EstimatePrepareMemory(huge)->total(), INT64_MAX);
}

}  // namespace
}  // namespace laprox::kernels
