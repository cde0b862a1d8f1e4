#include "cpu/cpu_backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <new>
#include <utility>
#include <vector>

#include <cblas.h>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/parallel.h"
#include "common/saturating.h"
#include "common/status_macros.h"
#include "cpu/baseline_stats.h"
#include "cpu/factors.h"
#include "cpu/rows.h"
#include "cpu/score.h"
#include "cpu/triangular.h"
#include "cpu/vector_ops.h"
#include "cpu/window.h"
#include "policy/baselines.h"
#include "policy/magnitude.h"
#include "policy/select.h"

namespace laprox::kernels::cpu {
namespace {

// Runs task(item, worker) for every item, stopping early after a failure, and returns the
// failure of the lowest-numbered failing item (so the error does not depend on thread timing:
// items are claimed in increasing order, and items above a known failure are skipped). A
// workspace allocation that fails (the host is short of memory despite the service's budget)
// fails its item with RESOURCE_EXHAUSTED: an exception must not leave a worker thread.
template <typename Task>
absl::Status RunAll(WorkerPool& pool, int64_t count, int threads, Task&& task,
                    int64_t* failed_item = nullptr) {
  std::vector<absl::Status> statuses(count);
  std::atomic<int64_t> first_failure{std::numeric_limits<int64_t>::max()};
  pool.ParallelFor(count, threads, [&](int64_t item, int worker) {
    if (item > first_failure.load(std::memory_order_relaxed)) return;
    try {
      statuses[item] = task(item, worker);
    } catch (const std::bad_alloc&) {
      statuses[item] = absl::ResourceExhaustedError(
          absl::StrCat("out of host memory computing item ", item, " of ", count));
    }
    if (!statuses[item].ok()) {
      int64_t seen = first_failure.load();
      while (item < seen && !first_failure.compare_exchange_weak(seen, item)) {
      }
    }
  });
  const int64_t failed = first_failure.load();
  if (failed_item != nullptr) *failed_item = failed;
  return failed < count ? statuses[failed] : absl::OkStatus();
}

// Per-worker scratch of PrepareModel.
struct PrepareScratch {
  std::vector<float> weights;   // one layer's o_proj in fp32, when it must be converted
  std::vector<double> columns;  // [D, d]: W_h, or sum_h W_h, in fp64
  std::vector<double> gram;     // [d, d]
};

// Fills the factor blocks of one layer from its o_proj [D, H*d] (converted to fp32 `w`): the
// triangular factors of blocks 0..G (factors.h, cpu/triangular.h) and the cross-Grams. Checks
// `stop` once per KV head.
absl::Status LayerFactors(const ModelGeometry& g, const float* w, bool cross, int64_t layer,
                          CpuPreparedModel& model, PrepareScratch& scratch,
                          const StopSignal* stop) {
  const int64_t D = g.hidden_size, d = g.head_dim, G = g.group_size(),
                Hd = int64_t{g.num_heads} * d;
  const int ld = static_cast<int>(model.row_stride());
  double* columns = Sized(scratch.columns, D * d);
  for (int64_t kv = 0; kv < g.num_kv_heads; ++kv) {
    LAPROX_RETURN_IF_ERROR(CheckStop(stop, "preparing the model"));
    float* f = model.mutable_factors(layer, kv);
    const float* group = w + kv * G * d;  // columns of head kv*G
    // Block 0: T with T T^T = S^T S, S = sum_h W[:, h-block] (D x d), summed in fp64.
    for (int64_t r = 0; r < D; ++r) {
      for (int64_t k = 0; k < d; ++k) {
        double sum = 0.0;
        for (int64_t h = 0; h < G; ++h) sum += group[r * Hd + h * d + k];
        columns[r * d + k] = sum;
      }
    }
    GramCholesky(columns, D, d, scratch.gram, f, ld);
    // Blocks 1..G: T_h with T_h T_h^T = W_h^T W_h.
    for (int64_t a = 0; a < G; ++a) {
      for (int64_t r = 0; r < D; ++r) {
        for (int64_t k = 0; k < d; ++k) columns[r * d + k] = group[r * Hd + a * d + k];
      }
      GramCholesky(columns, D, d, scratch.gram, f + (1 + a) * d, ld);
    }
    // Then the cross pairs W_h^T W_h' for h < h' (EXACT_BLOCK).
    if (!cross) continue;
    int64_t block = 1 + G;
    for (int64_t a = 0; a < G; ++a) {
      for (int64_t b = a + 1; b < G; ++b, ++block) {
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(d),
                    static_cast<int>(d), static_cast<int>(D), 1.f, group + a * d,
                    static_cast<int>(Hd), group + b * d, static_cast<int>(Hd), 0.f, f + block * d,
                    ld);
      }
    }
  }
  return absl::OkStatus();
}

// One sequence's plan: a scoring item per (layer, KV head), then the selection over them.
class SequenceJob {
 public:
  virtual ~SequenceJob() = default;
  // Scores item (layer * Hkv + KV head) with the calling worker's workspace.
  virtual absl::Status Score(int64_t item, ScoreWorkspace& ws) = 0;
  // Once every item is scored: the plan (called once; it may consume the job's buffers).
  virtual absl::StatusOr<KeepPlan> Select() = 0;
};

class LaproxJob final : public SequenceJob {
 public:
  LaproxJob(const CpuPreparedModel& model, const KeepPlanRequest& request,
            const RequestShape& shape, int64_t window_bytes, int64_t l2_bytes)
      : model_(model),
        request_(request),
        shape_(shape),
        window_bytes_(window_bytes),
        l2_bytes_(l2_bytes),
        raw_(int64_t{shape.num_layers} * shape.num_kv_heads * shape.n, 0.f) {
    // A decode re-plan scores each layer as a prefill of its own entries.
    for (int64_t l = 0; l < static_cast<int64_t>(shape.layer_n.size()); ++l) {
      layer_shapes_.push_back(LayerShape(shape, l));
    }
  }

  absl::Status Score(int64_t item, ScoreWorkspace& ws) override {
    HeadTask task;
    task.layer = item / shape_.num_kv_heads;
    task.kv_head = item % shape_.num_kv_heads;
    task.inputs = &request_.layers[task.layer];
    task.factors = model_.factors(task.layer, task.kv_head);
    task.factor_ld = model_.row_stride();
    task.hidden_size = model_.geometry().hidden_size;
    task.max_o_proj = model_.max_o_proj(task.layer);
    task.scale = model_.geometry().EffectiveScale();
    task.window_bytes = window_bytes_;
    task.l2_bytes = l2_bytes_;
    task.stop = request_.stop;
    const RequestShape& shape = layer_shapes_.empty() ? shape_ : layer_shapes_[task.layer];
    return ScoreHead(shape, request_.policy, task, ws, raw_.data() + item * shape_.n);
  }

  absl::StatusOr<KeepPlan> Select() override {
    return policy::SelectKeepPlan(shape_, request_.policy, std::move(raw_), request_.outputs,
                                  request_.stop);
  }

 private:
  const CpuPreparedModel& model_;
  const KeepPlanRequest& request_;
  const RequestShape& shape_;
  int64_t window_bytes_;
  int64_t l2_bytes_;
  std::vector<float> raw_;
  std::vector<RequestShape> layer_shapes_;  // per layer, a decode re-plan's only
};

class BaselineJob final : public SequenceJob {
 public:
  BaselineJob(const CpuPreparedModel& model, const KeepPlanRequest& request,
              const RequestShape& shape, int64_t l2_bytes)
      : model_(model), request_(request), shape_(shape), l2_bytes_(l2_bytes) {
    const PolicySpec& policy = request.policy;
    const int64_t L = shape.num_layers, Hkv = shape.num_kv_heads, n = shape.n;
    critical_ = policy.kind == PolicyKind::kCriticalKv || policy.kind == PolicyKind::kCriticalAdaKv;
    const bool compat = policy.numeric_mode == NumericMode::kKvpressCompat;
    scores_.assign(L * Hkv * n, 0.f);
    norms_.assign(critical_ ? L * Hkv * n : 0, 0.f);
    entropy_.assign(L * Hkv, 0.0);
    variance_.assign(L * Hkv, 0.0);
    safeguard_.assign(L, std::numeric_limits<float>::max());
    compat_dtype_.assign(compat ? L : 0, DType::kF32);
    for (int64_t l = 0; l < L && compat; ++l) {
      // The model dtype is the keys' dtype: kvpress's scores have it, and so does their maximum.
      const DType dtype = request.layers[l].keys.dtype();
      compat_dtype_[l] = dtype;
      if (dtype == DType::kBF16) safeguard_[l] = Bf16ToFloat(0x7f7f);
      if (dtype == DType::kF16) safeguard_[l] = F16ToFloat(0x7bff);
    }
    // CAKE has no kvpress press: KVPRESS_COMPAT only rounds its softmax output.
    compat_arithmetic_ = compat && policy.kind != PolicyKind::kCake;
  }

  absl::Status Score(int64_t item, ScoreWorkspace& ws) override {
    const int64_t n = shape_.n;
    const bool compat = !compat_dtype_.empty();
    HeadTask task;
    task.layer = item / shape_.num_kv_heads;
    task.kv_head = item % shape_.num_kv_heads;
    task.inputs = &request_.layers[task.layer];
    task.o_proj = model_.output_projection(task.layer);
    task.hidden_size = model_.geometry().hidden_size;
    task.max_o_proj = model_.max_o_proj(task.layer);
    task.scale = model_.geometry().EffectiveScale();
    task.kvpress_compat = compat_arithmetic_;
    task.l2_bytes = l2_bytes_;
    task.compat_dtype = compat ? compat_dtype_[task.layer] : DType::kF32;
    task.stop = request_.stop;
    // Only attention computed here is rounded; the engine's attention rows are used as given.
    const DType rounding =
        compat && !shape_.attention_given ? task.inputs->keys.dtype() : DType::kF32;
    const BaselineHeadOutput out = {.scores = scores_.data() + item * n,
                                    .value_norms = critical_ ? norms_.data() + item * n : nullptr,
                                    .entropy = &entropy_[item],
                                    .variance = &variance_[item]};
    return BaselineHead(shape_, request_.policy, task, rounding, ws, out);
  }

  absl::StatusOr<KeepPlan> Select() override {
    const policy::BaselineStatistics statistics = {.prefix_scores = scores_,
                                                   .value_norms = norms_,
                                                   .entropy = entropy_,
                                                   .variance = variance_,
                                                   .safeguard = safeguard_,
                                                   .compat_dtype = compat_dtype_};
    return policy::SelectBaselinePlan(shape_, request_.policy, statistics, request_.outputs,
                                      request_.stop);
  }

 private:
  const CpuPreparedModel& model_;
  const KeepPlanRequest& request_;
  const RequestShape& shape_;
  int64_t l2_bytes_;
  bool critical_ = false, compat_arithmetic_ = false;
  std::vector<float> scores_, norms_;
  std::vector<double> entropy_, variance_;
  std::vector<float> safeguard_;
  std::vector<DType> compat_dtype_;
};

}  // namespace

CpuPreparedModel::CpuPreparedModel(const ModelGeometry& geometry, const PrepareOptions& options)
    : PreparedModel(geometry, options, BackendKind::kCpu) {
  const int64_t G = geometry.group_size();
  blocks_ = 1 + G + (options.cross_grams ? G * (G - 1) / 2 : 0);
  factors_.resize(int64_t{geometry.num_layers} * geometry.num_kv_heads * matrix_size());
  if (options.output_projection) output_projection_.resize(geometry.num_layers * projection_size());
  max_o_proj_.assign(geometry.num_layers, 0.f);
}

CpuBackend::CpuBackend(int threads, int64_t window_bytes, int64_t l2_bytes)
    : threads_(std::max(threads, 1)),
      window_bytes_(std::max<int64_t>(window_bytes, 1)),
      l2_bytes_(l2_bytes > 0 ? l2_bytes : L2CacheBytes()) {
  // Parallelism comes from our workers over (layer, head) pairs; nested BLAS threads would
  // oversubscribe the cores.
  openblas_set_num_threads(1);
}

std::string CpuBackend::Describe() const {
  return absl::StrCat("cpu: ", threads_, " threads, L2 ", l2_bytes_ >> 10,
                      " KiB per core (chunks at d = 128: ", KeyChunk(l2_bytes_, 128), " keys, ",
                      ValueChunk(l2_bytes_, 128), " values), ", openblas_get_config());
}

absl::StatusOr<std::shared_ptr<const PreparedModel>> CpuBackend::PrepareModelImpl(
    const ModelGeometry& geometry, absl::Span<const TensorView> o_proj,
    const PrepareOptions& options, const StopSignal* stop) {
  auto model = std::make_shared<CpuPreparedModel>(geometry, options);
  const int64_t D = geometry.hidden_size, Hd = int64_t{geometry.num_heads} * geometry.head_dim;
  std::vector<PrepareScratch> scratch(threads_);
  LAPROX_RETURN_IF_ERROR(RunAll(pool_, geometry.num_layers, threads_, [&](int64_t l, int worker) {
    LAPROX_RETURN_IF_ERROR(CheckStop(stop, "preparing the model"));
    // View the [D, H*d] weight as one "head" of D rows so that LoadRows converts and checks it.
    const TensorView& w = o_proj[l];
    const TensorView rows(w.data(), w.dtype(), {1, D, Hd}, {0, w.stride(0), w.stride(1)});
    RowBlock block;
    std::vector<float>& buffer = scratch[worker].weights;
    float max_w = 0.f;
    LAPROX_RETURN_IF_ERROR(LoadRows(rows, 0, 0, D, {l, "o_proj"}, buffer, &block, &max_w));
    // Finite weights can still overflow the factors (and the scores): refuse them here.
    LAPROX_RETURN_IF_ERROR(policy::CheckFactorMagnitude(geometry, l, max_w));
    model->set_max_o_proj(l, max_w);
    if (block.ld != Hd) {  // used in place with padded rows: make it dense
      buffer.resize(D * Hd);
      for (int64_t r = 0; r < D; ++r) {
        std::copy(block.data + r * block.ld, block.data + r * block.ld + Hd, &buffer[r * Hd]);
      }
      block.data = buffer.data();
    }
    LAPROX_RETURN_IF_ERROR(
        LayerFactors(geometry, block.data, options.cross_grams, l, *model, scratch[worker], stop));
    // The bound above keeps every factor finite; a non-finite one would poison every request.
    const float* f = model->factors(l, 0);
    if (!std::isfinite(MaxAbs(f, geometry.num_kv_heads * model->matrix_size()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "o_proj[", l, "]: the factor matrices computed from it are not finite (max |o_proj[", l,
          "]| = ", max_w, ")"));
    }
    if (options.output_projection) {
      std::copy(block.data, block.data + D * Hd, model->mutable_output_projection(l));
    }
    return absl::OkStatus();
  }));
  return std::shared_ptr<const PreparedModel>(std::move(model));
}

absl::StatusOr<KeepPlan> CpuBackend::ComputeKeepPlanImpl(const PreparedModel& model,
                                                         const KeepPlanRequest& request,
                                                         const RequestShape& shape) {
  int64_t failed = 0;
  LAPROX_ASSIGN_OR_RETURN(std::vector<KeepPlan> plans,
                          RunSequences(model, absl::MakeConstSpan(&request, 1),
                                       absl::MakeConstSpan(&shape, 1), &failed));
  return std::move(plans[0]);
}

absl::StatusOr<std::vector<KeepPlan>> CpuBackend::ComputeKeepPlansImpl(
    const PreparedModel& model, absl::Span<const KeepPlanRequest> requests,
    absl::Span<const RequestShape> shapes) {
  int64_t failed = 0;
  absl::StatusOr<std::vector<KeepPlan>> plans = RunSequences(model, requests, shapes, &failed);
  if (!plans.ok()) return InSequence(static_cast<size_t>(failed), plans.status());
  return plans;
}

absl::StatusOr<std::vector<KeepPlan>> CpuBackend::RunSequences(
    const PreparedModel& model, absl::Span<const KeepPlanRequest> requests,
    absl::Span<const RequestShape> shapes, int64_t* failed) {
  const auto started = std::chrono::steady_clock::now();
  const auto& prepared = static_cast<const CpuPreparedModel&>(model);
  // Every (sequence, layer, KV head) is one work item of one pass over the workers, so that a
  // batch of short sequences keeps every worker busy until the last item.
  std::vector<std::unique_ptr<SequenceJob>> jobs;
  std::vector<int64_t> first_item = {0};
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i].policy.kind == PolicyKind::kLaprox) {
      jobs.push_back(
          std::make_unique<LaproxJob>(prepared, requests[i], shapes[i], window_bytes_, l2_bytes_));
    } else {
      jobs.push_back(std::make_unique<BaselineJob>(prepared, requests[i], shapes[i], l2_bytes_));
    }
    first_item.push_back(first_item.back() +
                         int64_t{shapes[i].num_layers} * shapes[i].num_kv_heads);
  }
  // The sequence an item belongs to.
  const auto job_of = [&](int64_t item) {
    return std::upper_bound(first_item.begin(), first_item.end(), item) - 1 - first_item.begin();
  };
  std::vector<ScoreWorkspace> workspaces(threads_);
  int64_t failed_item = 0;
  absl::Status scored = RunAll(
      pool_, first_item.back(), threads_,
      [&](int64_t item, int worker) {
        const int64_t j = job_of(item);
        LAPROX_RETURN_IF_ERROR(CheckStop(requests[j].stop));
        return jobs[j]->Score(item - first_item[j], workspaces[worker]);
      },
      &failed_item);
  if (!scored.ok()) {
    *failed = job_of(failed_item);
    return scored;
  }
  workspaces.clear();
  const auto scored_at = std::chrono::steady_clock::now();
  std::vector<KeepPlan> plans(jobs.size());
  LAPROX_RETURN_IF_ERROR(RunAll(
      pool_, static_cast<int64_t>(jobs.size()), threads_,
      [&](int64_t j, int) {
        LAPROX_RETURN_IF_ERROR(CheckStop(requests[j].stop));
        LAPROX_ASSIGN_OR_RETURN(plans[j], jobs[j]->Select());
        return absl::OkStatus();
      },
      failed));
  const auto selected_at = std::chrono::steady_clock::now();
  for (KeepPlan& plan : plans) {
    plan.timing.score_seconds = std::chrono::duration<double>(scored_at - started).count();
    plan.timing.select_seconds = std::chrono::duration<double>(selected_at - scored_at).count();
  }
  return plans;
}

// Upper bounds of the buffers above and in score.cc, window.cc, baseline_stats.cc and the
// selection (policy/select.cc, policy/baselines.cc); tests/kernels/memory_estimate_test.cc
// measures every policy's peak heap use against them.
int64_t CpuBackend::KeepPlanWorkspaceBytes(const ModelGeometry& geometry, const RequestShape& shape,
                                           const PolicySpec& policy) const {
  const int64_t heads = SatMul(shape.num_layers, shape.num_kv_heads), n = shape.n;
  const int64_t G = shape.group_size, d = shape.head_dim, D = geometry.hidden_size;
  const int64_t rows = SatMul(G, std::max(shape.window_rows, shape.window));
  const bool projected = policy.kind == PolicyKind::kLaprox &&
                         policy.indicator == Indicator::kAttentionXProjectedValue;
  const GqaValue gqa = policy.EffectiveGqaValue();
  const bool exact = projected && gqa == GqaValue::kExactBlock;
  // pool_target ATTENTION with per-head attention statistics pools each head's factor apart.
  const bool per_head_pool = (exact || (projected && gqa == GqaValue::kMeanHeadProduct)) &&
                             policy.EffectivePoolTarget() == PoolTarget::kAttention;
  // Factor blocks of the value product, and attention statistics per token (8 bytes each, so
  // that fp64 accumulators are covered).
  const int64_t blocks = exact ? SatAdd(G, SatMul(G, G - 1) / 2) : std::max<int64_t>(G, 2);
  const int64_t statistics = exact ? SatMul(G, G + 1) / 2 : G;
  // LAPROX computes the window rows in ranges within window_bytes_ (ScoreHead).
  const int64_t probability_rows = policy.kind == PolicyKind::kLaprox
                                       ? SatMul(G, WindowRowsPerRange(shape, window_bytes_))
                                       : rows;
  // Chunks of rows (KeyChunk, ValueChunk; a value chunk is largest with the fewest floats).
  const int64_t key_chunk = KeyChunk(l2_bytes_, d), value_chunk = ValueChunk(l2_bytes_, d);
  const int64_t per_worker = SatAdd({
      SatMul({4, probability_rows, n}),  // window probabilities
      SatMul({8, statistics, n}),        // attention statistics
      SatMul({4, blocks, n}),            // value statistics
      // One value chunk's products (EXACT_BLOCK's cross forms: at most ValueChunk(d) rows), or
      // a baseline's V W_O^h chunk (baseline_stats.cc: at most 256 rows).
      SatAdd(SatMul({4, value_chunk, blocks, d}), SatMul({4, 256, D})),
      SatMul({4, blocks, PackedTriangleSize(d)}),  // packed triangles
      SatMul(4, std::max({SatMul(std::max(key_chunk, value_chunk), d), SatMul(rows, d), n})),
      SatMul({4, key_chunk, d}),                      // packed keys
      SatMul({12, rows, d}),                          // scaled queries, row scales, LSE
      SatMul(40, n), SatMul(24, policy.pool_kernel),  // pooling and per-token temporaries
      SatMul(4, rows),                                // scaled row scales
      per_head_pool ? SatMul({4, G, n}) : 0,          // per-head pooled attention factors
  });
  // Shared: the raw scores, normalised in place by the selection, its marks and a block plan's
  // token marks (LAPROX: 4 + 1 + 1 bytes per entry, policy/select.cc; the baselines keep fp64
  // scores and ranked pools).
  const int64_t per_entry = policy.kind == PolicyKind::kLaprox ? 6 : 48;
  return SatAdd({SatMul(std::min<int64_t>(threads_, heads), per_worker),
                 SatMul({heads, n, per_entry}), SatMul(heads, 64)});
}

int64_t CpuBackend::PrepareWorkspaceBytes(const ModelGeometry& geometry,
                                          const PrepareOptions&) const {
  // Per worker: one layer's o_proj in fp32 (twice when it is made dense), one head's columns and
  // its Gram in fp64 (PrepareScratch).
  const int64_t D = geometry.hidden_size, d = geometry.head_dim;
  const int64_t Hd = SatMul(geometry.num_heads, d);
  const int64_t per_worker = SatAdd({SatMul({8, D, Hd}), SatMul({8, D, d}), SatMul({8, d, d})});
  return SatMul(std::min<int64_t>(threads_, geometry.num_layers), per_worker);
}

}  // namespace laprox::kernels::cpu
