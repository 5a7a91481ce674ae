#pragma once
// Internal: reading the part of a stored tensor a rank needs, from the shards that overlap it,
// with positioned reads of exactly the overlapping byte ranges.

#include <map>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "index.h"
#include "safetensors.h"

namespace hyper_parallel::checkpoint::detail {

/// A step directory's rank files, each opened (and its header checked) once.
class Readers {
 public:
  Readers(const char* fn, std::string dir) : fn_(fn), dir_(std::move(dir)) {}
  const SafetensorsReader& get(const std::string& file);

 private:
  const char* fn_;
  std::string dir_;
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers_;
};

/// The region `want` of tensor `key`, assembled from the shards that overlap it. A shard read
/// whole is checked against its crc32; a partial read is checked by length. Errors name the key,
/// the file and the tensor.
at::Tensor read_region(const char* fn, Readers& readers, const std::string& key, const TensorInfo& info,
                       const Region& want);

}  // namespace hyper_parallel::checkpoint::detail
