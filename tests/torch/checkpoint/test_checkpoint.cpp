// Checkpoints of the debug Llama (fp32) with AdamW: resharding between TP degrees (parameters and
// optimizer state, bitwise), the bytes a TP-4 rank reads, the files a save writes, corrupt or
// mismatched checkpoints that fail with a clear error and leave the model untouched, and
// export_full against the gathered parameters.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <hyper_parallel/hyper_parallel.h>

#include "checkpoint_test_util.h"
#include "common/test_util.h"
#include "llama3/model.h"
#include "llama3/parallelize.h"
#include "llama3/trainer.h"

namespace hp = hyper_parallel;
namespace ckpt = hp::checkpoint;
namespace fs = std::filesystem;
using hp::dtensor::DeviceMesh;
using hp_checkpoint_test::expect_error;
using hp_checkpoint_test::rank;
using hp_checkpoint_test::read_json;
using hp_checkpoint_test::SharedTmpDir;
using hp_checkpoint_test::world_size;

namespace {

constexpr uint64_t kDataSeed = 42;

// TP meshes by degree, each a slice of a [world / tp, tp] mesh so that DP replicas hold the same
// shards (and the save must write each shard once). Degree 1 is no mesh: not parallelized.
class Meshes {
 public:
  std::optional<DeviceMesh> tp(int64_t degree) {
    if (degree == 1) return std::nullopt;
    auto it = meshes_.find(degree);
    if (it == meshes_.end()) {
      auto mesh = hp::dtensor::init_device_mesh("cpu", {world_size() / degree, degree}, {"dp", "tp"});
      it = meshes_.emplace(degree, mesh["tp"]).first;
    }
    return it->second;
  }

 private:
  std::map<int64_t, DeviceMesh> meshes_;
};

// The Llama with AdamW, parallelized on `tp_mesh`, and its checkpoint state (model + optimizer).
struct Trainee {
  llama3::Transformer model{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer;
  ckpt::State state;

  Trainee(const std::optional<DeviceMesh>& tp_mesh, uint64_t init_seed,
          const llama3::ModelArgs& args = llama3::ModelArgs::debug()) {
    at::manual_seed(init_seed);
    model = llama3::Transformer(args);
    if (tp_mesh) llama3::parallelize_llama3(*model, *tp_mesh);
    optimizer = std::make_unique<torch::optim::AdamW>(
        model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1).betas({0.9, 0.95}));
    state = ckpt::model_state(*model);
    ckpt::add_optimizer_state(state, *optimizer, *model);
  }

  void train(int64_t steps) {
    const auto& a = model->args;
    for (int64_t step = 1; step <= steps; ++step) {
      auto batch = llama3::synthetic_batch(kDataSeed, step, 2, a.max_seq_len, a.vocab_size);
      optimizer->zero_grad();
      auto logits = model->forward(batch.narrow(1, 0, a.max_seq_len));
      at::cross_entropy_loss(logits.flatten(0, 1), batch.narrow(1, 1, a.max_seq_len).flatten()).backward();
      optimizer->step();
    }
  }
};

int64_t global_bytes(const ckpt::Entry& e) {
  int64_t n = 1;
  for (auto v : e.global_shape) n *= v;
  return n * static_cast<int64_t>(e.local.element_size());
}

// Every entry as its full tensor. Collective over the sharded entries' meshes.
std::map<std::string, at::Tensor> full_tensors(const ckpt::State& state) {
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, e] : state) {
    if (e.before_save) e.before_save(e.local);
    auto t = e.local.detach();
    if (!e.is_replicated()) {
      t = hp::dtensor::DTensor::from_local(t, *e.mesh, e.placements,
                                           hp::dtensor::FromLocalOptions().shape(e.global_shape))
              .full_tensor();
    }
    out.emplace(key, t.clone());
  }
  return out;
}

// This rank's part of `full` under e's layout.
at::Tensor local_part(const at::Tensor& full, const ckpt::Entry& e) {
  if (e.is_replicated()) return full;
  const auto offset =
      hp::dtensor::local_offset(e.global_shape, e.mesh->shape(), e.mesh->coordinate(), e.placements);
  const auto shape =
      hp::dtensor::local_shape(e.global_shape, e.mesh->shape(), e.mesh->coordinate(), e.placements);
  auto t = full;
  for (size_t d = 0; d < shape.size(); ++d) t = t.narrow(static_cast<int64_t>(d), offset[d], shape[d]);
  return t;
}

// A TP-4 rank reads about a quarter of each sharded tensor: only the byte ranges that overlap
// its shard, whichever TP degree wrote it.
void expect_quarter_reads(const std::string& root, const ckpt::State& state) {
  int checked = 0;
  for (const auto& [key, e] : state) {
    if (e.is_replicated()) continue;
    ckpt::State one;
    one.add(key, e);
    ckpt::reset_io_stats();
    ckpt::load(root, one, ckpt::LoadOptions().strict(false));
    const double share =
        static_cast<double>(ckpt::io_stats().bytes_read) / static_cast<double>(global_bytes(e));
    EXPECT_LT(share, 0.35) << key;
    EXPECT_GT(share, 0.2) << key;
    ++checked;
  }
  EXPECT_GT(checked, 0) << "a TP-4 state has sharded entries";
}

TEST(Checkpoint, ReshardsBetweenTensorParallelDegrees) {
  SharedTmpDir dir("reshard");
  Meshes meshes;
  std::vector<int64_t> degrees;
  for (int64_t tp : {1, 2, 4}) {
    if (world_size() % tp == 0) degrees.push_back(tp);
  }
  for (int64_t save_tp : degrees) {
    SCOPED_TRACE("saved at TP " + std::to_string(save_tp));
    Trainee saved(meshes.tp(save_tp), 1);
    saved.train(2);
    const auto root = dir / ("tp" + std::to_string(save_tp));
    ckpt::save(root, saved.state, ckpt::SaveOptions().step(2).fsync(false));
    const auto full = full_tensors(saved.state);
    for (int64_t load_tp : degrees) {
      SCOPED_TRACE("loaded at TP " + std::to_string(load_tp));
      Trainee loaded(meshes.tp(load_tp), 2);  // other initial weights: the load must replace them
      ckpt::load(root, loaded.state);
      ASSERT_EQ(loaded.state.size(), saved.state.size());
      for (const auto& [key, e] : loaded.state) {
        ASSERT_EQ(full.count(key), 1u) << key;
        EXPECT_TRUE(at::equal(e.local.detach(), local_part(full.at(key), e))) << key;
      }
      for (const auto& item : loaded.optimizer->state()) {
        EXPECT_EQ(static_cast<const torch::optim::AdamWParamState&>(*item.second).step(), 2)
            << "AdamW's step count is restored";
      }
      if (load_tp == 4) expect_quarter_reads(root, loaded.state);
    }
  }
}

TEST(Checkpoint, SaveWritesShardsIndexMarkerAndLatest) {
  SharedTmpDir dir("files");
  Meshes meshes;
  const int64_t p = world_size();
  Trainee t(meshes.tp(p), 1);
  const auto root = dir.path();
  ckpt::reset_io_stats();
  const auto result = ckpt::save(root, t.state, ckpt::SaveOptions().step(7));
  EXPECT_EQ(result.path, root + "/step-7");
  EXPECT_EQ(ckpt::io_stats().bytes_written, result.bytes_written);
  int64_t expected_total = 0;
  for (const auto& [key, e] : t.state) expected_total += global_bytes(e);
  EXPECT_EQ(result.total_bytes, expected_total) << "every tensor is written once";
  const auto written = hp::comm::all_reduce(at::full({1}, result.bytes_written, at::kLong),
                                            hp::comm::ReduceOp::kSum, hp::comm::world());
  EXPECT_EQ(written.item<int64_t>(), expected_total) << "no rank writes a region another writes";
  EXPECT_EQ(ckpt::latest_step(root).value_or(-1), 7);
  EXPECT_FALSE(ckpt::latest_step(dir / "nothing-here").has_value());

  if (rank() == 0) {
    EXPECT_TRUE(fs::exists(root + "/step-7/COMPLETE"));
    std::ifstream latest(root + "/latest");
    std::string text((std::istreambuf_iterator<char>(latest)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, "step-7\n");
    const auto index = read_json(root + "/step-7/index.json");
    EXPECT_EQ(index["format"], "hyper_parallel.checkpoint");
    EXPECT_EQ(index["version"], 1);
    EXPECT_EQ(index["step"], 7);
    EXPECT_EQ(index["world_size"], p);
    EXPECT_EQ(index["tensors"].size(), t.state.size());
    for (int64_t r = 0; r < p; ++r) {
      EXPECT_TRUE(fs::exists(root + "/step-7/rank" + std::to_string(r) + ".safetensors"))
          << "at TP = world size every rank holds shards";
    }
    // Each shard of the index is the tensor of that name in its file (read independently).
    std::map<std::string, std::map<std::string, at::Tensor>> files;
    for (const auto& [key, info] : index["tensors"].items()) {
      for (const auto& shard : info["shards"]) {
        const std::string file = shard["file"];
        if (!files.count(file)) files[file] = hp_checkpoint_test::read_safetensors(root + "/step-7/" + file);
        const auto name = shard["name"].get<std::string>();
        ASSERT_TRUE(files[file].count(name)) << key;
        const auto& tensor = files[file].at(name);
        EXPECT_EQ(tensor.sizes().vec(), shard["shape"].get<std::vector<int64_t>>()) << key;
        const auto range = shard["data_offsets"].get<std::vector<int64_t>>();
        const auto bytes = hp_checkpoint_test::read_bytes(root + "/step-7/" + file, range[0], range[1]);
        EXPECT_EQ(0, std::memcmp(bytes.data(), tensor.data_ptr(), bytes.size())) << key;
      }
    }
  }

  // Saving the same step again replaces it; nothing of the save is left behind.
  ckpt::save(root, t.state, ckpt::SaveOptions().step(7));
  hp::comm::barrier(hp::comm::world());
  if (rank() == 0) {
    std::set<std::string> names;
    for (const auto& item : fs::directory_iterator(root)) names.insert(item.path().filename().string());
    EXPECT_EQ(names, (std::set<std::string>{"latest", "step-7"}));
  }
  Trainee fresh(meshes.tp(p), 2);
  ckpt::load(root, fresh.state);
  EXPECT_TRUE(
      at::equal(fresh.state.at("tok_embeddings.weight").local, t.state.at("tok_embeddings.weight").local));
}

TEST(Checkpoint, ACopyAReSaveMovedAsideIsLoadedAndRestored) {
  // Where the filesystem cannot exchange two names, a re-save of step-N renames it to
  // .step-N.old-<id> before renaming the new one in. A crash between the two leaves only that copy.
  SharedTmpDir dir("moved_aside");
  Meshes meshes;
  const int64_t p = world_size();
  Trainee t(meshes.tp(p), 1);
  const auto root = dir.path();
  ckpt::save(root, t.state, ckpt::SaveOptions().step(7));
  hp::comm::barrier(hp::comm::world());
  if (rank() == 0) fs::rename(root + "/step-7", root + "/.step-7.old-interrupted");
  hp::comm::barrier(hp::comm::world());
  Trainee fresh(meshes.tp(p), 2);
  ckpt::load(root, fresh.state);  // `latest` names step-7: its copy is read
  for (const auto& [key, e] : t.state) EXPECT_TRUE(at::equal(fresh.state.at(key).local, e.local)) << key;
  Trainee named(meshes.tp(p), 4);
  ckpt::load(ckpt::step_dir(root, 7) + "/", named.state);  // so is it when the step is named
  for (const auto& [key, e] : t.state) EXPECT_TRUE(at::equal(named.state.at(key).local, e.local)) << key;
  ckpt::save(root, fresh.state, ckpt::SaveOptions().step(8));  // puts step-7 back, then writes step-8
  hp::comm::barrier(hp::comm::world());
  if (rank() == 0) {
    std::set<std::string> names;
    for (const auto& item : fs::directory_iterator(root)) names.insert(item.path().filename().string());
    EXPECT_EQ(names, (std::set<std::string>{"latest", "step-7", "step-8"}));
  }
  Trainee again(meshes.tp(p), 3);
  ckpt::load(root + "/step-7", again.state);
  for (const auto& [key, e] : t.state) EXPECT_TRUE(at::equal(again.state.at(key).local, e.local)) << key;
}

TEST(Checkpoint, CorruptOrMismatchedCheckpointsFailWithoutTouchingTheModel) {
  SharedTmpDir dir("errors");
  Meshes meshes;
  const auto mesh = meshes.tp(world_size());
  Trainee saved(mesh, 1);
  saved.train(1);
  const auto good = dir / "good";
  ckpt::save(good, saved.state, ckpt::SaveOptions().step(1).fsync(false));
  const auto index = read_json(good + "/step-1/index.json");

  Trainee target(mesh, 2);
  const auto snapshot = [&] {
    std::vector<at::Tensor> values;
    for (const auto& [key, e] : target.state) {
      if (e.before_save) e.before_save(e.local);
      values.push_back(e.local.detach().clone());
    }
    return values;
  };
  const auto before = snapshot();
  const auto expect_untouched = [&](const std::string& what) {
    const auto now = snapshot();
    size_t i = 0;
    for (const auto& [key, e] : target.state) {
      EXPECT_TRUE(at::equal(now[i], before[i])) << what << ": " << key << " changed";
      ++i;
    }
  };
  // A copy of the good checkpoint to damage (rank 0 copies, the others wait).
  const auto copy_of_good = [&](const std::string& name) {
    const auto path = dir / name;
    if (rank() == 0) fs::copy(good + "/step-1", path, fs::copy_options::recursive);
    hp::comm::barrier(hp::comm::world());
    return path;
  };

  {  // Every rank reads the replicated tensors rank 0 wrote, so every rank sees the damage.
    const auto path = copy_of_good("truncated");
    const auto file = path + "/rank0.safetensors";
    if (rank() == 0) fs::resize_file(file, fs::file_size(file) / 2);
    hp::comm::barrier(hp::comm::world());
    expect_error([&] { ckpt::load(path, target.state); }, {"rank0.safetensors", "truncated"});
    expect_untouched("truncated file");
  }
  // Rank 0 flips the byte after the first of a shard's data (the others wait).
  const auto flip_byte = [&](const std::string& file, const nlohmann::json& shard) {
    if (rank() == 0) {
      std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
      const auto at = shard["data_offsets"][0].get<int64_t>() + 1;
      f.seekg(at);
      char c = 0;
      f.get(c);
      f.seekp(at);
      f.put(static_cast<char>(c ^ 0x5a));
    }
    hp::comm::barrier(hp::comm::world());
  };
  {  // norm.weight is replicated: every rank reads its whole shard, so the crc is checked.
    const auto path = copy_of_good("flipped");
    const auto& shard = index["tensors"]["norm.weight"]["shards"][0];
    EXPECT_EQ(shard["file"], "rank0.safetensors");
    flip_byte(path + "/rank0.safetensors", shard);
    expect_error([&] { ckpt::load(path, target.state); }, {"crc32", "norm.weight", "rank0.safetensors"});
    expect_untouched("flipped byte");
  }
  if (world_size() > 1) {  // A shard only the last rank reads: it alone finds the damage; no rank loads.
    const auto path = copy_of_good("flipped_last");
    const std::string last = std::to_string(world_size() - 1), file = "rank" + last + ".safetensors";
    std::string key;
    for (const auto& [name, info] : index["tensors"].items()) {
      for (const auto& shard : info["shards"]) {
        if (key.empty() && shard["file"] == file) {
          key = name;
          flip_byte(path + "/" + file, shard);
        }
      }
    }
    ASSERT_FALSE(key.empty()) << "no shard in " << file;
    if (rank() == world_size() - 1) {
      expect_error([&] { ckpt::load(path, target.state); }, {"crc32", key, file});
    } else {
      expect_error([&] { ckpt::load(path, target.state); },
                   {"rank " + last + " failed to read the checkpoint, so no rank loaded it", "crc32", key});
    }
    expect_untouched("a shard only the last rank reads");
  }
  {
    ckpt::State partial = saved.state;
    ASSERT_TRUE(partial.erase("norm.weight"));
    ckpt::save(dir / "missing", partial, ckpt::SaveOptions().step(1).fsync(false));
    expect_error([&] { ckpt::load(dir / "missing", target.state); },
                 {"norm.weight", "missing from the checkpoint"});
    expect_untouched("missing key");
  }
  {
    ckpt::State extra = saved.state;
    extra.add("extra.weight", ckpt::Entry::replicated(at::ones({3})));
    ckpt::save(dir / "unexpected", extra, ckpt::SaveOptions().step(1).fsync(false));
    expect_error([&] { ckpt::load(dir / "unexpected", target.state); }, {"extra.weight", "unexpected key"});
    expect_untouched("unexpected key");
    Trainee other(mesh, 3);
    EXPECT_NO_THROW(ckpt::load(dir / "unexpected", other.state, ckpt::LoadOptions().strict(false)));
  }
  {
    ckpt::State wrong = target.state;  // aliases the model, which must stay untouched
    auto& e = wrong.at("norm.weight");
    e.local = e.local.detach().to(at::kDouble);
    expect_error(
        [&] { ckpt::load(good, wrong, ckpt::LoadOptions().strict_dtype(true)); },
        {"norm.weight", "expected dtype F64", "got F32", "strict_dtype(false) casts floating tensors"});
    expect_untouched("dtype mismatch");
  }
  {
    auto args = llama3::ModelArgs::debug();
    args.dim = 128;
    Trainee smaller(mesh, 1, args);
    ckpt::save(dir / "other_size", smaller.state, ckpt::SaveOptions().step(1).fsync(false));
    expect_error([&] { ckpt::load(dir / "other_size", target.state); },
                 {"tok_embeddings.weight: expected global shape [1024, 256] (this model), got [1024, 128]",
                  "is it from a model of another size?"});
    expect_untouched("model of another size");
  }
  {
    const auto path = copy_of_good("incomplete");
    if (rank() == 0) fs::remove(path + "/COMPLETE");
    hp::comm::barrier(hp::comm::world());
    expect_error([&] { ckpt::load(path, target.state); }, {path, "COMPLETE"});
    expect_untouched("no COMPLETE marker");
  }
  // The good checkpoint still loads.
  ckpt::load(good, target.state);
  EXPECT_TRUE(at::equal(target.state.at("tok_embeddings.weight").local,
                        saved.state.at("tok_embeddings.weight").local));
}

// A floating tensor saved in another floating dtype is cast to the state's, with one warning
// line (PyTorch DCP and Hugging Face loaders cast too); strict_dtype refuses it; other dtypes
// must match whatever the options.
TEST(Checkpoint, FloatingTensorsAreCastToTheStatesDtypeOnLoad) {
  SharedTmpDir dir("cast");
  at::manual_seed(7);
  ckpt::State saved;
  saved.add("w", ckpt::Entry::replicated(at::randn({4, 3})));
  saved.add("steps", ckpt::Entry::replicated(at::arange(3, at::kLong)));
  ckpt::save(dir / "f32", saved, ckpt::SaveOptions().step(1).fsync(false));
  ckpt::State bf16;
  bf16.add("w", ckpt::Entry::replicated(at::zeros({4, 3}, at::kBFloat16)));
  bf16.add("steps", ckpt::Entry::replicated(at::zeros({3}, at::kLong)));
  {
    hp_test::CapturedWarnings warnings;
    ckpt::load(dir / "f32", bf16);
    EXPECT_TRUE(warnings.contains("cast floating tensors of the checkpoint")) << warnings.messages.size();
    EXPECT_TRUE(warnings.contains("1 from F32 to BF16"));
    EXPECT_EQ(warnings.messages.size(), 1u);
  }
  EXPECT_TRUE(bf16.at("w").local.equal(saved.at("w").local.to(at::kBFloat16)));
  EXPECT_TRUE(bf16.at("steps").local.equal(saved.at("steps").local));
  expect_error([&] { ckpt::load(dir / "f32", bf16, ckpt::LoadOptions().strict_dtype(true)); },
               {"w: expected dtype BF16 (this state), got F32"});
  ckpt::State ints;
  ints.add("w", ckpt::Entry::replicated(at::zeros({4, 3})));
  ints.add("steps", ckpt::Entry::replicated(at::zeros({3}, at::kInt)));
  expect_error([&] { ckpt::load(dir / "f32", ints); }, {"steps: expected dtype I32 (this state), got I64"});
}

TEST(Checkpoint, ExportFullWritesTheUnshardedModel) {
  SharedTmpDir dir("export");
  Meshes meshes;
  Trainee t(meshes.tp(world_size()), 1);
  t.train(1);
  ckpt::save(dir / "ckpt", t.state, ckpt::SaveOptions().step(1).fsync(false));
  const auto out = dir / "full.safetensors";
  if (rank() == 0) ckpt::export_full(dir / "ckpt", out);
  hp::comm::barrier(hp::comm::world());
  const auto params = hp::tensor_parallel::full_named_parameters(*t.model);  // collective

  nlohmann::json metadata;
  const auto tensors = hp_checkpoint_test::read_safetensors(out, &metadata);
  EXPECT_EQ(metadata["format"], "hyper_parallel.checkpoint.full");
  EXPECT_EQ(metadata["step"], "1");
  for (const auto& [name, full] : params) {
    ASSERT_TRUE(tensors.count(name)) << name;
    EXPECT_TRUE(at::equal(tensors.at(name), full)) << name;
  }
  const auto buffers = t.model->named_buffers();
  for (const auto& b : buffers) {
    ASSERT_TRUE(tensors.count(b.key())) << b.key();
    EXPECT_TRUE(at::equal(tensors.at(b.key()), b.value())) << b.key();
  }
  EXPECT_EQ(tensors.size(), params.size() + buffers.size()) << "no optimizer state";
}

}  // namespace
