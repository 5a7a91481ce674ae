#pragma once
// Internal, save phase 3 (rank 0 alone): publication. A save writes into a temporary directory
// root/.step-N.tmp-<id>; once every shard is fsynced, rank 0 writes index.json and COMPLETE into
// it, renames it to root/step-N (exchanging it with an existing step-N where the filesystem
// can), and then replaces root/latest, by a rename. A crash at any point leaves `latest` naming
// a complete checkpoint; leftovers of interrupted saves are removed by the next save.
// HP_CHECKPOINT_FAULT's points (comm/test_hooks.h) sit between these steps.

#include <cstdint>
#include <string>

namespace hyper_parallel::checkpoint::detail {

/// The temporary directory of a save: root/.step-N.tmp-<nonce>.
std::string staging_dir(const std::string& root, int64_t step, const std::string& nonce);
/// Rank 0, before the shards are written: creates root (if needed) and the staging directory,
/// after removing what interrupted saves left.
void prepare_staging(const char* fn, const std::string& root, const std::string& staging);
/// Rank 0, after every rank wrote its shards: index.json, COMPLETE, the rename to step-N, then
/// `latest`.
void publish(const char* fn, const std::string& root, const std::string& staging, int64_t step,
             const std::string& nonce, const std::string& index_text, bool durable);

}  // namespace hyper_parallel::checkpoint::detail
