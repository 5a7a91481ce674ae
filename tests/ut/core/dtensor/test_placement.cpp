// Placement and shard arithmetic: no process group needed.
#include <gtest/gtest.h>

#include <hyper_parallel/core/dtensor/placement.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
using namespace hp::dtensor;

namespace {

TEST(Placement, NamesAndEquality) {
  EXPECT_EQ(Shard(1).str(), "Shard(1)");
  EXPECT_EQ(Replicate().str(), "Replicate()");
  EXPECT_EQ(Partial().str(), "Partial(sum)");
  EXPECT_EQ(Partial(hp::comm::ReduceOp::kAvg).str(), "Partial(avg)");
  EXPECT_EQ(Shard(0), Shard(0));
  EXPECT_NE(Shard(0), Shard(1));
  EXPECT_NE(Partial(), Partial(hp::comm::ReduceOp::kAvg));
  EXPECT_NE(Replicate(), Partial());
  EXPECT_EQ(to_string({Shard(0), Replicate()}), "[Shard(0), Replicate()]");
  EXPECT_EQ(Partial().for_gradient(), Replicate());
  EXPECT_EQ(Shard(2).for_gradient(), Shard(2));
}

TEST(Placement, NegativeDimsNormalize) {
  EXPECT_EQ(Shard(-1).normalized(3), Shard(2));
  EXPECT_EQ(Shard(-3).normalized(3), Shard(0));
  EXPECT_EQ(Replicate().normalized(3), Replicate());
  HP_EXPECT_THROW_MSG(Shard(3).normalized(3), "expected Shard dim in [-3, 3) for a 3-d tensor, got Shard(3)");
  HP_EXPECT_THROW_MSG(Shard(-4).normalized(3), "got Shard(-4)");
  HP_EXPECT_THROW_MSG(Replicate().dim(), "Placement::dim: expected a Shard placement, got Replicate()");
  HP_EXPECT_THROW_MSG(Shard(0).reduce_op(), "expected a Partial placement");
}

struct ChunkCase {
  int64_t global, parts;
  std::vector<int64_t> sizes;
};

// Keeps ctest's test names readable (gtest would otherwise print the case's raw bytes).
void PrintTo(const ChunkCase& c, std::ostream* os) { *os << "chunk(" << c.global << ", " << c.parts << ")"; }

class ShardArithmetic : public ::testing::TestWithParam<ChunkCase> {};

TEST_P(ShardArithmetic, FollowsTorchChunk) {
  const auto& c = GetParam();
  int64_t offset = 0;
  for (int64_t k = 0; k < c.parts; ++k) {
    EXPECT_EQ(shard_size(c.global, c.parts, k), c.sizes[k]) << "chunk " << k;
    EXPECT_EQ(shard_offset(c.global, c.parts, k), offset) << "chunk " << k;
    offset += c.sizes[k];
  }
  EXPECT_EQ(offset, c.global);
  EXPECT_EQ(hp::comm::chunk_sizes(c.global, c.parts), c.sizes);
}

INSTANTIATE_TEST_SUITE_P(Cases, ShardArithmetic,
                         ::testing::Values(ChunkCase{8, 4, {2, 2, 2, 2}}, ChunkCase{5, 4, {2, 2, 1, 0}},
                                           ChunkCase{0, 3, {0, 0, 0}}, ChunkCase{1, 3, {1, 0, 0}},
                                           ChunkCase{7, 1, {7}}, ChunkCase{10, 3, {4, 4, 2}},
                                           ChunkCase{9, 8, {2, 2, 2, 2, 1, 0, 0, 0}}),
                         [](const auto& info) {
                           return "global" + std::to_string(info.param.global) + "_parts" +
                                  std::to_string(info.param.parts);
                         });

TEST(ShardArithmetic, RejectsBadArguments) {
  HP_EXPECT_THROW_MSG(shard_size(4, 0, 0), "expected parts >= 1, got 0");
  HP_EXPECT_THROW_MSG(shard_size(4, 2, 2), "expected index in [0, 2), got 2");
  HP_EXPECT_THROW_MSG(shard_size(-1, 2, 0), "expected global >= 0");
}

TEST(LocalShape, NestedShardsFollowMeshDimOrder) {
  // [Shard(0), Shard(0)] on a 2x3 mesh: dim 0 (size 13) is cut in 2 (7, 6), then each in 3.
  const std::vector<int64_t> global{13, 4}, mesh{2, 3};
  const Placements pl{Shard(0), Shard(0)};
  EXPECT_EQ(local_shape(global, mesh, {0, 0}, pl), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(local_offset(global, mesh, {0, 2}, pl), (std::vector<int64_t>{6, 0}));
  EXPECT_EQ(local_shape(global, mesh, {1, 2}, pl), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(local_offset(global, mesh, {1, 1}, pl), (std::vector<int64_t>{9, 0}));
  // [Shard(1), Partial] and [Replicate, Shard(-1)]
  EXPECT_EQ(local_shape(global, mesh, {1, 0}, {Shard(1), Partial()}), (std::vector<int64_t>{13, 2}));
  EXPECT_EQ(local_shape(global, mesh, {0, 2}, {Replicate(), Shard(-1)}), (std::vector<int64_t>{13, 0}));
  HP_EXPECT_THROW_MSG(local_shape(global, mesh, {0, 0}, {Shard(0)}),
                      "expected one placement per mesh dim (2)");
}

TEST(PlacementsFromNames, SpellsTheOriginalsLayouts) {
  const std::vector<std::string> mesh{"dp", "tp"};
  using Names = std::vector<std::vector<std::string>>;
  EXPECT_EQ(placements_from_names(Names{{"dp"}, {"None"}}, mesh, 2), (Placements{Shard(0), Replicate()}));
  EXPECT_EQ(placements_from_names(Names{{"tp"}, {"dp"}}, mesh, 2), (Placements{Shard(1), Shard(0)}));
  EXPECT_EQ(placements_from_names(Names{{"dp", "tp"}, {}}, mesh, 2), (Placements{Shard(0), Shard(0)}));
  EXPECT_EQ(placements_from_names(Names{{"None"}, {"None", "tp"}}, mesh, 2),
            (Placements{Replicate(), Shard(1)}));
  EXPECT_EQ(placements_from_names(Names{}, mesh, 0), (Placements{Replicate(), Replicate()}));
}

TEST(PlacementsFromNames, NamesWhatIsWrong) {
  const std::vector<std::string> mesh{"dp", "tp"};
  using Names = std::vector<std::vector<std::string>>;
  HP_EXPECT_THROW_MSG(placements_from_names(Names{{"tp", "dp"}, {}}, mesh, 2), "in mesh-dim order");
  HP_EXPECT_THROW_MSG(placements_from_names(Names{{"dp"}, {"dp"}}, mesh, 2), "each mesh dim named once");
  HP_EXPECT_THROW_MSG(placements_from_names(Names{{"pp"}, {}}, mesh, 2),
                      "expected names of mesh dims [dp, tp]");
  HP_EXPECT_THROW_MSG(placements_from_names(Names{{"dp"}}, mesh, 2),
                      "one layout name per tensor dim (2), got 1");
  HP_EXPECT_THROW_MSG(placements_from_names(Names{{"dp"}}, {}, 1), "a mesh without names");
}

}  // namespace
