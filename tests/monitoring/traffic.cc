// laprox_traffic: sends a known set of calls to a running laproxd, for the monitoring test.
//
//   laprox_traffic --target=unix:/tmp/x.sock --plans=6 --bad=6 --regions=1
//
// Registers `regions` shared-memory regions and leaves them registered, registers the model
// "traffic" (L=2, H=4, Hkv=2, d=8, D=16) and leaves it registered when --plans > 0, computes
// --plans keep-plans (budgets cycling through 16, 40, 24) and sends --bad refused requests
// (alternately an unknown model: NOT_FOUND, and a negative budget: INVALID_ARGUMENT). Prints one
// line of what it did; exits 1 if any call answers otherwise than planned.
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "laprox/client/client.h"

ABSL_FLAG(std::string, target, laprox::client::DefaultTarget(), "laproxd address");
ABSL_FLAG(int, plans, 6, "keep-plans to compute");
ABSL_FLAG(int, bad, 6, "refused requests to send");
ABSL_FLAG(int, regions, 1, "regions to register and leave registered");

namespace {

constexpr int kL = 2, kH = 4, kHkv = 2, kD = 8, kHidden = 16, kWindow = 8;
constexpr int64_t kN = 256;

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "laprox_traffic: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  namespace lc = laprox::client;
  auto client = lc::Client::Connect(absl::GetFlag(FLAGS_target));
  if (!client.ok()) return Fail("connect", client.status());

  // Regions over one shared-memory object; the server keeps its mappings after the unlink.
  const std::string name = absl::StrCat("laprox-traffic-", getpid());
  const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 || ftruncate(fd, 4096) != 0) return Fail("shm_open", absl::InternalError(name));
  close(fd);
  int registered = 0;
  for (int i = 0; i < absl::GetFlag(FLAGS_regions); ++i) {
    auto id = (*client)->RegisterShmRegion(name, 0, 4096);
    if (!id.ok()) {
      shm_unlink(("/" + name).c_str());
      return Fail("RegisterShmRegion", id.status());
    }
    ++registered;
  }
  shm_unlink(("/" + name).c_str());

  const int plans = absl::GetFlag(FLAGS_plans);
  const int bad = absl::GetFlag(FLAGS_bad);
  if (plans > 0 || bad > 0) {
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.f, 1.f);
    auto fill = [&](size_t count) {
      std::vector<float> v(count);
      for (float& x : v) x = normal(rng);
      return v;
    };
    std::vector<std::vector<float>> o_proj, keys, values, queries;
    std::vector<lc::TensorRef> o_refs;
    std::vector<lc::LayerRefs> layers(kL);
    for (int l = 0; l < kL; ++l) {
      o_proj.push_back(fill(kHidden * kH * kD));
      keys.push_back(fill(kHkv * kN * kD));
      values.push_back(fill(kHkv * kN * kD));
      queries.push_back(fill(kH * kWindow * kD));
      using laprox::kernels::DType;
      o_refs.push_back(lc::TensorRef::Inline(o_proj[l].data(), DType::kF32, {kHidden, kH * kD}));
      layers[l].keys = lc::TensorRef::Inline(keys[l].data(), DType::kF32, {kHkv, kN, kD});
      layers[l].values = lc::TensorRef::Inline(values[l].data(), DType::kF32, {kHkv, kN, kD});
      layers[l].window_queries =
          lc::TensorRef::Inline(queries[l].data(), DType::kF32, {kH, kWindow, kD});
    }
    auto model = (*client)->RegisterModel("traffic", {kL, kH, kHkv, kD, kHidden, 0.f}, o_refs);
    if (!model.ok()) return Fail("RegisterModel", model.status());
    laprox::kernels::PolicySpec policy;
    policy.window = kWindow;
    constexpr int64_t kBudgets[] = {16, 40, 24};
    for (int i = 0; i < plans; ++i) {
      policy.budget = laprox::kernels::Budget::TokensPerHead(kBudgets[i % 3]);
      auto plan = (*client)->ComputeKeepPlan(*model, kN, layers, policy);
      if (!plan.ok()) return Fail("ComputeKeepPlan", plan.status());
    }
    for (int i = 0; i < bad; ++i) {
      const bool unknown_model = i % 2 == 0;
      policy.budget = laprox::kernels::Budget::TokensPerHead(unknown_model ? 16 : -1);
      auto plan =
          (*client)->ComputeKeepPlan(*model + (unknown_model ? 1000 : 0), kN, layers, policy);
      const absl::StatusCode want =
          unknown_model ? absl::StatusCode::kNotFound : absl::StatusCode::kInvalidArgument;
      if (plan.status().code() != want) {
        return Fail(absl::StrCat("bad request ", i, " answered"), plan.status());
      }
    }
    if (plans == 0) {
      if (absl::Status s = (*client)->UnregisterModel(*model); !s.ok()) {
        return Fail("UnregisterModel", s);
      }
    }
  }
  std::printf("laprox_traffic: %d regions left registered, %d plans, %d refused requests\n",
              registered, plans, bad);
  return 0;
}
