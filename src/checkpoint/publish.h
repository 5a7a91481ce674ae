#pragma once
// Internal, save phase 3 (rank 0 alone): publication. A save writes into a temporary directory
// root/.step-N.tmp-<id>; once every shard is fsynced, rank 0 writes index.json and COMPLETE into
// it, renames it to root/step-N (exchanging it with an existing step-N where the filesystem
// can), and then replaces root/latest, by a rename. A crash at any point leaves `latest` naming
// a complete checkpoint; leftovers of interrupted saves are removed by the next save.
//
// Fault points (HP_CHECKPOINT_FAULT, for tests; on the first attempt of a job only, so that a
// job hp-run restarts runs through) make the process exit with status 3:
//   after_shard     rank 1 (rank 0 in a 1-rank world), right after writing its shard file
//   async_write     rank 1 (rank 0 in a 1-rank world), halfway through writing its shard file,
//                   in an asynchronous save (on its background thread)
//   before_rename   rank 0, after writing COMPLETE, before the rename
//   before_latest   rank 0, after the rename, before `latest` is replaced

#include <cstdint>
#include <string>

namespace hyper_parallel::checkpoint::detail {

enum class Fault { kNone, kAfterShard, kAsyncWrite, kBeforeRename, kBeforeLatest };

/// HP_CHECKPOINT_FAULT, read at each save; an unknown value is a c10::Error naming it.
Fault fault_from_env(const char* fn);
/// Exits with status 3 at fault point `point` if `fault` is it (and this rank is the one named
/// above), after saying so on stderr.
void maybe_exit_for_fault(const char* fn, Fault fault, Fault point, int64_t rank, int64_t world_size);

/// The temporary directory of a save: root/.step-N.tmp-<nonce>.
std::string staging_dir(const std::string& root, int64_t step, const std::string& nonce);
/// Rank 0, before the shards are written: creates root (if needed) and the staging directory,
/// after removing what interrupted saves left.
void prepare_staging(const char* fn, const std::string& root, const std::string& staging);
/// Rank 0, after every rank wrote its shards: index.json, COMPLETE, the rename to step-N, then
/// `latest`; fault points as above.
void publish(const char* fn, const std::string& root, const std::string& staging, int64_t step,
             const std::string& nonce, const std::string& index_text, bool durable, Fault fault);

}  // namespace hyper_parallel::checkpoint::detail
