// checkpoint::save: the plan (who writes which region), the shard files, the index and the
// publication (rename, then `latest`). Each phase ends with an all_gather of every rank's status,
// which is also the phase's barrier: an error on one rank is raised on every rank, and no rank
// leaves a phase before all entered it.
#include <hyper_parallel/checkpoint/checkpoint.h>

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/process_group.h>

#include "file_io.h"
#include "layout.h"
#include "safetensors.h"

namespace hyper_parallel::checkpoint {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using detail::Region;

constexpr const char* kFn = "checkpoint::save";

enum class Fault { kNone, kAfterShard, kBeforeRename, kBeforeLatest };

Fault fault_from_env() {
  const char* value = std::getenv("HP_CHECKPOINT_FAULT");
  if (value == nullptr || *value == '\0') return Fault::kNone;
  const std::string v(value);
  if (v == "after_shard") return Fault::kAfterShard;
  if (v == "before_rename") return Fault::kBeforeRename;
  if (v == "before_latest") return Fault::kBeforeLatest;
  TORCH_CHECK(false, kFn, ": expected HP_CHECKPOINT_FAULT to be after_shard, before_rename or ",
              "before_latest, got '", v, "'");
}

[[noreturn]] void exit_for_fault(const char* point, int64_t rank) {
  std::fprintf(stderr, "%s: HP_CHECKPOINT_FAULT=%s: rank %lld exits with status 3\n", kFn, point,
               static_cast<long long>(rank));
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(3);
}

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

// Every rank's string, in rank order (bytes carried in int32 words: the collectives move no
// uint8).
std::vector<std::string> all_gather_strings(const std::string& mine, const comm::Group& group) {
  const int64_t p = group.size();
  auto lengths = comm::all_gather(at::full({1}, static_cast<int64_t>(mine.size()), at::kLong), 0,
                                  group)
                     .contiguous();
  const auto* length = lengths.data_ptr<int64_t>();
  std::vector<int64_t> words(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) words[r] = std::max<int64_t>(1, (length[r] + 3) / 4);
  auto buffer = at::zeros({words[group.rank()]}, at::kInt);
  std::memcpy(buffer.data_ptr(), mine.data(), mine.size());
  auto all = comm::all_gather(buffer, 0, group, words).contiguous();
  const auto* bytes = static_cast<const char*>(all.data_ptr());
  std::vector<std::string> out;
  int64_t word = 0;
  for (int64_t r = 0; r < p; ++r) {
    out.emplace_back(bytes + 4 * word, static_cast<size_t>(length[r]));
    word += words[r];
  }
  return out;
}

// Raises on every rank the first rank's error, if any rank has one.
void raise_if_any_failed(const std::vector<std::string>& errors, const std::string& phase) {
  for (size_t r = 0; r < errors.size(); ++r) {
    TORCH_CHECK(errors[r].empty(), kFn, ": rank ", r, " failed ", phase, ": ", errors[r]);
  }
}

void check_all(const comm::Group& world, const std::string& my_error, const std::string& phase) {
  raise_if_any_failed(all_gather_strings(my_error, world), phase);
}

struct KeyPlan {
  std::string dtype;
  std::vector<int64_t> global_shape;
  Region region;  // what this rank holds
};

json plan_json(const std::vector<KeyPlan>& plan, const std::vector<std::string>& keys) {
  json list = json::array();
  for (size_t i = 0; i < plan.size(); ++i) {
    list.push_back({keys[i], plan[i].dtype, plan[i].global_shape, plan[i].region.offset,
                    plan[i].region.shape});
  }
  return list;
}

// The writer of each region: its lowest global rank. Checks that the ranks agree on the keys and
// that their regions tile each tensor. Returns, per key, the rank that writes this rank's region
// (-1 for an empty one).
std::vector<int64_t> assign_writers(const std::vector<json>& plans, const std::vector<std::string>& keys,
                                    int64_t my_rank, int64_t* total_bytes) {
  const auto& reference = plans[0].at("keys");
  for (size_t r = 1; r < plans.size(); ++r) {
    const auto& theirs = plans[r].at("keys");
    TORCH_CHECK(theirs.size() == reference.size(), kFn, ": expected every rank to save the same ",
                "keys, got ", theirs.size(), " keys on rank ", r, " and ", reference.size(),
                " on rank 0");
    for (size_t i = 0; i < reference.size(); ++i) {
      for (int field = 0; field < 3; ++field) {  // key, dtype, global shape
        TORCH_CHECK(theirs[i][field] == reference[i][field], kFn, ": expected every rank to save ",
                    "the same keys, dtypes and global shapes in the same order, got ",
                    theirs[i].dump(), " on rank ", r, " where rank 0 has ", reference[i].dump());
      }
    }
  }
  std::vector<int64_t> writer(keys.size(), -1);
  *total_bytes = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto global = reference[i][2].get<std::vector<int64_t>>();
    const auto dtype = detail::dtype_from_name(kFn, reference[i][1].get<std::string>(), keys[i]);
    std::vector<std::pair<Region, int64_t>> claimed;
    int64_t covered = 0;
    for (size_t r = 0; r < plans.size(); ++r) {
      const auto& k = plans[r].at("keys")[i];
      Region region{k[3].get<std::vector<int64_t>>(), k[4].get<std::vector<int64_t>>()};
      if (region.numel() == 0) continue;
      int64_t owner = -1;
      for (const auto& [other, rank] : claimed) {
        if (other == region) {
          owner = rank;
          break;
        }
        TORCH_CHECK(!detail::overlaps(other, region), kFn, ": ", keys[i], ": rank ", r,
                    "'s shard (offset ", detail::shape_str(region.offset), ", shape ",
                    detail::shape_str(region.shape), ") overlaps rank ", rank, "'s (offset ",
                    detail::shape_str(other.offset), ", shape ", detail::shape_str(other.shape),
                    "); expected every rank to lay the tensor out alike");
      }
      if (owner < 0) {
        owner = static_cast<int64_t>(r);
        claimed.emplace_back(region, owner);
        covered += region.numel();
      }
      if (static_cast<int64_t>(r) == my_rank) writer[i] = owner;
    }
    TORCH_CHECK(covered == detail::numel_of(global), kFn, ": ", keys[i], ": the ranks' shards ",
                "cover ", covered, " of the ", detail::numel_of(global), " elements of global shape ",
                detail::shape_str(global), "; expected every rank to lay the tensor out alike");
    *total_bytes += covered * static_cast<int64_t>(c10::elementSize(dtype));
  }
  return writer;
}

struct WrittenShard {
  std::string key;
  Region region;
  int64_t begin = 0, end = 0;  // absolute bytes in the file
  uint32_t crc = 0;
};

// Writes this rank's regions (the keys it writes, in state order) as one safetensors file.
std::vector<WrittenShard> write_rank_file(const std::string& path, const State& state,
                                          const std::vector<size_t>& mine,
                                          const std::vector<KeyPlan>& plan, int64_t rank,
                                          int64_t step, bool durable, int64_t* bytes_written) {
  std::vector<at::Tensor> data;
  std::vector<detail::TensorRecord> records;
  int64_t offset = 0;
  for (size_t i : mine) {
    const auto& [key, entry] = *(state.begin() + static_cast<std::ptrdiff_t>(i));
    auto t = entry.local.detach().cpu().contiguous();
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    records.push_back({key, plan[i].dtype, plan[i].region.shape, offset, offset + nbytes});
    data.push_back(std::move(t));
    offset += nbytes;
  }
  const std::string header = detail::encode_header(
      records, {{"format", "hyper_parallel.checkpoint"}, {"rank", std::to_string(rank)},
                {"step", std::to_string(step)}});
  auto file = detail::File::create(kFn, path);
  file.write_all(header.data(), static_cast<int64_t>(header.size()));
  std::vector<WrittenShard> written;
  const auto start = static_cast<int64_t>(header.size());
  for (size_t j = 0; j < records.size(); ++j) {
    const int64_t nbytes = records[j].end - records[j].begin;
    file.write_all(data[j].data_ptr(), nbytes);
    detail::count_written(nbytes);
    *bytes_written += nbytes;
    written.push_back({records[j].name, plan[mine[j]].region, start + records[j].begin,
                       start + records[j].end, detail::crc32_update(0, data[j].data_ptr(), nbytes)});
  }
  if (durable) file.sync();
  file.close();
  return written;
}

json index_json(const State& state, const std::vector<KeyPlan>& plan,
                const std::vector<json>& shards_by_rank, int64_t step, int64_t world_size) {
  std::map<std::string, json> shards_of;
  for (const auto& rank_shards : shards_by_rank) {
    for (const auto& s : rank_shards) {
      auto& list = shards_of[s.at("key").get<std::string>()];
      if (list.is_null()) list = json::array();
      list.push_back({{"file", s.at("file")},
                      {"name", s.at("name")},
                      {"offset", s.at("offset")},
                      {"shape", s.at("shape")},
                      {"data_offsets", s.at("data_offsets")},
                      {"crc32", s.at("crc32")}});
    }
  }
  json tensors = json::object();
  size_t i = 0;
  for (const auto& [key, entry] : state) {
    auto it = shards_of.find(key);
    tensors[key] = {{"dtype", plan[i].dtype},
                    {"global_shape", plan[i].global_shape},
                    {"shards", it == shards_of.end() ? json::array() : it->second}};
    ++i;
  }
  return {{"format", "hyper_parallel.checkpoint"},
          {"version", 1},
          {"step", step},
          {"world_size", world_size},
          {"tensors", std::move(tensors)}};
}

void rename_or_throw(const std::string& from, const std::string& to) {
  TORCH_CHECK(::rename(from.c_str(), to.c_str()) == 0, kFn, ": cannot rename ", from, " to ", to,
              ": ", std::strerror(errno));
}

// Makes tmp the new step directory. Returns the path now holding a replaced older copy of it
// ("" if there was none), to be removed once `latest` is updated.
std::string publish_directory(const fs::path& tmp, const fs::path& final_dir, const fs::path& old_name) {
  if (!fs::exists(final_dir)) {
    rename_or_throw(tmp.string(), final_dir.string());
    return "";
  }
  // Swap both names in one step: step-N is never absent.
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    return tmp.string();
  }
  const int err = errno;
  TORCH_CHECK(err == EINVAL || err == ENOSYS || err == EOPNOTSUPP, kFn, ": cannot exchange ",
              tmp.string(), " with ", final_dir.string(), ": ", std::strerror(err));
  // The filesystem cannot exchange: move the old copy away first.
  rename_or_throw(final_dir.string(), old_name.string());
  rename_or_throw(tmp.string(), final_dir.string());
  return old_name.string();
}

// Removes what interrupted saves left in root (their temporary and replaced directories).
void remove_leftovers(const fs::path& root) {
  for (const auto& item : fs::directory_iterator(root)) {
    const auto name = item.path().filename().string();
    if (name.rfind(".step-", 0) == 0 &&
        (name.find(".tmp-") != std::string::npos || name.find(".old-") != std::string::npos)) {
      fs::remove_all(item.path());
    }
  }
}

std::string make_nonce() {
  const auto now = std::chrono::system_clock::now().time_since_epoch().count();
  std::ostringstream s;
  s << std::hex << (static_cast<uint64_t>(now) ^ (static_cast<uint64_t>(::getpid()) << 40));
  return s.str();
}

}  // namespace

SaveResult save(const std::string& root_dir, const State& state, const SaveOptions& options) {
  const Fault fault = fault_from_env();
  const auto world = comm::world();
  const int64_t rank = world.rank(), world_size = world.size();
  const int64_t step = options.step();
  TORCH_CHECK(step >= 0, kFn, ": expected step >= 0, got ", step);
  const bool durable = options.fsync();
  const fs::path root(root_dir);
  const std::string step_name = "step-" + std::to_string(step);

  // Phase 1, plan: each rank's region of every key, gathered, so that all ranks agree on who
  // writes what (rank 0's plan also carries the id of the temporary directory).
  std::vector<std::string> keys;
  std::vector<KeyPlan> plan;
  std::string error;
  try {
    for (const auto& [key, entry] : state) {
      if (entry.before_save) entry.before_save(entry.local);
      KeyPlan k{detail::dtype_name(kFn, entry.local.scalar_type(), key), entry.global_shape,
                detail::local_region(kFn, key, entry)};
      TORCH_CHECK(k.region.shape == entry.local.sizes().vec(), kFn, ": ", key,
                  ": expected a local tensor of shape ", detail::shape_str(k.region.shape),
                  " (its layout's shard of global shape ", detail::shape_str(entry.global_shape),
                  "), got ", entry.local.sizes());
      keys.push_back(key);
      plan.push_back(std::move(k));
    }
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  json my_plan = {{"error", error}, {"step", step}, {"keys", plan_json(plan, keys)}};
  if (rank == 0) my_plan["nonce"] = make_nonce();
  std::vector<json> plans;
  for (const auto& text : all_gather_strings(my_plan.dump(), world)) plans.push_back(json::parse(text));
  std::vector<std::string> errors;
  for (const auto& p : plans) errors.push_back(p.at("error").get<std::string>());
  raise_if_any_failed(errors, "preparing the save");
  for (size_t r = 1; r < plans.size(); ++r) {
    TORCH_CHECK(plans[r].at("step") == plans[0].at("step"), kFn, ": expected every rank to save ",
                "the same step, got ", plans[r].at("step").dump(), " on rank ", r, " and ",
                plans[0].at("step").dump(), " on rank 0");
  }
  int64_t total_bytes = 0;
  const auto writer = assign_writers(plans, keys, rank, &total_bytes);
  std::vector<size_t> mine;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (writer[i] == rank) mine.push_back(i);
  }
  const std::string nonce = plans[0].at("nonce").get<std::string>();
  const fs::path tmp = root / ("." + step_name + ".tmp-" + nonce);
  const fs::path final_dir = root / step_name;

  // Phase 2: rank 0 makes the temporary directory.
  error.clear();
  if (rank == 0) {
    try {
      fs::create_directories(root);
      remove_leftovers(root);
      fs::create_directory(tmp);
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  check_all(world, error, "creating " + tmp.string());

  // Phase 3: every rank writes and fsyncs its shards, then tells rank 0 where they are.
  SaveResult result{final_dir.string(), total_bytes, 0};
  const std::string file_name = "rank" + std::to_string(rank) + ".safetensors";
  json shards = json::array();
  error.clear();
  try {
    if (!mine.empty()) {
      for (const auto& w : write_rank_file((tmp / file_name).string(), state, mine, plan, rank,
                                           step, durable, &result.bytes_written)) {
        shards.push_back({{"key", w.key},
                          {"file", file_name},
                          {"name", w.key},
                          {"offset", w.region.offset},
                          {"shape", w.region.shape},
                          {"data_offsets", {w.begin, w.end}},
                          {"crc32", w.crc}});
      }
    }
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  if (fault == Fault::kAfterShard && rank == (world_size == 1 ? 0 : 1)) {
    exit_for_fault("after_shard", rank);
  }
  const json my_shards = {{"error", error}, {"shards", shards}};
  std::vector<json> shards_by_rank;
  errors.clear();
  for (const auto& text : all_gather_strings(my_shards.dump(), world)) {
    auto parsed = json::parse(text);
    errors.push_back(parsed.at("error").get<std::string>());
    shards_by_rank.push_back(std::move(parsed.at("shards")));
  }
  raise_if_any_failed(errors, "writing its shards");

  // Phase 4, rank 0: index, COMPLETE, rename, `latest`; the others wait in the last all_gather,
  // so that no rank returns before the checkpoint is published.
  error.clear();
  if (rank == 0) {
    try {
      const auto index = index_json(state, plan, shards_by_rank, step, world_size);
      detail::write_text(kFn, (tmp / "index.json").string(), index.dump(1) + "\n", durable, false);
      detail::write_text(kFn, (tmp / "COMPLETE").string(), step_name + "\n", durable, false);
      if (durable) detail::sync_directory(kFn, tmp.string());
      if (fault == Fault::kBeforeRename) exit_for_fault("before_rename", rank);
      const std::string replaced =
          publish_directory(tmp, final_dir, root / ("." + step_name + ".old-" + nonce));
      if (durable) detail::sync_directory(kFn, root.string());
      if (fault == Fault::kBeforeLatest) exit_for_fault("before_latest", rank);
      detail::write_text(kFn, (root / "latest").string(), step_name + "\n", durable, true);
      if (!replaced.empty()) {
        std::error_code ignored;  // a leftover is removed by the next save
        fs::remove_all(replaced, ignored);
      }
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  check_all(world, error, "publishing " + final_dir.string());
  return result;
}

}  // namespace hyper_parallel::checkpoint
