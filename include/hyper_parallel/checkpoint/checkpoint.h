#pragma once
// Sharded, resharding, atomic checkpoints.
//
// Each rank writes the shards it holds (a region held by several ranks, e.g. a replicated
// tensor or a DP replica's shard, is written once, by the lowest global rank holding it); a
// checkpoint saved at one TP degree loads at any other, each rank reading only the byte ranges
// that overlap its own shard; an interrupted save never damages the last complete checkpoint.
//
// On disk, under a root directory:
//   root/step-N/rank<R>.safetensors   the shards global rank R wrote (only ranks that wrote any)
//   root/step-N/index.json            every key: dtype, global shape, and where each shard lies
//   root/step-N/COMPLETE              written last; load refuses a directory without it
//   root/latest                       "step-N\n": the newest complete checkpoint
// A rank file is plain safetensors: its tensor names are the state's keys (a rank holds at most
// one region of a key, so no shard suffix is needed) and each shard is stored contiguously.
// index.json: {"format": "hyper_parallel.checkpoint", "version": 1, "step": N, "world_size": P,
//   "tensors": {key: {"dtype", "global_shape", "shards": [{"file", "name", "offset", "shape",
//   "data_offsets" (absolute bytes in the file), "crc32"}]}}}.
//
// A save goes to root/.step-N.tmp-<id> and becomes root/step-N by one rename once every shard,
// the index and COMPLETE are written and fsynced; `latest` is replaced after that, by a rename.
// A save of a step that already exists replaces it atomically (renameat2 RENAME_EXCHANGE; where
// the filesystem lacks it, the old directory is renamed away first, leaving a short window in
// which step-N is absent). Leftover temporary directories of interrupted saves are removed by
// the next save into the same root. One job saves into a root at a time; the root must be on a
// filesystem every rank sees.
//
// Fault injection, for tests: HP_CHECKPOINT_FAULT makes save exit the process (status 3) at one
// point of the protocol (on the first attempt of a job only, so that a job hp-run restarts runs
// through):
//   after_shard     rank 1 (rank 0 in a 1-rank world), right after writing its shard file
//   async_write     rank 1 (rank 0 in a 1-rank world), halfway through writing its shard file
//                   on an asynchronous save's background thread (synchronous saves ignore it)
//   before_rename   rank 0, after writing COMPLETE, before the temporary directory is renamed
//   before_latest   rank 0, after the rename, before `latest` is replaced
// In each case the previous checkpoint (the one `latest` names) stays loadable.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/dtensor/placement.h>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class AdamW;
}

namespace hyper_parallel::checkpoint {

/// One tensor of the state: this rank's part of it and its layout.
struct Entry {
  /// This rank's local shard (the whole tensor when replicated). load writes into it in place.
  at::Tensor local;
  std::vector<int64_t> global_shape;
  /// The mesh the tensor is laid out on; none means the same full tensor on every rank.
  std::optional<dtensor::DeviceMesh> mesh;
  /// One per mesh dim: Shard or Replicate (Partial cannot be saved). Empty without a mesh.
  dtensor::Placements placements;
  /// For values that do not live in a tensor (AdamW's step count): save calls before_save to
  /// fill `local` from where the value lives, load calls after_load once `local` holds the
  /// loaded value. Empty for tensors that are the state itself.
  std::function<void(const at::Tensor& local)> before_save;
  std::function<void(const at::Tensor& local)> after_load;

  /// A tensor every rank holds whole. Usage: state.add("extra", Entry::replicated(t));
  static Entry replicated(at::Tensor tensor);
  /// True without a mesh, or when every placement is Replicate.
  bool is_replicated() const;
};

/// The tensors of a checkpoint: fully qualified name -> Entry, in insertion order.
class State {
 public:
  using Item = std::pair<std::string, Entry>;

  /// Throws on a duplicate key, an unsupported dtype, a Partial placement, or a local tensor
  /// whose shape is not the shard its layout gives this rank.
  void add(std::string key, Entry entry);
  bool contains(const std::string& key) const { return index_.count(key) != 0; }
  /// nullptr if absent.
  const Entry* find(const std::string& key) const;
  Entry* find(const std::string& key);
  /// Throws naming the key if absent.
  const Entry& at(const std::string& key) const;
  Entry& at(const std::string& key);
  /// Removes `key`; false if it was absent.
  bool erase(const std::string& key);
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  std::vector<Item>::const_iterator begin() const { return items_.begin(); }
  std::vector<Item>::const_iterator end() const { return items_.end(); }
  std::vector<Item>::iterator begin() { return items_.begin(); }
  std::vector<Item>::iterator end() { return items_.end(); }

 private:
  std::vector<Item> items_;
  std::unordered_map<std::string, size_t> index_;
};

/// Every parameter and buffer of `model` by fully qualified name ("layers.0.attention.wq.weight"),
/// aliasing the module's tensors. A parameter's layout is the one its parallel style recorded
/// (nn::recorded_layout); everything else is replicated.
State model_state(torch::nn::Module& model);

/// An entry aliasing `tensor`, laid out as its parallel style recorded it (nn::recorded_layout),
/// else replicated. The Python front end builds states from these.
Entry entry_of(const at::Tensor& tensor);

/// AdamW's state of one parameter: the moments (aliased; max_exp_avg_sq undefined without
/// amsgrad) and where its step count lives.
struct AdamWTensors {
  at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq;
  std::function<int64_t()> get_step;
  std::function<void(int64_t)> set_step;
};
/// Adds "optim.<fqn>.exp_avg", ".exp_avg_sq" (and ".max_exp_avg_sq"), laid out as `param`, and
/// ".step", a 1-element int64 tensor, replicated, filled from get_step at save and handed to
/// set_step at load. add_optimizer_state calls it for libtorch's AdamW; the Python front end for
/// torch.optim.AdamW (whose step is a float tensor).
void add_adamw_state(State& state, const std::string& fqn, const at::Tensor& param,
                     const AdamWTensors& adamw);

/// Adds AdamW's state for every parameter of `optimizer`, named after the parameter's FQN in
/// `model`: "optim.<fqn>.exp_avg" and "optim.<fqn>.exp_avg_sq" (the parameter's layout, aliasing
/// the optimizer's tensors; also "optim.<fqn>.max_exp_avg_sq" with amsgrad) and
/// "optim.<fqn>.step" (a 1-element int64 tensor, replicated). A parameter without state yet (no
/// step taken) gets zeros and step 0, which AdamW then uses as if it had created them, so a
/// load before the first step restores the optimizer too.
///
/// Usage:
///   auto state = model_state(*model);
///   add_optimizer_state(state, optimizer, *model);
void add_optimizer_state(State& state, torch::optim::AdamW& optimizer, torch::nn::Module& model);

/// Usage:
///   save("/ckpt", state, SaveOptions().step(100));
///   save("/ckpt", state, SaveOptions().step(200).asynchronous(true));  // returns after a copy
///   ...                                                                 // training goes on
///   finish();                                                           // before the job ends
struct SaveOptions {
  /// The training step; the checkpoint is root/step-<step>.
  TORCH_ARG(int64_t, step) = 0;
  /// fsync files and directories so that a crash of the machine cannot lose a checkpoint that
  /// `latest` names. Off only for throwaway directories.
  TORCH_ARG(bool, fsync) = true;
  /// Return once this rank's share of the state is copied into staging buffers (a snapshot);
  /// the shard files, their crc32s, the fsyncs and the publication run on a background thread,
  /// while training goes on. The files are byte for byte those of a synchronous save. Extra
  /// memory: one snapshot of the tensors this rank writes, kept between saves so that the next
  /// snapshot is a plain copy. The background thread's collectives run on a group of its own,
  /// created (collectively) by the first asynchronous save, never on training's groups.
  TORCH_ARG(bool, asynchronous) = false;
};

struct SaveResult {
  /// root/step-N.
  std::string path;
  /// Tensor bytes of the whole checkpoint (every rank's shards).
  int64_t total_bytes = 0;
  /// Tensor bytes this rank wrote (or, for an asynchronous save in flight, writes).
  int64_t bytes_written = 0;
  /// The background part of an asynchronous save, as finish() returns it: wall time, and the
  /// CPU time of the writer thread. 0 for a synchronous save.
  double background_seconds = 0, background_cpu_seconds = 0;
};

/// Writes `state` as root/step-<options.step()> and points root/latest at it. Collective over
/// the world (comm::world()): every rank calls it with the same keys, dtypes and global shapes.
/// It first waits for an asynchronous save still in flight, and raises that save's error, if
/// it had one, instead of saving. A synchronous save returns once the checkpoint is published
/// on every rank; an error on any rank (e.g. a full disk) is raised on every rank, and `latest`
/// then still names the previous checkpoint. An asynchronous one (SaveOptions::asynchronous)
/// returns after the plan's agreement and the snapshot; its errors are raised, on every rank, by
/// the next save or finish().
SaveResult save(const std::string& root, const State& state, const SaveOptions& options = {});

/// Waits for the asynchronous save in flight, if any, and returns its result; raises its error
/// (naming the file or the rank that failed), after which no save is in flight. nullopt when
/// none was in flight. Every rank calls it before the job ends: a process that exits with a save
/// in flight waits for it at exit, but has no one to raise its error to (it is printed).
std::optional<SaveResult> finish();

/// Whether an asynchronous save was started and not yet collected by finish() or save().
bool save_in_flight();

/// Usage:
///   load("/ckpt", state, LoadOptions().strict(false));  // ignore checkpoint keys state lacks
struct LoadOptions {
  /// Refuse a checkpoint holding keys the state lacks. false loads a subset of it.
  TORCH_ARG(bool, strict) = true;
  /// Refuse a floating tensor saved in another floating dtype. By default it is cast to the
  /// state's dtype, as PyTorch DCP and Hugging Face loaders do (a float32 checkpoint resumes a
  /// bfloat16 run), and the load says so in one warning line. Other dtypes must always match.
  TORCH_ARG(bool, strict_dtype) = false;
  /// Every rank of the world calls load (collective): once each rank has checked and read its
  /// share, they exchange their outcomes, and a failure on any rank is raised on every rank
  /// before any state changes (PyTorch DCP's load is collective too). false: this rank loads
  /// alone, without communication (e.g. one rank reading weights for an evaluation); a failure
  /// is raised on it only. No effect without a process group or in a world of one.
  TORCH_ARG(bool, collective) = true;
};

/// Loads a checkpoint into `state`, resharding to each entry's layout. `dir` is a step-N
/// directory, or a root whose `latest` names one. Every rank reads what it needs itself: for a
/// sharded entry only the byte ranges overlapping its shard; then the ranks exchange their
/// outcomes (LoadOptions::collective). It first waits for an asynchronous save still in flight
/// (raising its error, as finish()), so that it reads what that save publishes.
///
/// Nothing is written into the state unless everything checks out, on every rank (collective):
/// a missing COMPLETE marker, a key of the state missing from the checkpoint, a key of the
/// checkpoint the state lacks (strict), a dtype mismatch (but floating to floating, unless
/// strict_dtype), a global-shape mismatch (a model of another size), a truncated file or a crc32
/// mismatch is a c10::Error naming the path, the file and/or the key, raised before any tensor
/// changes. The crc32 of a shard is checked whenever the whole shard is read (e.g. a load at the
/// TP degree of the save); a partial read is checked by length.
void load(const std::string& dir, State& state, const LoadOptions& options = {});

/// For a front end whose own preparation of this rank's load failed (e.g. Python's, building the
/// state) while the other ranks call load (collective): joins their exchange of outcomes with
/// `error`, so that they raise it too instead of waiting for this rank, then raises `error` here
/// (a c10::Error). Without a process group, or in a world of one, it only raises.
[[noreturn]] void abandon_load(const std::string& error);

/// The step `root/latest` names; nullopt if there is no `latest`.
std::optional<int64_t> latest_step(const std::string& root);

/// The directory of step `step` under `root`: root/step-<step>.
std::string step_dir(const std::string& root, int64_t step);

/// Writes the full (unsharded) tensors of every key not starting with "optim." to `out_file`
/// as one safetensors file named by the model's FQNs, reassembled from the shard files (no
/// process group needed; one process calls it). `dir` as in load.
void export_full(const std::string& dir, const std::string& out_file);

/// Tensor payload bytes this process read and wrote in checkpoint files (headers, index and
/// markers not counted) since the last reset.
struct IoStats {
  int64_t bytes_read = 0, bytes_written = 0;
};
IoStats io_stats();
void reset_io_stats();

}  // namespace hyper_parallel::checkpoint
