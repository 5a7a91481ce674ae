#include "save_plan.h"

#include <chrono>
#include <sstream>

#include <unistd.h>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <hyper_parallel/core/comm/collectives.h>

#include "phase_status.h"
#include "safetensors.h"

namespace hyper_parallel::checkpoint::detail {
namespace {

using json = nlohmann::ordered_json;

std::string make_nonce() {
  const auto now = std::chrono::system_clock::now().time_since_epoch().count();
  std::ostringstream s;
  s << std::hex << (static_cast<uint64_t>(now) ^ (static_cast<uint64_t>(::getpid()) << 40));
  return s.str();
}

// [[key, dtype, global shape, offset, shape], ...] of this rank, or the error that stopped it.
json describe_regions(const char* fn, const State& state, SavePlan& plan, std::string& error) {
  json list = json::array();
  try {
    for (const auto& [key, entry] : state) {
      if (entry.before_save) entry.before_save(entry.local);
      TensorInfo info{dtype_name(fn, entry.local.scalar_type(), key), entry.global_shape, {}};
      Region region = local_region(fn, key, entry);
      TORCH_CHECK(region.shape == entry.local.sizes().vec(), fn, ": ", key,
                  ": expected a local tensor of shape ", shape_str(region.shape),
                  " (its layout's shard of global shape ", shape_str(entry.global_shape), "), got ",
                  entry.local.sizes());
      list.push_back({key, info.dtype, info.global_shape, region.offset, region.shape});
      plan.keys.emplace_back(key, std::move(info));
      plan.regions.push_back(std::move(region));
    }
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  return list;
}

void check_same_keys(const char* fn, const std::vector<json>& plans) {
  const auto& reference = plans[0].at("keys");
  for (size_t r = 1; r < plans.size(); ++r) {
    TORCH_CHECK(plans[r].at("step") == plans[0].at("step"), fn, ": expected every rank to save ",
                "the same step, got ", plans[r].at("step").dump(), " on rank ", r, " and ",
                plans[0].at("step").dump(), " on rank 0");
    const auto& theirs = plans[r].at("keys");
    TORCH_CHECK(theirs.size() == reference.size(), fn, ": expected every rank to save the same ",
                "keys, got ", theirs.size(), " keys on rank ", r, " and ", reference.size(), " on rank 0");
    for (size_t i = 0; i < reference.size(); ++i) {
      for (int field = 0; field < 3; ++field) {  // key, dtype, global shape
        TORCH_CHECK(theirs[i][field] == reference[i][field], fn, ": expected every rank to save ",
                    "the same keys, dtypes and global shapes in the same order, got ", theirs[i].dump(),
                    " on rank ", r, " where rank 0 has ", reference[i].dump());
      }
    }
  }
}

// The rank that writes this rank's region of key i (its lowest holder; -1 for an empty region),
// after checking that the ranks' regions tile the tensor. Adds the key's bytes to total_bytes.
int64_t writer_of(const char* fn, const std::vector<json>& plans, size_t i, int64_t my_rank,
                  int64_t* total_bytes) {
  const auto& reference = plans[0].at("keys")[i];
  const auto key = reference[0].get<std::string>();
  const auto global = reference[2].get<std::vector<int64_t>>();
  const auto dtype = dtype_from_name(fn, reference[1].get<std::string>(), key);
  std::vector<std::pair<Region, int64_t>> claimed;
  int64_t covered = 0, writer = -1;
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
      TORCH_CHECK(!overlaps(other, region), fn, ": ", key, ": rank ", r, "'s shard (offset ",
                  shape_str(region.offset), ", shape ", shape_str(region.shape), ") overlaps rank ", rank,
                  "'s (offset ", shape_str(other.offset), ", shape ", shape_str(other.shape),
                  "); expected every rank to lay the tensor out alike");
    }
    if (owner < 0) {
      owner = static_cast<int64_t>(r);
      claimed.emplace_back(region, owner);
      covered += region.numel();
    }
    if (static_cast<int64_t>(r) == my_rank) writer = owner;
  }
  TORCH_CHECK(covered == numel_of(global), fn, ": ", key, ": the ranks' shards cover ", covered, " of the ",
              numel_of(global), " elements of global shape ", shape_str(global),
              "; expected every rank to lay the tensor out alike");
  *total_bytes += covered * static_cast<int64_t>(c10::elementSize(dtype));
  return writer;
}

}  // namespace

SavePlan agree_on_plan(const char* fn, const State& state, int64_t step, const comm::Group& group) {
  SavePlan plan;
  std::string error;
  json mine = {{"error", ""}, {"step", step}, {"keys", describe_regions(fn, state, plan, error)}};
  mine["error"] = error;
  if (group.rank() == 0) mine["nonce"] = make_nonce();
  std::vector<json> plans;
  std::vector<std::string> errors;
  for (const auto& text : comm::all_gather_strings(mine.dump(), group)) {
    plans.push_back(json::parse(text));
    errors.push_back(plans.back().at("error").get<std::string>());
  }
  raise_if_any_failed(fn, errors, "preparing the save");
  check_same_keys(fn, plans);
  for (size_t i = 0; i < plan.keys.size(); ++i) {
    if (writer_of(fn, plans, i, group.rank(), &plan.total_bytes) == group.rank()) plan.mine.push_back(i);
  }
  plan.nonce = plans[0].at("nonce").get<std::string>();
  return plan;
}

}  // namespace hyper_parallel::checkpoint::detail
