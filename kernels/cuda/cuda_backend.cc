#include "cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "cuda/cuda_status.h"
#include "cuda/ipc.h"
#include "cuda/prepare.h"
#include "laprox/kernels/layer_tensors.h"
#include "policy/magnitude.h"
#include "policy/select.h"

namespace laprox::kernels::cuda {
namespace {

// Errors after which the CUDA context cannot be used again (the CUDA runtime documents these
// as leaving the process in an inconsistent state until it exits).
bool IsSticky(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
      return true;
    default:
      return false;
  }
}

// A device view whose first element is not aligned to its element size would make the kernels
// fault with cudaErrorMisalignedAddress, which poisons the CUDA context: refuse it up front.
// (Element strides keep every element aligned once the first one is.)
absl::Status CheckAligned(const TensorView& view, absl::string_view name) {
  if (view.empty() || view.space() != MemorySpace::kDevice) return absl::OkStatus();
  const auto address = reinterpret_cast<uintptr_t>(view.data());
  const size_t size = DTypeSize(view.dtype());
  if (address % size == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(name, " starts at a device address that is not a ",
                                                 "multiple of its ", size, "-byte element size (",
                                                 "address % ", size, " = ", address % size, ")"));
}

// The CPU backend's magnitude checks (policy/magnitude.h) on the maxima the input check found,
// in its order: per (layer, KV head), the logits, then the values.
absl::Status CheckMagnitudes(const CudaPreparedModel& model, const PolicySpec& policy,
                             const RequestShape& shape, const InputMagnitudes& m) {
  const int64_t Hkv = shape.num_kv_heads, G = shape.group_size;
  const bool logits = !shape.attention_given && shape.window > 0;
  const double scale = model.geometry().EffectiveScale();
  for (int64_t l = 0; l < shape.num_layers; ++l) {
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t lg = l * Hkv + g;
      if (logits) {
        float max_queries = 0.f;
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          max_queries = std::max(max_queries, m.queries[l * Hkv * G + h]);
        }
        LAPROX_RETURN_IF_ERROR(
            policy::CheckLogitMagnitude(l, g, shape.head_dim, scale, max_queries, m.keys[lg]));
      }
      LAPROX_RETURN_IF_ERROR(policy::CheckValueMagnitude(
          shape, policy, model.geometry().hidden_size, l, g, m.values[lg], model.max_o_proj(l)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device, CudaKernels kernels) {
  LAPROX_ASSIGN_OR_RETURN(const DeviceContext context, CreateDeviceContext(device));
  return std::unique_ptr<CudaBackend>(new CudaBackend(context, kernels));
}

CudaBackend::CudaBackend(DeviceContext context, CudaKernels kernels)
    : context_(context), kernels_(kernels), gemm_(NewGemmScorer()), fused_(NewFusedScorer()) {}

CudaBackend::~CudaBackend() { DestroyDeviceContext(context_); }

std::string CudaBackend::Describe() const {
  cudaDeviceProp prop{};
  const std::string kernels = kernels_ == CudaKernels::kFused ? "fused" : "gemm";
  if (cudaGetDeviceProperties(&prop, context_.device) != cudaSuccess) {
    return absl::StrCat("cuda: device ", context_.device, ", kernels ", kernels);
  }
  return absl::StrCat("cuda: device ", context_.device, " ", prop.name, " (sm_", prop.major,
                      prop.minor, "), kernels ", kernels);
}

std::vector<DeviceDescription> CudaBackend::Devices() const {
  std::vector<DeviceDescription> devices = ListDevices(context_.device);
  for (DeviceDescription& d : devices) {
    if (!d.active) continue;
    ScopedDevice current(d.ordinal);
    size_t free = 0, total = 0;
    if (current.error() == cudaSuccess && cudaMemGetInfo(&free, &total) == cudaSuccess) {
      d.used_memory_bytes = static_cast<int64_t>(total - free);
    } else {
      cudaGetLastError();  // unknown for this call; the next kernel launch check must not see it
    }
  }
  return devices;
}

absl::Status CudaBackend::Health() const {
  absl::MutexLock lock(&mu_);
  return sticky_;
}

absl::Status CudaBackend::Track(absl::Status status) {
  if (!sticky_.ok()) return sticky_;
  if (status.ok()) return status;
  // A failed stage may have left a sticky error behind; the next synchronisation reports it.
  const cudaError_t error = cudaStreamSynchronize(context_.stream);
  if (IsSticky(error)) {
    sticky_ = absl::UnavailableError(absl::StrCat("the CUDA context of device ", context_.device,
                                                  " is unusable after ", cudaGetErrorName(error),
                                                  " (", status.message(), "); restart laproxd"));
    std::fprintf(stderr, "laproxd: %s\n", sticky_.ToString().c_str());
    return sticky_;
  }
  // A failed runtime call (cudaMalloc out of memory, a refused launch) stays this thread's last
  // error, and every kernel wrapper returns cudaGetLastError(): clear it, or the next request on
  // this worker thread fails with this request's error.
  cudaGetLastError();
  return status;
}

absl::Status CudaBackend::StageToDevice(std::vector<TensorView*> views) {
  WorkspaceLayout layout;
  std::vector<size_t> offsets(views.size(), 0);
  std::vector<size_t> bytes(views.size(), 0);
  for (size_t i = 0; i < views.size(); ++i) {
    const TensorView& v = *views[i];
    if (v.empty() || v.space() == MemorySpace::kDevice) continue;
    int64_t extent = 0;
    LAPROX_RETURN_IF_ERROR(v.ElementExtent(&extent));
    bytes[i] = static_cast<size_t>(extent) * DTypeSize(v.dtype());
    offsets[i] = layout.Add<std::byte>(bytes[i]);
  }
  if (layout.total() == 0) return absl::OkStatus();
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(staging_.Reserve(layout.total()), "allocating the input staging buffer"));
  for (size_t i = 0; i < views.size(); ++i) {
    TensorView& v = *views[i];
    if (v.empty() || v.space() == MemorySpace::kDevice) continue;
    std::byte* dst = staging_.as<std::byte>() + offsets[i];
    LAPROX_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(dst, v.data(), bytes[i], cudaMemcpyHostToDevice, context_.stream),
        "copying an input to the device"));
    v = TensorView(dst, v.dtype(), v.shape(), v.strides(), MemorySpace::kDevice);
  }
  return CudaStatus(cudaStreamSynchronize(context_.stream), "copying inputs to the device");
}

absl::StatusOr<std::shared_ptr<const PreparedModel>> CudaBackend::PrepareModelImpl(
    const ModelGeometry& geometry, absl::Span<const TensorView> o_proj,
    const PrepareOptions& options, const StopSignal* stop) {
  absl::MutexLock lock(&mu_);
  LAPROX_RETURN_IF_ERROR(sticky_);
  LAPROX_RETURN_IF_ERROR(CheckStop(stop, "preparing the model"));
  LAPROX_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(context_.device), "cudaSetDevice"));
  for (size_t l = 0; l < o_proj.size(); ++l) {
    LAPROX_RETURN_IF_ERROR(CheckAligned(o_proj[l], absl::StrCat("o_proj[", l, "]")));
  }
  std::vector<TensorView> views(o_proj.begin(), o_proj.end());
  std::vector<TensorView*> pointers;
  pointers.reserve(views.size());
  for (TensorView& v : views) pointers.push_back(&v);
  LAPROX_RETURN_IF_ERROR(Track(StageToDevice(pointers)));
  absl::StatusOr<std::shared_ptr<CudaPreparedModel>> model =
      PrepareFactors(context_, geometry, views, options);
  LAPROX_RETURN_IF_ERROR(Track(model.status()));
  return std::shared_ptr<const PreparedModel>(*std::move(model));
}

absl::StatusOr<KeepPlan> CudaBackend::ComputeKeepPlanImpl(const PreparedModel& model,
                                                          const KeepPlanRequest& request,
                                                          const RequestShape& shape) {
  using Clock = std::chrono::steady_clock;
  const auto& prepared = static_cast<const CudaPreparedModel&>(model);
  // One request at a time: this mutex is held from staging to the plan on the host, so however
  // many laproxd workers (--workers, --heavy_workers) call in at once, the CUDA backend computes
  // their requests one after another, each with the whole GPU, its one stream and the
  // backend's single set of buffers (staging_, raw_, the scorers', selector_). The others wait
  // here, and their deadlines run while they wait.
  absl::MutexLock lock(&mu_);
  LAPROX_RETURN_IF_ERROR(sticky_);
  // The stop signal is checked between the stages below (the kernels queued for a stage run to
  // their end): a call that waited for the mutex past its deadline starts nothing.
  LAPROX_RETURN_IF_ERROR(CheckStop(request.stop));
  const Clock::time_point started = Clock::now();
  LAPROX_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(context_.device), "cudaSetDevice"));

  for (size_t l = 0; l < request.layers.size(); ++l) {
    LAPROX_RETURN_IF_ERROR(ForEachLayerTensor(
        [&](LayerTensor tensor, const TensorView& view) {
          return CheckAligned(view, absl::StrCat("layers[", l, "].", tensor.name));
        },
        request.layers[l]));
  }
  std::vector<LayerInputs> layers = request.layers;
  std::vector<TensorView*> views;
  for (LayerInputs& layer : layers) {
    ForEachLayerTensor(
        [&](LayerTensor, TensorView& view) {
          views.push_back(&view);
          return absl::OkStatus();
        },
        layer)
        .IgnoreError();
  }
  LAPROX_RETURN_IF_ERROR(Track(StageToDevice(views)));
  LAPROX_RETURN_IF_ERROR(CheckStop(request.stop));
  InputMagnitudes magnitudes;
  LAPROX_RETURN_IF_ERROR(Track(checker_.Check(context_, layers, shape, &magnitudes)));
  LAPROX_RETURN_IF_ERROR(CheckMagnitudes(prepared, request.policy, shape, magnitudes));

  const size_t raw_bytes =
      static_cast<size_t>(shape.num_layers) * shape.num_kv_heads * shape.n * sizeof(float);
  LAPROX_RETURN_IF_ERROR(
      Track(CudaStatus(raw_.Reserve(raw_bytes), "allocating the raw score buffer")));
  const bool use_v1 =
      kernels_ == CudaKernels::kFused && fused_->Supports(shape, request.policy, layers);
  Scorer& scorer = use_v1 ? *fused_ : *gemm_;
  LAPROX_RETURN_IF_ERROR(CheckStop(request.stop));
  LAPROX_RETURN_IF_ERROR(
      Track(scorer.Score(context_, prepared, layers, shape, request.policy, raw_.as<float>())));
  LAPROX_RETURN_IF_ERROR(CheckStop(request.stop));
  const Clock::time_point scored = Clock::now();

  absl::StatusOr<KeepPlan> plan;
  const bool layer_cap =
      request.policy.LayerSelectionCap(shape.num_layers, shape.num_kv_heads, shape.quota)
          .has_value();
  if (IsBlockShape(request.policy.EffectivePlanShape()) || layer_cap) {
    // Block plans, and plans under max_layer_share, are selected on the host from the raw scores
    // (L * Hkv * n floats read back): the device selector knows only token-granular competitions
    // without a per-layer cap. The plan is then exactly the CPU backend's for these raw scores.
    std::vector<float> raw(raw_bytes / sizeof(float));
    LAPROX_RETURN_IF_ERROR(
        Track(CudaStatus(cudaMemcpyAsync(raw.data(), raw_.as<float>(), raw_bytes,
                                         cudaMemcpyDeviceToHost, context_.stream),
                         "reading the raw scores back")));
    LAPROX_RETURN_IF_ERROR(
        Track(CudaStatus(cudaStreamSynchronize(context_.stream), "reading the raw scores back")));
    plan = policy::SelectKeepPlan(shape, request.policy, raw, request.outputs, request.stop);
    LAPROX_RETURN_IF_ERROR(plan.status());
  } else {
    plan = selector_.Select(context_, shape, request.policy, raw_.as<float>(), request.outputs,
                            use_v1 ? SelectAlgorithm::kHistogram : SelectAlgorithm::kRadixSort);
    LAPROX_RETURN_IF_ERROR(Track(plan.status()));
  }
  plan->timing.score_seconds = std::chrono::duration<double>(scored - started).count();
  plan->timing.select_seconds = std::chrono::duration<double>(Clock::now() - scored).count();
  return plan;
}

absl::StatusOr<std::unique_ptr<ImportedRegion>> CudaBackend::ImportCudaIpcImpl(
    const CudaIpcRegionSpec& spec) {
  absl::MutexLock lock(&mu_);
  LAPROX_RETURN_IF_ERROR(sticky_);
  absl::StatusOr<std::unique_ptr<ImportedRegion>> region = ImportIpcRegion(context_.device, spec);
  // A refused handle or a bad range leaves the runtime's last error set: see Track.
  if (!region.ok()) cudaGetLastError();
  return region;
}

absl::Status CudaBackend::CopyToRegion(void* dst, MemorySpace space, const void* src,
                                       int64_t bytes) {
  if (space == MemorySpace::kHost) return Backend::CopyToRegion(dst, space, src, bytes);
  absl::MutexLock lock(&mu_);
  LAPROX_RETURN_IF_ERROR(sticky_);
  if (bytes <= 0) return absl::OkStatus();
  LAPROX_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(context_.device), "cudaSetDevice"));
  LAPROX_RETURN_IF_ERROR(Track(CudaStatus(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                                          cudaMemcpyHostToDevice, context_.stream),
                                          "writing an output to a device region")));
  return Track(
      CudaStatus(cudaStreamSynchronize(context_.stream), "writing an output to a device region"));
}

}  // namespace laprox::kernels::cuda
