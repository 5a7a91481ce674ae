// Tensor parallelism on a slice of a 2-d mesh (DP x TP), where most TP groups do not contain
// global rank 0, and the meaning of src_data_rank (the source's coordinate on the mesh, as in
// torch.distributed.tensor). Runs on 4 ranks as a 2 x 2 mesh.
#include <gtest/gtest.h>

#include <sstream>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>

#include <hyper_parallel/hyper_parallel.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;
using namespace hp::dtensor;
using hp_test::expect_close;

namespace {

class DataTimesTensorParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (hp_test::world_size() != 4) GTEST_SKIP() << "runs on 4 ranks (2 x 2 mesh)";
    mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    tp_mesh = (*mesh)["tp"];
  }
  std::optional<DeviceMesh> mesh, tp_mesh;
};

struct MLP {
  hp::nn::Linear fc1{nullptr}, fc2{nullptr};
  MLP(int64_t dim, int64_t hidden, at::ScalarType dtype, uint64_t seed) {
    at::manual_seed(seed);
    fc1 = hp::nn::Linear(dim, hidden);
    fc2 = hp::nn::Linear(hidden, dim);
    fc1->to(dtype);
    fc2->to(dtype);
  }
  at::Tensor operator()(const at::Tensor& x) { return fc2(at::silu(fc1(x))); }
};

// The sequence-parallel MLP (Colwise in Shard(1) -> Rowwise out Shard(1)), plain or MC2, on the TP
// slice of a 2 x 2 mesh: both DP replicas run the same batch, and each must equal the
// single-process MLP, forward and backward.
void check_mlp_against_reference(const DeviceMesh& tp_mesh, bool mc2, at::ScalarType dtype) {
  SCOPED_TRACE(std::string(mc2 ? "MC2" : "plain") + " " + c10::toString(dtype));
  const int64_t dim = 512, hidden = 1024, seq = 8, t = tp_mesh.get_local_rank(0);
  MLP ref(dim, hidden, at::kFloat, 7), m(dim, hidden, dtype, 7);
  if (mc2) {
    const auto contract = dtype == at::kFloat ? tp::MC2Contract::relaxed() : tp::MC2Contract::strict();
    tp::parallelize_module(*m.fc1, tp_mesh,
                           tp::MC2ColwiseParallel(tp::MC2ColwiseParallelOptions().contract(contract)));
    tp::parallelize_module(*m.fc2, tp_mesh,
                           tp::MC2RowwiseParallel(tp::MC2RowwiseParallelOptions().contract(contract)));
  } else {
    tp::parallelize_module(*m.fc1, tp_mesh,
                           tp::ColwiseParallel(tp::ColwiseParallelOptions().input_layouts(Shard(1))));
    tp::parallelize_module(*m.fc2, tp_mesh,
                           tp::RowwiseParallel(tp::RowwiseParallelOptions().output_layouts(Shard(1))));
  }
  at::manual_seed(8);  // the same batch on both DP replicas
  auto full_x = at::randn({2, seq, dim});
  auto upstream = at::randn({2, seq, dim});
  const int64_t s_local = seq / tp_mesh.size(0);
  auto x = full_x.narrow(1, t * s_local, s_local).to(dtype).requires_grad_(true);
  auto y = m(x);
  (y * upstream.narrow(1, t * s_local, s_local).to(dtype)).sum().backward();
  auto xr = full_x.clone().requires_grad_(true);
  auto yr = ref(xr);
  (yr * upstream).sum().backward();

  // bf16: the MC2 contract's tolerance; fp32: reordering noise.
  const double rtol = dtype == at::kFloat ? 1e-4 : 0.15, atol = dtype == at::kFloat ? 1e-4 : 0.25;
  auto close = [&](const at::Tensor& a, const at::Tensor& e, const char* what) {
    ASSERT_EQ(a.sizes(), e.sizes()) << what;
    EXPECT_TRUE(at::allclose(a.to(at::kDouble), e.to(at::kDouble), rtol, atol))
        << what << ": max abs diff " << (a.to(at::kDouble) - e.to(at::kDouble)).abs().max().item<double>();
  };
  const int64_t h_local = hidden / tp_mesh.size(0);
  close(y, yr.narrow(1, t * s_local, s_local), "output");
  close(x.grad(), xr.grad().narrow(1, t * s_local, s_local), "input grad");
  close(m.fc1->weight.grad(), ref.fc1->weight.grad().narrow(0, t * h_local, h_local), "fc1 weight grad");
  close(m.fc1->bias.grad(), ref.fc1->bias.grad().narrow(0, t * h_local, h_local), "fc1 bias grad");
  close(m.fc2->weight.grad(), ref.fc2->weight.grad().narrow(1, t * h_local, h_local), "fc2 weight grad");
  close(m.fc2->bias.grad(), ref.fc2->bias.grad(), "fc2 bias grad");
}

TEST_F(DataTimesTensorParallel, PlainPlanOnTheTensorParallelSliceMatchesSingleProcess) {
  check_mlp_against_reference(*tp_mesh, /*mc2=*/false, at::kFloat);
}

TEST_F(DataTimesTensorParallel, MC2PlanOnTheTensorParallelSliceMatchesSingleProcess) {
  check_mlp_against_reference(*tp_mesh, /*mc2=*/true, at::kBFloat16);
  check_mlp_against_reference(*tp_mesh, /*mc2=*/true, at::kFloat);
}

TEST_F(DataTimesTensorParallel, SourceIsACoordinateOnEveryMeshDim) {
  const int64_t r = hp_test::rank();
  // Every rank offers its own global rank; the shards come from the source coordinate's rank.
  auto mine = [&] { return at::full({4, 4}, double(r), at::kDouble); };
  for (int64_t src = 0; src < 2; ++src) {
    // On the 2-d mesh: the rank at coordinate (src, src).
    auto d2 = distribute_tensor(mine(), *mesh, {Shard(0), Shard(1)}, src);
    expect_close(d2.full_tensor(), at::full({4, 4}, double(src * 2 + src), at::kDouble));
    // On the TP slice: TP rank src of this rank's slice.
    auto d1 = distribute_tensor(mine(), *tp_mesh, {Shard(0)}, src);
    expect_close(d1.full_tensor(), at::full({4, 4}, double(tp_mesh->ranks()[src]), at::kDouble));
  }
  HP_EXPECT_THROW_MSG(distribute_tensor(mine(), *tp_mesh, {Shard(0)}, 2),
                      "distribute_tensor: expected src_data_rank (the source's coordinate on every "
                      "mesh dim) in [0, 2) for mesh dim 0 of DeviceMesh('cpu', shape=[2], "
                      "names=(tp)), got 2");
}

TEST_F(DataTimesTensorParallel, ParallelizeModuleTakesTheSourceOrNone) {
  const int64_t r = hp_test::rank();
  auto fill_with_rank = [&](hp::nn::Linear& l) {
    at::NoGradGuard g;
    l->weight.fill_(double(r));
    l->bias.fill_(double(r));
  };
  // Default: TP rank 0's values.
  hp::nn::Linear a(4, 4);
  fill_with_rank(a);
  tp::parallelize_module(*a, *tp_mesh, tp::ColwiseParallel());
  EXPECT_TRUE(a->weight.eq(double(tp_mesh->ranks()[0])).all().item<bool>());
  // TP rank 1's values.
  hp::nn::Linear b(4, 4);
  fill_with_rank(b);
  tp::parallelize_module(*b, *tp_mesh, {{"", std::make_shared<tp::RowwiseParallel>()}}, 1);
  EXPECT_TRUE(b->weight.eq(double(tp_mesh->ranks()[1])).all().item<bool>());
  EXPECT_TRUE(b->bias.eq(double(tp_mesh->ranks()[1])).all().item<bool>());
  // None: each rank shards its own copy; nothing moves but the plan check's small all_gathers.
  hp::nn::Linear c(4, 4);
  fill_with_rank(c);
  hp::comm::reset_collective_counts();
  tp::parallelize_module(*c, *tp_mesh, tp::ColwiseParallel(), std::nullopt);
  EXPECT_EQ(hp::comm::total_collective_count() - hp::comm::total_collective_count("parallelize_check"), 0);
  EXPECT_TRUE(c->weight.eq(double(r)).all().item<bool>());
  EXPECT_EQ(c->weight.sizes(), (at::IntArrayRef{2, 4}));
}

TEST_F(DataTimesTensorParallel, PrintedModuleShowsStylesPlacementsAndMC2Mode) {
  torch::nn::Sequential model;
  hp::nn::Linear plain(512, 1024), fused(512, 1024), norm_free(1024, 512);
  model->push_back("colwise", plain);
  model->push_back("mc2", fused);
  model->push_back("rowwise", norm_free);
  model->to(at::kBFloat16);
  tp::parallelize_module(*model, *tp_mesh,
                         {{"colwise", std::make_shared<tp::ColwiseParallel>()},
                          {"mc2", std::make_shared<tp::MC2ColwiseParallel>()},
                          {"rowwise", std::make_shared<tp::RowwiseParallel>()}});
  std::ostringstream printed;
  printed << *model;
  const auto text = printed.str();
  for (const char* expected :
       {"in_features=512, out_features=1024, bias=true, style=ColwiseParallel, bias=Shard(0) over "
        "tp[2], weight=Shard(0) over tp[2])",
        "style=MC2ColwiseParallel, bias=Shard(0) over tp[2], weight=Shard(0) over tp[2], "
        "forward=MC2Linear(all_gather))",
        "style=RowwiseParallel, bias=Replicate() over tp[2], weight=Shard(1) over tp[2], "
        "forward=RowwiseLinear)"}) {
    EXPECT_NE(text.find(expected), std::string::npos) << "missing '" << expected << "' in\n" << text;
  }
}

}  // namespace
