#include "publish.h"

#include <fcntl.h>
#include <stdio.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/lifecycle.h>

#include "file_io.h"
#include "steps.h"

namespace hyper_parallel::checkpoint::detail {
namespace {

namespace fs = std::filesystem;

const char* name_of(Fault fault) {
  switch (fault) {
    case Fault::kAfterShard:
      return "after_shard";
    case Fault::kAsyncWrite:
      return "async_write";
    case Fault::kBeforeRename:
      return "before_rename";
    case Fault::kBeforeLatest:
      return "before_latest";
    case Fault::kNone:
      break;
  }
  return "none";
}

void rename_or_throw(const char* fn, const std::string& from, const std::string& to) {
  TORCH_CHECK(::rename(from.c_str(), to.c_str()) == 0, fn, ": cannot rename ", from, " to ", to, ": ",
              std::strerror(errno));
}

// Makes `staging` the step directory. Returns the path now holding a replaced older copy of it
// ("" if there was none), to be removed once `latest` is updated.
std::string rename_into_place(const char* fn, const fs::path& staging, const fs::path& final_dir,
                              const fs::path& old_name) {
  if (!fs::exists(final_dir)) {
    rename_or_throw(fn, staging.string(), final_dir.string());
    return "";
  }
  // Swap both names in one step: step-N is never absent.
  if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    return staging.string();
  }
  const int err = errno;
  TORCH_CHECK(err == EINVAL || err == ENOSYS || err == EOPNOTSUPP, fn, ": cannot exchange ", staging.string(),
              " with ", final_dir.string(), ": ", std::strerror(err));
  // The filesystem cannot exchange: move the old copy away first.
  rename_or_throw(fn, final_dir.string(), old_name.string());
  rename_or_throw(fn, staging.string(), final_dir.string());
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

}  // namespace

Fault fault_from_env(const char* fn) {
  const char* value = std::getenv("HP_CHECKPOINT_FAULT");
  // A restarted job (hp-run --max-restarts) runs through: the fault is the first attempt's.
  if (value == nullptr || *value == '\0' || comm::restart_count() > 0) return Fault::kNone;
  const std::string v(value);
  for (auto f : {Fault::kAfterShard, Fault::kAsyncWrite, Fault::kBeforeRename, Fault::kBeforeLatest}) {
    if (v == name_of(f)) return f;
  }
  TORCH_CHECK(false, fn, ": expected HP_CHECKPOINT_FAULT to be after_shard, async_write, before_rename or ",
              "before_latest, got '", v, "'");
}

void maybe_exit_for_fault(const char* fn, Fault fault, Fault point, int64_t rank, int64_t world_size) {
  if (fault != point) return;
  const bool shard_point = point == Fault::kAfterShard || point == Fault::kAsyncWrite;
  const int64_t faulting_rank = shard_point ? (world_size == 1 ? 0 : 1) : 0;
  if (rank != faulting_rank) return;
  std::fprintf(stderr, "%s: HP_CHECKPOINT_FAULT=%s: rank %lld exits with status 3\n", fn, name_of(point),
               static_cast<long long>(rank));
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(3);
}

std::string staging_dir(const std::string& root, int64_t step, const std::string& nonce) {
  const std::string name = step_name(step);
  return (fs::path(root) / ("." + name + ".tmp-" + nonce)).string();
}

void prepare_staging(const char* fn, const std::string& root, const std::string& staging) {
  try {
    fs::create_directories(root);
    remove_leftovers(root);
    fs::create_directory(staging);
  } catch (const fs::filesystem_error& e) {
    TORCH_CHECK(false, fn, ": cannot prepare ", staging, ": ", e.what());
  }
}

void publish(const char* fn, const std::string& root, const std::string& staging, int64_t step,
             const std::string& nonce, const std::string& index_text, bool durable, Fault fault) {
  const fs::path tmp(staging), root_path(root);
  const std::string name = step_name(step);
  write_text(fn, (tmp / "index.json").string(), index_text, durable, false);
  write_text(fn, (tmp / "COMPLETE").string(), name + "\n", durable, false);
  if (durable) sync_directory(fn, tmp.string());
  maybe_exit_for_fault(fn, fault, Fault::kBeforeRename, 0, 1);
  const std::string replaced =
      rename_into_place(fn, tmp, root_path / name, root_path / ("." + name + ".old-" + nonce));
  if (durable) sync_directory(fn, root);
  maybe_exit_for_fault(fn, fault, Fault::kBeforeLatest, 0, 1);
  write_text(fn, (root_path / "latest").string(), name + "\n", durable, true);
  if (!replaced.empty()) {
    std::error_code ignored;  // a leftover is removed by the next save
    fs::remove_all(replaced, ignored);
  }
}

}  // namespace hyper_parallel::checkpoint::detail
