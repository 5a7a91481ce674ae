// Resuming equals the uninterrupted run: llama3::train for 10 steps straight against 5 steps with
// a checkpoint and a second train() call that resumes for steps 6..10. At the same TP degree the
// losses, gradient norms, final parameters and AdamW state are bitwise identical; resumed at TP 1
// (the single-process reference) from the TP = world-size checkpoint, the losses agree to 1e-4.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include <ATen/ATen.h>

#include <hyper_parallel/hyper_parallel.h>

#include "checkpoint_test_util.h"
#include "llama3/trainer.h"

namespace hp = hyper_parallel;
namespace fs = std::filesystem;
using hp_checkpoint_test::rank;
using hp_checkpoint_test::read_bytes;
using hp_checkpoint_test::read_json;
using hp_checkpoint_test::SharedTmpDir;

namespace {

// fp32 TP against the single process reorders sums (~1e-6 relative per op); 5 AdamW steps.
constexpr double kLossRtol = 1e-4;

// Two checkpoints with the same keys and layout hold the same bytes in every shard.
void expect_same_checkpoint(const std::string& a, const std::string& b) {
  const auto index_a = read_json(a + "/index.json"), index_b = read_json(b + "/index.json");
  EXPECT_EQ(index_a["step"], index_b["step"]);
  ASSERT_EQ(index_a["tensors"].size(), index_b["tensors"].size());
  int64_t shards = 0;
  for (const auto& [key, ta] : index_a["tensors"].items()) {
    ASSERT_TRUE(index_b["tensors"].contains(key)) << key;
    const auto& sa = ta["shards"];
    const auto& sb = index_b["tensors"][key]["shards"];
    ASSERT_EQ(sa.size(), sb.size()) << key;
    for (size_t j = 0; j < sa.size(); ++j) {
      EXPECT_EQ(sa[j]["offset"], sb[j]["offset"]) << key;
      const auto ra = sa[j]["data_offsets"].get<std::vector<int64_t>>();
      const auto rb = sb[j]["data_offsets"].get<std::vector<int64_t>>();
      const auto bytes_a = read_bytes(a + "/" + sa[j]["file"].get<std::string>(), ra[0], ra[1]);
      const auto bytes_b = read_bytes(b + "/" + sb[j]["file"].get<std::string>(), rb[0], rb[1]);
      EXPECT_TRUE(bytes_a == bytes_b) << key << ": shard " << j << " differs";
      ++shards;
    }
  }
  EXPECT_GT(shards, 0);
}

TEST(Resume, EqualsTheUninterruptedRun) {
  SharedTmpDir dir("resume");
  const auto base = llama3::TrainOptions().steps(10).log(false);
  const auto straight =
      llama3::train(llama3::TrainOptions(base).checkpoint_dir(dir / "straight").checkpoint_every(10));
  ASSERT_EQ(straight.size(), 10u);
  const auto first =
      llama3::train(llama3::TrainOptions(base).steps(5).checkpoint_dir(dir / "resumed").checkpoint_every(5));
  ASSERT_EQ(first.size(), 5u);
  for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ(first[i].loss, straight[i].loss) << "step " << i + 1;
  EXPECT_EQ(hp::checkpoint::latest_step(dir / "resumed").value_or(-1), 5);
  // The step-5 checkpoint again, for the resume at TP 1.
  if (rank() == 0) fs::copy(dir / "resumed", dir / "reshard", fs::copy_options::recursive);
  hp::comm::barrier(hp::comm::world());

  const auto second = llama3::train(
      llama3::TrainOptions(base).checkpoint_dir(dir / "resumed").checkpoint_every(5).resume(true));
  ASSERT_EQ(second.size(), 5u) << "only the steps this call ran";
  for (size_t i = 0; i < second.size(); ++i) {
    EXPECT_EQ(second[i].step, static_cast<int64_t>(6 + i));
    EXPECT_EQ(second[i].loss, straight[5 + i].loss) << "step " << 6 + i;
    EXPECT_EQ(second[i].grad_norm, straight[5 + i].grad_norm) << "step " << 6 + i;
  }
  // Both runs saved step 10 with the same layout: parameters and AdamW state, byte for byte.
  if (rank() == 0) expect_same_checkpoint(dir / "straight/step-10", dir / "resumed/step-10");

  const auto reference =
      llama3::train(llama3::TrainOptions(base).checkpoint_dir(dir / "reshard").resume(true).reference(true));
  ASSERT_EQ(reference.size(), 5u);
  for (size_t i = 0; i < reference.size(); ++i) {
    EXPECT_NEAR(reference[i].loss, straight[5 + i].loss, kLossRtol * std::abs(straight[5 + i].loss))
        << "step " << 6 + i << " resumed at TP 1";
  }
}

}  // namespace
