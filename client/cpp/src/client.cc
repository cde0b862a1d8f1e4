#include "laprox/client/client.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <type_traits>
#include <utility>

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "laprox/client/service_config.h"
#include "laprox/kernels/layer_tensors.h"
#include "laprox/v1/endpoint.h"
#include "laprox/v1/laprox.grpc.pb.h"
#include "laprox/v1/plan_wire.h"
#include "laprox/v1/policy_wire.h"

namespace laprox::client {
namespace {

// The client's one seam: gRPC status -> absl::Status with the same code and message.
absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

void ToProto(const TensorRef& ref, v1::TensorRef* proto) {
  if (ref.host_data != nullptr) {
    int64_t extent = 0;
    const kernels::Dims strides =
        ref.strides.empty() ? kernels::ContiguousStrides(ref.shape) : ref.strides;
    // An invalid view is sent as is (empty bytes): the server names the problem.
    if (kernels::TensorView(ref.host_data, ref.dtype, ref.shape, strides)
            .ElementExtent(&extent)
            .ok()) {
      proto->set_inline_bytes(ref.host_data,
                              static_cast<size_t>(extent) * kernels::DTypeSize(ref.dtype));
    } else {
      proto->set_inline_bytes("");
    }
  } else {
    proto->mutable_region()->set_region_id(ref.region_id);
    proto->mutable_region()->set_byte_offset(ref.byte_offset);
  }
  proto->set_dtype(v1::DTypeToProto(ref.dtype));
  proto->mutable_shape()->Assign(ref.shape.begin(), ref.shape.end());
  proto->mutable_strides()->Assign(ref.strides.begin(), ref.strides.end());
  if (ref.paged) {
    v1::PagedLayout* paged = proto->mutable_paged();
    paged->set_block_table(ref.paged->block_table);
    paged->set_block_stride(ref.paged->block_stride);
    paged->set_slot_stride(ref.paged->slot_stride);
    paged->set_head_stride(ref.paged->head_stride);
    paged->set_dim_stride(ref.paged->dim_stride);
  }
}

// A paged reference (strides empty: the layout replaces them).
TensorRef PagedTensor(uint64_t region, int64_t byte_offset, DType dtype, std::vector<int64_t> shape,
                      const PagedRef& layout) {
  TensorRef ref = TensorRef::InRegion(region, byte_offset, dtype, std::move(shape));
  ref.paged = layout;
  return ref;
}

// The request of one sequence: every option of its policy explicit, so the server applies
// exactly it (start from PolicySpec::ForKind for a kind's defaults).
void SequenceToProto(uint64_t model_id, const SequenceRequest& sequence,
                     v1::ComputeKeepMaskRequest* request) {
  request->set_model_id(model_id);
  request->set_n(sequence.n);
  v1::PolicyToProto(sequence.policy, request->mutable_policy());
  v1::BudgetToProto(sequence.policy.budget, request->mutable_budget());
  v1::OutputsToProto(sequence.outputs, sequence.destination ? &*sequence.destination : nullptr,
                     request->mutable_outputs());
  static constexpr v1::LayerTensorMutators kMutators;
  for (const LayerRefs& layer : sequence.layers) {
    v1::LayerInputs* in = request->add_layers();
    kernels::ForEachLayerTensor(
        [&](kernels::LayerTensor, const auto& ref, auto mutator) {
          // keys and values are TensorRefs; the window tensors are optional ones.
          if constexpr (std::is_same_v<std::decay_t<decltype(ref)>, TensorRef>) {
            ToProto(ref, (in->*mutator)());
          } else if (ref) {
            ToProto(*ref, (in->*mutator)());
          }
          return absl::OkStatus();
        },
        layer, kMutators)
        .IgnoreError();
  }
  for (const BlockTableRef& table : sequence.block_tables) {
    v1::BlockTable* proto = request->add_block_tables();
    proto->mutable_block_ids()->Assign(table.block_ids.begin(), table.block_ids.end());
    proto->set_block_size(static_cast<int32_t>(table.block_size));
    proto->set_allow_repeated_ids(table.allow_repeated_ids);
    if (table.in_region) {
      proto->mutable_ids_region()->set_region_id(table.in_region->region_id);
      proto->mutable_ids_region()->set_byte_offset(table.in_region->byte_offset);
      proto->set_ids_count(table.in_region->count);
    }
  }
  if (sequence.cache) {
    v1::DecodeCache* cache = request->mutable_cache();
    for (const CacheLayer& layer : *sequence.cache) {
      v1::DecodeCacheLayer* proto = cache->add_layers();
      proto->set_entries(layer.entries);
      proto->mutable_positions()->Assign(layer.positions.begin(), layer.positions.end());
    }
  }
}

ServerTiming ServerTimingOf(const v1::Timing& timing) {
  return {.queue_seconds = timing.queue_seconds(),
          .respond_seconds = timing.respond_seconds(),
          .total_seconds = timing.total_seconds()};
}

}  // namespace

struct Client::Impl {
  std::unique_ptr<v1::Laprox::Stub> stub;
  ClientOptions options;

  // One unary call with the default deadline, its status converted.
  template <typename Request, typename Response>
  absl::Status Call(grpc::Status (v1::Laprox::Stub::*method)(grpc::ClientContext*, const Request&,
                                                             Response*),
                    const Request& request, Response* response) const {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(options.deadline));
    return FromGrpc((stub.get()->*method)(&context, request, response));
  }

  // RegisterRegion for a request whose kind (shm or cuda_ipc) is filled in.
  absl::StatusOr<uint64_t> RegisterRegion(v1::RegisterRegionRequest& request, bool writable) const {
    request.set_writable(writable);
    v1::RegisterRegionResponse response;
    if (absl::Status s = Call(&v1::Laprox::Stub::RegisterRegion, request, &response); !s.ok()) {
      return s;
    }
    return response.region_id();
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target,
                                                        ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("target is empty");
  auto impl = std::make_unique<Impl>();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  // Retries a busy laproxd's RESOURCE_EXHAUSTED to UnregisterRegion (laprox.proto says how).
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 1);
  args.SetServiceConfigJSON(internal::kServiceConfig);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls->root_certs_pem;
    ssl.pem_cert_chain = options.tls->cert_chain_pem;
    ssl.pem_private_key = options.tls->private_key_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  impl->stub = v1::Laprox::NewStub(grpc::CreateCustomChannel(target, credentials, args));
  impl->options = options;
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<ServerInfo> Client::GetServerInfo() {
  v1::GetServerInfoResponse response;
  if (absl::Status s =
          impl_->Call(&v1::Laprox::Stub::GetServerInfo, v1::GetServerInfoRequest(), &response);
      !s.ok()) {
    return s;
  }
  ServerInfo info;
  info.version = response.version();
  info.backend = response.backend() == v1::BACKEND_KIND_CUDA ? "cuda" : "cpu";
  info.backend_description = response.backend_description();
  for (int wire : response.supported_policies()) {
    // A kind this build does not know (a newer server's) is left out.
    if (const std::optional<PolicyKind> kind = v1::PolicyKindFromProto(wire)) {
      info.supported_policies.push_back(*kind);
    }
  }
  for (const v1::DeviceInfo& d : response.devices()) {
    info.device_uuids.push_back(d.uuid());
    if (d.active()) info.active_device_uuid = d.uuid();
  }
  for (int kind : response.supported_region_kinds()) {
    info.cuda_ipc |= kind == v1::REGION_KIND_CUDA_IPC;
  }
  info.max_tokens = response.limits().max_tokens();
  info.max_regions = response.limits().max_regions();
  info.max_models = response.limits().max_models();
  info.max_request_work = response.limits().max_request_work();
  info.heavy_request_work = response.limits().heavy_request_work();
  return info;
}

absl::StatusOr<uint64_t> Client::RegisterShmRegion(const std::string& name, int64_t offset,
                                                   int64_t byte_size, bool writable) {
  v1::RegisterRegionRequest request;
  request.mutable_shm()->set_name(name);
  request.mutable_shm()->set_offset(offset);
  request.mutable_shm()->set_byte_size(byte_size);
  return impl_->RegisterRegion(request, writable);
}

absl::StatusOr<uint64_t> Client::RegisterCudaIpcRegion(const CudaIpcExport& region, bool writable) {
  v1::RegisterRegionRequest request;
  v1::CudaIpcRegion* cuda_ipc = request.mutable_cuda_ipc();
  cuda_ipc->set_handle(region.handle);
  cuda_ipc->set_device_uuid(region.device_uuid);
  cuda_ipc->set_offset(region.offset);
  cuda_ipc->set_byte_size(region.byte_size);
  return impl_->RegisterRegion(request, writable);
}

absl::StatusOr<TlsOptions> TlsOptionsFromFiles(const std::string& root_certs_file,
                                               const std::string& cert_chain_file,
                                               const std::string& private_key_file) {
  TlsOptions tls;
  for (auto [path, out] : {std::pair{&root_certs_file, &tls.root_certs_pem},
                           std::pair{&cert_chain_file, &tls.cert_chain_pem},
                           std::pair{&private_key_file, &tls.private_key_pem}}) {
    if (path->empty()) continue;
    std::ifstream file(*path, std::ios::binary);
    if (!file) return absl::NotFoundError(absl::StrCat(*path, " cannot be read"));
    std::stringstream text;
    text << file.rdbuf();
    *out = text.str();
  }
  return tls;
}

std::string DefaultTarget() { return v1::DefaultTarget(); }

absl::Status Client::UnregisterRegion(uint64_t region_id) {
  v1::UnregisterRegionRequest request;
  request.set_region_id(region_id);
  v1::UnregisterRegionResponse response;
  return impl_->Call(&v1::Laprox::Stub::UnregisterRegion, request, &response);
}

absl::StatusOr<SharedBuffer> Client::ShareHostBuffer(const std::string& name, size_t bytes,
                                                     bool writable) {
  const std::string path = "/" + name;
  const int fd = shm_open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    const std::string message = absl::StrCat("shm_open(\"", name, "\"): ", std::strerror(errno));
    return errno == EEXIST ? absl::AlreadyExistsError(message) : absl::InternalError(message);
  }
  SharedBuffer buffer;
  buffer.name_ = name;
  buffer.size_ = bytes;
  void* mapping = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
    mapping = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int error = errno;
  close(fd);
  if (mapping == MAP_FAILED) {
    shm_unlink(path.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot size or map \"", name, "\": ", std::strerror(error)));
  }
  buffer.data_ = static_cast<std::byte*>(mapping);
  auto id = RegisterShmRegion(name, 0, static_cast<int64_t>(bytes), writable);
  if (!id.ok()) return id.status();  // ~SharedBuffer unmaps and unlinks
  buffer.region_id_ = *id;
  buffer.client_ = this;
  return buffer;
}

absl::StatusOr<uint64_t> Client::RegisterModel(const std::string& name,
                                               const ModelGeometry& geometry,
                                               absl::Span<const TensorRef> o_proj,
                                               bool cross_grams) {
  v1::RegisterModelRequest request;
  request.set_name(name);
  v1::GeometryToProto(geometry, request.mutable_geometry());
  for (const TensorRef& ref : o_proj) ToProto(ref, request.add_o_proj());
  request.set_prepare_cross_grams(cross_grams);
  v1::RegisterModelResponse response;
  if (absl::Status s = impl_->Call(&v1::Laprox::Stub::RegisterModel, request, &response); !s.ok()) {
    return s;
  }
  return response.model_id();
}

absl::Status Client::UnregisterModel(uint64_t model_id) {
  v1::UnregisterModelRequest request;
  request.set_model_id(model_id);
  v1::UnregisterModelResponse response;
  return impl_->Call(&v1::Laprox::Stub::UnregisterModel, request, &response);
}

absl::StatusOr<KeepPlan> Client::ComputeKeepPlan(uint64_t model_id, int64_t n,
                                                 absl::Span<const LayerRefs> layers,
                                                 const PolicySpec& policy,
                                                 const OutputOptions& outputs,
                                                 ServerTiming* server_timing) {
  return ComputeKeepPlan(
      model_id,
      {.n = n, .layers = {layers.begin(), layers.end()}, .policy = policy, .outputs = outputs},
      server_timing);
}

absl::StatusOr<KeepPlan> Client::ComputeKeepPlanInto(uint64_t model_id, int64_t n,
                                                     absl::Span<const LayerRefs> layers,
                                                     const PolicySpec& policy,
                                                     const OutputDestination& destination,
                                                     ServerTiming* server_timing) {
  // Nothing inline beyond what is always returned; the server produces what it writes.
  return ComputeKeepPlan(model_id,
                         {.n = n,
                          .layers = {layers.begin(), layers.end()},
                          .policy = policy,
                          .outputs = {.positions = false},
                          .destination = destination},
                         server_timing);
}

absl::StatusOr<KeepPlan> Client::ComputeKeepPlan(uint64_t model_id, const SequenceRequest& sequence,
                                                 ServerTiming* server_timing) {
  v1::ComputeKeepMaskRequest request;
  SequenceToProto(model_id, sequence, &request);
  v1::ComputeKeepMaskResponse response;
  if (absl::Status s = impl_->Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
      !s.ok()) {
    return s;
  }
  if (server_timing != nullptr) *server_timing = ServerTimingOf(response.timing());
  return v1::KeepPlanFromProto(response);
}

absl::StatusOr<std::vector<KeepPlan>> Client::ComputeKeepPlans(
    uint64_t model_id, absl::Span<const SequenceRequest> sequences, ServerTiming* server_timing) {
  v1::ComputeKeepPlansRequest request;
  for (const SequenceRequest& sequence : sequences) {
    SequenceToProto(model_id, sequence, request.add_sequences());
  }
  v1::ComputeKeepPlansResponse response;
  if (absl::Status s = impl_->Call(&v1::Laprox::Stub::ComputeKeepPlans, request, &response);
      !s.ok()) {
    return s;
  }
  if (server_timing != nullptr) *server_timing = ServerTimingOf(response.timing());
  std::vector<KeepPlan> plans;
  plans.reserve(response.plans_size());
  for (const v1::ComputeKeepMaskResponse& plan : response.plans()) {
    plans.push_back(v1::KeepPlanFromProto(plan));
  }
  return plans;
}

namespace {

// A vLLM cache [2, num_blocks, ...]: K in the first half of the pool, V in the second, both read
// with `layout`.
PagedKv TwoPools(uint64_t region, int64_t pool_offset, DType dtype, int64_t num_blocks,
                 int64_t num_kv_heads, int64_t head_dim, int64_t n, const PagedRef& layout) {
  const int64_t element = static_cast<int64_t>(kernels::DTypeSize(dtype));
  const int64_t values_offset = pool_offset + num_blocks * layout.block_stride * element;
  return {PagedTensor(region, pool_offset, dtype, {num_kv_heads, n, head_dim}, layout),
          PagedTensor(region, values_offset, dtype, {num_kv_heads, n, head_dim}, layout)};
}

}  // namespace

PagedKv PagedKv::VllmFlashAttention(uint64_t region, int64_t pool_offset, DType dtype,
                                    int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                                    int64_t head_dim, int64_t n, uint32_t table) {
  return TwoPools(region, pool_offset, dtype, num_blocks, num_kv_heads, head_dim, n,
                  {.block_table = table,
                   .block_stride = block_size * num_kv_heads * head_dim,
                   .slot_stride = num_kv_heads * head_dim,
                   .head_stride = head_dim,
                   .dim_stride = 1});
}

PagedKv PagedKv::VllmHeadMajor(uint64_t region, int64_t pool_offset, DType dtype,
                               int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                               int64_t head_dim, int64_t n, uint32_t table) {
  return TwoPools(region, pool_offset, dtype, num_blocks, num_kv_heads, head_dim, n,
                  {.block_table = table,
                   .block_stride = block_size * num_kv_heads * head_dim,
                   .slot_stride = head_dim,
                   .head_stride = block_size * head_dim,
                   .dim_stride = 1});
}

PagedKv PagedKv::SglangTokenPool(uint64_t region, int64_t keys_offset, int64_t values_offset,
                                 DType dtype, int64_t num_kv_heads, int64_t head_dim, int64_t n,
                                 uint32_t table) {
  const PagedRef layout = {.block_table = table,
                           .block_stride = num_kv_heads * head_dim,
                           .slot_stride = 0,
                           .head_stride = head_dim,
                           .dim_stride = 1};
  return {PagedTensor(region, keys_offset, dtype, {num_kv_heads, n, head_dim}, layout),
          PagedTensor(region, values_offset, dtype, {num_kv_heads, n, head_dim}, layout)};
}

SharedBuffer::SharedBuffer(SharedBuffer&& other) noexcept { *this = std::move(other); }

SharedBuffer& SharedBuffer::operator=(SharedBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    client_ = std::exchange(other.client_, nullptr);
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    region_id_ = std::exchange(other.region_id_, 0);
  }
  return *this;
}

SharedBuffer::~SharedBuffer() { Reset(); }

void SharedBuffer::Reset() {
  if (client_ != nullptr && region_id_ != 0) {
    // A busy server is retried for a while (the channel's retry policy); any other error ends
    // it (the server may be gone).
    client_->UnregisterRegion(region_id_).IgnoreError();
  }
  if (data_ != nullptr) {
    munmap(data_, size_);
    shm_unlink(("/" + name_).c_str());
  }
  client_ = nullptr;
  data_ = nullptr;
  region_id_ = 0;
}

absl::StatusOr<bool> CheckHealth(const std::string& target, const std::string& service,
                                 absl::Duration deadline) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  if (absl::Status s = FromGrpc(stub->Check(&context, request, &response)); !s.ok()) return s;
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace laprox::client
