#pragma once
// Internal: the asynchronous save's writer. save() agrees on the plan and copies the tensors
// this rank writes into staging buffers (the snapshot) on the calling thread; a writer thread
// then runs the rest of the save (save_phases.h) on the snapshot.
//
// Who waits on whom: the training thread waits for the writer only at the next save or at
// finish(). The writer's collectives (the staging barrier, the shard gather, the publication
// barrier) run on a group of its own, made by the first asynchronous save on every rank of the
// world in the same order, so they never interleave with training's ops on training's groups
// (see comm::OpScope). The writer's collectives are counted in CommRegion "checkpoint".

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/checkpoint/checkpoint.h>
#include <hyper_parallel/core/comm/process_group.h>

#include "publish.h"
#include "save_plan.h"

namespace hyper_parallel::checkpoint::detail {

class AsyncWriter {
 public:
  /// The process's writer.
  static AsyncWriter& get();

  /// The writer's group over the whole world; the first call makes it (collective).
  const comm::Group& group();
  /// Snapshots this rank's tensors of `plan` from `state`, starts the writer thread on them and
  /// returns what the save will write. No save may be in flight (call wait() first).
  SaveResult start(const char* fn, const std::string& root, SavePlan plan, const State& state, int64_t step,
                   bool durable);
  /// Waits for the save in flight and returns its result, or raises its error; nullopt if none.
  std::optional<SaveResult> wait();
  bool in_flight() const { return thread_.joinable(); }

  /// Waits for a save still in flight; prints its error, which no one else will see.
  ~AsyncWriter();

 private:
  AsyncWriter() = default;
  void snapshot(const State& state, const SavePlan& plan);

  comm::Group group_;
  bool has_group_ = false;
  // One buffer per tensor this rank writes, reused while the plan's shapes and dtypes stay.
  std::vector<at::Tensor> buffers_;
  std::thread thread_;
  std::optional<SaveResult> result_;
  std::exception_ptr error_;
  std::string path_;  // the save in flight's step directory, for messages
};

}  // namespace hyper_parallel::checkpoint::detail
