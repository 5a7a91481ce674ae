// Tests for the hp-run launcher. They run the real binary (HP_RUN_PATH) with
// small /bin/sh programs as ranks and check its output and exit status.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "launch.h"

namespace {

using namespace hp_run_test;
using namespace std::chrono_literals;

const std::string kPrintEnv =
    "echo r=$RANK l=$LOCAL_RANK w=$WORLD_SIZE lw=$LOCAL_WORLD_SIZE g=$GROUP_RANK "
    "a=$MASTER_ADDR p=$MASTER_PORT";

// The MASTER_PORT each rank printed (via kPrintEnv or "port=..."), in output order.
std::vector<int> printed_ports(const std::string& out) {
  std::vector<int> ports;
  for (const std::string& line : lines_of(out)) {
    for (const char* key : {" p=", "port="}) {
      const std::size_t at = line.find(key);
      if (at != std::string::npos) ports.push_back(std::stoi(line.substr(at + std::strlen(key))));
    }
  }
  return ports;
}

// --- environment and output -------------------------------------------------

TEST(HpRun, SingleRankSeesItsEnvironment) {
  const Result r = run_hp_run(sh_job(1, kPrintEnv, {"--master-port", "29555"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(has_line(r.out, "[rank 0] r=0 l=0 w=1 lw=1 g=0 a=127.0.0.1 p=29555")) << describe(r);
  EXPECT_EQ(r.err, "");
}

TEST(HpRun, ThreeRanksShareOnePickedPort) {
  const Result r = run_hp_run(sh_job(3, kPrintEnv, {"--master-addr", "127.0.0.1"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const std::vector<int> ports = printed_ports(r.out);
  ASSERT_EQ(ports.size(), 3u) << describe(r);
  EXPECT_GT(ports[0], 0);
  EXPECT_EQ(std::set<int>(ports.begin(), ports.end()).size(), 1u) << "ranks disagree on the port";
  const std::string port = std::to_string(ports[0]);
  for (int rank = 0; rank < 3; ++rank) {
    const std::string r_ = std::to_string(rank);
    EXPECT_TRUE(
        has_line(r.out, "[rank " + r_ + "] r=" + r_ + " l=" + r_ + " w=3 lw=3 g=0 a=127.0.0.1 p=" + port))
        << "rank " << rank << "\n"
        << describe(r);
  }
  EXPECT_EQ(lines_of(r.out).size(), 3u);
}

TEST(HpRun, SecondNodeGetsGlobalRanks) {
  // Also exercises the --flag=value form.
  const Result r = run_hp_run(
      sh_job(2, kPrintEnv, {"--nnodes=2", "--node-rank=1", "--master-addr=10.1.2.3", "--master-port=29600"}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(has_line(r.out, "[rank 2] r=2 l=0 w=4 lw=2 g=1 a=10.1.2.3 p=29600")) << describe(r);
  EXPECT_TRUE(has_line(r.out, "[rank 3] r=3 l=1 w=4 lw=2 g=1 a=10.1.2.3 p=29600")) << describe(r);
}

TEST(HpRun, KeepsStdoutAndStderrApartAndFlushesPartialLines) {
  const Result r = run_hp_run(sh_job(2, "echo out$RANK; echo err$RANK >&2; printf tail$RANK"));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  for (const std::string rank : {"0", "1"}) {
    EXPECT_TRUE(has_line(r.out, "[rank " + rank + "] out" + rank)) << describe(r);
    EXPECT_TRUE(has_line(r.out, "[rank " + rank + "] tail" + rank)) << describe(r);
    EXPECT_TRUE(has_line(r.err, "[rank " + rank + "] err" + rank)) << describe(r);
  }
  EXPECT_EQ(r.out.find("err"), std::string::npos);
  EXPECT_EQ(r.err.find("out"), std::string::npos);
}

TEST(HpRun, LargeOutputArrivesComplete) {
  // 20000 short lines from rank 0, one 200 kB line from rank 1.
  const Result r = run_hp_run(
      sh_job(2, "if [ $RANK = 0 ]; then seq 1 20000; else head -c 200000 /dev/zero | tr '\\0' x; echo; fi"));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::vector<std::string> rank0;
  std::size_t long_lines = 0;
  for (const std::string& line : lines_of(r.out)) {
    if (line.starts_with("[rank 0] ")) rank0.push_back(line.substr(9));
    if (line == "[rank 1] " + std::string(200000, 'x')) ++long_lines;
  }
  ASSERT_EQ(rank0.size(), 20000u);
  for (std::size_t i = 0; i < rank0.size(); ++i) {
    ASSERT_EQ(rank0[i], std::to_string(i + 1)) << "line " << i;
  }
  EXPECT_EQ(long_lines, 1u);
}

// --- failures ---------------------------------------------------------------

TEST(HpRun, ForwardsTheFailingRanksExitCode) {
  const auto start = Clock::now();
  const Result r = run_hp_run(sh_job(3, "if [ $RANK = 1 ]; then exit 3; fi; sleep 60"));
  EXPECT_EQ(r.exit_code, 3) << describe(r);
  EXPECT_NE(r.err.find("hp-run: rank 1 exited with code 3"), std::string::npos) << describe(r);
  EXPECT_EQ(r.err.find("restart"), std::string::npos) << "restarted without --max-restarts\n" << describe(r);
  EXPECT_LT(Clock::now() - start, 15s);
}

TEST(HpRun, CrashingRankTearsDownTheJob) {
  const Result r = run_hp_run(sh_job(3, "if [ $RANK = 1 ]; then kill -SEGV $$; fi; sleep 60"));
  EXPECT_EQ(r.exit_code, 128 + SIGSEGV) << describe(r);
  EXPECT_NE(r.err.find("hp-run: rank 1 was killed by signal SIGSEGV (11)"), std::string::npos) << describe(r);
  EXPECT_LT(r.seconds, 15.0);
}

TEST(HpRun, RankIgnoringSigtermIsKilledAfterGrace) {
  // Rank 0 fails only once rank 1 has installed its trap (signalled through a
  // file), so SIGTERM cannot stop rank 1 and only SIGKILL can.
  const std::string ready = ::testing::TempDir() + "hp_run_trapped_" + std::to_string(::getpid());
  std::remove(ready.c_str());
  const Result r = run_hp_run(sh_job(2,
                                     "if [ $RANK = 0 ]; then while [ ! -e '" + ready +
                                         "' ]; do sleep 0.05; done; exit 1; fi; trap '' TERM; touch '" +
                                         ready + "'; sleep 60",
                                     {"--grace", "1"}));
  std::remove(ready.c_str());
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.err.find("hp-run: rank 0 exited with code 1"), std::string::npos) << describe(r);
  EXPECT_NE(r.err.find("rank(s) 1 still running 1 s after SIGTERM; sending SIGKILL"), std::string::npos)
      << describe(r);
  EXPECT_GE(r.seconds, 1.0);  // the grace period was honoured
  EXPECT_LT(r.seconds, 10.0);
}

TEST(HpRun, KillReachesTheRanksOwnSubprocesses) {
  const std::string marker = ::testing::TempDir() + "hp_run_leak_" + std::to_string(::getpid());
  std::remove(marker.c_str());
  // Rank 1's background subshell would create the marker after 8 s if it survived the teardown
  // that rank 0's failure triggers (7 s of slack for the teardown, whatever the load).
  const Result r = run_hp_run(
      sh_job(2, "if [ $RANK = 0 ]; then sleep 0.3; exit 1; fi; (sleep 8; touch '" + marker + "') & wait"));
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  std::this_thread::sleep_for(9s);
  EXPECT_NE(::access(marker.c_str(), F_OK), 0) << "a rank's subprocess outlived the job";
  std::remove(marker.c_str());
}

// The shell command of a rank that would leave a marker file after 8 s if it survived (the
// tests end it within about 1 s: 7 s of slack whatever the load).
std::string leaves_marker_if_alive(const std::string& marker) {
  return "(sleep 8; touch '" + marker + "$RANK') & wait";
}

bool any_marker(const std::string& marker) {
  return ::access((marker + "0").c_str(), F_OK) == 0 || ::access((marker + "1").c_str(), F_OK) == 0;
}

TEST(HpRun, TimeoutKillsAllRanks) {
  const std::string marker = ::testing::TempDir() + "hp_run_timeout_" + std::to_string(::getpid());
  const Result r = run_hp_run(sh_job(2, leaves_marker_if_alive(marker), {"--timeout", "1"}));
  EXPECT_EQ(r.exit_code, 124) << describe(r);
  EXPECT_NE(r.err.find("hp-run: timeout after 1 s; killing all ranks"), std::string::npos) << describe(r);
  // The ranks went at SIGTERM, not at the grace period's SIGKILL; the bound is a hang deadline.
  EXPECT_EQ(r.err.find("after SIGTERM; sending SIGKILL"), std::string::npos) << describe(r);
  EXPECT_LT(r.seconds, 30.0);
  std::this_thread::sleep_for(9s);
  EXPECT_FALSE(any_marker(marker)) << "a rank outlived the timeout";
}

TEST(HpRun, MissingProgramIsAFailingRank) {
  const Result r = run_hp_run({"--nproc-per-node", "2", "--", "/nonexistent/hp_run_test_prog"});
  EXPECT_EQ(r.exit_code, 127) << describe(r);
  EXPECT_NE(r.err.find("cannot run '/nonexistent/hp_run_test_prog'"), std::string::npos) << describe(r);
}

// --- signals to the launcher ------------------------------------------------

class HpRunSignal : public ::testing::TestWithParam<int> {};

// A stop request reaches every rank as SIGUSR1; these ranks do not handle it and die of it, which
// ends the job as a failure (the preemption-aware path is in test_hp_run_restart.cpp).
TEST_P(HpRunSignal, IsForwardedToAllRanks) {
  const int sig = GetParam();
  const std::string marker =
      ::testing::TempDir() + "hp_run_signal_" + std::to_string(sig) + "_" + std::to_string(::getpid());
  Launch launch(sh_job(2, "echo ready; " + leaves_marker_if_alive(marker), {"--grace", "1"}));
  ASSERT_TRUE(launch.wait_for_stdout("[rank 1] ready", 10s) && launch.wait_for_stdout("[rank 0] ready", 10s));
  ASSERT_EQ(::kill(launch.pid(), sig), 0);
  const Result r = launch.wait();
  EXPECT_EQ(r.exit_code, 128 + sig) << describe(r);
  EXPECT_NE(r.err.find("asking every rank to checkpoint and stop (SIGUSR1)"), std::string::npos)
      << describe(r);
  EXPECT_NE(r.err.find("was killed by signal SIGUSR1 (10) while stopping; terminating all ranks"),
            std::string::npos)
      << describe(r);
  EXPECT_LT(r.seconds, 10.0);
  std::this_thread::sleep_for(9s);
  EXPECT_FALSE(any_marker(marker)) << "a rank outlived the forwarded signal";
}

INSTANTIATE_TEST_SUITE_P(IntAndTerm, HpRunSignal, ::testing::Values(SIGINT, SIGTERM),
                         [](const auto& info) { return info.param == SIGINT ? "SIGINT" : "SIGTERM"; });

// --- ports ------------------------------------------------------------------

TEST(HpRun, ConcurrentLaunchesPickDifferentPorts) {
  const std::vector<std::string> args = sh_job(1, "sleep 1; echo port=$MASTER_PORT");
  Launch first(args);
  Launch second(args);
  const Result a = first.wait();
  const Result b = second.wait();
  ASSERT_EQ(a.exit_code, 0) << describe(a);
  ASSERT_EQ(b.exit_code, 0) << describe(b);
  const std::vector<int> pa = printed_ports(a.out);
  const std::vector<int> pb = printed_ports(b.out);
  ASSERT_EQ(pa.size(), 1u) << describe(a);
  ASSERT_EQ(pb.size(), 1u) << describe(b);
  EXPECT_GT(pa[0], 0);
  EXPECT_GT(pb[0], 0);
  EXPECT_NE(pa[0], pb[0]);
}

// The picked port stays bound by hp-run while the ranks run: a plain bind (as the kernel's choice
// of an ephemeral port for another program's listener would need) fails, while rank 0's store,
// which binds with SO_REUSEADDR, still listens there.
TEST(HpRun, APickedPortStaysHeldForTheStoreOnly) {
  const std::string probe =
      "import os, socket\n"
      "port = int(os.environ['MASTER_PORT'])\n"
      "plain = socket.socket()\n"
      "try:\n"
      "    plain.bind(('127.0.0.1', port)); plain.close(); print('plain bind: free')\n"
      "except OSError as e:\n"
      "    print('plain bind: held' if e.errno == 98 else 'plain bind: ' + str(e))\n"
      "store = socket.socket(); store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
      "store.bind(('', port)); store.listen(1); print('store bind: listening')\n";
  const Result r = run_hp_run(
      {"--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--", "/usr/bin/python3", "-c", probe});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(has_line(r.out, "[rank 0] plain bind: held")) << describe(r);
  EXPECT_TRUE(has_line(r.out, "[rank 0] store bind: listening")) << describe(r);
}

// A given port is held too, and one that another program listens on, on any local address, is
// refused before any rank starts: rank 0's store binds every address, and could not listen there.
TEST(HpRun, AGivenPortIsHeldAndOneInUseIsRefused) {
  auto listener = std::make_unique<Listener>(INADDR_LOOPBACK + 1);  // 127.0.0.2: not the --master-addr
  const std::string port = std::to_string(listener->port());
  const Result refused =
      run_hp_run(sh_job(2, "echo started", {"--master-addr", "127.0.0.1", "--master-port", port}));
  EXPECT_NE(refused.exit_code, 0) << describe(refused);
  EXPECT_NE(refused.err.find("hp-run: expected port " + port +
                             " free on this node for rank 0's store, got it held by another socket"),
            std::string::npos)
      << describe(refused);
  EXPECT_EQ(refused.out.find("started"), std::string::npos) << describe(refused);
  listener.reset();

  const std::string probe =
      "import os, socket\n"
      "for host in ('127.0.0.1', '127.0.0.2'):\n"
      "    plain = socket.socket()\n"
      "    try:\n"
      "        plain.bind((host, int(os.environ['MASTER_PORT']))); print(host, 'free')\n"
      "    except OSError as e:\n"
      "        print(host, 'held' if e.errno == 98 else str(e))\n";
  const Result held = run_hp_run({"--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                                  port, "--", "/usr/bin/python3", "-c", probe});
  ASSERT_EQ(held.exit_code, 0) << describe(held);
  EXPECT_TRUE(has_line(held.out, "[rank 0] 127.0.0.1 held")) << describe(held);
  EXPECT_TRUE(has_line(held.out, "[rank 0] 127.0.0.2 held")) << describe(held);
}

// --- command line -----------------------------------------------------------

TEST(HpRun, HelpPrintsUsage) {
  for (const char* flag : {"-h", "--help"}) {
    const Result r = run_hp_run({flag});
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_NE(r.out.find("usage: hp-run"), std::string::npos) << describe(r);
  }
}

struct BadFlags {
  std::string name;  // test name suffix
  std::vector<std::string> args;
  std::string message;
};

// Keeps ctest's test names readable (gtest would otherwise dump raw bytes).
void PrintTo(const BadFlags& flags, std::ostream* os) { *os << flags.name; }

class HpRunBadFlags : public ::testing::TestWithParam<BadFlags> {};

TEST_P(HpRunBadFlags, ExitsWithUsageError) {
  const Result r = run_hp_run(GetParam().args);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("hp-run: " + GetParam().message), std::string::npos) << describe(r);
  EXPECT_EQ(r.out, "");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, HpRunBadFlags,
    ::testing::Values(
        BadFlags{
            "UnknownFlag", {"--nproc-per-node", "2", "--foo", "1", "--", "true"}, "unknown flag '--foo'"},
        BadFlags{"UnknownFlagWithEquals",
                 {"--nproc-per-node", "2", "--foo=1", "--", "true"},
                 "unknown flag '--foo'"},
        BadFlags{"NprocNotANumber",
                 {"--nproc-per-node", "abc", "--", "true"},
                 "--nproc-per-node: expected a positive integer, got 'abc'"},
        BadFlags{"NprocZero",
                 {"--nproc-per-node", "0", "--", "true"},
                 "--nproc-per-node: expected a positive integer, got '0'"},
        BadFlags{"NprocNegative",
                 {"--nproc-per-node=-1", "--", "true"},
                 "--nproc-per-node: expected a positive integer, got '-1'"},
        BadFlags{"NprocTrailingJunk",
                 {"--nproc-per-node", "2x", "--", "true"},
                 "--nproc-per-node: expected a positive integer, got '2x'"},
        BadFlags{"NprocMissingValue", {"--nproc-per-node"}, "--nproc-per-node: missing value"},
        BadFlags{"NnodesMissingValue",
                 {"--nproc-per-node", "2", "--nnodes", "--", "true"},
                 "--nnodes: missing value"},
        BadFlags{"NprocMissing", {"--", "true"}, "--nproc-per-node is required"},
        BadFlags{"NodeRankTooLarge",
                 {"--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "29500",
                  "--", "true"},
                 "--node-rank: expected a value in [0, 2) for --nnodes 2, got 2"},
        BadFlags{"NodeRankNegative",
                 {"--nproc-per-node", "2", "--node-rank", "-1", "--", "true"},
                 "--node-rank: expected a non-negative integer, got '-1'"},
        BadFlags{"PortTooLarge",
                 {"--nproc-per-node", "2", "--master-port", "65536", "--", "true"},
                 "--master-port: expected an integer in [0, 65535], got '65536'"},
        BadFlags{"PortNegative",
                 {"--nproc-per-node", "2", "--master-port", "-5", "--", "true"},
                 "--master-port: expected an integer in [0, 65535], got '-5'"},
        BadFlags{"PickedPortWithTwoNodes",
                 {"--nproc-per-node", "2", "--nnodes", "2", "--", "true"},
                 "--master-port 0 (pick a free port) only works with --nnodes 1; give every "
                 "node the same port"},
        BadFlags{"NoSeparator", {"--nproc-per-node", "2"}, "expected '--' followed by a program to run"},
        BadFlags{"NothingAfterSeparator",
                 {"--nproc-per-node", "2", "--"},
                 "expected '--' followed by a program to run"},
        BadFlags{"ProgramWithoutSeparator",
                 {"--nproc-per-node", "2", "true"},
                 "expected '--' followed by a program to run"},
        BadFlags{"TimeoutNotANumber",
                 {"--nproc-per-node", "2", "--timeout", "soon", "--", "true"},
                 "--timeout: expected a non-negative integer (seconds), got 'soon'"},
        BadFlags{"MaxRestartsNegative",
                 {"--nproc-per-node", "2", "--max-restarts", "-1", "--", "true"},
                 "--max-restarts: expected a non-negative integer, got '-1'"},
        BadFlags{"RestartPortsPastTheLastPort",
                 {"--nproc-per-node", "2", "--master-port", "65530", "--max-restarts", "6", "--", "true"},
                 "--master-port 65530 + --max-restarts 6 exceeds 65535 (attempt k uses port + k)"},
        BadFlags{"PreemptGraceNotANumber",
                 {"--nproc-per-node", "2", "--preempt-grace-s", "x", "--", "true"},
                 "--preempt-grace-s: expected a non-negative integer (seconds), got 'x'"},
        BadFlags{"GraceNegative",
                 {"--nproc-per-node", "2", "--grace", "-1", "--", "true"},
                 "--grace: expected a non-negative integer (seconds), got '-1'"}),
    [](const auto& info) { return info.param.name; });

}  // namespace
