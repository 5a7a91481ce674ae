// The life of a launch: agreeing on a stop request (any rank's SIGUSR1 stops every rank after the
// same step), the restart count hp-run passes, and the HP_FAULT_KILL_AT_STEP fault point.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
using hp::comm::CollectiveKind;

namespace {

// Sets an environment variable for the scope, restoring the previous value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = ::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

class Preemption : public ::testing::Test {
 protected:
  void TearDown() override { hp::comm::detail::clear_preemption_request(); }
  hp::comm::Group world = hp::comm::world();
};

TEST_F(Preemption, NobodyAskedMeansNobodyStopsInOneAllReduce) {
  hp::comm::reset_collective_counts();
  EXPECT_FALSE(hp::comm::preemption_requested());
  EXPECT_FALSE(hp::comm::agree_on_preemption(world));
  // One rank alone needs no collective; otherwise exactly one all_reduce, in its own region.
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce, "preemption"), world.size() > 1 ? 1 : 0);
  EXPECT_EQ(hp::comm::total_collective_count(), world.size() > 1 ? 1 : 0);
}

TEST_F(Preemption, AnyOneRanksSignalStopsEveryRank) {
  for (int64_t asked = 0; asked < world.size(); ++asked) {
    if (world.rank() == asked) {
      ASSERT_EQ(::raise(SIGUSR1), 0);  // the handler sets the flag
    }
    EXPECT_EQ(hp::comm::preemption_requested(), world.rank() == asked) << "asked rank " << asked;
    EXPECT_TRUE(hp::comm::agree_on_preemption(world)) << "asked rank " << asked;
    hp::comm::detail::clear_preemption_request();
    EXPECT_FALSE(hp::comm::agree_on_preemption(world)) << "after clearing, asked rank " << asked;
  }
}

TEST_F(Preemption, AgreementWorksOnASubgroup) {
  if (world.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  // Ranks 0 and 1 form a group; only rank 1 is asked.
  std::vector<int64_t> members{0, 1};
  auto pair = hp::comm::new_group(members);
  if (world.rank() > 1) return;
  if (world.rank() == 1) {
    ASSERT_EQ(::raise(SIGUSR1), 0);
  }
  EXPECT_TRUE(hp::comm::agree_on_preemption(pair));
}

TEST(RestartCount, ReadsHpRunsVariableThenTorchElastics) {
  {
    ScopedEnv hp("HP_RESTART_COUNT", nullptr), torch("TORCHELASTIC_RESTART_COUNT", nullptr);
    EXPECT_EQ(hp::comm::restart_count(), 0);
  }
  {
    ScopedEnv hp("HP_RESTART_COUNT", nullptr), torch("TORCHELASTIC_RESTART_COUNT", "3");
    EXPECT_EQ(hp::comm::restart_count(), 3);
  }
  {
    ScopedEnv hp("HP_RESTART_COUNT", "2"), torch("TORCHELASTIC_RESTART_COUNT", "3");
    EXPECT_EQ(hp::comm::restart_count(), 2);
  }
  ScopedEnv hp("HP_RESTART_COUNT", "two");
  HP_EXPECT_THROW_MSG(hp::comm::restart_count(),
                      "restart_count: expected an integer for HP_RESTART_COUNT, got 'two'");
}

TEST(FaultKillAtStep, MalformedValueIsAnError) {
  ScopedEnv restart("HP_RESTART_COUNT", "0");
  for (const char* bad : {"3", "a:b", "1:2x", "1:"}) {
    ScopedEnv fault("HP_FAULT_KILL_AT_STEP", bad);
    HP_EXPECT_THROW_MSG(hp::comm::maybe_kill_at_step(1),
                        "expected HP_FAULT_KILL_AT_STEP=<rank>:<step>, got '" + std::string(bad) + "'");
  }
}

TEST(FaultKillAtStep, FiresOnlyAtItsRankAndStepOnTheFirstAttempt) {
  const std::string here = std::to_string(hp::comm::global_rank()) + ":5";
  const std::string elsewhere = std::to_string(hp::comm::world_size()) + ":5";  // no such rank
  ScopedEnv restart("HP_RESTART_COUNT", "0");
  {
    ScopedEnv fault("HP_FAULT_KILL_AT_STEP", here.c_str());
    hp::comm::maybe_kill_at_step(4);  // another step: the process lives on
  }
  {
    ScopedEnv fault("HP_FAULT_KILL_AT_STEP", elsewhere.c_str());
    hp::comm::maybe_kill_at_step(5);
  }
  ScopedEnv second_attempt("HP_RESTART_COUNT", "1");
  ScopedEnv fault("HP_FAULT_KILL_AT_STEP", here.c_str());
  hp::comm::maybe_kill_at_step(5);  // a restarted job runs through the fault point
  SUCCEED();
}

TEST(FaultKillAtStep, KillsTheProcessAtItsStep) {
  ScopedEnv restart("HP_RESTART_COUNT", "0");
  const std::string here = std::to_string(hp::comm::global_rank()) + ":5";
  ScopedEnv fault("HP_FAULT_KILL_AT_STEP", here.c_str());
  EXPECT_EXIT(hp::comm::maybe_kill_at_step(5), ::testing::KilledBySignal(SIGKILL),
              "HP_FAULT_KILL_AT_STEP=" + here + ": rank [0-9]+ kills itself at step 5");
}

}  // namespace
