// Registry: what happens around Core's own steps in a registration's life — the lease of a local
// client, the hooks laproxd hangs its metrics series and readiness on, a region call that ended
// before it could answer, and reclaiming what a client that is gone registered. Real shared
// memory, a real child process, the CPU backend.
#include "service/core/registry.h"

#include <csignal>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "laprox/kernels/registry.h"
#include "tests/service/shm_object.h"

namespace laprox::service {
namespace {

using core_testing::IsStatus;
using core_testing::ShmObject;
using core_testing::UniqueName;

// One layer of 1 head (d = 2, D = 2): a model small enough to register in microseconds.
const kernels::ModelGeometry kTiny = {
    .num_layers = 1, .num_heads = 1, .num_kv_heads = 1, .head_dim = 2, .hidden_size = 2};
const std::string kOProj(4 * sizeof(float), '\0');  // [D, H*d] of zeros, inline

ModelSpec TinyModel() {
  ModelSpec spec{.name = "tiny", .geometry = kTiny};
  spec.o_proj.push_back({.source = TensorRef::Source::kInline,
                         .inline_bytes = kOProj,
                         .dtype = kernels::DType::kF32,
                         .shape = {2, 2}});
  return spec;
}

// What the hooks saw, in order.
struct Seen {
  std::vector<std::string> events;
  RegistryHooks Hooks(absl::Status added = absl::OkStatus()) {
    return {.model_bytes = [](const kernels::ModelGeometry&) { return int64_t{1} << 20; },
            .model_added =
                [this, added](const ModelInfo& m) {
                  events.push_back(absl::StrCat("added ", m.name));
                  return added;
                },
            .model_removed = [this](uint64_t) { events.push_back("removed"); },
            .models_changed =
                [this](int64_t models) { events.push_back(absl::StrCat("models ", models)); },
            .reclaimed =
                [this](const Reclaimed& r) {
                  events.push_back(
                      absl::StrCat("reclaimed ", r.regions, " ", r.region_bytes, " ", r.models));
                }};
  }
};

class RegistryTest : public ::testing::Test {
 protected:
  Core core_{*kernels::CreateBackend("cpu"), CoreLimits{}};
  Seen seen_;
};

TEST_F(RegistryTest, AModelsHooksFollowItFromRegistrationToItsEnd) {
  Registry registry(core_, absl::ZeroDuration(), seen_.Hooks());
  const int64_t before = core_.model_memory().in_use();
  auto model = registry.RegisterModel(TinyModel(), {.owner = Owner::Laproxd()});
  ASSERT_TRUE(model.ok()) << model.status();
  // The hook's bytes are reserved with the prepared factors, for as long as the model lives.
  EXPECT_GE(core_.model_memory().in_use() - before, (int64_t{1} << 20) + model->prepared_bytes);
  ASSERT_TRUE(registry.UnregisterModel(model->id, Owner::Laproxd()).ok());
  EXPECT_EQ(core_.model_memory().in_use(), before);
  EXPECT_THAT(seen_.events,
              ::testing::ElementsAre("added tiny", "models 1", "removed", "models 0"));
  // An unknown id changes nothing and calls no hook.
  EXPECT_THAT(registry.UnregisterModel(model->id, Owner::Laproxd()),
              IsStatus(absl::StatusCode::kNotFound, ""));
  EXPECT_EQ(seen_.events.size(), 4u);
}

TEST_F(RegistryTest, AModelTheHookRefusesIsNotLeftRegistered) {
  Registry registry(core_, absl::Seconds(30),
                    seen_.Hooks(absl::ResourceExhaustedError("too many series")));
  auto model = registry.RegisterModel(TinyModel(), {.owner = Owner::LocalUser(getuid(), getpid())});
  EXPECT_THAT(model.status(), IsStatus(absl::StatusCode::kResourceExhausted, "too many series"));
  EXPECT_EQ(core_.model_totals().count, 0);
  EXPECT_EQ(core_.model_memory().in_use(), 0);
  EXPECT_EQ(registry.leases(), 0);
  EXPECT_THAT(seen_.events, ::testing::ElementsAre("added tiny"));  // no readiness change
}

TEST_F(RegistryTest, ARegionWhoseCallEndedWhileItOpenedIsClosedAgain) {
  ShmObject object(UniqueName("ended"), 4096);
  Registry registry(core_, absl::Seconds(30));
  const Owner owner = Owner::LocalUser(getuid(), getpid());
  const ShmRegionSpec spec = {.name = object.name(), .byte_size = 4096};
  EXPECT_THAT(
      registry.RegisterRegion(spec, {.owner = owner, .cancelled = [] { return true; }}).status(),
      IsStatus(absl::StatusCode::kDeadlineExceeded, "it was closed"));
  EXPECT_THAT(
      registry.RegisterRegion(spec, {.owner = owner, .deadline = absl::Now() - absl::Seconds(1)})
          .status(),
      IsStatus(absl::StatusCode::kDeadlineExceeded, "it was closed"));
  EXPECT_TRUE(core_.regions().List(Owner::Laproxd()).empty());
  EXPECT_EQ(registry.leases(), 0);
  // A call still running gets its region, and its lease.
  auto id = registry.RegisterRegion(spec, {.owner = owner});
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(registry.leases(), 1);
  ASSERT_TRUE(registry.UnregisterRegion(*id, owner, absl::InfiniteFuture()).ok());
  EXPECT_EQ(registry.leases(), 0);
}

TEST_F(RegistryTest, ReclaimsWhatAClientThatIsGoneRegistered) {
  ShmObject object(UniqueName("gone"), 8192);
  Registry registry(core_, absl::Seconds(30), seen_.Hooks());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    pause();
    _exit(0);
  }
  const Owner client = Owner::LocalUser(getuid(), child);
  auto region = registry.RegisterRegion(ShmRegionSpec{.name = object.name(), .byte_size = 8192},
                                        {.owner = client});
  ASSERT_TRUE(region.ok()) << region.status();
  auto model = registry.RegisterModel(TinyModel(), {.owner = client});
  ASSERT_TRUE(model.ok()) << model.status();
  auto unregistered = registry.RegisterModel(TinyModel(), {.owner = client});
  ASSERT_TRUE(unregistered.ok()) << unregistered.status();
  ASSERT_TRUE(registry.UnregisterModel(unregistered->id, client).ok());
  EXPECT_EQ(registry.leases(), 2);
  const auto disconnected = [](uid_t, pid_t) { return false; };
  // Disconnected but alive: it keeps what it registered.
  EXPECT_EQ(registry.ReclaimLapsed(disconnected).models, 0);
  ASSERT_EQ(kill(child, SIGKILL), 0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  seen_.events.clear();
  const Reclaimed reclaimed = registry.ReclaimLapsed(disconnected);
  EXPECT_EQ(reclaimed.regions, 1);
  EXPECT_EQ(reclaimed.region_bytes, 8192);
  EXPECT_EQ(reclaimed.models, 1);
  EXPECT_THAT(seen_.events, ::testing::ElementsAre("removed", "reclaimed 1 8192 1", "models 0"));
  EXPECT_TRUE(core_.regions().List(Owner::Laproxd()).empty());
  EXPECT_EQ(core_.model_totals().count, 0);
  EXPECT_EQ(registry.leases(), 0);
}

}  // namespace
}  // namespace laprox::service
