// Tests for hp-run's restarts (--max-restarts) and its graceful preemption (SIGTERM or SIGINT to
// hp-run becomes SIGUSR1 to the ranks, a checkpoint, and exit status 75). The ranks are small
// /bin/sh programs that play a trainer's part: they fail on the first attempt, or trap SIGUSR1
// and print the line a trainer prints after its preemption checkpoint.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "launch.h"

namespace {

using namespace hp_run_test;

std::size_t count_of(const std::string& text, const std::string& needle) {
  std::size_t count = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++count;
  return count;
}

// A port for the tests that need a fixed one: the environment is all that is checked, nothing
// but hp-run's hold binds it. Below the kernel's ephemeral ports (32768 on), which concurrent
// tests' connections use.
std::string fixed_port() { return std::to_string(20000 + ::getpid() % 12000); }

// --- restarts ---------------------------------------------------------------

TEST(HpRunRestart, RestartsEveryRankWithTheCountAndTheNextPort) {
  const std::string port = fixed_port();
  const Result r =
      run_hp_run(sh_job(2,
                        "echo count=$HP_RESTART_COUNT/$TORCHELASTIC_RESTART_COUNT port=$MASTER_PORT; "
                        "if [ $HP_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then exit 3; fi",
                        {"--max-restarts", "2", "--restart-backoff-s", "0", "--master-port", port}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const std::string next = std::to_string(std::stoi(port) + 1);
  // Rank 0 of the first attempt may be stopped before it prints: rank 1's failure ends it.
  EXPECT_TRUE(has_line(r.out, "[rank 1] count=0/0 port=" + port)) << describe(r);
  for (const std::string rank : {"0", "1"}) {
    EXPECT_TRUE(has_line(r.out, "[rank " + rank + "] count=1/1 port=" + next)) << describe(r);
  }
  EXPECT_EQ(count_of(r.out, "count=2/2"), 0u) << "a third attempt ran\n" << describe(r);
  EXPECT_TRUE(has_line(r.err, "hp-run: restart 1/2 after rank 1 exited with code 3")) << describe(r);
  EXPECT_EQ(count_of(r.err, "hp-run: restart"), 1u) << describe(r);
}

// An attempt whose port another program holds fails before its ranks start; the next one goes on
// with its own port.
TEST(HpRunRestart, AnAttemptWhosePortIsHeldElsewhereFailsAndTheNextGoesOn) {
  const Listener listener;
  const int held = listener.port(), base = held - 1;
  const Result r = run_hp_run(sh_job(2,
                                     "echo count=$HP_RESTART_COUNT port=$MASTER_PORT; "
                                     "if [ $HP_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then exit 3; fi",
                                     {"--max-restarts", "2", "--restart-backoff-s", "0", "--master-addr",
                                      "127.0.0.1", "--master-port", std::to_string(base)}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_of(r.out, "count=1 "), 0u) << "attempt 1 started its ranks\n" << describe(r);
  for (const std::string rank : {"0", "1"}) {
    EXPECT_TRUE(has_line(r.out, "[rank " + rank + "] count=2 port=" + std::to_string(base + 2)))
        << describe(r);
  }
  EXPECT_TRUE(has_line(r.err, "hp-run: restart 2/2 after attempt 1 (--master-port " + std::to_string(base) +
                                  " + 1): expected port " + std::to_string(held) +
                                  " free on this node for rank 0's store, got it held by another socket "
                                  "(Address already in use; another program listens there?)"))
      << describe(r);
}

TEST(HpRunRestart, PickedPortIsPickedAgainForEachAttempt) {
  const Result r = run_hp_run(sh_job(1, "echo port=$MASTER_PORT; [ $HP_RESTART_COUNT = 1 ]",
                                     {"--max-restarts", "1", "--restart-backoff-s", "0"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_of(r.out, "[rank 0] port="), 2u) << describe(r);
}

TEST(HpRunRestart, ExhaustedRestartsExitWithTheLastCause) {
  const Result r = run_hp_run(sh_job(2, "if [ $RANK = 1 ]; then sleep 0.2; kill -KILL $$; fi; sleep 30",
                                     {"--max-restarts", "1", "--restart-backoff-s", "0"}));
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << describe(r);
  EXPECT_TRUE(has_line(r.err, "hp-run: restart 1/1 after rank 1 was killed by signal SIGKILL (9)"))
      << describe(r);
  EXPECT_EQ(count_of(r.err, "hp-run: restart"), 1u) << describe(r);
  // Both attempts name the rank; the last line of the job is the last attempt's cause.
  EXPECT_EQ(count_of(r.err, "hp-run: rank 1 was killed by signal SIGKILL (9)\n"), 2u) << describe(r);
  EXPECT_LT(r.seconds, 20.0);
}

TEST(HpRunRestart, SuccessIsNotRestarted) {
  const Result r = run_hp_run(sh_job(2, "echo attempt=$HP_RESTART_COUNT", {"--max-restarts", "3"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_of(r.out, "attempt=0"), 2u) << describe(r);
  EXPECT_EQ(count_of(r.out, "attempt=1"), 0u) << describe(r);
  EXPECT_EQ(r.err, "");
}

// Attempts of 0.1 s against a 4 s timeout: restarts happen whatever the load, and the timeout
// still ends the job. The bound on its length is a hang deadline.
TEST(HpRunRestart, TimeoutCoversEveryAttempt) {
  const Result r = run_hp_run(sh_job(
      2, "sleep 0.1; exit 1", {"--timeout", "4", "--max-restarts", "100", "--restart-backoff-s", "0"}));
  EXPECT_EQ(r.exit_code, 124) << describe(r);
  EXPECT_NE(r.err.find("hp-run: timeout after 4 s; killing all ranks"), std::string::npos) << describe(r);
  EXPECT_GE(count_of(r.err, "hp-run: restart"), 1u) << describe(r);
  EXPECT_EQ(r.err.find("after SIGTERM; sending SIGKILL"), std::string::npos) << describe(r);
  EXPECT_LT(r.seconds, 30.0);
}

TEST(HpRunRestart, StopRequestDuringTheBackoffEndsTheJob) {
  Launch launch(sh_job(2, "exit 1", {"--max-restarts", "3", "--restart-backoff-s", "30"}));
  ASSERT_TRUE(launch.wait_for_stderr("hp-run: restart 1/3", 10s));
  ASSERT_EQ(::kill(launch.pid(), SIGTERM), 0);
  const Result r = launch.wait();
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << describe(r);
  EXPECT_NE(r.err.find("received SIGTERM (15) before the restart; stopping"), std::string::npos)
      << describe(r);
  EXPECT_LT(r.seconds, 10.0);
}

// --- preemption -------------------------------------------------------------

// A rank that stops at its next "step" on SIGUSR1 after reporting its checkpoint, as the trainers do.
const std::string kPreemptionAware =
    "trap 'echo \"hp-preempted: checkpoint at step 7\"; exit 0' USR1; echo ready; "
    "while :; do sleep 0.05; done";

class HpRunPreemption : public ::testing::TestWithParam<int> {};

TEST_P(HpRunPreemption, CheckpointsAndExits75) {
  Launch launch(sh_job(2, kPreemptionAware, {"--max-restarts", "2"}));
  ASSERT_TRUE(launch.wait_for_stdout("[rank 0] ready", 10s) && launch.wait_for_stdout("[rank 1] ready", 10s));
  ASSERT_EQ(::kill(launch.pid(), GetParam()), 0);
  const Result r = launch.wait();
  EXPECT_EQ(r.exit_code, 75) << describe(r);
  EXPECT_TRUE(has_line(r.err, "hp-run: preempted; checkpoint at step 7")) << describe(r);
  EXPECT_EQ(count_of(r.err, "hp-run: restart"), 0u) << "a preemption is not a failure\n" << describe(r);
  EXPECT_LT(r.seconds, 10.0);
}

INSTANTIATE_TEST_SUITE_P(IntAndTerm, HpRunPreemption, ::testing::Values(SIGINT, SIGTERM),
                         [](const auto& info) { return info.param == SIGINT ? "SIGINT" : "SIGTERM"; });

TEST(HpRunRestart, RanksThatIgnoreThePreemptionGetSigtermAfterTheGrace) {
  Launch launch(sh_job(2, "trap '' USR1; echo ready; sleep 30", {"--preempt-grace-s", "1", "--grace", "1"}));
  ASSERT_TRUE(launch.wait_for_stdout("[rank 0] ready", 10s) && launch.wait_for_stdout("[rank 1] ready", 10s));
  ASSERT_EQ(::kill(launch.pid(), SIGTERM), 0);
  const Result r = launch.wait();
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << describe(r);
  EXPECT_NE(r.err.find("hp-run: ranks still running 1 s after SIGUSR1; terminating all ranks"),
            std::string::npos)
      << describe(r);
  EXPECT_GE(r.seconds, 1.0);  // the preemption grace was honoured
  EXPECT_LT(r.seconds, 10.0);
}

TEST(HpRunRestart, SecondStopRequestKillsAtOnce) {
  Launch launch(
      sh_job(2, "trap '' USR1 TERM; echo ready; sleep 30", {"--preempt-grace-s", "20", "--grace", "20"}));
  ASSERT_TRUE(launch.wait_for_stdout("[rank 0] ready", 10s) && launch.wait_for_stdout("[rank 1] ready", 10s));
  ASSERT_EQ(::kill(launch.pid(), SIGTERM), 0);
  ASSERT_TRUE(launch.wait_for_stderr("asking every rank to checkpoint and stop", 5s));
  ASSERT_EQ(::kill(launch.pid(), SIGINT), 0);
  const Result r = launch.wait();
  EXPECT_NE(r.err.find("received SIGINT (2) again; killing all ranks now"), std::string::npos) << describe(r);
  EXPECT_LT(r.seconds, 10.0);
}

}  // namespace
