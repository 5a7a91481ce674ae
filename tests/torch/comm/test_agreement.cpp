// Ranks that disagree get a clear c10::Error on every rank, before any payload moves, and the
// group stays usable: shapes, dtypes, chunk counts, call order, a skipped call, a zero-row
// shard; the apply-time check of parallelize_module; and a randomized run of many ops in one
// launch, each ending equal to a single-process reference or with an agreement error on all
// ranks. Runs at world sizes 2, 3 and 4, with HP_TIMEOUT_S at its default (a timeout would
// take minutes and fail the test's time bounds).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>

#include <hyper_parallel/hyper_parallel.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;
using hp::comm::ReduceOp;

namespace {

using Clock = std::chrono::steady_clock;

// Runs `call` on every rank; expects a c10::Error naming `op` and "disagree" on every rank
// within 5 s, then a correct collective on the same group.
void expect_disagreement(const std::string& op, const std::function<void()>& call) {
  auto world = hp::comm::world();
  const auto start = Clock::now();
  std::string message;
  try {
    call();
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_NE(message.find("disagree on " + op), std::string::npos) << "message: " << message;
  EXPECT_NE(message.find("rank 0 (global 0)"), std::string::npos) << message;
  EXPECT_NE(message.find("No data was sent"), std::string::npos) << message;
  EXPECT_LT(seconds, 5.0);
  // The group is still usable.
  auto sum = hp::comm::all_reduce(at::ones({3}), ReduceOp::kSum, world);
  EXPECT_TRUE(sum.equal(at::full({3}, double(world.size()))));
}

class Agreement : public ::testing::Test {
 protected:
  void SetUp() override {
    if (hp_test::world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  }
  hp::comm::Group world = hp::comm::world();
  int64_t p = world.size(), r = world.rank();
};

TEST_F(Agreement, DifferentSequenceLengthsInAllGather) {
  expect_disagreement("all_gather", [&] { hp::comm::all_gather(at::ones({4 + (r == 1), 8}), 0, world); });
}

TEST_F(Agreement, DifferentHiddenSizesInReduceScatterAndAllReduce) {
  expect_disagreement("reduce_scatter", [&] {
    hp::comm::reduce_scatter(at::ones({4 * p, r == 0 ? 16 : 8}), 0, ReduceOp::kSum, world);
  });
  expect_disagreement("all_reduce",
                      [&] { hp::comm::all_reduce(at::ones({r == 0 ? 10 : 12}), ReduceOp::kSum, world); });
}

TEST_F(Agreement, DifferentDtypes) {
  expect_disagreement("all_gather", [&] {
    hp::comm::all_gather(at::ones({4, 8}, r == 0 ? at::kBFloat16 : at::kFloat), 0, world);
  });
}

// A kind is its name: ranks that call different ops (one of them defined above comm) disagree,
// and every rank's message names each rank's op.
TEST_F(Agreement, DifferentKindsAreNamedForEveryRank) {
  auto x = at::ones({4, 32}, at::kBFloat16), w = at::ones({16, 32}, at::kBFloat16);
  expect_disagreement(r == 0 ? "all_gather_matmul" : "all_gather", [&] {
    try {
      if (r == 0) {
        tp::all_gather_matmul(x, w, world, tp::MC2Options().chunks_per_rank(1));
      } else {
        hp::comm::all_gather(x, 0, world);
      }
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("rank 0 (global 0): call"), std::string::npos) << message;
      EXPECT_NE(message.find(", all_gather_matmul BFloat16"), std::string::npos) << message;
      EXPECT_NE(message.find("rank 1 (global 1): call"), std::string::npos) << message;
      EXPECT_NE(message.find(", all_gather BFloat16"), std::string::npos) << message;
      throw;
    }
  });
}

// Names of up to CollectiveKind::kMaxNameLength characters travel whole; a longer one is refused
// where the kind is made.
TEST_F(Agreement, KindNamesOfTheLongestLengthTravelWhole) {
  static constexpr hp::comm::CollectiveKind kLongest{"op_name_of_24_characters"};
  static_assert(std::char_traits<char>::length(kLongest.name()) == hp::comm::CollectiveKind::kMaxNameLength);
  hp::comm::OpSignature sig{kLongest, at::kFloat, {4 + r, 0, 0, 0}, {"rows"}};
  try {
    const hp::comm::OpScope op(world, sig, "longest name");
    ADD_FAILURE() << "expected the ranks to disagree on rows";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("rank 1 (global 1): call"), std::string::npos) << message;
    EXPECT_NE(message.find(", op_name_of_24_characters Float rows=5"), std::string::npos) << message;
  }
  const std::string too_long(hp::comm::CollectiveKind::kMaxNameLength + 1, 'x');
  try {
    hp::comm::CollectiveKind{too_long.c_str()};
    ADD_FAILURE() << "expected std::invalid_argument for a name of " << too_long.size() << " characters";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "CollectiveKind: expected a name of 1 to 24 characters, got '" + too_long + "' (25)");
  }
  EXPECT_THROW(hp::comm::CollectiveKind{""}, std::invalid_argument);
}

TEST_F(Agreement, FusedOpsWithDifferentShapesOrChunkCounts) {
  auto w = at::ones({16, 32}, at::kBFloat16);
  // m, k and chunks_per_rank differ by rank; n differs in the row-parallel op.
  expect_disagreement("all_gather_matmul", [&] {
    tp::all_gather_matmul(at::ones({4 + r, 32}, at::kBFloat16), w, world);
  });
  expect_disagreement("all_gather_matmul", [&] {
    tp::all_gather_matmul(at::ones({4, r == 0 ? 32 : 16}, at::kBFloat16),
                          at::ones({16, r == 0 ? 32 : 16}, at::kBFloat16), world);
  });
  expect_disagreement("all_gather_matmul", [&] {
    tp::all_gather_matmul(at::ones({4, 32}, at::kBFloat16), w, world,
                          tp::MC2Options().chunks_per_rank(1 + r));
  });
  expect_disagreement("matmul_reduce_scatter", [&] {
    tp::matmul_reduce_scatter(at::ones({2 * p, 32}, at::kBFloat16),
                              at::ones({r == 0 ? 16 : 24, 32}, at::kBFloat16), world);
  });
}

// kAutoChunks: each rank proposes its own count and all take rank 0's; every rank must propose.
TEST_F(Agreement, ProposedChunkCountsSettleOnRankZeros) {
  for (int i = 0; i < 2; ++i) {
    hp::comm::OpSignature sig{tp::kAllGatherMatmulKind, at::kBFloat16, {4, 32, 0, 0}};
    sig.chunks = 1 + r + i;  // the ranks' estimates differ
    sig.chunks_proposed = true;
    const hp::comm::OpScope op(world, sig, "proposals");
    EXPECT_EQ(op.chunks(), 1 + i);
  }
  // The op itself: the same on every rank, equal to a fixed count's result.
  auto x = at::arange(4 * 32, at::kFloat).reshape({4, 32}).div(128).add(r).to(at::kBFloat16);
  auto w = at::arange(16 * 32, at::kFloat).reshape({16, 32}).div(512).to(at::kBFloat16);
  EXPECT_TRUE(
      tp::all_gather_matmul(x, w, world)
          .first.equal(tp::all_gather_matmul(x, w, world, tp::MC2Options().chunks_per_rank(2)).first));
  // Automatic on one rank, fixed on the others: they disagree (the group's link is measured).
  expect_disagreement("all_gather_matmul", [&] {
    tp::all_gather_matmul(x, w, world, tp::MC2Options().chunks_per_rank(r == 0 ? 0 : 2));
  });
}

// A bad count is checked once the ranks agreed: on one rank, the agreement error on all (not a
// wait for the transport's timeout on the others); on all, the count's error on all.
TEST_F(Agreement, ABadChunkCountFailsOnEveryRank) {
  auto x = at::ones({4, 32}, at::kBFloat16), w = at::ones({16, 32}, at::kBFloat16);
  expect_disagreement("all_gather_matmul", [&] {
    tp::all_gather_matmul(x, w, world, tp::MC2Options().chunks_per_rank(r == 0 ? -1 : 2));
  });
  expect_disagreement("matmul_reduce_scatter", [&] {
    tp::matmul_reduce_scatter(at::ones({2 * p, 32}, at::kBFloat16), w, world,
                              tp::MC2Options().chunks_per_rank(r == p - 1 ? -3 : 0));
  });
  HP_EXPECT_THROW_MSG(tp::all_gather_matmul(x, w, world, tp::MC2Options().chunks_per_rank(-1)),
                      "expected chunks_per_rank >= 1, or kAutoChunks (0: chosen per op), got -1");
}

// The first automatic op of a group measures its link, a collective: a rank that calls another
// op there gets the agreement error instead of a hang.
TEST_F(Agreement, FirstAutomaticOpOfAGroupAgainstAFixedOne) {
  std::vector<int64_t> all(p);
  for (int64_t q = 0; q < p; ++q) all[q] = q;
  const auto fresh = hp::comm::new_group(all);
  auto x = at::ones({4, 32}, at::kBFloat16), w = at::ones({16, 32}, at::kBFloat16);
  std::string message;
  try {
    tp::all_gather_matmul(x, w, fresh, tp::MC2Options().chunks_per_rank(r == 0 ? 0 : 2));
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  EXPECT_NE(message.find(r == 0 ? "disagree on link_probe" : "disagree on all_gather_matmul"),
            std::string::npos)
      << message;
  EXPECT_TRUE(tp::all_gather_matmul(x, w, fresh).first.equal(at::full({4 * p, 16}, 32, at::kBFloat16)));
}

TEST_F(Agreement, FusedOpsAllowUnevenShardsOfTheLocalExtent) {
  // A weight whose sharded dim does not divide by the world size has torch.chunk shards: the
  // gather's n and the reduce-scatter's k_l differ between ranks, and the ops still run.
  const int64_t extent = 4 * p + 1, m = 3, k = 8;
  auto full_w = at::arange(extent * k, at::kDouble).reshape({extent, k}).div(extent * k);
  auto shard = full_w.chunk(p, 0)[r];  // out features of the column op
  auto x_all = at::arange(p * m * k, at::kDouble).reshape({p * m, k}).div(p * m * k).sub(0.3);
  auto [y, gathered] = tp::all_gather_matmul(x_all.narrow(0, r * m, m).contiguous(), shard, world);
  hp_test::expect_close(y, x_all.matmul(shard.t()), "all_gather_matmul with n differing by rank");
  auto in_shard = full_w.t().contiguous().chunk(p, 1)[r].contiguous();  // [k, extent_r]: row op
  auto x_rows = at::arange(p * m * extent, at::kDouble).reshape({p * m, extent}).div(p * m * extent);
  auto out = tp::matmul_reduce_scatter(x_rows.chunk(p, 1)[r].contiguous(), in_shard, world);
  hp_test::expect_close(out, x_rows.matmul(full_w).narrow(0, r * m, m),
                        "matmul_reduce_scatter with k differing by rank");
}

TEST_F(Agreement, ZeroRowShardOnOneRank) {
  // The rank with no rows would send nothing and the others would wait for the full timeout.
  auto w = at::ones({16, 32}, at::kBFloat16);
  expect_disagreement("all_gather_matmul", [&] {
    tp::all_gather_matmul(at::ones({r == p - 1 ? 0 : 4, 32}, at::kBFloat16), w, world);
  });
}

TEST_F(Agreement, CallSequenceDivergesOnTheSecondCall) {
  expect_disagreement(r == 0 ? "all_gather" : "reduce_scatter", [&] {
    hp::comm::all_gather(at::ones({4}), 0, world);  // call 1: every rank agrees
    if (r == 0) {
      hp::comm::all_gather(at::ones({4}), 0, world);
    } else {
      hp::comm::reduce_scatter(at::ones({4 * p}), 0, ReduceOp::kSum, world);
    }
  });
}

TEST_F(Agreement, ARankThatSkipsACall) {
  // The last rank skips the all_gather and goes on to the barrier.
  expect_disagreement(r == p - 1 ? "barrier" : "all_gather", [&] {
    if (r != p - 1) hp::comm::all_gather(at::ones({4}), 0, world);
    hp::comm::barrier(world);
  });
}

TEST_F(Agreement, ContentsNamedByTheCallerAreCompared) {
  const int64_t content = r == 0 ? 1 : 2;
  expect_disagreement("reduce_scatter", [&] {
    hp::comm::start_reduce_scatter(at::ones({4 * p}), ReduceOp::kSum, world, hp::comm::Agreement::kPerOp,
                                   content)
        .wait();
  });
  // The row-sparse ops of an embedding's table too.
  expect_disagreement("reduce_scatter", [&] {
    hp::comm::start_row_sparse_reduce_scatter(at::ones({4 * p}), 2, ReduceOp::kSum, world,
                                              hp::comm::Agreement::kPerOp, content)
        .wait();
  });
  expect_disagreement("all_gather", [&] {
    const int64_t rows = 3 * p;
    hp::comm::gather_rows(at::ones({3, 4}), rows, at::arange(rows), world, content);
  });
}

// Ops agreed in advance make no round trip of their own: two started in another order on rank 0
// (one size, contents named) are an error at the group's next agreement, on every rank; in the
// same order, none.
TEST_F(Agreement, OpsAgreedInAdvanceInAnotherOrderFailAtTheNextAgreement) {
  auto start_two = [&](int64_t first, int64_t second) {
    std::vector<hp::comm::PendingReduceScatter> started;
    for (int64_t content : {first, second}) {
      started.push_back(hp::comm::start_reduce_scatter(at::ones({4 * p}), ReduceOp::kSum, world,
                                                       hp::comm::Agreement::kAgreedInAdvance, content));
    }
    for (auto& s : started) s.wait();
  };
  start_two(1, 2);
  hp::comm::barrier(world);
  std::string message;
  try {
    if (r == 0) {
      start_two(2, 1);
    } else {
      start_two(1, 2);
    }
    hp::comm::barrier(world);
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  EXPECT_NE(message.find("agree on barrier"), std::string::npos) << message;
  EXPECT_NE(message.find("started different ops agreed in advance before it"), std::string::npos) << message;
  EXPECT_NE(message.find("before it 2 ops agreed in advance from call"), std::string::npos) << message;
  // The group is still usable, and its next agreement covers only what follows.
  start_two(1, 2);
  auto sum = hp::comm::all_reduce(at::ones({3}), ReduceOp::kSum, world);
  EXPECT_TRUE(sum.equal(at::full({3}, double(p))));
}

TEST_F(Agreement, ParallelizeModuleNamesTheModuleAndTheRanks) {
  // Rank 1 builds its feed-forward with another hidden size.
  auto mesh = hp::dtensor::init_device_mesh("cpu", {p}, {"tp"});
  torch::nn::Sequential model;
  model->push_back("w1", hp::nn::Linear(64, r == 1 ? 256 : 128));
  std::string message;
  try {
    tp::parallelize_module(*model, mesh, {{"w1", std::make_shared<tp::ColwiseParallel>()}});
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  EXPECT_NE(message.find("parallelize_module: ranks of world disagree on what they parallelize"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("rank 0 (global 0) has w1: ColwiseParallel weight Float[128, 64]"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("rank 1 (global 1) has w1: ColwiseParallel weight Float[256, 64]"),
            std::string::npos)
      << message;
  // Nothing was sharded.
  EXPECT_EQ(model->named_parameters()["w1.weight"].size(1), 64);
  EXPECT_EQ(model->named_parameters()["w1.weight"].size(0), r == 1 ? 256 : 128);
}

// ---- Randomized: many ops in one launch; one run in five has a rank that disagrees ---------

enum class RandomOp {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kAllToAll,
  kBroadcast,
  kAllGatherMatmul,
  kMatmulReduceScatter
};
constexpr int kRandomOps = 7;

// Small integers, exact in every dtype and in their sums: the reference is exact.
at::Tensor values(int64_t run, int64_t rank, at::IntArrayRef shape, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * run + rank);
  return at::randint(-3, 4, shape, gen, at::kLong).to(dtype);
}

TEST_F(Agreement, RandomizedRunsEndEqualOrWithAnErrorOnAllRanks) {
  const char* env = std::getenv("HP_AGREEMENT_RUNS");
  const int64_t runs = env ? std::atoll(env) : 20;
  int64_t perturbed_runs = 0, errors = 0;
  for (int64_t run = 0; run < runs; ++run) {
    std::mt19937_64 rng(77 + run);  // the same draws on every rank
    const auto op = static_cast<RandomOp>(rng() % kRandomOps);
    const bool fused = op == RandomOp::kAllGatherMatmul || op == RandomOp::kMatmulReduceScatter;
    const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf, at::kLong};
    const auto dtype = dtypes[rng() % (fused ? 3 : 4)];
    const int64_t rows = 1 + rng() % 6, cols = 1 + rng() % 9, chunks = 1 + rng() % 3;
    const bool perturb = rng() % 5 == 0;
    const int64_t victim = rng() % p;
    const bool skip = rng() % 2 == 0;
    const bool me = perturb && victim == r;
    perturbed_runs += perturb;
    SCOPED_TRACE("run " + std::to_string(run) + " op " + std::to_string(static_cast<int>(op)) + " " +
                 c10::toString(dtype) + (perturb ? (skip ? " skip" : " perturbed") : ""));
    const int64_t my_rows = rows + (me && !skip ? 1 : 0);
    const auto start = Clock::now();
    bool error = false;
    at::Tensor out, ref;
    try {
      if (!(me && skip)) {
        switch (op) {
          case RandomOp::kAllGather: {
            out = hp::comm::all_gather(values(run, r, {my_rows, cols}, dtype), 0, world);
            std::vector<at::Tensor> all;
            for (int64_t q = 0; q < p; ++q) all.push_back(values(run, q, {rows, cols}, dtype));
            ref = at::cat(all);
            break;
          }
          case RandomOp::kReduceScatter:
          case RandomOp::kAllReduce: {
            auto sum = at::zeros({p * rows, cols}, at::kLong);
            for (int64_t q = 0; q < p; ++q) sum += values(run, q, {p * rows, cols}, at::kLong);
            auto mine = values(run, r, {p * my_rows, cols}, dtype);
            if (op == RandomOp::kReduceScatter) {
              out = hp::comm::reduce_scatter(mine, 0, ReduceOp::kSum, world);
              ref = sum.narrow(0, r * rows, rows).to(dtype);
            } else {
              out = hp::comm::all_reduce(mine, ReduceOp::kSum, world);
              ref = sum.to(dtype);
            }
            break;
          }
          case RandomOp::kAllToAll: {
            out = hp::comm::all_to_all(values(run, r, {p * my_rows, cols}, dtype), 0, 1, world);
            std::vector<at::Tensor> pieces;
            for (int64_t q = 0; q < p; ++q)
              pieces.push_back(values(run, q, {p * rows, cols}, dtype).narrow(0, r * rows, rows));
            ref = at::cat(pieces, 1);
            break;
          }
          case RandomOp::kBroadcast:
            out = hp::comm::broadcast(values(run, r, {my_rows, cols}, dtype), 0, world);
            ref = values(run, 0, {rows, cols}, dtype);
            break;
          case RandomOp::kAllGatherMatmul: {
            auto w = values(run, 99, {5, cols}, dtype);
            out = tp::all_gather_matmul(values(run, r, {my_rows, cols}, dtype), w, world,
                                        tp::MC2Options().chunks_per_rank(chunks))
                      .second;
            std::vector<at::Tensor> all;
            for (int64_t q = 0; q < p; ++q) all.push_back(values(run, q, {rows, cols}, dtype));
            ref = at::cat(all);
            break;
          }
          case RandomOp::kMatmulReduceScatter: {
            auto w = values(run, 99, {5, cols}, dtype);
            out = tp::matmul_reduce_scatter(values(run, r, {p * my_rows, cols}, dtype), w, world,
                                            tp::MC2Options().chunks_per_rank(chunks));
            auto sum = at::zeros({p * rows, 5}, at::kDouble);
            for (int64_t q = 0; q < p; ++q) {
              sum += at::mm(values(run, q, {p * rows, cols}, at::kDouble), w.to(at::kDouble).t());
            }
            ref = sum.narrow(0, r * rows, rows);
            break;
          }
        }
      }
      hp::comm::barrier(world);
    } catch (const c10::Error& e) {
      error = true;
      EXPECT_NE(std::string(e.what()).find("disagree on"), std::string::npos) << e.what_without_backtrace();
    }
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);
    // Every rank reached the same verdict.
    auto verdicts = hp::comm::all_gather(at::full({1}, int64_t{error}), 0, world);
    EXPECT_TRUE(verdicts.eq(int64_t{error}).all().item<bool>()) << verdicts;
    EXPECT_EQ(error, perturb) << "an agreement error exactly when a rank disagreed";
    errors += error;
    if (!error && !(me && skip) && ref.defined()) {
      if (op == RandomOp::kMatmulReduceScatter) {
        hp_test::expect_close(out, ref, "matmul_reduce_scatter");
      } else {
        EXPECT_TRUE(out.equal(ref)) << "result differs from the single-process reference";
      }
    }
  }
  if (r == 0) {
    std::printf(
        "randomized agreement: %lld runs on %lld ranks, %lld with a disagreeing rank, %lld "
        "agreement errors, 0 aborts, 0 timeouts\n",
        static_cast<long long>(runs), static_cast<long long>(p), static_cast<long long>(perturbed_runs),
        static_cast<long long>(errors));
  }
}

}  // namespace
