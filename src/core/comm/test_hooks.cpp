#include "test_hooks.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/lifecycle.h>
#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::comm::test_hooks {
namespace {

thread_local bool t_skip_transfers = false;
thread_local bool t_background_save = false;

// The value of fault variable `name` on a first attempt; nullptr when unset, empty, or restarted.
const char* armed_value(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' || restart_count() > 0 ? nullptr : v;
}

// What a fault point said reaches the launcher before the process stops or exits.
void flush_output() {
  std::fflush(stdout);
  std::fflush(stderr);
}

constexpr SaveFault kSaveFaults[] = {SaveFault::kAfterShard, SaveFault::kAsyncWrite, SaveFault::kBeforeRename,
                                     SaveFault::kBeforeLatest};

const char* name_of(SaveFault fault) {
  switch (fault) {
    case SaveFault::kAfterShard:
      return "after_shard";
    case SaveFault::kAsyncWrite:
      return "async_write";
    case SaveFault::kBeforeRename:
      return "before_rename";
    case SaveFault::kBeforeLatest:
      return "before_latest";
  }
  return "?";
}

}  // namespace

bool step_fault(const char* name, int64_t step) {
  const char* v = armed_value(name);
  if (v == nullptr) return false;
  long long rank = -1, at_step = -1;
  char tail = 0;
  TORCH_CHECK(std::sscanf(v, "%lld:%lld%c", &rank, &at_step, &tail) == 2, "hyper_parallel::comm: expected ",
              name, "=<rank>:<step>, got '", v, "'");
  if (at_step != step || rank != global_rank()) return false;
  std::fprintf(stderr, "%s=%s: rank %lld %s itself at step %lld\n", name, v, rank,
               std::string(name) == "HP_FAULT_KILL_AT_STEP" ? "kills" : "stops", at_step);
  flush_output();
  return true;
}

void check_save_fault_setting(const char* fn) {
  const char* v = armed_value("HP_CHECKPOINT_FAULT");
  if (v == nullptr) return;
  for (auto f : kSaveFaults) {
    if (std::string(v) == name_of(f)) return;
  }
  TORCH_CHECK(false, fn, ": expected HP_CHECKPOINT_FAULT to be after_shard, async_write, before_rename or ",
              "before_latest, got '", v, "'");
}

void exit_at_save_fault(const char* fn, SaveFault point, int64_t rank, int64_t world_size) {
  const char* v = armed_value("HP_CHECKPOINT_FAULT");
  if (v == nullptr || std::string(v) != name_of(point)) return;
  if (point == SaveFault::kAsyncWrite && !t_background_save) return;
  const bool shard_point = point == SaveFault::kAfterShard || point == SaveFault::kAsyncWrite;
  const int64_t faulting_rank = shard_point ? (world_size == 1 ? 0 : 1) : 0;
  if (rank != faulting_rank) return;
  std::fprintf(stderr, "%s: HP_CHECKPOINT_FAULT=%s: rank %lld exits with status 3\n", fn, name_of(point),
               static_cast<long long>(rank));
  flush_output();
  std::_Exit(3);
}

BackgroundSaveThread::BackgroundSaveThread() : previous_(t_background_save) { t_background_save = true; }
BackgroundSaveThread::~BackgroundSaveThread() { t_background_save = previous_; }

SkipTransfers::SkipTransfers() : previous_(t_skip_transfers) { t_skip_transfers = true; }
SkipTransfers::~SkipTransfers() { t_skip_transfers = previous_; }
bool transfers_skipped() { return t_skip_transfers; }

}  // namespace hyper_parallel::comm::test_hooks
