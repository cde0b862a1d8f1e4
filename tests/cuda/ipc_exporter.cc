// ipc_exporter: the engine's side of tests/cuda/ipc_test.cc, in its own process (CUDA IPC
// handles cannot be opened by the process that exported them, and CUDA does not survive fork,
// so the test fork+execs this binary). Device memory comes from the client library
// (DeviceAllocation, ExportCudaBuffer), the code an engine would use.
//
//   ipc_exporter SEED
//
// Puts ipc_sample.h's sample for SEED in two device allocations (KV at kKvPad bytes into the
// first, the window queries at the start of the second), adds a third for plans the server
// writes (kOutBytes of 0xee), exports all three with the client library's ExportCudaBuffer and
// prints, on stdout, one line per region and then "ready":
//   region kv|queries|out HANDLE_HEX DEVICE_UUID OFFSET BYTE_SIZE ALLOCATION_BYTES
// It then keeps the memory alive until stdin reaches EOF or a line "exit", and exits 0. A line
// "dump OFFSET BYTES" is answered with "data HEX", the bytes of the out region read back now.
// Any failure: a line "error MESSAGE" and exit 1.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "laprox/client/cuda_export.h"
#include "tests/cuda/ipc_sample.h"

namespace {

int Fail(const std::string& message) {
  std::printf("error %s\n", message.c_str());
  std::fflush(stdout);
  return 1;
}

bool Print(const char* name, const laprox::client::CudaIpcExport& e, size_t allocation) {
  std::printf("region %s %s %s %lld %lld %zu\n", name, absl::BytesToHexString(e.handle).c_str(),
              e.device_uuid.c_str(), static_cast<long long>(e.offset),
              static_cast<long long>(e.byte_size), allocation);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace laprox::ipc_test;
  if (argc != 2) return Fail("usage: ipc_exporter SEED");
  const auto seed = static_cast<uint32_t>(std::strtoul(argv[1], nullptr, 10));
  const Sample sample = MakeSample(seed);

  const size_t kv_bytes = sample.kv.size() * sizeof(uint16_t);
  // cudaMalloc may sub-allocate small sizes from a larger block, and IPC then shares (and the
  // importer's address-range query reports) the whole block. A 2 MiB multiple is never
  // sub-allocated, so the KV allocation's size is exactly what the importer sees and the
  // OUT_OF_RANGE cases of ipc_test are exact. (The queries' allocation stays small and so
  // exercises a possibly sub-allocated export.)
  constexpr size_t kTwoMiB = size_t{2} << 20;
  const size_t kv_allocation = (kKvPad + kv_bytes + kTwoMiB - 1) / kTwoMiB * kTwoMiB;
  const size_t q_bytes = sample.queries.size() * sizeof(uint16_t);
  auto kv = laprox::client::DeviceAllocation::Allocate(kv_allocation);
  if (!kv.ok()) return Fail(kv.status().ToString());
  auto q = laprox::client::DeviceAllocation::Allocate(q_bytes);
  if (!q.ok()) return Fail(q.status().ToString());
  if (absl::Status s = kv->CopyFromHost(kKvPad, sample.kv.data(), kv_bytes); !s.ok()) {
    return Fail(s.ToString());
  }
  if (absl::Status s = q->CopyFromHost(0, sample.queries.data(), q_bytes); !s.ok()) {
    return Fail(s.ToString());
  }
  // The KV tensor's pointer, not the allocation's: ExportCudaBuffer finds base and offset.
  auto kv_export = laprox::client::ExportCudaBuffer(
      static_cast<const std::byte*>(kv->data()) + kKvPad, static_cast<int64_t>(kv_bytes));
  if (!kv_export.ok()) return Fail(kv_export.status().ToString());
  if (kv_export->offset != kKvPad) return Fail("ExportCudaBuffer found the wrong offset");
  auto q_export = laprox::client::ExportCudaBuffer(q->data(), static_cast<int64_t>(q_bytes));
  if (!q_export.ok()) return Fail(q_export.status().ToString());
  auto out = laprox::client::DeviceAllocation::Allocate(kOutBytes);
  if (!out.ok()) return Fail(out.status().ToString());
  const std::vector<unsigned char> fill(kOutBytes, 0xee);
  if (absl::Status s = out->CopyFromHost(0, fill.data(), kOutBytes); !s.ok()) {
    return Fail(s.ToString());
  }
  auto out_export = laprox::client::ExportCudaBuffer(out->data(), static_cast<int64_t>(kOutBytes));
  if (!out_export.ok()) return Fail(out_export.status().ToString());
  Print("kv", *kv_export, kv_allocation);
  Print("queries", *q_export, q_bytes);
  Print("out", *out_export, kOutBytes);
  std::printf("ready\n");
  std::fflush(stdout);

  char line[64];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    if (std::string(line).rfind("exit", 0) == 0) break;
    long long offset = 0, bytes = 0;
    if (std::sscanf(line, "dump %lld %lld", &offset, &bytes) == 2) {
      std::string data(bytes > 0 ? static_cast<size_t>(bytes) : 0, '\0');
      if (absl::Status s = out->CopyToHost(static_cast<size_t>(offset), data.data(), data.size());
          !s.ok()) {
        return Fail(s.ToString());
      }
      std::printf("data %s\n", absl::BytesToHexString(data).c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}
