#include "index.h"

#include <filesystem>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "file_io.h"
#include "safetensors.h"

namespace hyper_parallel::checkpoint::detail {
namespace {

using json = nlohmann::ordered_json;

ShardInfo parse_shard(const char* fn, const std::string& path, const std::string& key, const json& s,
                      const std::vector<int64_t>& global_shape, int64_t element_size) {
  ShardInfo shard;
  shard.file = s.at("file").get<std::string>();
  shard.name = s.at("name").get<std::string>();
  shard.region = {s.at("offset").get<std::vector<int64_t>>(), s.at("shape").get<std::vector<int64_t>>()};
  const auto offsets = s.at("data_offsets").get<std::vector<int64_t>>();
  shard.crc = s.at("crc32").get<uint32_t>();
  // Only files of this directory.
  TORCH_CHECK(!shard.file.empty() && shard.file.find('/') == std::string::npos && shard.file != "." &&
                  shard.file != "..",
              fn, ": ", path, ": ", key, ": expected a file name in this directory, got '", shard.file, "'");
  const auto ndim = global_shape.size();
  bool inside = shard.region.offset.size() == ndim && shard.region.shape.size() == ndim;
  for (size_t d = 0; inside && d < ndim; ++d) {
    inside = shard.region.offset[d] >= 0 && shard.region.shape[d] >= 0 &&
             shard.region.offset[d] + shard.region.shape[d] <= global_shape[d];
  }
  TORCH_CHECK(inside, fn, ": ", path, ": ", key, ": expected shards inside the global shape ",
              shape_str(global_shape), ", got offset ", shape_str(shard.region.offset), " shape ",
              shape_str(shard.region.shape));
  TORCH_CHECK(offsets.size() == 2 && offsets[0] >= 0 &&
                  offsets[1] - offsets[0] == shard.region.numel() * element_size,
              fn, ": ", path, ": ", key, ": expected data_offsets spanning ",
              shard.region.numel() * element_size, " bytes for shape ", shape_str(shard.region.shape));
  shard.begin = offsets[0];
  shard.end = offsets[1];
  return shard;
}

TensorInfo parse_tensor(const char* fn, const std::string& path, const std::string& key, const json& t) {
  TensorInfo info;
  info.dtype = t.at("dtype").get<std::string>();
  info.global_shape = t.at("global_shape").get<std::vector<int64_t>>();
  const auto dtype = dtype_from_name(fn, info.dtype, path + ": " + key);
  const auto element_size = static_cast<int64_t>(c10::elementSize(dtype));
  int64_t covered = 0;
  for (const auto& s : t.at("shards")) {
    auto shard = parse_shard(fn, path, key, s, info.global_shape, element_size);
    for (const auto& other : info.shards) {
      TORCH_CHECK(!overlaps(other.region, shard.region), fn, ": ", path, ": ", key,
                  ": expected disjoint shards, got two overlapping");
    }
    covered += shard.region.numel();
    info.shards.push_back(std::move(shard));
  }
  TORCH_CHECK(covered == numel_of(info.global_shape), fn, ": ", path, ": ", key,
              ": expected shards covering global shape ", shape_str(info.global_shape), " (",
              numel_of(info.global_shape), " elements), got ", covered, " elements");
  return info;
}

}  // namespace

const TensorInfo* Index::find(const std::string& key) const {
  auto it = by_key.find(key);
  return it == by_key.end() ? nullptr : &tensors[it->second].second;
}

std::string shard_json(const std::string& key, const ShardInfo& shard) {
  return json{{"key", key},
              {"file", shard.file},
              {"name", shard.name},
              {"offset", shard.region.offset},
              {"shape", shard.region.shape},
              {"data_offsets", {shard.begin, shard.end}},
              {"crc32", shard.crc}}
      .dump();
}

std::string index_text(const std::vector<std::pair<std::string, TensorInfo>>& keys,
                       const std::vector<std::vector<std::string>>& shards_by_rank, int64_t step,
                       int64_t world_size) {
  std::map<std::string, json> shards_of;
  for (const auto& rank_shards : shards_by_rank) {
    for (const auto& text : rank_shards) {
      auto s = json::parse(text);
      auto& list = shards_of[s.at("key").get<std::string>()];
      if (list.is_null()) list = json::array();
      s.erase("key");
      list.push_back(std::move(s));
    }
  }
  json tensors = json::object();
  for (const auto& [key, info] : keys) {
    auto it = shards_of.find(key);
    tensors[key] = {{"dtype", info.dtype},
                    {"global_shape", info.global_shape},
                    {"shards", it == shards_of.end() ? json::array() : it->second}};
  }
  const json index{{"format", "hyper_parallel.checkpoint"},
                   {"version", 1},
                   {"step", step},
                   {"world_size", world_size},
                   {"tensors", std::move(tensors)}};
  return index.dump(1) + "\n";
}

Index read_index(const char* fn, const std::string& dir) {
  const auto path = (std::filesystem::path(dir) / "index.json").string();
  const auto text = read_text(fn, path);
  Index index;
  try {
    const auto j = json::parse(text);
    TORCH_CHECK(j.at("format") == "hyper_parallel.checkpoint", fn, ": ", path,
                ": expected format 'hyper_parallel.checkpoint', got ", j.at("format").dump());
    TORCH_CHECK(j.at("version") == 1, fn, ": ", path, ": expected version 1, got ", j.at("version").dump());
    index.step = j.at("step").get<int64_t>();
    for (const auto& [key, t] : j.at("tensors").items()) {
      index.by_key.emplace(key, index.tensors.size());
      index.tensors.emplace_back(key, parse_tensor(fn, path, key, t));
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, fn, ": ", path, ": malformed index: ", e.what());
  }
  return index;
}

}  // namespace hyper_parallel::checkpoint::detail
