// DTensor: every redistribute transition, forward and backward, against a single-process
// reference in float64, on 1-d meshes of every world size and on a 2-d mesh.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/dtensor.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
using namespace hp::dtensor;
using hp::comm::CollectiveKind;
using hp_test::expect_close;

namespace {

// The local shard of a full tensor under `placements` on this rank (reference, no
// communication). Partial(sum) mesh dims hold the full value scaled by a weight w(k) with
// sum_k w(k) = 1; Partial(avg) ones by n w(k), so that the mean is the full value.
at::Tensor reference_local(const at::Tensor& full, const DeviceMesh& mesh, const Placements& pl) {
  auto shape = full.sizes().vec();
  auto lshape = local_shape(shape, mesh.shape(), mesh.coordinate(), pl);
  auto loff = local_offset(shape, mesh.shape(), mesh.coordinate(), pl);
  auto x = full;
  for (size_t d = 0; d < shape.size(); ++d) x = x.narrow(d, loff[d], lshape[d]);
  x = x.clone();
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    if (!pl[i].is_partial()) continue;
    const int64_t n = mesh.size(i), k = mesh.get_local_rank(i);
    const double w = double(k + 1) / double(n * (n + 1) / 2);
    x = x * (pl[i].reduce_op() == hp::comm::ReduceOp::kAvg ? n * w : w);
  }
  return x;
}

std::string name(const Placements& from, const Placements& to) {
  return to_string(from) + " -> " + to_string(to);
}

// Forward: the result holds the right shard of the same global value. Backward: with an upstream
// gradient G laid out as the result (Partial read as Replicate), the gradient reaching the input's
// local tensor is G laid out as the input (Partial read as Replicate).
void check_transition(const DeviceMesh& mesh, const std::vector<int64_t>& shape, const Placements& from,
                      const Placements& to) {
  at::manual_seed(7);  // same on every rank
  auto full = at::randn(shape, at::kDouble);
  auto upstream = at::randn(shape, at::kDouble);
  auto local = reference_local(full, mesh, from).requires_grad_(true);
  auto x = DTensor::from_local(local, mesh, from, FromLocalOptions().shape(shape));
  auto y = x.redistribute(to);
  EXPECT_EQ(y.placements(), to) << name(from, to);
  EXPECT_EQ(y.shape(), shape);
  auto out = y.to_local();
  Placements to_grad;
  for (const auto& p : to) to_grad.push_back(p.for_gradient());
  if (std::none_of(to.begin(), to.end(), [](const Placement& p) { return p.is_partial(); })) {
    expect_close(out, reference_local(full, mesh, to), name(from, to) + " forward");
  }
  expect_close(y.full_tensor(), full, name(from, to) + " full_tensor");
  (out * reference_local(upstream, mesh, to_grad)).sum().backward();
  Placements from_grad;
  for (const auto& p : from) from_grad.push_back(p.for_gradient());
  ASSERT_TRUE(local.grad().defined()) << name(from, to);
  expect_close(local.grad(), reference_local(upstream, mesh, from_grad), name(from, to) + " backward");
}

const Placements kOneDim[] = {
    {Shard(0)}, {Shard(1)}, {Replicate()}, {Partial()}, {Partial(hp::comm::ReduceOp::kAvg)}};

TEST(Redistribute, EveryTransitionOnOneDimMeshEvenAndUneven) {
  auto mesh = init_device_mesh("cpu", {hp_test::world_size()});
  for (auto shape : {std::vector<int64_t>{8, 12}, std::vector<int64_t>{5, 7}, std::vector<int64_t>{1, 3}}) {
    for (const auto& from : kOneDim) {
      for (const auto& to : kOneDim) {
        SCOPED_TRACE(name(from, to) + " shape " + std::to_string(shape[0]) + "x" + std::to_string(shape[1]));
        check_transition(mesh, shape, from, to);
      }
    }
  }
}

TEST(Redistribute, EveryTransitionOnTwoDimMesh) {
  if (hp_test::world_size() != 4) GTEST_SKIP() << "needs 4 ranks (2x2 mesh)";
  auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  const Placement options[] = {Shard(0), Shard(1), Replicate(), Partial()};
  std::vector<Placements> all;
  for (const auto& a : options)
    for (const auto& b : options) all.push_back({a, b});
  for (const auto& from : all) {
    for (const auto& to : all) {
      SCOPED_TRACE(name(from, to));
      check_transition(mesh, {7, 5}, from, to);
    }
  }
}

TEST(Redistribute, OneDimCollectivesMatchTheSemantics) {
  const int64_t p = hp_test::world_size();
  auto mesh = init_device_mesh("cpu", {p});
  struct Case {
    Placements from, to;
    CollectiveKind forward;
    std::optional<CollectiveKind> backward;  // nullopt: no collective
  };
  const Case cases[] = {
      {{Shard(0)}, {Replicate()}, CollectiveKind::kAllGather, std::nullopt},  // grad R -> S: slice
      {{Partial()}, {Replicate()}, CollectiveKind::kAllReduce, std::nullopt},
      {{Partial()}, {Shard(0)}, CollectiveKind::kReduceScatter, CollectiveKind::kAllGather},
      {{Shard(0)}, {Shard(1)}, CollectiveKind::kAllToAll, CollectiveKind::kAllToAll},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(name(c.from, c.to));
    auto local = at::ones({4, 4}, at::kDouble).requires_grad_(true);
    auto x = DTensor::from_local(local, mesh, c.from);
    hp::comm::reset_collective_counts();
    at::Tensor out;
    {
      hp::comm::CommRegion region("forward");
      out = x.redistribute(c.to).to_local();
    }
    {
      hp::comm::CommRegion region("backward");
      out.sum().backward();
    }
    EXPECT_EQ(hp::comm::total_collective_count("forward"), 1) << hp::comm::collective_counts_summary();
    EXPECT_EQ(hp::comm::collective_count(c.forward, "forward"), 1);
    EXPECT_EQ(hp::comm::total_collective_count("backward"), c.backward ? 1 : 0)
        << hp::comm::collective_counts_summary();
    if (c.backward) {
      EXPECT_EQ(hp::comm::collective_count(*c.backward, "backward"), 1);
    }
  }
  // Replicate -> Shard is a local slice both ways... forward slice, backward all_gather.
  auto local = at::ones({4, 4}, at::kDouble).requires_grad_(true);
  hp::comm::reset_collective_counts();
  auto out = DTensor::from_local(local, mesh, {Replicate()}).redistribute({Shard(0)}).to_local();
  EXPECT_EQ(hp::comm::total_collective_count(), 0);
  out.sum().backward();
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllGather), 1);
}

TEST(Redistribute, PartialGradientTurnsAllGatherBackwardIntoReduceScatter) {
  // Column-parallel pattern: the sequence-sharded input is gathered, then consumed by a matmul
  // whose input gradient is Partial, so backward must reduce-scatter (Megatron's
  // gather_from_sequence_parallel_region).
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  auto mesh = init_device_mesh("cpu", {p});
  auto local = at::full({2, 3}, double(r), at::kDouble).requires_grad_(true);
  auto x = DTensor::from_local(local, mesh, {Shard(0)});
  hp::comm::reset_collective_counts();
  auto gathered = x.redistribute({Replicate()}).to_local({Partial()});
  EXPECT_EQ(gathered.size(0), 2 * p);
  // Each rank's gradient contribution is (rank + 1); the sum over ranks reaches every shard.
  (gathered * double(r + 1)).sum().backward();
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kReduceScatter), 1);
  expect_close(local.grad(), at::full({2, 3}, double(p * (p + 1) / 2), at::kDouble));
}

TEST(DistributeTensor, BroadcastsFromSourceAndGathersGradient) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  auto mesh = init_device_mesh("cpu", {p});
  auto mine = at::full({2 * p + 1, 2}, double(r), at::kDouble).requires_grad_(true);
  const int64_t src = p - 1;
  auto d = distribute_tensor(mine, mesh, {Shard(0)}, src);
  auto expected = at::full({2 * p + 1, 2}, double(src), at::kDouble);
  expect_close(d.full_tensor(), expected);
  d.to_local().sum().backward();
  expect_close(mine.grad(), at::ones({2 * p + 1, 2}, at::kDouble));
  // Without a source, every rank shards its own data: no communication.
  hp::comm::reset_collective_counts();
  auto own = distribute_tensor(mine.detach(), mesh, {Shard(1)}, std::nullopt);
  EXPECT_EQ(hp::comm::total_collective_count(), 0);
  EXPECT_EQ(own.to_local().size(1), shard_size(2, p, r));
}

TEST(DistributeTensor, TwoDimMeshFromEachSourceCoordinate) {
  if (hp_test::world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  // src_data_rank is the source's coordinate on every mesh dim: rank (src, src) of the 2 x 2 grid.
  for (int64_t src = 0; src < 2; ++src) {
    auto d = distribute_tensor(at::full({4, 4}, double(hp_test::rank()), at::kDouble), mesh,
                               {Shard(0), Shard(1)}, src);
    expect_close(d.full_tensor(), at::full({4, 4}, double(src * 2 + src), at::kDouble));
  }
}

TEST(FromLocal, RunCheckRecoversUnevenGlobalShape) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  auto mesh = init_device_mesh("cpu", {p});
  // 2p - 1 rows: torch.chunk gives 2 to each rank but the last, which gets 1.
  auto x = DTensor::from_local(at::ones({r == p - 1 ? 1 : 2, 3}), mesh, {Shard(0)},
                               FromLocalOptions().run_check(true));
  EXPECT_EQ(x.shape(), (std::vector<int64_t>{2 * p - 1, 3}));
  if (p > 1) {  // another split: every rank names the first rank whose extents differ
    HP_EXPECT_THROW_MSG(
        DTensor::from_local(at::ones({r + 1, 3}), mesh, {Shard(0)}, FromLocalOptions().run_check(true)),
        "DTensor::from_local: expected local shape [" + std::to_string((p * (p + 1) / 2 + p - 1) / p) +
            ", 3] on mesh coordinate [0] (torch.chunk's split");
    HP_EXPECT_THROW_MSG(
        DTensor::from_local(at::ones({2, 3}), mesh, {Shard(0)},
                            FromLocalOptions().run_check(true).shape(std::vector<int64_t>{2 * p + 1, 3})),
        "expected the shape given ([" + std::to_string(2 * p + 1) + ", 3]) to be the one");
  }
  // Replicas take coordinate 0's data; the gradient reaches each rank's own local tensor.
  auto mine = at::full({2}, double(r), at::kDouble).requires_grad_();
  auto replicated = DTensor::from_local(mine, mesh, {Replicate()}, FromLocalOptions().run_check(true));
  EXPECT_TRUE(replicated.to_local().equal(at::zeros({2}, at::kDouble)));
  replicated.to_local().sum().backward();
  EXPECT_TRUE(mine.grad().equal(at::ones({2}, at::kDouble)));
  auto even = DTensor::from_local(at::ones({2, 3}), mesh, {Shard(-1)});
  EXPECT_EQ(even.shape(), (std::vector<int64_t>{2, 3 * p}));
  EXPECT_EQ(even.placements(), Placements{Shard(1)});
  if (p > 1) {
    HP_EXPECT_THROW_MSG(
        DTensor::from_local(at::ones({2, r + 1}), mesh, {Shard(0)}, FromLocalOptions().run_check(true)),
        "DTensor::from_local: expected local shape [2, ");
  }
}

TEST(MeshAndDTensorErrors, NameFunctionExpectedAndGot) {
  const int64_t p = hp_test::world_size();
  auto mesh = init_device_mesh("cpu", {p}, {"tp"});
  HP_EXPECT_THROW_MSG(DTensor::from_local(at::ones({2}), mesh, {Shard(0), Shard(0)}),
                      "DTensor::from_local: expected one placement per mesh dim (1)");
  HP_EXPECT_THROW_MSG(DTensor::from_local(at::ones({2}), mesh, {Shard(1)}),
                      "expected Shard dim in [-1, 1) for a 1-d tensor, got Shard(1)");
  HP_EXPECT_THROW_MSG(distribute_tensor(at::ones({2}), mesh, {Partial()}),
                      "distribute_tensor: does not support Partial placements");
  HP_EXPECT_THROW_MSG(distribute_tensor(at::ones({2}), mesh, {Shard(0)}, p),
                      "distribute_tensor: expected src_data_rank (the source's coordinate on every "
                      "mesh dim) in [0, ");
  HP_EXPECT_THROW_MSG(DTensor::from_local(at::ones({2, 2}), mesh, {Shard(0)},
                                          FromLocalOptions().shape(std::vector<int64_t>{2 * p + 5, 2})),
                      "from_local: expected local shape");
  HP_EXPECT_THROW_MSG(mesh.size(1), "DeviceMesh::size: expected mesh dim in [-1, 1), got 1");
  HP_EXPECT_THROW_MSG(mesh["dp"], "expected one of the mesh dim names ['tp'], got 'dp'");
  HP_EXPECT_THROW_MSG(init_device_mesh("cpu", {p, 2}), "to hold the world size");
  HP_EXPECT_THROW_MSG(init_device_mesh("cpu", {p}, {"a", "b"}), "expected one name per mesh dim (1)");
  auto x = DTensor::from_local(at::ones({2}), mesh, {Replicate()});
  HP_EXPECT_THROW_MSG(x.redistribute({Shard(0), Shard(0)}), "DTensor::redistribute: expected one placement");
}

TEST(DeviceMesh, TwoDimGroupsCoordinatesAndSlices) {
  if (hp_test::world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const int64_t r = hp_test::rank();
  auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  EXPECT_EQ(mesh.coordinate(), (std::vector<int64_t>{r / 2, r % 2}));
  EXPECT_EQ(mesh.get_group("tp").global_ranks(), (std::vector<int64_t>{r / 2 * 2, r / 2 * 2 + 1}));
  EXPECT_EQ(mesh.get_group("dp").global_ranks(), (std::vector<int64_t>{r % 2, r % 2 + 2}));
  EXPECT_EQ(mesh.get_local_rank(1), r % 2);
  auto tp = mesh["tp"];
  EXPECT_EQ(tp.ndim(), 1);
  EXPECT_EQ(tp.ranks(), mesh.get_group("tp").global_ranks());
  auto sum =
      hp::comm::all_reduce(at::full({1}, double(r), at::kDouble), hp::comm::ReduceOp::kSum, tp.get_group());
  EXPECT_EQ(sum.item<double>(), double(r / 2 * 4 + 1));
}

}  // namespace
