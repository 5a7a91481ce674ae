#include "read_region.h"

#include <filesystem>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "file_io.h"

namespace hyper_parallel::checkpoint::detail {

const SafetensorsReader& Readers::get(const std::string& file) {
  auto& reader = readers_[file];
  if (!reader)
    reader = std::make_unique<SafetensorsReader>(fn_, (std::filesystem::path(dir_) / file).string());
  return *reader;
}

namespace {

// Reads the box [b, b + e) of a contiguous shard of shape s stored at byte `base`, into `dst`
// (contiguous, shape e). The dims inside the outermost partial one form contiguous runs: one
// pread per run, so a rank reads only the slab it needs (e.g. a quarter of every row of a
// tensor sharded along its last dim).
void read_box(const SafetensorsReader& file, int64_t base, const std::vector<int64_t>& s,
              const std::vector<int64_t>& b, const std::vector<int64_t>& e, int64_t element_size, char* dst) {
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

}  // namespace

at::Tensor read_region(const char* fn, Readers& readers, const std::string& key, const TensorInfo& info,
                       const Region& want) {
  const auto dtype = dtype_from_name(fn, info.dtype, key);
  const auto element_size = static_cast<int64_t>(c10::elementSize(dtype));
  auto out = at::empty(want.shape, at::TensorOptions().dtype(dtype));
  for (const auto& shard : info.shards) {
    const Region box = intersect(shard.region, want);
    if (box.numel() == 0) continue;
    const auto& file = with_key(key, [&]() -> const SafetensorsReader& { return readers.get(shard.file); });
    const auto* record = file.find(shard.name);
    TORCH_CHECK(record != nullptr, fn, ": ", key, ": ", file.path(), " has no tensor '", shard.name,
                "', which index.json lists");
    TORCH_CHECK(record->dtype == info.dtype && record->shape == shard.region.shape &&
                    file.data_start() + record->begin == shard.begin &&
                    file.data_start() + record->end == shard.end,
                fn, ": ", key, ": ", file.path(), ": tensor '", shard.name, "' (", record->dtype, " ",
                shape_str(record->shape), ") disagrees with index.json (", info.dtype, " ",
                shape_str(shard.region.shape), " at bytes [", shard.begin, ", ", shard.end, "))");
    std::vector<int64_t> begin(box.offset.size());
    for (size_t d = 0; d < begin.size(); ++d) begin[d] = box.offset[d] - shard.region.offset[d];
    auto piece = at::empty(box.shape, at::TensorOptions().dtype(dtype));
    with_key(key, [&] {
      read_box(file, shard.begin, shard.region.shape, begin, box.shape, element_size,
               static_cast<char*>(piece.data_ptr()));
    });
    if (box == shard.region) {
      const uint32_t crc = crc32_update(0, piece.data_ptr(), shard.end - shard.begin);
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

}  // namespace hyper_parallel::checkpoint::detail
