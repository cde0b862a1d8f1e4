// What the fuzz targets share: the shared-memory objects of fuzz_world.h, a Core on the real CPU
// backend with laproxd's default limits, checks that turn a broken contract into a crash, and a
// structure-aware mutator for serialized protos (Debian has no libprotobuf-mutator).
//
// Set-up failures (no /dev/shm, no CPU backend) abort: the harness cannot run without them. A
// contract violation found while fuzzing calls Fail(), which prints and traps, so libFuzzer
// saves the input as a crash.
#ifndef LAPROX_TESTS_FUZZ_FUZZ_SUPPORT_H_
#define LAPROX_TESTS_FUZZ_FUZZ_SUPPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <google/protobuf/message.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "service/core/core.h"

namespace laprox::fuzz {

// Call first in LLVMFuzzerInitialize: silences protobuf's logging (every invalid UTF-8 string a
// mutation makes would print a line).
void SetUpHarness();

// A POSIX shared-memory object "laprox-fuzz-<pid><suffix>" of `bytes` bytes, created (mode 0600)
// and mapped read-write for the harness; unlinked when destroyed, or by Unlink().
class ShmObject {
 public:
  ShmObject(const std::string& suffix, int64_t bytes);
  ~ShmObject();
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;

  const std::string& name() const { return name_; }
  std::byte* data() const { return data_; }
  int64_t size() const { return size_; }
  // Removes the name; the mappings (the harness's and the server's) stay valid.
  void Unlink();

 private:
  std::string name_;
  std::byte* data_ = nullptr;
  int64_t size_ = 0;
  bool linked_ = false;
};

// Fills an input object with the sections fuzz_world.h describes (fixed seed).
void FillInputObject(ShmObject& object);

// The input object, created and filled on first use and unlinked at exit. Leaked on purpose:
// regions registered on it must outlive every static destructor.
ShmObject& InputObject();

// A Core on the CPU backend (kernels::CreateBackend) with default CoreLimits, which are
// laproxd's flag defaults. Aborts if the backend cannot be created.
std::unique_ptr<service::Core> NewCore();

// Registers InputObject() read-only (expects id kInputRegionId); when `output` is not null, also
// `output` writable (expects kOutputRegionId). Aborts on failure.
void RegisterWorldRegions(service::Core& core, const ShmObject* output);

// Registers fuzz_world.h's kModels with inline o_proj bytes (expects ids 1, 2, ... in order).
// Aborts on failure.
void RegisterWorldModels(service::Core& core);

// The world of the keep-plan targets, set up once in LLVMFuzzerInitialize: a NewCore() with
// InputObject() and an output object registered as regions and the models registered, every
// shm name unlinked (the mappings stay). Both are leaked on purpose, like InputObject().
struct ComputeWorld {
  service::Core* core = nullptr;
  ShmObject* output = nullptr;
};
ComputeWorld SetUpComputeWorld();

// `name` with every kSelfShmName replaced by InputObject().name().
std::string ResolveShmName(absl::string_view name);

// With LAPROX_FUZZ_VERBOSE=1 in the environment, prints `what` (what the server answered to
// this input): for replaying seeds and crash files. Otherwise nothing.
void Note(absl::string_view what);

// Checks `plan`, computed for `call` on a model of fuzz_world.h's kModels, against what
// laprox.proto promises (counts, offsets, positions, bitmask and scores agree; LAPROX keeps the
// window and the sinks; block plans keep whole blocks; finite layer sums). Fail() otherwise.
// LAPROX_FUZZ_ALLOW_NONFINITE=1 in the environment lets non-finite layer sums and NaN scores
// pass (to fuzz on while such a finding is being fixed).
void CheckPlan(const kernels::KeepPlan& plan, const service::KeepPlanCall& call);

// Prints `what` and traps: a finding.
[[noreturn]] void Fail(absl::string_view what);

// A request was refused: it must say why with a code a client can act on. INTERNAL and UNKNOWN
// are findings (docs/style.md: INTERNAL is a broken invariant or a CUDA failure, and the CPU
// backend has no CUDA), as is an empty message or OK passed as an error.
void CheckRefusal(const absl::Status& status, absl::string_view call);

// libFuzzer's LLVMFuzzerCustomMutator for inputs that are serialized `prototype` messages: most
// of the time the input is parsed, one to three fields somewhere in the message tree are
// changed (interesting integers and floats, one integer set to another's value or to a product
// of two, enum values in and out of range, strings and bytes through libFuzzer's byte mutator,
// repeated fields grown and shrunk, sub-messages set and cleared, and for laprox.v1.TensorRef:
// inline bytes resized to match shape and strides, or the reference pointed into a world
// region), and the result is serialized again; otherwise, or if the input does not parse,
// libFuzzer's own byte mutator runs.
size_t MutateSerializedProto(const google::protobuf::Message& prototype, uint8_t* data, size_t size,
                             size_t max_size, unsigned int seed);

}  // namespace laprox::fuzz

#endif  // LAPROX_TESTS_FUZZ_FUZZ_SUPPORT_H_
