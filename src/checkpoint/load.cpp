// checkpoint::load and export_full: resolve the step directory, read its index, check that the
// state fits it, then read each rank's regions (read_region.h) before anything is written.
#include <hyper_parallel/checkpoint/checkpoint.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/process_group.h>

#include "file_io.h"
#include "index.h"
#include "layout.h"
#include "phase_status.h"
#include "publish.h"
#include "read_region.h"
#include "safetensors.h"
#include "steps.h"

namespace hyper_parallel::checkpoint {
namespace {

namespace fs = std::filesystem;
using detail::Region;
using detail::shape_str;

constexpr const char* kLoad = "checkpoint::load";

// The step directory `dir` designates: itself if complete, else the one its `latest` names.
std::string resolve(const char* fn, const std::string& dir) {
  const fs::path p(dir);
  if (fs::exists(p / "COMPLETE")) return p.string();
  const fs::path named = p.has_filename() ? p : p.parent_path();  // "root/step-7/" names step-7
  if (!fs::exists(named) && named.has_parent_path()) {  // a step a re-save moved aside, named directly
    if (auto aside = detail::replaced_copy(named.parent_path().string(), named.filename().string()))
      return *aside;
  }
  if (fs::exists(p / "latest")) {
    const auto name = detail::read_latest(fn, dir).first;
    const auto target = p / name;
    if (fs::exists(target / "COMPLETE")) return target.string();
    // A re-save of that step stopped between its two renames: the copy it moved aside.
    if (auto aside = detail::replaced_copy(dir, name)) return *aside;
    TORCH_CHECK(false, fn, ": expected a complete checkpoint at ", target.string(), " (named by ",
                (p / "latest").string(), "), got no COMPLETE marker there");
  }
  TORCH_CHECK(fs::exists(p), fn, ": expected a checkpoint at ", dir, ", got no such directory");
  TORCH_CHECK(false, fn, ": expected a complete checkpoint at ", dir, ", got a directory without ",
              "the COMPLETE marker (an interrupted save?) and without a 'latest' file");
}

// Whether an entry of dtype `ours` may take a tensor saved as `saved`: the same, or, unless
// strict_dtype, both floating (copy_ casts). Counts the casts in `casts`.
void check_dtype(const std::string& key, at::ScalarType ours, const std::string& saved,
                 const std::string& where, const LoadOptions& options,
                 std::map<std::string, int64_t>& casts) {
  const auto dtype = detail::dtype_name(kLoad, ours, key);
  if (dtype == saved) return;
  const bool floating =
      at::isFloatingType(ours) && at::isFloatingType(detail::dtype_from_name(kLoad, saved, key));
  TORCH_CHECK(floating && !options.strict_dtype(), kLoad, ": ", key, ": expected dtype ", dtype,
              " (this state), got ", saved, " in the checkpoint ", where,
              floating ? " (LoadOptions().strict_dtype(false) casts floating tensors)" : "");
  casts[saved + " to " + dtype] += 1;
}

// The region each entry of the state needs, after checking the state against the index: every
// key present (and, strict, no extra one), dtypes equal (or cast), global shapes equal, local
// shapes right.
std::vector<Region> check_state(const State& state, const detail::Index& index, const std::string& where,
                                const LoadOptions& options) {
  const bool strict = options.strict();
  for (const auto& [key, entry] : state) {
    TORCH_CHECK(index.find(key) != nullptr, kLoad, ": ", key, ": missing from the checkpoint ", where,
                " (the state has this key, the checkpoint does not)");
  }
  if (strict) {
    for (const auto& [key, info] : index.tensors) {
      TORCH_CHECK(state.contains(key), kLoad, ": ", key, ": unexpected key in the checkpoint ", where,
                  " (the state has no such entry; LoadOptions().strict(false) ignores it)");
    }
  }
  std::vector<Region> regions;
  std::map<std::string, int64_t> casts;
  for (const auto& [key, entry] : state) {
    const auto& info = *index.find(key);
    check_dtype(key, entry.local.scalar_type(), info.dtype, where, options, casts);
    TORCH_CHECK(entry.global_shape == info.global_shape, kLoad, ": ", key, ": expected global shape ",
                shape_str(entry.global_shape), " (this model), got ", shape_str(info.global_shape),
                " in the checkpoint ", where, "; is it from a model of another size?");
    auto region = detail::local_region(kLoad, key, entry);
    TORCH_CHECK(region.shape == entry.local.sizes().vec(), kLoad, ": ", key,
                ": expected a local tensor of shape ", shape_str(region.shape),
                " (its layout's shard of global shape ", shape_str(entry.global_shape), "), got ",
                entry.local.sizes());
    regions.push_back(std::move(region));
  }
  if (!casts.empty()) {
    std::ostringstream line;
    for (const auto& [what, n] : casts) line << (line.tellp() > 0 ? ", " : "") << n << " from " << what;
    TORCH_WARN(kLoad, ": cast floating tensors of the checkpoint ", where,
               " to this state's dtypes: ", line.str(),
               " (LoadOptions().strict_dtype(true) refuses instead)");
  }
  return regions;
}

}  // namespace

namespace {

// The state's new values, read after checking the state against the checkpoint.
std::vector<at::Tensor> read_state(const std::string& dir, const State& state, const LoadOptions& options) {
  const auto step_dir = resolve(kLoad, dir);
  const auto index = detail::read_index(kLoad, step_dir);
  const auto regions = check_state(state, index, step_dir, options);
  detail::Readers readers(kLoad, step_dir);
  std::vector<at::Tensor> loaded;
  size_t i = 0;
  for (const auto& [key, entry] : state) {
    loaded.push_back(detail::read_region(kLoad, readers, key, *index.find(key), regions[i++]));
  }
  return loaded;
}

// Every rank's outcome of read_state (collective over the world): this rank's own error is
// raised as it was; another rank's is raised here too, so that no rank changes its state when one
// cannot (a rank that loads while another falls back to a fresh start would train on alone).
void agree_on_reads(const std::exception_ptr& failure) {
  std::string mine;
  if (failure) {
    mine = "an exception of unknown type";
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      mine = detail::message_of(e);
    } catch (...) {
    }
    if (mine.empty()) mine = "an exception without a message";
  }
  std::vector<std::string> errors;
  try {
    errors = comm::all_gather_strings(mine, comm::world());
  } catch (const std::exception& e) {
    if (failure) std::rethrow_exception(failure);
    TORCH_CHECK(false, kLoad, ": expected every rank of the world to call load (it is collective: the ranks ",
                "exchange their outcomes), got a failure of that exchange: ", detail::message_of(e),
                " (LoadOptions().collective(false), Python collective=False, loads on one rank alone)");
  }
  if (failure) std::rethrow_exception(failure);
  detail::raise_if_any_failed(kLoad, errors, "to read the checkpoint, so no rank loaded it");
}

}  // namespace

void load(const std::string& dir, State& state, const LoadOptions& options) {
  // An asynchronous save still in flight is waited for first (its error raised): the load reads
  // what it publishes, not the checkpoint before it.
  if (save_in_flight()) finish();
  // Everything is checked and read into new tensors before the state changes.
  std::vector<at::Tensor> loaded;
  std::exception_ptr failure;
  try {
    loaded = read_state(dir, state, options);
  } catch (...) {
    failure = std::current_exception();
  }
  if (options.collective() && comm::is_initialized() && comm::world_size() > 1) {
    agree_on_reads(failure);
  } else if (failure) {
    std::rethrow_exception(failure);
  }
  at::NoGradGuard no_grad;
  size_t i = 0;
  for (auto& [key, entry] : state) {
    entry.local.copy_(loaded[i++]);
    if (entry.after_load) entry.after_load(entry.local);
  }
}

void abandon_load(const std::string& error) {
  const std::string mine = error.empty() ? std::string("a failure without a message") : error;
  if (comm::is_initialized() && comm::world_size() > 1) {
    try {
      comm::all_gather_strings(mine, comm::world());
    } catch (const std::exception&) {
      // The peers did not exchange either: the error below is still this rank's.
    }
  }
  TORCH_CHECK(false, mine);
}

void export_full(const std::string& dir, const std::string& out_file) {
  constexpr const char* kFn = "checkpoint::export_full";
  const auto step_dir = resolve(kFn, dir);
  const auto index = detail::read_index(kFn, step_dir);
  std::vector<detail::TensorRecord> records;
  std::vector<const std::pair<std::string, detail::TensorInfo>*> exported;
  int64_t offset = 0;
  for (const auto& item : index.tensors) {
    if (item.first.rfind("optim.", 0) == 0) continue;
    const auto dtype = detail::dtype_from_name(kFn, item.second.dtype, item.first);
    const int64_t nbytes =
        detail::numel_of(item.second.global_shape) * static_cast<int64_t>(c10::elementSize(dtype));
    records.push_back({item.first, item.second.dtype, item.second.global_shape, offset, offset + nbytes});
    exported.push_back(&item);
    offset += nbytes;
  }
  const std::string header = detail::encode_header(
      records, {{"format", "hyper_parallel.checkpoint.full"}, {"step", std::to_string(index.step)}});
  // Written aside and renamed: a reader never sees half a file.
  const std::string tmp = out_file + ".tmp";
  auto file = detail::File::create(kFn, tmp);
  file.write_all(header.data(), static_cast<int64_t>(header.size()));
  detail::Readers readers(kFn, step_dir);
  for (const auto* item : exported) {
    const auto& info = item->second;
    const Region whole{std::vector<int64_t>(info.global_shape.size(), 0), info.global_shape};
    // One tensor in memory at a time.
    const auto full = detail::read_region(kFn, readers, item->first, info, whole);
    const int64_t nbytes = full.numel() * static_cast<int64_t>(full.element_size());
    file.write_all(full.data_ptr(), nbytes);
    detail::count_written(nbytes);
  }
  file.sync();
  file.close();
  TORCH_CHECK(std::rename(tmp.c_str(), out_file.c_str()) == 0, kFn, ": cannot rename ", tmp, " to ", out_file,
              ": ", std::strerror(errno));
}

}  // namespace hyper_parallel::checkpoint
