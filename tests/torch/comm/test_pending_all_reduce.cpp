// PendingAllReduce: the direct two-phase all-reduce a gradient reducer starts per bucket. Equal
// to a float64 reference and bitwise equal on every rank, for world sizes 1..8 (non-powers of
// two included), sizes 0, 1, fewer than P and uneven blocks, several in flight at once.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <numeric>
#include <string>
#include <thread>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>

#include "common/test_util.h"

namespace comm = hyper_parallel::comm;

namespace {

comm::Group world() { return comm::world(); }

// Rank q's input: a deterministic function of (q, i), the same on every rank.
at::Tensor input_of(int64_t q, int64_t numel, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + q);
  return at::randn({numel}, gen, at::TensorOptions(at::kDouble)).to(dtype);
}

at::Tensor reference(int64_t numel, at::ScalarType dtype, comm::ReduceOp op) {
  auto sum = at::zeros({numel}, at::kDouble);
  for (int64_t q = 0; q < hp_test::world_size(); ++q) sum += input_of(q, numel, dtype).to(at::kDouble);
  return op == comm::ReduceOp::kAvg ? sum / double(hp_test::world_size()) : sum;
}

// Every rank's result, as float64, gathered (in float32 for the 16-bit dtypes is not needed:
// the gather is bitwise for any dtype).
void expect_equal_on_every_rank(const at::Tensor& result) {
  auto all = comm::all_gather(result.view({1, -1}), 0, world());
  for (int64_t q = 1; q < all.size(0); ++q) {
    EXPECT_TRUE(at::equal(all[q], all[0])) << "rank " << q << "'s result differs from rank 0's";
  }
}

TEST(PendingAllReduce, EqualsTheReferenceAndIsBitwiseEqualOnEveryRank) {
  const int64_t p = hp_test::world_size();
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (auto op : {comm::ReduceOp::kSum, comm::ReduceOp::kAvg}) {
      for (int64_t numel : {int64_t{0}, int64_t{1}, p - 1, 3 * p + 1, int64_t{1000}}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + comm::to_string(op) + " numel " +
                     std::to_string(numel));
        auto buffer = input_of(hp_test::rank(), numel, dtype);
        auto pending = comm::start_all_reduce(buffer, op, world());
        pending.wait();
        hp_test::expect_close(buffer, reference(numel, dtype, op).to(dtype));
        expect_equal_on_every_rank(buffer);
      }
    }
  }
}

TEST(PendingAllReduce, SeveralInFlightCompleteOnTheirOwnAndCountOneAllReduceEach) {
  const int64_t n = 5;
  std::vector<at::Tensor> buffers;
  std::vector<comm::PendingAllReduce> pending;
  comm::reset_collective_counts();
  for (int64_t k = 0; k < n; ++k) {
    buffers.push_back(input_of(hp_test::rank(), 100 * (k + 1), at::kBFloat16));
    pending.push_back(comm::start_all_reduce(buffers.back(), comm::ReduceOp::kSum, world(),
                                             comm::Agreement::kAgreedInAdvance));
  }
  EXPECT_EQ(comm::collective_count(comm::CollectiveKind::kAllReduce), n);
  // Nobody waits: the all-reduces complete on their own (is_completed() never blocks).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (bool all_done = false; !all_done && std::chrono::steady_clock::now() < deadline;) {
    all_done = true;
    for (auto& w : pending) all_done = w.is_completed() && all_done;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (int64_t k = 0; k < n; ++k) {
    EXPECT_TRUE(pending[k].is_completed());
    pending[k].wait();  // a no-op now
    hp_test::expect_close(buffers[k],
                          reference(100 * (k + 1), at::kBFloat16, comm::ReduceOp::kSum).to(at::kBFloat16));
  }
}

// Both phases' bytes count in the starting thread's region, though the second phase is sent
// from the completion thread: (P - 1) / P of the tensor each.
TEST(PendingAllReduce, CountsBothPhasesInTheStartingThreadsRegion) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank(), numel = 1001;
  auto buffer = input_of(r, numel, at::kFloat);
  comm::reset_collective_counts();
  {
    comm::CommRegion region("grads");
    comm::start_all_reduce(buffer, comm::ReduceOp::kAvg, world()).wait();
  }
  const int64_t own = comm::chunk_size(numel, p, r);
  EXPECT_EQ(comm::payload_bytes_sent("grads"), 4 * ((numel - own) + (p - 1) * own));
  EXPECT_EQ(comm::payload_bytes_sent(), comm::payload_bytes_sent("grads"));
}

// The calling thread's blocked seconds in region "late", per op.
std::map<std::string, double> exposed_in_late_region() {
  std::map<std::string, double> out;
  for (const auto& w : comm::exposed_waits()) {
    if (w.region == "late") out[w.op] += w.seconds;
  }
  return out;
}

// Seconds `fn` takes on this thread's clock.
template <typename Fn>
double seconds_of(Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Exposed waits: the time a caller is blocked, under its region and op. Rank 0 arrives late, so
// the others block in the all_gather and in a started all-reduce's wait(). Whatever the load:
// only the caller's own ops appear (the completion thread's waits for the late partials are its
// own: they would show under another op, or make the wait() longer than the call), each within
// the call it was blocked in, and a rank that waited for a late peer recorded a wait.
TEST(PendingAllReduce, ExposedWaitsAreTheCallersBlockedTimeOnly) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  auto late = [&] {
    if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  };
  comm::barrier(world());
  comm::reset_collective_counts();
  double gather_s = 0, wait_s = 0;
  {
    comm::CommRegion region("late");
    late();
    gather_s = seconds_of([&] { comm::all_gather(at::ones({64}), 0, world()); });
    comm::barrier(world());
    late();
    auto pending = comm::start_all_reduce(at::ones({4096}), comm::ReduceOp::kSum, world(),
                                          comm::Agreement::kAgreedInAdvance);
    wait_s = seconds_of([&] { pending.wait(); });
  }
  const auto waits = exposed_in_late_region();
  for (const auto& [op, seconds] : waits) {
    EXPECT_TRUE(op == "all_gather" || op == "barrier" || op == "pending all_reduce")
        << op << ": another thread's waits were counted as this one's (" << seconds << " s)";
  }
  if (p == 1) return;  // nothing travels: nothing to wait for
  if (waits.count("all_gather")) {
    EXPECT_LE(waits.at("all_gather"), gather_s);
  }
  if (waits.count("pending all_reduce")) {
    EXPECT_LE(waits.at("pending all_reduce"), wait_s);
  }
  if (r != 0) {
    ASSERT_EQ(waits.count("all_gather"), 1u);
    EXPECT_GT(waits.at("all_gather"), 0);
    ASSERT_EQ(waits.count("pending all_reduce"), 1u);
    EXPECT_GT(waits.at("pending all_reduce"), 0);
  }
  comm::reset_collective_counts();
  EXPECT_TRUE(comm::exposed_waits().empty());
}

// The last line of the flight recorder's dump that names an all_reduce.
std::string last_all_reduce() {
  std::string dump = comm::flight_recorder_dump(), last;
  for (size_t begin = 0, end; begin < dump.size(); begin = end + 1) {
    end = dump.find('\n', begin);
    if (end == std::string::npos) end = dump.size();
    const auto line = dump.substr(begin, end - begin);
    if (line.find(" all_reduce seq ") != std::string::npos) last = line;
  }
  return last;
}

// Rank 0 starts its all-reduce only once every other rank has seen, in its flight recorder, its
// own started all-reduce's phase 2 waiting on rank 0 (they say so in a barrier on a second
// group): no clock decides the order. A record that never shows it fails at HP_TIMEOUT_S, when
// the op itself fails.
TEST(PendingAllReduce, TheFlightRecorderKeepsTheOpOpenUntilItCompletes) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  std::vector<int64_t> ranks(static_cast<size_t>(p));
  std::iota(ranks.begin(), ranks.end(), 0);
  const auto release = comm::new_group(ranks);
  comm::barrier(world());
  auto start = [] {
    return comm::start_all_reduce(at::ones({4096}), comm::ReduceOp::kSum, world(),
                                  comm::Agreement::kAgreedInAdvance);
  };
  if (r == 0) {
    comm::barrier(release);
    auto pending = start();
    pending.wait();
  } else {
    auto pending = start();
    std::string line = last_all_reduce();
    while (line.find("waiting on rank 0") == std::string::npos &&
           line.find("— failed") == std::string::npos) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      line = last_all_reduce();
    }
    EXPECT_NE(line.find("waiting on rank 0"), std::string::npos) << line;
    EXPECT_EQ(line.find("— done"), std::string::npos) << line;
    comm::barrier(release);
    pending.wait();
  }
  const auto line = last_all_reduce();
  EXPECT_NE(line.find("— done"), std::string::npos) << line;
}

int64_t thread_count() {
  int64_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Each group's started collectives complete on a thread of that group's; a loop of short-lived
// groups must not leave one thread per group behind. Eight groups live at once, so that they have
// distinct addresses (the threads were once kept per address).
TEST(PendingAllReduce, AGroupsCompletionThreadEndsWithTheGroup) {
  if (hp_test::world_size() < 2) GTEST_SKIP() << "a group of one rank completes at once";
  std::vector<int64_t> ranks(static_cast<size_t>(hp_test::world_size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  comm::start_all_reduce(at::ones({8}), comm::ReduceOp::kSum, world()).wait();
  const int64_t before = thread_count();
  {
    std::vector<comm::Group> groups;
    for (int i = 0; i < 8; ++i) groups.push_back(comm::new_group(ranks));
    for (const auto& group : groups) {
      auto buffer = at::ones({8});
      comm::start_all_reduce(buffer, comm::ReduceOp::kSum, group).wait();
      EXPECT_EQ(buffer[0].item<float>(), float(hp_test::world_size()));
    }
    EXPECT_GT(thread_count(), before);
  }
  // A group may die on its completion thread (its last handle is the finished job's): wait.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (thread_count() > before && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_LE(thread_count(), before) << "threads left behind by eight destroyed groups";
  comm::barrier(world());
}

TEST(PendingAllReduce, RejectsWhatItCannotReduce) {
  HP_EXPECT_THROW_MSG(comm::start_all_reduce(at::ones({4}, at::kLong), comm::ReduceOp::kSum, world()),
                      "hyper_parallel::comm::start_all_reduce: expected a floating-point tensor, got Long");
  HP_EXPECT_THROW_MSG(
      comm::start_all_reduce(at::ones({4, 4}).t(), comm::ReduceOp::kSum, world()),
      "hyper_parallel::comm::start_all_reduce: expected a contiguous buffer, got strides [1, 4]");
}

}  // namespace
