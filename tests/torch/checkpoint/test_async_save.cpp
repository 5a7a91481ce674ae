// Asynchronous checkpoint saves of the debug Llama (fp32) with AdamW: the files are byte for byte
// a synchronous save's, of the state at the call (training that goes on does not leak in); a
// background error surfaces at the next save and at finish(), naming the checkpoint and the
// cause; training goes on while a save is in flight, with the losses of a run without saves; the
// writer's collectives run on its own group and count in region "checkpoint".
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <hyper_parallel/hyper_parallel.h>

#include "checkpoint_test_util.h"
#include "llama3/model.h"
#include "llama3/parallelize.h"
#include "llama3/trainer.h"

namespace hp = hyper_parallel;
namespace ckpt = hp::checkpoint;
namespace fs = std::filesystem;
using hp_checkpoint_test::expect_error;
using hp_checkpoint_test::rank;
using hp_checkpoint_test::SharedTmpDir;
using hp_checkpoint_test::world_size;

namespace {

// The debug Llama, TP over the world, with AdamW and its checkpoint state, after `steps` steps.
struct Trainee {
  llama3::Transformer model{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer;
  ckpt::State state;

  Trainee() {
    at::manual_seed(7);
    model = llama3::Transformer(llama3::ModelArgs::debug());
    if (world_size() > 1) {
      llama3::parallelize_llama3(*model, hp::dtensor::init_device_mesh("cpu", {world_size()}, {"tp"}));
    }
    optimizer = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
    state = ckpt::model_state(*model);
    ckpt::add_optimizer_state(state, *optimizer, *model);
  }

  void train(int64_t first, int64_t last) {
    const auto& a = model->args;
    for (int64_t step = first; step <= last; ++step) {
      auto batch = llama3::synthetic_batch(42, step, 2, a.max_seq_len, a.vocab_size);
      optimizer->zero_grad();
      auto logits = model->forward(batch.narrow(1, 0, a.max_seq_len));
      at::cross_entropy_loss(logits.flatten(0, 1), batch.narrow(1, 1, a.max_seq_len).flatten()).backward();
      optimizer->step();
    }
  }
};

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Rank 0: the two trees hold the same files, byte for byte.
void expect_same_files(const fs::path& a, const fs::path& b) {
  std::set<std::string> names_a, names_b;
  for (const auto& f : fs::recursive_directory_iterator(a))
    names_a.insert(fs::relative(f.path(), a).string());
  for (const auto& f : fs::recursive_directory_iterator(b))
    names_b.insert(fs::relative(f.path(), b).string());
  EXPECT_EQ(names_a, names_b);
  int compared = 0;
  for (const auto& name : names_a) {
    if (fs::is_directory(a / name) || !names_b.count(name)) continue;
    EXPECT_TRUE(read_bytes(a / name) == read_bytes(b / name)) << name << " differs";
    ++compared;
  }
  EXPECT_GE(compared, 4) << "index.json, COMPLETE, latest and a rank file at least";
}

TEST(AsyncSave, WritesTheSynchronousSavesBytesOfTheStateAtTheCall) {
  SharedTmpDir dir("async_same_bytes");
  Trainee t;
  t.train(1, 2);
  ckpt::save(dir / "sync", t.state, ckpt::SaveOptions().step(2));
  const auto promised = ckpt::save(dir / "async", t.state, ckpt::SaveOptions().step(2).asynchronous(true));
  EXPECT_TRUE(ckpt::save_in_flight());
  EXPECT_EQ(promised.path, ckpt::step_dir(dir / "async", 2));
  t.train(3, 3);  // changes every tensor while the write may still run
  const auto done = ckpt::finish();
  ASSERT_TRUE(done.has_value());
  EXPECT_FALSE(ckpt::save_in_flight());
  EXPECT_EQ(done->path, promised.path);
  EXPECT_EQ(done->total_bytes, promised.total_bytes);
  EXPECT_EQ(done->bytes_written, promised.bytes_written);
  EXPECT_GT(done->background_seconds, 0);
  EXPECT_FALSE(ckpt::finish().has_value()) << "nothing left in flight";
  hp::comm::barrier(hp::comm::world());
  if (rank() == 0) expect_same_files(dir / "sync", dir / "async");
}

TEST(AsyncSave, ALoadReadsTheSaveInFlight) {
  SharedTmpDir dir("async_then_load");
  Trainee t;
  t.train(1, 1);
  ckpt::save(dir.path(), t.state, ckpt::SaveOptions().step(1).asynchronous(true));
  Trainee fresh;
  ckpt::load(dir.path(), fresh.state);  // before: no `latest` yet, or the checkpoint before
  EXPECT_FALSE(ckpt::save_in_flight());
  EXPECT_EQ(ckpt::latest_step(dir.path()), 1);
  for (const auto& [key, e] : t.state) EXPECT_TRUE(at::equal(fresh.state.at(key).local, e.local)) << key;
}

TEST(AsyncSave, BackgroundErrorSurfacesAtTheNextSaveAndAtFinish) {
  SharedTmpDir dir("async_errors");
  const std::string root = dir / "root";
  Trainee t;
  ckpt::save(root, t.state, ckpt::SaveOptions().step(1).asynchronous(true));
  ASSERT_TRUE(ckpt::finish().has_value());
  // The root becomes a plain file: the writer cannot make its staging directory.
  hp::comm::barrier(hp::comm::world());
  if (rank() == 0) {
    fs::remove_all(root);
    std::ofstream(root) << "not a directory";
  }
  hp::comm::barrier(hp::comm::world());
  ckpt::save(root, t.state,
             ckpt::SaveOptions().step(2).asynchronous(true));  // returns: the write fails later
  const std::vector<std::string> step2 = {"the asynchronous save of " + ckpt::step_dir(root, 2) + " failed",
                                          "rank 0 failed creating " + root + "/.step-2.tmp-"};
  expect_error([&] { ckpt::save(root, t.state, ckpt::SaveOptions().step(3)); }, step2);
  EXPECT_FALSE(ckpt::save_in_flight()) << "the error was delivered once";
  ckpt::save(root, t.state, ckpt::SaveOptions().step(4).asynchronous(true));
  expect_error([] { ckpt::finish(); }, {"the asynchronous save of " + ckpt::step_dir(root, 4) + " failed"});
  // Fixed, the next save works.
  hp::comm::barrier(hp::comm::world());
  if (rank() == 0) fs::remove(root);
  hp::comm::barrier(hp::comm::world());
  ckpt::save(root, t.state, ckpt::SaveOptions().step(5).asynchronous(true));
  ASSERT_TRUE(ckpt::finish().has_value());
  EXPECT_EQ(ckpt::latest_step(root), 5);
}

TEST(AsyncSave, TrainingGoesOnWithTheLossesOfARunWithoutSaves) {
  SharedTmpDir dir("async_training");
  auto options = llama3::TrainOptions().steps(6).log(false);
  const auto plain = llama3::train(options);
  int in_flight_at_odd_steps = 0;
  const auto saved = llama3::train(
      llama3::TrainOptions(options).checkpoint_dir(dir / "ckpt").checkpoint_every(2).async_checkpoint(true),
      [&](int64_t step, llama3::TransformerImpl&) {
        in_flight_at_odd_steps += step % 2 == 1 && ckpt::save_in_flight();
      });
  ASSERT_EQ(plain.size(), saved.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(saved[i].loss, plain[i].loss) << "step " << i + 1 << ": bitwise";
    EXPECT_EQ(saved[i].grad_norm, plain[i].grad_norm) << "step " << i + 1;
  }
  EXPECT_EQ(in_flight_at_odd_steps, 2) << "steps 3 and 5 ran while the saves of steps 2 and 4 were in flight";
  EXPECT_FALSE(ckpt::save_in_flight()) << "train() collects its last save";
  EXPECT_EQ(ckpt::latest_step(dir / "ckpt"), 6);
}

TEST(AsyncSave, WriterCollectivesCountInItsOwnRegion) {
  SharedTmpDir dir("async_regions");
  Trainee t;
  hp::comm::reset_collective_counts();
  {
    hp::comm::CommRegion training("training");
    ckpt::save(dir.path(), t.state, ckpt::SaveOptions().step(1).asynchronous(true));
    const int64_t foreground = hp::comm::total_collective_count("training");
    ASSERT_TRUE(ckpt::finish().has_value());
    EXPECT_EQ(hp::comm::total_collective_count("training"), foreground)
        << "the writer counted in training's region";
  }
  EXPECT_GT(hp::comm::total_collective_count("checkpoint"), 0) << hp::comm::collective_counts_summary();
}

}  // namespace
