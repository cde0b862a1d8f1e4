// liblaprox_client: talk to laproxd with domain types in and absl::StatusOr out.
//
// An engine connects once, shares its buffers once (POSIX shared memory created here or by the
// engine), registers its model once, then calls ComputeKeepPlan at the end of every prefill with
// references into the shared buffers; no tensor is copied per call. No generated protobuf type
// appears in this header.
//
//   auto client = *laprox::client::Client::Connect(laprox::client::DefaultTarget());
//   auto kv = *client->ShareHostBuffer("laprox-kv-engine0", bytes);  // create + register
//   std::memcpy(kv.data(), ..., bytes);                                // or write in place
//   uint64_t model = *client->RegisterModel("smollm2", geometry, o_proj_refs);
//   absl::StatusOr<KeepPlan> plan = client->ComputeKeepPlan(model, n, layers, policy);
//
// Errors: the server's gRPC status comes back as the absl::Status of the same code and message
// (one conversion function, the client's seam). Every call carries a deadline (ClientOptions).
// Thread safety: a Client may be used from many threads at once.
#ifndef LAPROX_CLIENT_CLIENT_H_
#define LAPROX_CLIENT_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "laprox/client/cuda_export.h"
#include "laprox/kernels/geometry.h"
#include "laprox/kernels/keep_plan.h"
#include "laprox/kernels/policy.h"
#include "laprox/kernels/tensor_view.h"

namespace laprox::client {

using kernels::DType;
using kernels::KeepPlan;
using kernels::ModelGeometry;
using kernels::NumericMode;
using kernels::OutputOptions;
using kernels::PolicyKind;
using kernels::PolicySpec;

// Where ComputeKeepPlanInto writes a plan's outputs instead of the response: byte offsets into a
// region registered writable (on the server's CPU: shared memory; on its GPU: a cuda_ipc region,
// written on the device). An output whose offset is set is written there; positions, bitmask
// and scores are then left out of the returned plan (counts and offsets are always returned as
// well). The area must lie inside the region (OUT_OF_RANGE) and be aligned to its element size.
using kernels::OutputDestination;

// How a paged tensor lies in its block pool (laprox.v1 PagedLayout): element (h, i, c) of the
// logical [Hkv, n, d] tensor is at id * block_stride + (i % block_size) * slot_stride +
// h * head_stride + c * dim_stride elements from the reference's byte_offset (element 0 of
// physical block 0), with id = the named table's block_ids[i / block_size].
struct PagedRef {
  uint32_t block_table = 0;  // index into SequenceRequest::block_tables
  int64_t block_stride = 0, slot_stride = 0, head_stride = 0, dim_stride = 0;
};

// A tensor for the server: a slice of a registered region (no copy), or host bytes sent inline
// with the call (small tensors, tests). Keys and values may be paged (a region only).
struct TensorRef {
  uint64_t region_id = 0;           // registered region, or 0 with host_data
  int64_t byte_offset = 0;          // from the region start to element 0
  const void* host_data = nullptr;  // inline: extent * element size bytes, read during the call
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // elements; empty: contiguous
  std::optional<PagedRef> paged = std::nullopt;

  static TensorRef InRegion(uint64_t region, int64_t byte_offset, DType dtype,
                            std::vector<int64_t> shape, std::vector<int64_t> strides = {}) {
    return {region, byte_offset, nullptr, dtype, std::move(shape), std::move(strides)};
  }
  static TensorRef Inline(const void* data, DType dtype, std::vector<int64_t> shape,
                          std::vector<int64_t> strides = {}) {
    return {0, 0, data, dtype, std::move(shape), std::move(strides)};
  }
};

// One layer's inputs; give window_queries or window_attention (and window_lse only with queries).
struct LayerRefs {
  TensorRef keys, values;
  std::optional<TensorRef> window_queries, window_attention, window_lse;
};

// A sequence's block table (laprox.v1 BlockTable): the physical block of each logical block,
// exactly ceil(n / block_size) of them, sent in the call or read from a registered region.
struct BlockTableRef {
  std::vector<int32_t> block_ids;
  int64_t block_size = 0;
  bool allow_repeated_ids = false;
  // Instead of block_ids: `count` int32 ids at `byte_offset` of a registered host region (the
  // server copies them during the call).
  struct InRegion {
    uint64_t region_id = 0;
    int64_t byte_offset = 0;
    int64_t count = 0;
  };
  std::optional<InRegion> in_region = std::nullopt;
};

// The keys and values of one layer in an engine's paged KV cache, read in place through block
// table `table` (an index into SequenceRequest::block_tables). `pool_offset`: bytes from the
// region start to the pool's element 0; element sizes follow `dtype`.
struct PagedKv {
  TensorRef keys, values;

  // vLLM's FlashAttention layout [2, num_blocks, block_size, Hkv, d] (K pool, then V pool).
  static PagedKv VllmFlashAttention(uint64_t region, int64_t pool_offset, DType dtype,
                                    int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                                    int64_t head_dim, int64_t n, uint32_t table);
  // Head-major block interiors [2, num_blocks, Hkv, block_size, d] (vLLM's CPU attention).
  static PagedKv VllmHeadMajor(uint64_t region, int64_t pool_offset, DType dtype,
                               int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                               int64_t head_dim, int64_t n, uint32_t table);
  // SGLang's token pools [slots, Hkv, d], one for K and one for V (`values_offset` bytes from
  // the region start), read through a table of block size 1 holding the request's slots.
  static PagedKv SglangTokenPool(uint64_t region, int64_t keys_offset, int64_t values_offset,
                                 DType dtype, int64_t num_kv_heads, int64_t head_dim, int64_t n,
                                 uint32_t table);
};

// One layer of a decode re-plan's cache (laprox.proto, DecodeCacheLayer): the entries every KV
// head holds and each entry's token position, [Hkv, entries] row-major, strictly ascending
// along every head.
struct CacheLayer {
  int64_t entries = 0;
  std::vector<int32_t> positions;
};

// One sequence of a keep-plan call: its tensors, policy, outputs and block tables.
struct SequenceRequest {
  int64_t n = 0;
  std::vector<LayerRefs> layers;
  PolicySpec policy;
  OutputOptions outputs;
  std::optional<OutputDestination> destination;  // set: outputs written into that region
  std::vector<BlockTableRef> block_tables;       // named by paged keys and values
  // Set: a decode re-plan of the cache the engine holds (one per layer; layer l's keys and
  // values are [Hkv, entries, d], n the longest layer's entries). The plan's positions are then
  // the kept entries' token positions, its bitmask and scores index entries.
  std::optional<std::vector<CacheLayer>> cache;
};

struct ServerInfo {
  std::string version;
  std::string backend;  // "cpu" or "cuda"
  std::string backend_description;
  std::vector<PolicyKind> supported_policies;  // what ComputeKeepPlan accepts
  std::vector<std::string> device_uuids;       // GPUs the server sees, in ordinal order
  std::string active_device_uuid;              // the one the CUDA backend computes on, or ""
  bool cuda_ipc = false;                       // RegisterCudaIpcRegion is supported
  int64_t max_tokens = 0;
  int32_t max_regions = 0;
  int32_t max_models = 0;
  int64_t max_request_work = 0;    // work units one call may do (ServerLimits); 0: not reported
  int64_t heavy_request_work = 0;  // calls above it run on the server's heavy workers
};

// A POSIX shared-memory object this process created, mapped read-write, registered with the
// server. Destroying it unregisters the region (if the client is still alive), unmaps and
// unlinks the object. Move-only.
class SharedBuffer {
 public:
  SharedBuffer(SharedBuffer&& other) noexcept;
  SharedBuffer& operator=(SharedBuffer&& other) noexcept;
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;
  ~SharedBuffer();

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  uint64_t region_id() const { return region_id_; }

 private:
  friend class Client;
  SharedBuffer() = default;
  void Reset();

  class Client* client_ = nullptr;
  std::string name_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  uint64_t region_id_ = 0;
};

// laproxd's own account of one ComputeKeepPlan beside the compute (the response's Timing), in
// seconds. The compute's stages (validate, score, select) come in KeepPlan::timing. What the
// caller measured minus total_seconds is the transport: (de)serialization on both sides, the
// socket, and gRPC's thread hops.
struct ServerTiming {
  double queue_seconds = 0;    // waiting for a free worker
  double respond_seconds = 0;  // building the response, writing outputs into a region
  double total_seconds = 0;    // from the request's arrival in the handler to the response built
};

// Where laproxd listens when started without --socket: unix:$XDG_RUNTIME_DIR/laprox/laproxd.sock
// for a user other than root whose XDG_RUNTIME_DIR is an absolute path (its trailing slashes
// dropped), else unix:/run/laprox/laproxd.sock. laproxd and the Python client apply the same
// rule (proto/endpoint/laprox/v1/endpoint.h).
std::string DefaultTarget();

// TLS for a laproxd --listen with --tls_cert_file (PEM text, not file names).
struct TlsOptions {
  std::string root_certs_pem;   // the CA bundle that signed the server's certificate ("": the
                                // system roots)
  std::string cert_chain_pem;   // mutual TLS (--tls_client_ca_file): this client's chain
  std::string private_key_pem;  // and its key
};

struct ClientOptions {
  absl::Duration deadline = absl::Seconds(60);  // per call
  std::optional<TlsOptions> tls;                // set: a TLS channel; not set: plaintext
};

// TlsOptions from PEM files (any may be empty: not given). NOT_FOUND naming the file that
// cannot be read.
absl::StatusOr<TlsOptions> TlsOptionsFromFiles(const std::string& root_certs_file,
                                               const std::string& cert_chain_file,
                                               const std::string& private_key_file);

class Client {
 public:
  // `target` is a gRPC target: "unix:/run/laprox/laproxd.sock" or "127.0.0.1:50051". Connects
  // lazily; the first call reports UNAVAILABLE if nothing listens.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& target,
                                                         ClientOptions options = {});
  ~Client();

  absl::StatusOr<ServerInfo> GetServerInfo();

  // Registers an existing shared-memory object window (name starts with "laprox-").
  absl::StatusOr<uint64_t> RegisterShmRegion(const std::string& name, int64_t offset,
                                             int64_t byte_size, bool writable = false);
  // Registers device memory another call exported (ExportCudaBuffer in this process, or any
  // process on the server's machine); the server opens the handle once and reads in place.
  // The server's errors: UNIMPLEMENTED on a CPU server, NOT_FOUND for a device it does not see,
  // OUT_OF_RANGE past the allocation, INVALID_ARGUMENT for a malformed export.
  absl::StatusOr<uint64_t> RegisterCudaIpcRegion(const CudaIpcExport& region,
                                                 bool writable = false);
  // Waits until requests using the region finish. RESOURCE_EXHAUSTED (laproxd's control queue
  // is full) is retried by the channel, up to 5 attempts over about 5 s
  // (proto/laprox/v1/service_config.json); other statuses return at once.
  absl::Status UnregisterRegion(uint64_t region_id);

  // Creates the shared-memory object `name` (must not exist; "laprox-" prefix) of `bytes`
  // bytes, maps it, and registers it (`writable`: the server may write plans into it).
  // ALREADY_EXISTS, and the server's errors.
  absl::StatusOr<SharedBuffer> ShareHostBuffer(const std::string& name, size_t bytes,
                                               bool writable = false);

  // The model's id. `o_proj` holds each layer's [D, H*d] weight.
  absl::StatusOr<uint64_t> RegisterModel(const std::string& name, const ModelGeometry& geometry,
                                         absl::Span<const TensorRef> o_proj,
                                         bool cross_grams = false);
  absl::Status UnregisterModel(uint64_t model_id);

  // The keep-plan of one prefill under `policy`: LAPROX or a baseline (policy.kind; start from
  // PolicySpec::ForKind(kind) for that kind's defaults). Every option of `policy` is sent.
  // The plan's `timing` holds the server's compute stages; `server_timing`, when given, the rest
  // of the server's time.
  absl::StatusOr<KeepPlan> ComputeKeepPlan(uint64_t model_id, int64_t n,
                                           absl::Span<const LayerRefs> layers,
                                           const PolicySpec& policy,
                                           const OutputOptions& outputs = {},
                                           ServerTiming* server_timing = nullptr);
  // The keep-plan of one sequence described by `sequence` (paged keys and values, block
  // tables, a destination: everything a request can say).
  absl::StatusOr<KeepPlan> ComputeKeepPlan(uint64_t model_id, const SequenceRequest& sequence,
                                           ServerTiming* server_timing = nullptr);
  // The keep-plans of several sequences of one model in one call (ComputeKeepPlans): one plan
  // per sequence, each equal to its ComputeKeepPlan; all or nothing (the first failing sequence
  // fails the call, its message naming "sequences[i]"). `server_timing`: the whole call's.
  absl::StatusOr<std::vector<KeepPlan>> ComputeKeepPlans(
      uint64_t model_id, absl::Span<const SequenceRequest> sequences,
      ServerTiming* server_timing = nullptr);
  // The same plan with its outputs written into `destination` (an engine's own mask or index
  // buffer, with no copy through the response). Only the outputs `destination` has an offset
  // for are produced, and only there: the returned plan has counts, offsets and layer sums.
  // FAILED_PRECONDITION for a read-only region, OUT_OF_RANGE for an area past its end.
  absl::StatusOr<KeepPlan> ComputeKeepPlanInto(uint64_t model_id, int64_t n,
                                               absl::Span<const LayerRefs> layers,
                                               const PolicySpec& policy,
                                               const OutputDestination& destination,
                                               ServerTiming* server_timing = nullptr);

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Asks the standard grpc.health.v1 service at `target` about `service` ("" is the server as a
// whole; laproxd reports "laprox.v1.Laprox" SERVING only while a model is registered): true for
// SERVING, false otherwise. NOT_FOUND for a service the server does not know; UNAVAILABLE or
// DEADLINE_EXCEEDED when nothing answers in time.
absl::StatusOr<bool> CheckHealth(const std::string& target, const std::string& service = "",
                                 absl::Duration deadline = absl::Seconds(5));

}  // namespace laprox::client

#endif  // LAPROX_CLIENT_CLIENT_H_
