#pragma once
// For benchmarks only: a thread's transfers skipped, so a program runs its compute with the
// shard shapes of a real run and none of its communication (the compute-only twin of a step).

namespace hyper_parallel::comm::detail {

/// While one is alive on a thread, that thread's sends and receives (and the ops' agreement) are
/// skipped and receives read as zeros. Results are meaningless; every rank must hold one around
/// the same calls. Transfers posted from other threads are not affected.
///
/// Usage (bench): { comm::detail::SkipTransfers skip; train_step(model); }  // compute only
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

}  // namespace hyper_parallel::comm::detail
