#pragma once
// Internal: every test and bench hook of the library, in one place, so that no production
// signature carries one. Each is off unless a test or a bench turns it on:
// - fault points, from the environment, on the first attempt of a job only (restart_count() ==
//   0), so that a job hp-run restarts runs through: a step's (HP_FAULT_KILL_AT_STEP,
//   HP_FAULT_STOP_AT_STEP) and a checkpoint save's (HP_CHECKPOINT_FAULT);
// - skipped transfers, the compute-only twin of a step for benchmarks.
// docs/environment.md lists the variables.

#include <cstdint>

namespace hyper_parallel::comm::test_hooks {

// ---- Fault points ---------------------------------------------------------------------------

/// Whether fault variable `name` ("<rank>:<step>") names this global rank and `step` on a first
/// attempt; says so on stderr when it does. A malformed value is a c10::Error naming it.
bool step_fault(const char* name, int64_t step);

/// The points of a checkpoint save where HP_CHECKPOINT_FAULT makes the process exit (status 3):
///   kAfterShard    rank 1 (rank 0 in a 1-rank world), right after writing its shard file
///   kAsyncWrite    rank 1 (rank 0 in a 1-rank world), halfway through writing its shard file,
///                  on an asynchronous save's background thread only
///   kBeforeRename  rank 0, after writing COMPLETE, before the rename
///   kBeforeLatest  rank 0, after the rename, before `latest` is replaced
enum class SaveFault { kAfterShard, kAsyncWrite, kBeforeRename, kBeforeLatest };

/// At the start of each save: an HP_CHECKPOINT_FAULT that names no point is a c10::Error.
void check_save_fault_setting(const char* fn);
/// Exits with status 3 at `point` if HP_CHECKPOINT_FAULT names it, on a first attempt, on the
/// rank the point names, after saying so on stderr.
void exit_at_save_fault(const char* fn, SaveFault point, int64_t rank, int64_t world_size);

/// Marks the calling thread, while alive, as an asynchronous save's background writer (where
/// kAsyncWrite may fire).
class BackgroundSaveThread {
 public:
  BackgroundSaveThread();
  ~BackgroundSaveThread();
  BackgroundSaveThread(const BackgroundSaveThread&) = delete;
  BackgroundSaveThread& operator=(const BackgroundSaveThread&) = delete;

 private:
  bool previous_;
};

// ---- Skipped transfers (benchmarks) ---------------------------------------------------------

/// While one is alive on a thread, that thread's sends and receives (and the ops' agreement) are
/// skipped and receives read as zeros: a program runs its compute with the shard shapes of a
/// real run and none of its communication. Results are meaningless; every rank must hold one
/// around the same calls. Transfers posted from other threads are not affected.
///
/// Usage (bench): { comm::test_hooks::SkipTransfers skip; train_step(model); }  // compute only
class SkipTransfers {
 public:
  SkipTransfers();
  ~SkipTransfers();
  SkipTransfers(const SkipTransfers&) = delete;
  SkipTransfers& operator=(const SkipTransfers&) = delete;

 private:
  bool previous_;
};

/// Whether the calling thread skips its transfers.
bool transfers_skipped();

}  // namespace hyper_parallel::comm::test_hooks
