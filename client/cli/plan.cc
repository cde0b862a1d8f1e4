#include "client/cli/plan.h"

#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cli/policy_flags.h"
#include "laprox/kernels/registry.h"

namespace laprox::cli {
namespace {

// The dump's tensors in one device allocation, registered with laproxd as a cuda_ipc region.
struct DeviceUpload {
  client::DeviceAllocation memory;
  uint64_t region_id = 0;
};

absl::StatusOr<DeviceUpload> UploadToDevice(client::Client& server, const Dump& dump,
                                            const std::map<std::string, int64_t>& offsets,
                                            size_t total) {
  auto with_context = [](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("--device: ", s.message()));
  };
  if (!client::CudaExportBuilt()) {
    return absl::UnimplementedError(
        "--device: this laprox-cli was built without CUDA; drop --device to use shared memory");
  }
  auto info = server.GetServerInfo();
  if (!info.ok()) return info.status();
  if (!info->cuda_ipc) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device: laproxd runs the ", info->backend,
        " backend, which cannot read GPU memory; start it with --backend=cuda or drop --device"));
  }
  auto memory = client::DeviceAllocation::Allocate(total);
  if (!memory.ok()) return with_context(memory.status());
  for (const auto& [name, t] : dump.file.tensors) {
    if (absl::Status s = memory->CopyFromHost(offsets.at(name), t.bytes.data(), t.bytes.size());
        !s.ok()) {
      return with_context(s);
    }
  }
  auto exported = client::ExportCudaBuffer(memory->data(), static_cast<int64_t>(total));
  if (!exported.ok()) return with_context(exported.status());
  auto id = server.RegisterCudaIpcRegion(*exported);
  if (!id.ok()) return with_context(id.status());
  return DeviceUpload{*std::move(memory), *id};
}

}  // namespace

absl::StatusOr<kernels::KeepPlan> PlanLocal(const Dump& dump, const kernels::PolicySpec& policy) {
  auto backend = kernels::CreateBackend("cpu");
  if (!backend.ok()) return backend.status();
  auto view = [](const SafeTensor& t) {
    return kernels::TensorView(t.bytes.data(), t.dtype,
                               kernels::Dims(t.shape.begin(), t.shape.end()));
  };
  std::vector<kernels::TensorView> o_proj;
  kernels::KeepPlanRequest request;
  request.n = dump.n;
  request.policy = policy;
  for (int l = 0; l < dump.geometry.num_layers; ++l) {
    o_proj.push_back(view(dump.Get(l, "o_proj")));
    kernels::LayerInputs& in = request.layers.emplace_back();
    in.keys = view(dump.Get(l, "keys"));
    in.values = view(dump.Get(l, "values"));
    if (const SafeTensor* t = dump.Find(l, "window_attention")) {
      in.window_attention = view(*t);
    } else {
      in.window_queries = view(dump.Get(l, "window_queries"));
      if (const SafeTensor* lse = dump.Find(l, "window_lse")) in.window_lse = view(*lse);
    }
  }
  kernels::PrepareOptions options;
  options.cross_grams = NeedsCrossGrams(policy);
  auto model = (*backend)->PrepareModel(dump.geometry, o_proj, options);
  if (!model.ok()) return model.status();
  return (*backend)->ComputeKeepPlan(**model, request);
}

absl::StatusOr<kernels::KeepPlan> PlanRemote(client::Client& client, const Dump& dump,
                                             const kernels::PolicySpec& policy, bool device_memory,
                                             const std::string& shm_name) {
  size_t total = 0;
  std::map<std::string, int64_t> offsets;
  for (const auto& [name, t] : dump.file.tensors) {
    offsets[name] = static_cast<int64_t>(total);
    total += (t.bytes.size() + 63) / 64 * 64;
  }
  uint64_t region_id = 0;
  std::optional<client::SharedBuffer> buffer;
  std::optional<DeviceUpload> device;
  // Destroyed before `device`: the server closes the region before its memory is freed.
  struct UnregisterOnExit {
    client::Client* client = nullptr;
    uint64_t region_id = 0;
    ~UnregisterOnExit() {
      if (client != nullptr) client->UnregisterRegion(region_id).IgnoreError();
    }
  } unregister_device;
  if (device_memory) {
    auto upload = UploadToDevice(client, dump, offsets, total);
    if (!upload.ok()) return upload.status();
    device.emplace(*std::move(upload));
    region_id = device->region_id;
    unregister_device.client = &client;
    unregister_device.region_id = region_id;
  } else {
    auto shared = client.ShareHostBuffer(shm_name, total);
    if (!shared.ok()) return shared.status();
    for (const auto& [name, t] : dump.file.tensors) {
      std::memcpy(shared->data() + offsets.at(name), t.bytes.data(), t.bytes.size());
    }
    region_id = shared->region_id();
    buffer.emplace(*std::move(shared));
  }
  auto ref = [&](int l, const char* what) {
    const std::string name = absl::StrCat("layers.", l, ".", what);
    const SafeTensor& t = dump.file.tensors.at(name);
    return client::TensorRef::InRegion(region_id, offsets.at(name), t.dtype, t.shape);
  };
  std::vector<client::TensorRef> o_proj;
  std::vector<client::LayerRefs> layers;
  for (int l = 0; l < dump.geometry.num_layers; ++l) {
    o_proj.push_back(ref(l, "o_proj"));
    client::LayerRefs& in = layers.emplace_back();
    in.keys = ref(l, "keys");
    in.values = ref(l, "values");
    if (dump.Find(l, "window_attention") != nullptr) {
      in.window_attention = ref(l, "window_attention");
    } else {
      in.window_queries = ref(l, "window_queries");
      if (dump.Find(l, "window_lse") != nullptr) in.window_lse = ref(l, "window_lse");
    }
  }
  auto model = client.RegisterModel("laprox-cli", dump.geometry, o_proj, NeedsCrossGrams(policy));
  if (!model.ok()) return model.status();
  auto plan = client.ComputeKeepPlan(*model, dump.n, layers, policy);
  client.UnregisterModel(*model).IgnoreError();
  return plan;
}

}  // namespace laprox::cli
