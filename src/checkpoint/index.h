#pragma once
// Internal: index.json, the map of a step directory. Written by rank 0 at the end of a save from
// every rank's shard descriptions; read (and checked) by load and export_full.
//   {"format": "hyper_parallel.checkpoint", "version": 1, "step": N, "world_size": P,
//    "tensors": {key: {"dtype", "global_shape", "shards": [{"file", "name", "offset", "shape",
//                "data_offsets" (absolute bytes in the file), "crc32"}]}}}

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "layout.h"

namespace hyper_parallel::checkpoint::detail {

/// One stored shard of a tensor.
struct ShardInfo {
  std::string file, name;
  Region region;
  int64_t begin = 0, end = 0;  // absolute bytes in the file
  uint32_t crc = 0;
};

struct TensorInfo {
  std::string dtype;
  std::vector<int64_t> global_shape;
  std::vector<ShardInfo> shards;
};

struct Index {
  int64_t step = 0;
  std::vector<std::pair<std::string, TensorInfo>> tensors;  // in the index's order
  std::map<std::string, size_t> by_key;

  /// nullptr if absent.
  const TensorInfo* find(const std::string& key) const;
};

/// One shard as a JSON object (what a rank tells rank 0 after writing it).
std::string shard_json(const std::string& key, const ShardInfo& shard);
/// index.json's text for the keys in save order (each with its dtype and global shape) and every
/// rank's shards (each rank's list of shard_json texts).
std::string index_text(const std::vector<std::pair<std::string, TensorInfo>>& keys,
                       const std::vector<std::vector<std::string>>& shards_by_rank, int64_t step,
                       int64_t world_size);
/// Reads and checks dir/index.json: format, version, shards inside their tensors, disjoint and
/// covering them, files inside the directory. Errors name the path and the key.
Index read_index(const char* fn, const std::string& dir);

}  // namespace hyper_parallel::checkpoint::detail
