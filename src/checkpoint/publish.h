#pragma once
// Internal, save phase 3 (rank 0 alone): publication. A save writes into a temporary directory
// root/.step-N.tmp-<id>; once every shard is fsynced, rank 0 writes index.json and COMPLETE into
// it, renames it to root/step-N (exchanging it with an existing step-N where the filesystem
// can), and then replaces root/latest, by a rename. Where the filesystem cannot exchange, an
// existing step-N is first renamed to root/.step-N.old-<id>: a crash before the second rename
// leaves `latest` naming a step-N found there (load reads it; the next save renames it back). A
// crash at any other point leaves `latest` naming a complete checkpoint; leftovers of interrupted
// saves are removed by the next save.
// HP_CHECKPOINT_FAULT's points (comm/test_hooks.h) sit between these steps.

#include <cstdint>
#include <optional>
#include <string>

namespace hyper_parallel::checkpoint::detail {

/// The temporary directory of a save: root/.step-N.tmp-<nonce>.
std::string staging_dir(const std::string& root, int64_t step, const std::string& nonce);
/// Rank 0, before the shards are written: creates root (if needed) and the staging directory,
/// after removing what interrupted saves left.
void prepare_staging(const char* fn, const std::string& root, const std::string& staging);
/// The complete copy of root/<step_name> a re-save moved aside and did not replace (it was
/// interrupted between its two renames), if any.
std::optional<std::string> replaced_copy(const std::string& root, const std::string& step_name);
/// Rank 0, after every rank wrote its shards: index.json, COMPLETE, the rename to step-N, then
/// `latest`.
void publish(const char* fn, const std::string& root, const std::string& staging, int64_t step,
             const std::string& nonce, const std::string& index_text, bool durable);

}  // namespace hyper_parallel::checkpoint::detail
