#include "tests/fuzz/fuzz_support.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/stubs/logging.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "kernels/common/half.h"
#include "service/server.h"
#include "tests/fuzz/fuzz_world.h"

// libFuzzer's byte-level mutator (linked in by -fsanitize=fuzzer).
extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

// UBSan is compiled recoverable (cmake/LaproxFuzz.cmake); by default every report still ends the
// run, so libFuzzer saves the input. UBSAN_OPTIONS overrides these.
extern "C" const char* __ubsan_default_options() {  // NOLINT(bugprone-reserved-identifier)
  return "halt_on_error=1:print_stacktrace=1";
}

namespace laprox::fuzz {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

[[noreturn]] void SetupFailed(absl::string_view what) {
  std::fprintf(stderr, "fuzz set-up failed: %.*s\n", static_cast<int>(what.size()), what.data());
  std::abort();
}

}  // namespace

void SetUpHarness() { google::protobuf::SetLogHandler(nullptr); }

ShmObject::ShmObject(const std::string& suffix, int64_t bytes)
    : name_(absl::StrCat("laprox-fuzz-", getpid(), suffix)), size_(bytes) {
  const std::string path = "/" + name_;
  // O_TRUNC: a stale object of a crashed process with the same pid is reused.
  const int fd = shm_open(path.c_str(), O_CREAT | O_TRUNC | O_RDWR, 0600);
  if (fd < 0) SetupFailed(absl::StrCat("shm_open(", path, "): ", std::strerror(errno)));
  linked_ = true;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    SetupFailed(absl::StrCat("ftruncate(", path, "): ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) SetupFailed(absl::StrCat("mmap(", path, "): ", std::strerror(errno)));
  data_ = static_cast<std::byte*>(p);
}

ShmObject::~ShmObject() {
  Unlink();
  munmap(data_, static_cast<size_t>(size_));
}

void ShmObject::Unlink() {
  if (linked_) shm_unlink(("/" + name_).c_str());
  linked_ = false;
}

void FillInputObject(ShmObject& object) {
  if (object.size() < kInputBytes) SetupFailed("the input object is too small");
  std::mt19937 rng(20);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto* f32 = reinterpret_cast<float*>(object.data() + kF32Offset);
  for (int64_t i = 0; i < kF32Bytes / 4; ++i) f32[i] = normal(rng);
  auto* f16 = reinterpret_cast<uint16_t*>(object.data() + kF16Offset);
  for (int64_t i = 0; i < kF16Bytes / 2; ++i) f16[i] = kernels::FloatToF16(normal(rng));
  auto* bf16 = reinterpret_cast<uint16_t*>(object.data() + kBf16Offset);
  for (int64_t i = 0; i < kBf16Bytes / 2; ++i) bf16[i] = kernels::FloatToBf16(normal(rng));
}

ShmObject& InputObject() {
  static ShmObject* const object = [] {
    auto* created = new ShmObject("", kInputBytes);
    FillInputObject(*created);
    // The name goes at exit; a crash leaves it for scripts/fuzz.sh to remove.
    std::atexit([] { InputObject().Unlink(); });
    return created;
  }();
  return *object;
}

std::unique_ptr<service::Core> NewCore() {
  // laproxd's Core with its default limits, built as laproxd builds it, on the CPU backend.
  service::ServerOptions options;
  options.backend = "cpu";
  auto core = service::BuildCore(options);
  if (!core.ok()) SetupFailed(core.status().ToString());
  return *std::move(core);
}

void RegisterWorldRegions(service::Core& core, const ShmObject* output) {
  auto input = core.regions().RegisterShm({.name = InputObject().name(),
                                           .offset = 0,
                                           .byte_size = InputObject().size(),
                                           .writable = false},
                                          service::Owner::Laproxd());
  if (!input.ok() || *input != kInputRegionId) {
    SetupFailed(absl::StrCat("input region: ", input.status().ToString()));
  }
  if (output == nullptr) return;
  auto out = core.regions().RegisterShm(
      {.name = output->name(), .offset = 0, .byte_size = output->size(), .writable = true},
      service::Owner::Laproxd());
  if (!out.ok() || *out != kOutputRegionId) {
    SetupFailed(absl::StrCat("output region: ", out.status().ToString()));
  }
}

void RegisterWorldModels(service::Core& core) {
  for (int m = 0; m < kNumModels; ++m) {
    const FuzzModel& g = kModels[m];
    const int64_t columns = int64_t{g.num_heads} * g.head_dim;
    std::vector<std::vector<float>> weights(g.num_layers);
    service::ModelSpec spec;
    spec.name = absl::StrCat("fuzz-", m + 1);
    spec.geometry = {.num_layers = g.num_layers,
                     .num_heads = g.num_heads,
                     .num_kv_heads = g.num_kv_heads,
                     .head_dim = g.head_dim,
                     .hidden_size = g.hidden_size,
                     .softmax_scale = g.softmax_scale};
    spec.cross_grams = g.cross_grams;
    for (int l = 0; l < g.num_layers; ++l) {
      std::vector<float>& w = weights[l];
      w.resize(g.hidden_size * columns);
      for (int64_t r = 0; r < g.hidden_size; ++r) {
        for (int64_t c = 0; c < columns; ++c) w[r * columns + c] = OProjValue(m, l, r, c);
      }
      service::TensorRef& ref = spec.o_proj.emplace_back();
      ref.source = service::TensorRef::Source::kInline;
      ref.inline_bytes = absl::string_view(reinterpret_cast<const char*>(w.data()), w.size() * 4);
      ref.dtype = kernels::DType::kF32;
      ref.shape = {g.hidden_size, columns};
    }
    auto info = core.RegisterModel(spec, service::Owner::Laproxd());
    if (!info.ok() || info->id != static_cast<uint64_t>(m) + 1) {
      SetupFailed(absl::StrCat("model ", m + 1, ": ", info.status().ToString()));
    }
  }
}

std::string ResolveShmName(absl::string_view name) {
  return absl::StrReplaceAll(name, {{kSelfShmName, InputObject().name()}});
}

void Note(absl::string_view what) {
  static const bool verbose = [] {
    const char* v = std::getenv("LAPROX_FUZZ_VERBOSE");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  if (verbose) {
    std::fprintf(stderr, "laprox fuzz: %.*s\n", static_cast<int>(what.size()), what.data());
  }
}

void Fail(absl::string_view what) {
  std::fprintf(stderr, "\n==== laprox fuzz finding: %.*s\n", static_cast<int>(what.size()),
               what.data());
  std::fflush(stderr);
  __builtin_trap();
}

void CheckRefusal(const absl::Status& status, absl::string_view call) {
  Note(absl::StrCat(call, ": ", status.ToString()));
  if (status.ok()) Fail(absl::StrCat(call, ": OK passed as a refusal"));
  if (status.code() == absl::StatusCode::kInternal || status.code() == absl::StatusCode::kUnknown) {
    Fail(absl::StrCat(call, " answered ", status.ToString()));
  }
  if (status.message().empty()) Fail(absl::StrCat(call, ": ", status.ToString(), " says nothing"));
}

// ---------------------------------------------------------------------------------------------
// The proto mutator.

namespace {

using Rng = std::minstd_rand;

uint64_t Below(Rng& rng, uint64_t n) { return n == 0 ? 0 : rng() % n; }

int64_t MutateInteger(int64_t value, Rng& rng) {
  // Sizes around the limits (window 4096, pool 1025, 2^16 head_dim, 2^20 tokens, 2^31, 2^32).
  static constexpr int64_t kInteresting[] = {
      0,     1,       -1,      2,          3,          4,          7,          8,          16,
      31,    32,      33,      63,         64,         65,         127,        128,        255,
      256,   1023,    1024,    1025,       4095,       4096,       4097,       65535,      65536,
      65537, 1048576, 1048577, 1073741824, 2147483647, 2147483648, 4294967296, -2147483648};
  // Unsigned arithmetic: wrapping is wanted here, and signed overflow would be UB in the harness.
  const auto u = static_cast<uint64_t>(value);
  switch (Below(rng, 9)) {
    case 0:
      return static_cast<int64_t>(u + 1);
    case 1:
      return static_cast<int64_t>(u - 1);
    case 2:
      return static_cast<int64_t>(u * 2);
    case 3:
      return value / 2;
    case 4:
      return static_cast<int64_t>(Below(rng, 65));
    case 5:
      return static_cast<int64_t>(u ^ (uint64_t{1} << Below(rng, 64)));
    case 6:
      return Below(rng, 2) == 0 ? std::numeric_limits<int64_t>::max()
                                : std::numeric_limits<int64_t>::min();
    default:
      return kInteresting[Below(rng, std::size(kInteresting))];
  }
}

double MutateFloating(double value, Rng& rng) {
  // fp32 max, fp64 max and the smallest fp64 denormal among them.
  static constexpr double kInteresting[] = {0.0,
                                            -0.0,
                                            1.0,
                                            -1.0,
                                            0.5,
                                            0.2,
                                            1e-4,
                                            1e-45,
                                            1e-20,
                                            1e20,
                                            3e38,
                                            3.4028234663852886e38,
                                            -3.4028234663852886e38,
                                            1.7976931348623157e308,
                                            4.9406564584124654e-324,
                                            INFINITY,
                                            -INFINITY,
                                            NAN};
  switch (Below(rng, 5)) {
    case 0:
      return value * 2;
    case 1:
      return -value;
    case 2:
      return std::uniform_real_distribution<double>(-4.0, 4.0)(rng);
    default:
      return kInteresting[Below(rng, std::size(kInteresting))];
  }
}

std::string MutateBytes(const std::string& value, Rng& rng) {
  static constexpr const char* kTokens[] = {kSelfShmName,
                                            "/laprox-fuzz-self",
                                            "laprox-",
                                            "laprox-fuzz-self.x",
                                            "GPU-00112233-4455-6677-8899-aabbccddeeff",
                                            "00112233-4455-6677-8899-AABBCCDDEEFF",
                                            "127.0.0.1:0",
                                            "[::1]:0",
                                            ":0",
                                            "localhost:0"};
  switch (Below(rng, 6)) {
    case 0:
      return kTokens[Below(rng, std::size(kTokens))];
    case 1:
      return value.substr(0, Below(rng, value.size() + 1));
    case 2:
      return value + value;
    default: {
      const size_t max_size = std::max<size_t>(2 * value.size(), 64);
      std::string buffer = value;
      buffer.resize(max_size);
      const size_t n =
          LLVMFuzzerMutate(reinterpret_cast<uint8_t*>(buffer.data()), value.size(), max_size);
      buffer.resize(n);
      return buffer;
    }
  }
}

// The element size a laprox.v1.TensorRef's dtype names (4 when it names none).
int64_t ElementBytes(const Message& tensor) {
  const FieldDescriptor* dtype = tensor.GetDescriptor()->FindFieldByName("dtype");
  const int value = tensor.GetReflection()->GetEnumValue(tensor, dtype);
  return value == 2 || value == 3 ? 2 : 4;
}

// Resizes the inline bytes of a laprox.v1.TensorRef to the extent its shape and strides give
// (when that is small), appending finite values of its dtype.
void FitInlineBytes(Message& tensor, Rng& rng) {
  const Descriptor* d = tensor.GetDescriptor();
  const Reflection* r = tensor.GetReflection();
  const FieldDescriptor* shape_field = d->FindFieldByName("shape");
  const FieldDescriptor* strides_field = d->FindFieldByName("strides");
  const FieldDescriptor* bytes_field = d->FindFieldByName("inline_bytes");
  const int rank = r->FieldSize(tensor, shape_field);
  std::vector<int64_t> shape(rank), strides(rank);
  for (int i = 0; i < rank; ++i) shape[i] = r->GetRepeatedInt64(tensor, shape_field, i);
  if (r->FieldSize(tensor, strides_field) == rank) {
    for (int i = 0; i < rank; ++i) strides[i] = r->GetRepeatedInt64(tensor, strides_field, i);
  } else {
    int64_t stride = 1;
    for (int i = rank - 1; i >= 0; --i) {
      strides[i] = stride;
      if (shape[i] < 0 || __builtin_mul_overflow(stride, shape[i], &stride)) return;
    }
  }
  constexpr int64_t kMaxElements = int64_t{1} << 16;
  int64_t extent = 1;
  for (int i = 0; i < rank; ++i) {
    if (shape[i] == 0) extent = 0;
    if (shape[i] < 0 || strides[i] < 0) return;
  }
  for (int i = 0; i < rank && extent > 0; ++i) {
    int64_t span;
    if (__builtin_mul_overflow(shape[i] - 1, strides[i], &span) ||
        __builtin_add_overflow(extent, span, &extent) || extent > kMaxElements) {
      return;
    }
  }
  const int dtype = r->GetEnumValue(tensor, d->FindFieldByName("dtype"));
  const int64_t element = ElementBytes(tensor);
  std::string bytes = r->GetString(tensor, bytes_field);
  const size_t old_size = bytes.size();
  bytes.resize(static_cast<size_t>(extent * element));
  std::normal_distribution<float> normal(0.f, 1.f);
  for (size_t at = old_size - old_size % element; at + element <= bytes.size(); at += element) {
    const float x = normal(rng);
    if (element == 4) {
      std::memcpy(bytes.data() + at, &x, 4);
    } else {
      const uint16_t h = dtype == 3 ? kernels::FloatToBf16(x) : kernels::FloatToF16(x);
      std::memcpy(bytes.data() + at, &h, 2);
    }
  }
  r->SetString(&tensor, bytes_field, std::move(bytes));
}

// Points a laprox.v1.TensorRef at the world section of its dtype (or the output region).
void PointAtRegion(Message& tensor, Rng& rng) {
  const Descriptor* d = tensor.GetDescriptor();
  const Reflection* r = tensor.GetReflection();
  Message* slice = r->MutableMessage(&tensor, d->FindFieldByName("region"));
  const Descriptor* sd = slice->GetDescriptor();
  const bool output = Below(rng, 8) == 0;
  const int dtype = r->GetEnumValue(tensor, d->FindFieldByName("dtype"));
  const int64_t element = ElementBytes(tensor);
  const int64_t base = output ? 0 : dtype == 2 ? kF16Offset : dtype == 3 ? kBf16Offset : kF32Offset;
  slice->GetReflection()->SetUInt64(slice, sd->FindFieldByName("region_id"),
                                    output ? kOutputRegionId : kInputRegionId);
  slice->GetReflection()->SetInt64(slice, sd->FindFieldByName("byte_offset"),
                                   base + static_cast<int64_t>(Below(rng, 4096)) * element);
}

// One place in the message tree a mutation can happen.
struct Site {
  Message* message;
  const FieldDescriptor* field;  // nullptr: a whole-TensorRef operation
  int index;                     // element of a repeated scalar field, or -1
};

void CollectSites(Message& message, int depth, std::vector<Site>& sites) {
  const Descriptor* d = message.GetDescriptor();
  const Reflection* r = message.GetReflection();
  if (d->full_name() == "laprox.v1.TensorRef") sites.push_back({&message, nullptr, -1});
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    sites.push_back({&message, f, -1});
    if (f->is_repeated()) {
      const int size = r->FieldSize(message, f);
      for (int j = 0; j < size; ++j) {
        if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) {
          sites.push_back({&message, f, j});
        } else if (depth < 8) {
          CollectSites(*r->MutableRepeatedMessage(&message, f, j), depth + 1, sites);
        }
      }
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && r->HasField(message, f) &&
               depth < 8) {
      CollectSites(*r->MutableMessage(&message, f), depth + 1, sites);
    }
  }
}

int MutateEnum(const FieldDescriptor* f, Rng& rng) {
  const auto* type = f->enum_type();
  if (Below(rng, 4) != 0) {
    return type->value(static_cast<int>(Below(rng, type->value_count())))->number();
  }
  static constexpr int kOutOfRange[] = {-1, 9, 100, std::numeric_limits<int32_t>::min()};
  return kOutOfRange[Below(rng, std::size(kOutOfRange))];
}

// Sets singular scalar `f` of `m` (or element `index` of a repeated one) to a mutated value.
void MutateScalar(Message& m, const FieldDescriptor* f, int index, Rng& rng) {
  const Reflection* r = m.GetReflection();
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: {
      const int32_t v = rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f);
      const auto x = static_cast<int32_t>(MutateInteger(v, rng));
      rep ? r->SetRepeatedInt32(&m, f, index, x) : r->SetInt32(&m, f, x);
      break;
    }
    case FieldDescriptor::CPPTYPE_INT64: {
      const int64_t v = rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f);
      const int64_t x = MutateInteger(v, rng);
      rep ? r->SetRepeatedInt64(&m, f, index, x) : r->SetInt64(&m, f, x);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT32: {
      const uint32_t v = rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f);
      const auto x = static_cast<uint32_t>(MutateInteger(v, rng));
      rep ? r->SetRepeatedUInt32(&m, f, index, x) : r->SetUInt32(&m, f, x);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT64: {
      const uint64_t v = rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f);
      const auto x = static_cast<uint64_t>(MutateInteger(static_cast<int64_t>(v), rng));
      rep ? r->SetRepeatedUInt64(&m, f, index, x) : r->SetUInt64(&m, f, x);
      break;
    }
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      const double v = rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f);
      const double x = MutateFloating(v, rng);
      rep ? r->SetRepeatedDouble(&m, f, index, x) : r->SetDouble(&m, f, x);
      break;
    }
    case FieldDescriptor::CPPTYPE_FLOAT: {
      const float v = rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f);
      const auto x = static_cast<float>(MutateFloating(v, rng));
      rep ? r->SetRepeatedFloat(&m, f, index, x) : r->SetFloat(&m, f, x);
      break;
    }
    case FieldDescriptor::CPPTYPE_BOOL: {
      const bool v = rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f);
      rep ? r->SetRepeatedBool(&m, f, index, !v) : r->SetBool(&m, f, !v);
      break;
    }
    case FieldDescriptor::CPPTYPE_ENUM: {
      const int x = MutateEnum(f, rng);
      rep ? r->SetRepeatedEnumValue(&m, f, index, x) : r->SetEnumValue(&m, f, x);
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string v = rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
      std::string x = MutateBytes(v, rng);
      // proto3 `string` fields must be UTF-8 (else the message does not parse); ASCII is.
      if (f->type() == FieldDescriptor::TYPE_STRING) {
        for (char& c : x) c = static_cast<char>(c & 0x7f);
      }
      rep ? r->SetRepeatedString(&m, f, index, std::move(x)) : r->SetString(&m, f, std::move(x));
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
}

// Grows, shrinks or clears repeated field `f` of `m`.
void MutateRepeated(Message& m, const FieldDescriptor* f, Rng& rng) {
  const Reflection* r = m.GetReflection();
  const int size = r->FieldSize(m, f);
  const uint64_t op = Below(rng, 8);
  if (op == 0) {
    r->ClearField(&m, f);
  } else if (op <= 2 && size > 0) {
    r->SwapElements(&m, f, static_cast<int>(Below(rng, size)), size - 1);
    r->RemoveLast(&m, f);
  } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    Message* added = r->AddMessage(&m, f);
    if (size > 0 && Below(rng, 4) != 0) {
      added->CopyFrom(r->GetRepeatedMessage(m, f, static_cast<int>(Below(rng, size))));
    }
  } else if (size > 0 && Below(rng, 2) == 0) {
    // Duplicate an element (then it can be mutated on its own).
    const int from = static_cast<int>(Below(rng, size));
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        r->AddInt32(&m, f, r->GetRepeatedInt32(m, f, from));
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        r->AddInt64(&m, f, r->GetRepeatedInt64(m, f, from));
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        r->AddUInt32(&m, f, r->GetRepeatedUInt32(m, f, from));
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        r->AddUInt64(&m, f, r->GetRepeatedUInt64(m, f, from));
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        r->AddDouble(&m, f, r->GetRepeatedDouble(m, f, from));
        break;
      case FieldDescriptor::CPPTYPE_FLOAT:
        r->AddFloat(&m, f, r->GetRepeatedFloat(m, f, from));
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        r->AddBool(&m, f, r->GetRepeatedBool(m, f, from));
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        r->AddEnumValue(&m, f, r->GetRepeatedEnumValue(m, f, from));
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        r->AddString(&m, f, r->GetRepeatedString(m, f, from));
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        break;
    }
  } else {
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        r->AddInt32(&m, f, static_cast<int32_t>(MutateInteger(1, rng)));
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        r->AddInt64(&m, f, MutateInteger(1, rng));
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        r->AddUInt32(&m, f, static_cast<uint32_t>(MutateInteger(1, rng)));
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        r->AddUInt64(&m, f, static_cast<uint64_t>(MutateInteger(1, rng)));
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        r->AddDouble(&m, f, MutateFloating(1.0, rng));
        break;
      case FieldDescriptor::CPPTYPE_FLOAT:
        r->AddFloat(&m, f, static_cast<float>(MutateFloating(1.0, rng)));
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        r->AddBool(&m, f, true);
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        r->AddEnumValue(&m, f, MutateEnum(f, rng));
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        r->AddString(&m, f, MutateBytes("", rng));
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        break;
    }
  }
}

bool IsInteger(const FieldDescriptor* f) {
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
    case FieldDescriptor::CPPTYPE_INT64:
    case FieldDescriptor::CPPTYPE_UINT32:
    case FieldDescriptor::CPPTYPE_UINT64:
      return true;
    default:
      return false;
  }
}

// The value of integer site `s` (a singular field, or element s.index of a repeated one).
int64_t GetInteger(const Site& s) {
  const Message& m = *s.message;
  const Reflection* r = m.GetReflection();
  const bool rep = s.index >= 0;
  switch (s.field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return rep ? r->GetRepeatedInt32(m, s.field, s.index) : r->GetInt32(m, s.field);
    case FieldDescriptor::CPPTYPE_INT64:
      return rep ? r->GetRepeatedInt64(m, s.field, s.index) : r->GetInt64(m, s.field);
    case FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r->GetRepeatedUInt32(m, s.field, s.index) : r->GetUInt32(m, s.field);
    case FieldDescriptor::CPPTYPE_UINT64:
      return static_cast<int64_t>(rep ? r->GetRepeatedUInt64(m, s.field, s.index)
                                      : r->GetUInt64(m, s.field));
    default:
      return 0;
  }
}

void SetInteger(const Site& s, int64_t value) {
  Message* m = s.message;
  const Reflection* r = m->GetReflection();
  const bool rep = s.index >= 0;
  switch (s.field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: {
      const auto x = static_cast<int32_t>(value);
      rep ? r->SetRepeatedInt32(m, s.field, s.index, x) : r->SetInt32(m, s.field, x);
      break;
    }
    case FieldDescriptor::CPPTYPE_INT64:
      rep ? r->SetRepeatedInt64(m, s.field, s.index, value) : r->SetInt64(m, s.field, value);
      break;
    case FieldDescriptor::CPPTYPE_UINT32: {
      const auto x = static_cast<uint32_t>(value);
      rep ? r->SetRepeatedUInt32(m, s.field, s.index, x) : r->SetUInt32(m, s.field, x);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT64: {
      const auto x = static_cast<uint64_t>(value);
      rep ? r->SetRepeatedUInt64(m, s.field, s.index, x) : r->SetUInt64(m, s.field, x);
      break;
    }
    default:
      break;
  }
}

// Sets one integer to another's value, or to the product of two: shapes must agree with n and
// the model's geometry (keys [Hkv, n, d], o_proj [D, H * d]), which single-field changes rarely
// achieve.
void CopyInteger(const std::vector<Site>& sites, Rng& rng) {
  std::vector<Site> integers;
  for (const Site& s : sites) {
    if (s.field != nullptr && IsInteger(s.field) && (s.index >= 0 || !s.field->is_repeated())) {
      integers.push_back(s);
    }
  }
  if (integers.size() < 2) return;
  const Site& to = integers[Below(rng, integers.size())];
  auto value = static_cast<uint64_t>(GetInteger(integers[Below(rng, integers.size())]));
  if (Below(rng, 3) == 0) {
    value *= static_cast<uint64_t>(GetInteger(integers[Below(rng, integers.size())]));
  }
  SetInteger(to, static_cast<int64_t>(value));
}

void MutateOnce(Message& root, Rng& rng) {
  std::vector<Site> sites;
  CollectSites(root, 0, sites);
  if (sites.empty()) return;
  if (Below(rng, 5) == 0) {
    CopyInteger(sites, rng);
    return;
  }
  const Site site = sites[Below(rng, sites.size())];
  Message& m = *site.message;
  const Reflection* r = m.GetReflection();
  if (site.field == nullptr) {  // a laprox.v1.TensorRef as a whole
    if (Below(rng, 2) == 0) {
      FitInlineBytes(m, rng);
    } else {
      PointAtRegion(m, rng);
    }
    return;
  }
  const FieldDescriptor* f = site.field;
  if (site.index >= 0) {
    MutateScalar(m, f, site.index, rng);
  } else if (f->is_repeated()) {
    MutateRepeated(m, f, rng);
  } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    if (r->HasField(m, f) && Below(rng, 2) == 0) {
      r->ClearField(&m, f);
    } else {
      r->MutableMessage(&m, f);  // set (possibly empty; a oneof switches to it)
    }
  } else if (f->has_presence() && r->HasField(m, f) && Below(rng, 6) == 0) {
    r->ClearField(&m, f);
  } else {
    MutateScalar(m, f, -1, rng);
  }
}

}  // namespace

size_t MutateSerializedProto(const Message& prototype, uint8_t* data, size_t size, size_t max_size,
                             unsigned int seed) {
  Rng rng(seed);
  if (Below(rng, 5) == 0) return LLVMFuzzerMutate(data, size, max_size);
  std::unique_ptr<Message> message(prototype.New());
  if (!message->ParseFromArray(data, static_cast<int>(size))) {
    return LLVMFuzzerMutate(data, size, max_size);
  }
  const uint64_t count = 1 + Below(rng, 3);
  for (uint64_t i = 0; i < count; ++i) MutateOnce(*message, rng);
  std::string out;
  if (!message->SerializeToString(&out) || out.size() > max_size) {
    return LLVMFuzzerMutate(data, size, max_size);
  }
  std::copy(out.begin(), out.end(), data);
  return out.size();
}

ComputeWorld SetUpComputeWorld() {
  ComputeWorld world;
  world.core = NewCore().release();
  world.output = new ShmObject("-out", kOutputBytes);
  RegisterWorldRegions(*world.core, world.output);
  RegisterWorldModels(*world.core);
  // Registered regions stay mapped; nothing needs the names any more, so a crash leaves none.
  InputObject().Unlink();
  world.output->Unlink();
  return world;
}

namespace {

// LAPROX_FUZZ_ALLOW_NONFINITE=1: non-finite layer sums and NaN scores are not findings (to fuzz
// on while such a finding is being fixed; tests/fuzz/README.md).
bool AllowNonFinite() {
  static const bool allow = [] {
    const char* v = std::getenv("LAPROX_FUZZ_ALLOW_NONFINITE");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  return allow;
}

// What a block plan promises (laprox.proto BlockPlan): 1 or L units, kept logical blocks
// ascending inside [0, num_blocks), every (layer, head) keeping exactly its unit's blocks'
// positions, and with paged keys a new table beside the kept blocks and the rest freed.
void CheckBlocks(const kernels::KeepPlan& plan, const FuzzModel& model) {
  const kernels::BlockPlan& b = *plan.blocks;
  const int64_t n = plan.n, bs = b.block_size;
  if (bs < 1 || b.num_blocks != (n + bs - 1) / bs ||
      (b.units != 1 && b.units != model.num_layers) ||
      static_cast<int64_t>(b.offsets.size()) != b.units + 1 || b.offsets[0] != 0 ||
      b.offsets[b.units] != static_cast<int64_t>(b.kept.size())) {
    Fail(absl::StrCat("block plan header: block_size ", bs, ", ", b.num_blocks, " blocks, ",
                      b.units, " units, ", b.offsets.size(), " offsets, ", b.kept.size(), " kept"));
  }
  for (int32_t u = 0; u < b.units; ++u) {
    int64_t tokens = 0, previous = -1;
    for (int32_t block : b.kept_blocks(u)) {
      if (block <= previous || block >= b.num_blocks) {
        Fail(absl::StrCat("unit ", u, ": kept block ", block, " after ", previous, " of ",
                          b.num_blocks));
      }
      previous = block;
      tokens += std::min<int64_t>(bs, n - int64_t{block} * bs);
    }
    const int first = b.units == 1 ? 0 : u, last = b.units == 1 ? model.num_layers : u + 1;
    for (int l = first; l < last; ++l) {
      for (int g = 0; g < model.num_kv_heads; ++g) {
        if (plan.count(l, g) != tokens) {
          Fail(absl::StrCat("layer ", l, " head ", g, " keeps ", plan.count(l, g),
                            " positions, its unit's blocks hold ", tokens));
        }
      }
    }
    if (b.paged() &&
        (b.new_block_table(u).size() != b.kept_blocks(u).size() ||
         static_cast<int64_t>(b.freed_ids(u).size() + b.kept_blocks(u).size()) != b.num_blocks)) {
      Fail(absl::StrCat("unit ", u, ": ", b.new_block_table(u).size(), " new ids, ",
                        b.freed_ids(u).size(), " freed, ", b.kept_blocks(u).size(), " kept"));
    }
  }
}

}  // namespace

// What the API promises about every plan (laprox.proto, ComputeKeepMaskResponse).
namespace {

// A decode re-plan's plan (laprox.proto, DecodeCache): each head keeps at most its layer's
// entries, L * Hkv * (window + sinks) + selected_total in all; its positions are token
// positions of its layer's row, ascending, the row's first `sinks` and last `window` among them.
void CheckDecodePlan(const kernels::KeepPlan& plan, const service::KeepPlanCall& call,
                     int64_t heads) {
  const int64_t Hkv = plan.num_kv_heads;
  if (plan.offsets[heads] != heads * (plan.window + plan.sinks) + plan.selected_total) {
    Fail(absl::StrCat("decode re-plan kept ", plan.offsets[heads], ", expected ", heads, " * (",
                      plan.window, " + ", plan.sinks, ") + ", plan.selected_total));
  }
  const bool positions =
      call.outputs.positions && !(call.destination && call.destination->positions_offset);
  for (int64_t i = 0; i < heads; ++i) {
    const service::CacheLayer& layer = (*call.cache)[static_cast<size_t>(i / Hkv)];
    if (plan.counts[i] > layer.entries) {
      Fail(absl::StrCat("head ", i, ": keeps ", plan.counts[i], " of ", layer.entries, " entries"));
    }
    if (!positions) continue;
    const int32_t* row = layer.positions.data() + (i % Hkv) * layer.entries;
    const int32_t* kept = plan.positions.data() + plan.offsets[i];
    const int64_t count = plan.counts[i];
    for (int64_t k = 0; k < count; ++k) {
      if (!std::binary_search(row, row + layer.entries, kept[k]) ||
          (k > 0 && kept[k] <= kept[k - 1])) {
        Fail(absl::StrCat("head ", i, ": kept position ", kept[k],
                          " is not an ascending entry "
                          "of its row"));
      }
    }
    for (int32_t s = 0; s < plan.sinks; ++s) {
      if (count <= s || kept[s] != row[s]) Fail(absl::StrCat("head ", i, " lost sink ", s));
    }
    for (int32_t w = 0; w < plan.window; ++w) {
      if (count < plan.window ||
          kept[count - plan.window + w] != row[layer.entries - plan.window + w]) {
        Fail(absl::StrCat("head ", i, " lost window entry ", w));
      }
    }
  }
}

}  // namespace

void CheckPlan(const kernels::KeepPlan& plan, const service::KeepPlanCall& call) {
  const FuzzModel& model = kModels[call.model_id - 1];
  const int64_t heads = int64_t{model.num_layers} * model.num_kv_heads;
  const int64_t n = call.n;
  if (plan.num_layers != model.num_layers || plan.num_kv_heads != model.num_kv_heads ||
      plan.n != n) {
    Fail(absl::StrCat("plan geometry ", plan.num_layers, "x", plan.num_kv_heads, " n=", plan.n,
                      " for a request of n=", n));
  }
  if (static_cast<int64_t>(plan.counts.size()) != heads ||
      static_cast<int64_t>(plan.offsets.size()) != heads + 1 || plan.offsets[0] != 0 ||
      static_cast<int64_t>(plan.layer_sums.size()) != model.num_layers) {
    Fail(absl::StrCat("plan arrays: ", plan.counts.size(), " counts, ", plan.offsets.size(),
                      " offsets, ", plan.layer_sums.size(), " layer sums"));
  }
  for (int64_t i = 0; i < heads; ++i) {
    if (plan.counts[i] < 0 || plan.counts[i] > n ||
        plan.offsets[i + 1] - plan.offsets[i] != plan.counts[i]) {
      Fail(absl::StrCat("head ", i, ": count ", plan.counts[i], ", offsets ", plan.offsets[i], "..",
                        plan.offsets[i + 1], ", n = ", n));
    }
  }
  for (int l = 0; l < model.num_layers && !AllowNonFinite(); ++l) {
    if (!std::isfinite(plan.layer_sums[l])) {
      Fail(absl::StrCat("layer_sums[", l, "] = ", plan.layer_sums[l]));
    }
  }
  if (plan.blocks) CheckBlocks(plan, model);
  if (call.cache) {
    CheckDecodePlan(plan, call, heads);
  } else if (call.policy.kind == kernels::PolicyKind::kLaprox && !plan.blocks) {
    // "For LAPROX with plan_shape RAGGED or LAYER_UNIFORM that is exactly L * Hkv * (window +
    // sinks + quota)".
    if (plan.offsets[heads] != heads * (plan.window + plan.sinks + plan.quota)) {
      Fail(absl::StrCat("LAPROX kept ", plan.offsets[heads], " positions, expected ", heads, " * (",
                        plan.window, " + ", plan.sinks, " + ", plan.quota, ")"));
    }
  }
  const bool in_region = call.destination.has_value();
  if (!call.cache && call.outputs.positions && !(in_region && call.destination->positions_offset)) {
    if (static_cast<int64_t>(plan.positions.size()) != plan.offsets[heads]) {
      Fail(absl::StrCat(plan.positions.size(), " positions, offsets say ", plan.offsets[heads]));
    }
    for (int64_t i = 0; i < heads; ++i) {
      for (int64_t k = plan.offsets[i]; k < plan.offsets[i + 1]; ++k) {
        const int32_t p = plan.positions[k];
        if (p < 0 || p >= n || (k > plan.offsets[i] && p <= plan.positions[k - 1])) {
          Fail(absl::StrCat("head ", i, ": positions not ascending inside [0, n): ", p));
        }
      }
      if (call.policy.kind == kernels::PolicyKind::kLaprox) {
        // The window and the sinks are always kept.
        const int64_t count = plan.counts[i];
        const int32_t* kept = plan.positions.data() + plan.offsets[i];
        for (int32_t s = 0; s < plan.sinks; ++s) {
          if (count <= s || kept[s] != s) Fail(absl::StrCat("head ", i, " lost sink ", s));
        }
        for (int32_t w = 0; w < plan.window; ++w) {
          if (count < plan.window || kept[count - plan.window + w] != n - plan.window + w) {
            Fail(absl::StrCat("head ", i, " lost window position ", n - plan.window + w));
          }
        }
      }
    }
  }
  if (call.outputs.bitmask && !(in_region && call.destination->bitmask_offset)) {
    const int64_t row = (n + 7) / 8;
    if (static_cast<int64_t>(plan.bitmask.size()) != heads * row) {
      Fail(absl::StrCat("bitmask of ", plan.bitmask.size(), " bytes, expected ", heads * row));
    }
    for (int64_t i = 0; i < heads; ++i) {
      int64_t bits = 0;
      for (int64_t b = 0; b < row; ++b) bits += __builtin_popcount(plan.bitmask[i * row + b]);
      if (bits != plan.counts[i]) {
        Fail(absl::StrCat("head ", i, ": ", bits, " bits set, count ", plan.counts[i]));
      }
    }
  }
  if (call.outputs.scores && !(in_region && call.destination->scores_offset)) {
    if (static_cast<int64_t>(plan.scores.size()) != heads * n) {
      Fail(absl::StrCat(plan.scores.size(), " scores, expected ", heads * n));
    }
    for (size_t i = 0; i < plan.scores.size() && !AllowNonFinite(); ++i) {
      if (std::isnan(plan.scores[i])) Fail(absl::StrCat("scores[", i, "] is NaN"));
    }
  }
}

}  // namespace laprox::fuzz
