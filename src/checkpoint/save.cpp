// checkpoint::save, phase by phase: the plan (save_plan.h), the shard files (write_shards.h) and
// the publication (publish.h). Each phase ends with an all_gather of every rank's status
// (phase_status.h), which is also its barrier: an error on one rank is raised on every rank, and
// no rank leaves a phase before all entered it. An asynchronous save runs the phases after the
// plan on its writer thread (async_writer.h).
#include <hyper_parallel/checkpoint/checkpoint.h>

#include <filesystem>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/process_group.h>

#include "../core/comm/test_hooks.h"
#include "async_writer.h"
#include "index.h"
#include "phase_status.h"
#include "save_phases.h"
#include "write_shards.h"

namespace hyper_parallel::checkpoint {
namespace {

using json = nlohmann::ordered_json;

constexpr const char* kFn = "checkpoint::save";

// Phase 2: every rank writes and fsyncs its shards, then the shard descriptions of every rank
// are gathered (rank 0 needs them for the index).
std::vector<std::vector<std::string>> write_and_gather_shards(const detail::SavePlan& plan,
                                                              const std::vector<at::Tensor>& data,
                                                              const std::string& staging, int64_t step,
                                                              bool durable, const comm::Group& group,
                                                              int64_t* bytes_written) {
  const int64_t rank = group.rank();
  json shards = json::array();
  std::string error;
  try {
    if (!plan.mine.empty()) {
      const auto path = (std::filesystem::path(staging) / detail::rank_file_name(rank)).string();
      const auto halfway = [&] {
        comm::test_hooks::exit_at_save_fault(kFn, comm::test_hooks::SaveFault::kAsyncWrite, rank,
                                             group.size());
      };
      for (const auto& shard : detail::write_rank_file(kFn, path, plan, data, rank, step, durable, halfway)) {
        shards.push_back(detail::shard_json(shard.name, shard));
        *bytes_written += shard.end - shard.begin;
      }
    }
  } catch (const std::exception& e) {
    error = detail::message_of(e);
  }
  comm::test_hooks::exit_at_save_fault(kFn, comm::test_hooks::SaveFault::kAfterShard, rank, group.size());
  std::vector<std::vector<std::string>> shards_by_rank;
  std::vector<std::string> errors;
  for (const auto& text :
       comm::all_gather_strings(json{{"error", error}, {"shards", shards}}.dump(), group)) {
    const auto parsed = json::parse(text);
    errors.push_back(parsed.at("error").get<std::string>());
    shards_by_rank.push_back(parsed.at("shards").get<std::vector<std::string>>());
  }
  detail::raise_if_any_failed(kFn, errors, "writing its shards");
  return shards_by_rank;
}

}  // namespace

namespace detail {

SaveResult write_and_publish(const char* fn, const std::string& root, const SavePlan& plan,
                             const std::vector<at::Tensor>& data, int64_t step, bool durable,
                             const comm::Group& group) {
  const auto staging = staging_dir(root, step, plan.nonce);
  std::string error;
  if (group.rank() == 0) {
    try {
      prepare_staging(fn, root, staging);
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  check_all(fn, group, error, "creating " + staging);

  SaveResult result{step_dir(root, step), plan.total_bytes, 0};
  const auto shards_by_rank =
      write_and_gather_shards(plan, data, staging, step, durable, group, &result.bytes_written);
  // Phase 3, rank 0: the index and the publication; the others wait in the last gather, so that
  // no rank returns before the checkpoint is published.
  error.clear();
  if (group.rank() == 0) {
    try {
      const auto index = index_text(plan.keys, shards_by_rank, step, group.size());
      publish(fn, root, staging, step, plan.nonce, index, durable);
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  check_all(fn, group, error, "publishing " + result.path);
  return result;
}

}  // namespace detail

SaveResult save(const std::string& root, const State& state, const SaveOptions& options) {
  comm::test_hooks::check_save_fault_setting(kFn);
  const int64_t step = options.step();
  TORCH_CHECK(step >= 0, kFn, ": expected step >= 0, got ", step);
  auto& writer = detail::AsyncWriter::get();
  writer.wait();  // the previous asynchronous save, if any: its error is this call's
  if (!options.asynchronous()) {
    const auto world = comm::world();
    const auto plan = detail::agree_on_plan(kFn, state, step, world);
    return detail::write_and_publish(kFn, root, plan, detail::tensors_to_write(state, plan), step,
                                     options.fsync(), world);
  }
  const auto& group = writer.group();
  auto plan = detail::agree_on_plan(kFn, state, step, group);
  return writer.start(kFn, root, std::move(plan), state, step, options.fsync());
}

std::optional<SaveResult> finish() { return detail::AsyncWriter::get().wait(); }

bool save_in_flight() { return detail::AsyncWriter::get().in_flight(); }

}  // namespace hyper_parallel::checkpoint
