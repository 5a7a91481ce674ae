// checkpoint::load, latest_step and export_full: the index, and positioned reads of exactly the
// byte ranges of each shard that overlap the region a rank needs.
#include <hyper_parallel/checkpoint/checkpoint.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "file_io.h"
#include "layout.h"
#include "safetensors.h"

namespace hyper_parallel::checkpoint {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using detail::Region;
using detail::shape_str;

constexpr const char* kLoad = "checkpoint::load";

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

  const TensorInfo* find(const std::string& key) const {
    auto it = by_key.find(key);
    return it == by_key.end() ? nullptr : &tensors[it->second].second;
  }
};

// "step-N" from root/latest, and N.
std::pair<std::string, int64_t> read_latest(const char* fn, const fs::path& root) {
  const auto path = (root / "latest").string();
  std::string text = detail::read_text(fn, path);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  const bool well_formed = text.size() > 5 && text.rfind("step-", 0) == 0 && text.size() <= 5 + 18 &&
                           std::all_of(text.begin() + 5, text.end(),
                                       [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
  TORCH_CHECK(well_formed, fn, ": ", path, ": expected 'step-N', got '", text, "'");
  return {text, std::stoll(text.substr(5))};
}

// The step directory `dir` designates: itself if complete, else the one its `latest` names.
fs::path resolve(const char* fn, const std::string& dir) {
  const fs::path p(dir);
  if (fs::exists(p / "COMPLETE")) return p;
  if (fs::exists(p / "latest")) {
    const auto target = p / read_latest(fn, p).first;
    TORCH_CHECK(fs::exists(target / "COMPLETE"), fn, ": expected a complete checkpoint at ",
                target.string(), " (named by ", (p / "latest").string(),
                "), got no COMPLETE marker there");
    return target;
  }
  TORCH_CHECK(fs::exists(p), fn, ": expected a checkpoint at ", dir, ", got no such directory");
  TORCH_CHECK(false, fn, ": expected a complete checkpoint at ", dir, ", got a directory without ",
              "the COMPLETE marker (an interrupted save?) and without a 'latest' file");
}

Index read_index(const char* fn, const fs::path& dir) {
  const auto path = (dir / "index.json").string();
  const auto text = detail::read_text(fn, path);
  Index index;
  try {
    const auto j = json::parse(text);
    TORCH_CHECK(j.at("format") == "hyper_parallel.checkpoint", fn, ": ", path,
                ": expected format 'hyper_parallel.checkpoint', got ", j.at("format").dump());
    TORCH_CHECK(j.at("version") == 1, fn, ": ", path, ": expected version 1, got ",
                j.at("version").dump());
    index.step = j.at("step").get<int64_t>();
    for (const auto& [key, t] : j.at("tensors").items()) {
      TensorInfo info;
      info.dtype = t.at("dtype").get<std::string>();
      info.global_shape = t.at("global_shape").get<std::vector<int64_t>>();
      const auto dtype = detail::dtype_from_name(fn, info.dtype, path + ": " + key);
      const auto element_size = static_cast<int64_t>(c10::elementSize(dtype));
      const auto ndim = info.global_shape.size();
      int64_t covered = 0;
      for (const auto& s : t.at("shards")) {
        ShardInfo shard;
        shard.file = s.at("file").get<std::string>();
        shard.name = s.at("name").get<std::string>();
        shard.region = {s.at("offset").get<std::vector<int64_t>>(), s.at("shape").get<std::vector<int64_t>>()};
        const auto offsets = s.at("data_offsets").get<std::vector<int64_t>>();
        shard.crc = s.at("crc32").get<uint32_t>();
        // Only files of this directory.
        TORCH_CHECK(!shard.file.empty() && shard.file.find('/') == std::string::npos &&
                        shard.file != "." && shard.file != "..",
                    fn, ": ", path, ": ", key, ": expected a file name in this directory, got '",
                    shard.file, "'");
        bool inside = shard.region.offset.size() == ndim && shard.region.shape.size() == ndim;
        for (size_t d = 0; inside && d < ndim; ++d) {
          inside = shard.region.offset[d] >= 0 && shard.region.shape[d] >= 0 &&
                   shard.region.offset[d] + shard.region.shape[d] <= info.global_shape[d];
        }
        TORCH_CHECK(inside, fn, ": ", path, ": ", key, ": expected shards inside the global shape ",
                    shape_str(info.global_shape), ", got offset ", shape_str(shard.region.offset),
                    " shape ", shape_str(shard.region.shape));
        TORCH_CHECK(offsets.size() == 2 && offsets[0] >= 0 &&
                        offsets[1] - offsets[0] == shard.region.numel() * element_size,
                    fn, ": ", path, ": ", key, ": expected data_offsets spanning ",
                    shard.region.numel() * element_size, " bytes for shape ",
                    shape_str(shard.region.shape));
        shard.begin = offsets[0];
        shard.end = offsets[1];
        for (const auto& other : info.shards) {
          TORCH_CHECK(!detail::overlaps(other.region, shard.region), fn, ": ", path, ": ", key,
                      ": expected disjoint shards, got two overlapping");
        }
        covered += shard.region.numel();
        info.shards.push_back(std::move(shard));
      }
      TORCH_CHECK(covered == detail::numel_of(info.global_shape), fn, ": ", path, ": ", key,
                  ": expected shards covering global shape ", shape_str(info.global_shape), " (",
                  detail::numel_of(info.global_shape), " elements), got ", covered, " elements");
      index.by_key.emplace(key, index.tensors.size());
      index.tensors.emplace_back(key, std::move(info));
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, fn, ": ", path, ": malformed index: ", e.what());
  }
  return index;
}

// The step directory's rank files, each opened (and its header checked) once.
class Readers {
 public:
  Readers(const char* fn, fs::path dir) : fn_(fn), dir_(std::move(dir)) {}
  const detail::SafetensorsReader& get(const std::string& file) {
    auto& reader = readers_[file];
    if (!reader) reader = std::make_unique<detail::SafetensorsReader>(fn_, (dir_ / file).string());
    return *reader;
  }

 private:
  const char* fn_;
  fs::path dir_;
  std::map<std::string, std::unique_ptr<detail::SafetensorsReader>> readers_;
};

// Reads the box [b, b + e) of a contiguous shard of shape s stored at byte `base`, into `dst`
// (contiguous, shape e). The dims inside the outermost partial one form contiguous runs: one
// pread per run, so a rank reads only the slab it needs (e.g. a quarter of every row of a
// tensor sharded along its last dim).
void read_box(const detail::SafetensorsReader& file, int64_t base, const std::vector<int64_t>& s,
              const std::vector<int64_t>& b, const std::vector<int64_t>& e, int64_t element_size,
              char* dst) {
  const auto ndim = static_cast<int64_t>(s.size());
  if (ndim == 0) {
    file.read(dst, element_size, base);
    return;
  }
  std::vector<int64_t> stride(ndim, 1);
  for (int64_t d = ndim - 2; d >= 0; --d) stride[d] = stride[d + 1] * s[d + 1];
  int64_t p = ndim - 1;  // the run's outermost dim: every dim inside it is whole
  while (p > 0 && e[p] == s[p]) --p;
  const int64_t run_bytes = e[p] * stride[p] * element_size;
  std::vector<int64_t> idx(b.begin(), b.begin() + p);  // odometer over dims [0, p)
  while (true) {
    int64_t element = b[p] * stride[p];
    for (int64_t d = 0; d < p; ++d) element += idx[d] * stride[d];
    file.read(dst, run_bytes, base + element * element_size);
    dst += run_bytes;
    int64_t d = p - 1;
    while (d >= 0 && ++idx[d] == b[d] + e[d]) {
      idx[d] = b[d];
      --d;
    }
    if (d < 0) return;
  }
}

// Runs `body`, adding the key to a file error (a missing or truncated file names only the path).
template <typename Body>
decltype(auto) with_key(const std::string& key, Body&& body) {
  try {
    return body();
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(Error, c10::str(e.what_without_backtrace(), " (reading ", key, ")"));
  }
}

// The region `want` of a tensor, assembled from the shards that overlap it. A shard read whole
// is checked against its crc32; a partial read is checked by length.
at::Tensor read_region(const char* fn, Readers& readers, const std::string& key,
                       const TensorInfo& info, const Region& want) {
  const auto dtype = detail::dtype_from_name(fn, info.dtype, key);
  const auto element_size = static_cast<int64_t>(c10::elementSize(dtype));
  auto out = at::empty(want.shape, at::TensorOptions().dtype(dtype));
  for (const auto& shard : info.shards) {
    const Region box = detail::intersect(shard.region, want);
    if (box.numel() == 0) continue;
    const auto& file = with_key(key, [&]() -> const detail::SafetensorsReader& { return readers.get(shard.file); });
    const auto* record = file.find(shard.name);
    TORCH_CHECK(record != nullptr, fn, ": ", key, ": ", file.path(), " has no tensor '", shard.name,
                "', which index.json lists");
    TORCH_CHECK(record->dtype == info.dtype && record->shape == shard.region.shape &&
                    file.data_start() + record->begin == shard.begin &&
                    file.data_start() + record->end == shard.end,
                fn, ": ", key, ": ", file.path(), ": tensor '", shard.name, "' (", record->dtype,
                " ", shape_str(record->shape), ") disagrees with index.json (", info.dtype, " ",
                shape_str(shard.region.shape), " at bytes [", shard.begin, ", ", shard.end, "))");
    std::vector<int64_t> begin(box.offset.size());
    for (size_t d = 0; d < begin.size(); ++d) begin[d] = box.offset[d] - shard.region.offset[d];
    auto piece = at::empty(box.shape, at::TensorOptions().dtype(dtype));
    with_key(key, [&] {
      read_box(file, shard.begin, shard.region.shape, begin, box.shape, element_size,
               static_cast<char*>(piece.data_ptr()));
    });
    if (box == shard.region) {
      const uint32_t crc = detail::crc32_update(0, piece.data_ptr(), shard.end - shard.begin);
      TORCH_CHECK(crc == shard.crc, fn, ": ", key, ": crc32 mismatch in ", file.path(), " (tensor '",
                  shard.name, "', bytes [", shard.begin, ", ", shard.end, ")): expected ", shard.crc,
                  " (index.json), got ", crc, "; the file is corrupt");
    }
    auto dst = out;
    for (size_t d = 0; d < begin.size(); ++d) {
      dst = dst.narrow(static_cast<int64_t>(d), box.offset[d] - want.offset[d], box.shape[d]);
    }
    dst.copy_(piece);
  }
  return out;
}

}  // namespace

void load(const std::string& dir, State& state, const LoadOptions& options) {
  const auto step_dir = resolve(kLoad, dir);
  const auto index = read_index(kLoad, step_dir);
  const std::string where = step_dir.string();

  // Everything is checked and read into new tensors before the state changes.
  for (const auto& [key, entry] : state) {
    TORCH_CHECK(index.find(key) != nullptr, kLoad, ": ", key, ": missing from the checkpoint ",
                where, " (the state has this key, the checkpoint does not)");
  }
  if (options.strict()) {
    for (const auto& [key, info] : index.tensors) {
      TORCH_CHECK(state.contains(key), kLoad, ": ", key, ": unexpected key in the checkpoint ",
                  where, " (the state has no such entry; LoadOptions().strict(false) ignores it)");
    }
  }
  std::vector<Region> regions;
  for (const auto& [key, entry] : state) {
    const auto& info = *index.find(key);
    const auto dtype = detail::dtype_name(kLoad, entry.local.scalar_type(), key);
    TORCH_CHECK(dtype == info.dtype, kLoad, ": ", key, ": expected dtype ", dtype,
                " (this state), got ", info.dtype, " in the checkpoint ", where);
    TORCH_CHECK(entry.global_shape == info.global_shape, kLoad, ": ", key,
                ": expected global shape ", shape_str(entry.global_shape), " (this model), got ",
                shape_str(info.global_shape), " in the checkpoint ", where,
                "; is it from a model of another size?");
    auto region = detail::local_region(kLoad, key, entry);
    TORCH_CHECK(region.shape == entry.local.sizes().vec(), kLoad, ": ", key,
                ": expected a local tensor of shape ", shape_str(region.shape),
                " (its layout's shard of global shape ", shape_str(entry.global_shape), "), got ",
                entry.local.sizes());
    regions.push_back(std::move(region));
  }
  Readers readers(kLoad, step_dir);
  std::vector<at::Tensor> loaded;
  size_t i = 0;
  for (const auto& [key, entry] : state) {
    loaded.push_back(read_region(kLoad, readers, key, *index.find(key), regions[i++]));
  }
  at::NoGradGuard no_grad;
  i = 0;
  for (auto& [key, entry] : state) {
    entry.local.copy_(loaded[i++]);
    if (entry.after_load) entry.after_load(entry.local);
  }
}

std::optional<int64_t> latest_step(const std::string& root) {
  if (!fs::exists(fs::path(root) / "latest")) return std::nullopt;
  return read_latest("checkpoint::latest_step", root).second;
}

void export_full(const std::string& dir, const std::string& out_file) {
  constexpr const char* kFn = "checkpoint::export_full";
  const auto step_dir = resolve(kFn, dir);
  const auto index = read_index(kFn, step_dir);
  std::vector<detail::TensorRecord> records;
  std::vector<const std::pair<std::string, TensorInfo>*> exported;
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
  Readers readers(kFn, step_dir);
  for (const auto* item : exported) {
    const auto& info = item->second;
    const Region whole{std::vector<int64_t>(info.global_shape.size(), 0), info.global_shape};
    // One tensor in memory at a time.
    const auto full = read_region(kFn, readers, item->first, info, whole);
    const int64_t nbytes = full.numel() * static_cast<int64_t>(full.element_size());
    file.write_all(full.data_ptr(), nbytes);
    detail::count_written(nbytes);
  }
  file.sync();
  file.close();
  TORCH_CHECK(std::rename(tmp.c_str(), out_file.c_str()) == 0, kFn, ": cannot rename ", tmp, " to ",
              out_file, ": ", std::strerror(errno));
}

}  // namespace hyper_parallel::checkpoint
