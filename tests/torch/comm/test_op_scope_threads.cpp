// One thread at a time issues ops on a group: a second thread's op on a group another thread is
// issuing on fails with a message (instead of interleaving differently on each rank), while two
// threads on two groups run side by side, as the asynchronous checkpoint writer does.
#include <gtest/gtest.h>

#include <atomic>
#include <numeric>
#include <thread>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm.h>

namespace hp = hyper_parallel;
using hp::comm::ReduceOp;

namespace {

// Whether the flight recorder shows an all_reduce on "world" that has not completed.
bool all_reduce_in_flight() {
  const std::string dump = hp::comm::flight_recorder_dump();
  for (size_t begin = 0, end; begin < dump.size(); begin = end + 1) {
    end = dump.find('\n', begin);
    if (end == std::string::npos) end = dump.size();
    const auto line = dump.substr(begin, end - begin);
    if (line.find(" all_reduce seq ") != std::string::npos && line.find(" on world:") != std::string::npos &&
        line.find("— done") == std::string::npos && line.find("— failed") == std::string::npos) {
      return true;
    }
  }
  return false;
}

// Rank 0's first op waits for its peers, which join only after rank 0's second thread has tried
// its op and failed (they wait in a barrier on another group meanwhile): no clock decides the
// order.
TEST(OpScopeThreads, SecondThreadOnTheSameGroupFails) {
  const auto world = hp::comm::world();
  if (world.size() < 2) GTEST_SKIP() << "needs a peer that keeps the first op waiting";
  std::vector<int64_t> ranks(static_cast<size_t>(world.size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  const auto release = hp::comm::new_group(ranks);
  const auto one = at::ones({4});
  if (world.rank() == 0) {
    at::Tensor first;
    std::atomic<bool> issuer_done{false};
    std::thread issuer([&] {
      try {
        first = hp::comm::all_reduce(one, ReduceOp::kSum, world);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "the first op failed: " << e.what();
      }
      issuer_done = true;
    });
    while (!all_reduce_in_flight() && !issuer_done) std::this_thread::yield();
    try {
      hp::comm::all_reduce(one, ReduceOp::kSum, world);
      ADD_FAILURE() << "expected the second thread's op to fail";
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("expected one thread at a time to issue ops on group"), std::string::npos)
          << message;
      EXPECT_NE(message.find("all_reduce"), std::string::npos) << message;
    }
    hp::comm::barrier(release);
    issuer.join();
    EXPECT_TRUE(at::equal(first, at::full({4}, static_cast<double>(world.size()))));
  } else {
    hp::comm::barrier(release);
    hp::comm::all_reduce(one, ReduceOp::kSum, world);
  }
  // The group still works, from any thread, one at a time.
  EXPECT_TRUE(at::equal(hp::comm::all_reduce(one, ReduceOp::kSum, world),
                        at::full({4}, static_cast<double>(world.size()))));
}

TEST(OpScopeThreads, TwoThreadsOnTwoGroupsRunSideBySide) {
  const auto world = hp::comm::world();
  std::vector<int64_t> ranks(static_cast<size_t>(world.size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  const auto other = hp::comm::new_group(ranks);
  constexpr int kOps = 40;
  const auto expected = at::full({16}, static_cast<double>(world.size() * (world.size() - 1) / 2));
  const auto mine = at::full({16}, static_cast<double>(world.rank()));
  int background_ok = 0;
  std::thread background([&] {
    hp::comm::CommRegion region("background");
    for (int i = 0; i < kOps; ++i)
      background_ok += at::equal(hp::comm::all_reduce(mine, ReduceOp::kSum, other), expected);
  });
  int foreground_ok = 0;
  {
    hp::comm::CommRegion region("foreground");
    for (int i = 0; i < kOps; ++i)
      foreground_ok += at::equal(hp::comm::all_reduce(mine, ReduceOp::kSum, world), expected);
  }
  background.join();
  EXPECT_EQ(background_ok, kOps);
  EXPECT_EQ(foreground_ok, kOps);
  // Each thread counts in its own regions.
  EXPECT_EQ(hp::comm::collective_count(hp::comm::CollectiveKind::kAllReduce, "background"), kOps);
  EXPECT_EQ(hp::comm::collective_count(hp::comm::CollectiveKind::kAllReduce, "foreground"), kOps);
}

}  // namespace
