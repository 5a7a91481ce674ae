#include "publish.h"

#include <fcntl.h>
#include <stdio.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <vector>

#include <c10/util/Exception.h>

#include "../core/comm/test_hooks.h"
#include "file_io.h"
#include "steps.h"

namespace hyper_parallel::checkpoint::detail {
namespace {

namespace fs = std::filesystem;

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

// Removes what interrupted saves left in root (their temporary and replaced directories). A
// replaced copy whose step directory is missing (the re-save stopped between its two renames) is
// the only copy of a published step: it is renamed back instead.
void remove_leftovers(const fs::path& root) {
  std::vector<fs::path> leftovers;
  for (const auto& item : fs::directory_iterator(root)) {
    const auto name = item.path().filename().string();
    if (name.rfind(".step-", 0) == 0 &&
        (name.find(".tmp-") != std::string::npos || name.find(".old-") != std::string::npos)) {
      leftovers.push_back(item.path());
    }
  }
  for (const auto& path : leftovers) {
    const auto name = path.filename().string();
    const auto old = name.find(".old-");
    if (old != std::string::npos && fs::exists(path / "COMPLETE")) {
      const fs::path step_dir = root / name.substr(1, old - 1);  // ".step-N.old-<id>" -> "step-N"
      if (!fs::exists(step_dir)) {
        fs::rename(path, step_dir);
        continue;
      }
    }
    fs::remove_all(path);
  }
}

}  // namespace

std::optional<std::string> replaced_copy(const std::string& root, const std::string& step_name) {
  std::error_code error;
  for (const auto& item : fs::directory_iterator(root, error)) {
    const auto name = item.path().filename().string();
    if (name.rfind("." + step_name + ".old-", 0) == 0 && fs::exists(item.path() / "COMPLETE")) {
      return item.path().string();
    }
  }
  return std::nullopt;
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
             const std::string& nonce, const std::string& index_text, bool durable) {
  const fs::path tmp(staging), root_path(root);
  const std::string name = step_name(step);
  write_text(fn, (tmp / "index.json").string(), index_text, durable, false);
  write_text(fn, (tmp / "COMPLETE").string(), name + "\n", durable, false);
  if (durable) sync_directory(fn, tmp.string());
  comm::test_hooks::exit_at_save_fault(fn, comm::test_hooks::SaveFault::kBeforeRename, 0, 1);
  const std::string replaced =
      rename_into_place(fn, tmp, root_path / name, root_path / ("." + name + ".old-" + nonce));
  if (durable) sync_directory(fn, root);
  comm::test_hooks::exit_at_save_fault(fn, comm::test_hooks::SaveFault::kBeforeLatest, 0, 1);
  write_text(fn, (root_path / "latest").string(), name + "\n", durable, true);
  if (!replaced.empty()) {
    std::error_code ignored;  // a leftover is removed by the next save
    fs::remove_all(replaced, ignored);
  }
}

}  // namespace hyper_parallel::checkpoint::detail
