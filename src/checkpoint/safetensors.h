#pragma once
// The safetensors format: an 8-byte little-endian header length N, N bytes of JSON header
// ({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {string: string}},
// padded with spaces to a multiple of 8), then the raw little-endian bytes; data_offsets are
// relative to the first byte after the header.

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>

#include "file_io.h"

namespace hyper_parallel::checkpoint::detail {

/// "F32", "BF16", ...; throws, naming `what`, for a dtype the format here does not carry.
std::string dtype_name(const char* fn, at::ScalarType dtype, const std::string& what);
/// The inverse; throws naming `where` for an unknown name.
at::ScalarType dtype_from_name(const char* fn, const std::string& name, const std::string& where);

struct TensorRecord {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // relative to the data region
};

using Metadata = std::vector<std::pair<std::string, std::string>>;

/// Everything before the data: the length and the padded JSON header.
std::string encode_header(const std::vector<TensorRecord>& tensors, const Metadata& metadata);

/// A safetensors file opened for positioned reads. Opening reads and checks the header only:
/// every record's byte count matches its dtype and shape, and the file is as long as the header
/// says (else it is reported as truncated).
class SafetensorsReader {
 public:
  SafetensorsReader(const char* fn, const std::string& path);

  const std::string& path() const { return file_.path(); }
  /// Absolute offset of the data region.
  int64_t data_start() const { return data_start_; }
  const std::vector<TensorRecord>& tensors() const { return tensors_; }
  /// nullptr if absent.
  const TensorRecord* find(const std::string& name) const;
  /// Reads `n` bytes at absolute `offset`, counted in io_stats().
  void read(void* dst, int64_t n, int64_t offset) const;

 private:
  File file_;
  int64_t data_start_ = 0;
  std::vector<TensorRecord> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
};

}  // namespace hyper_parallel::checkpoint::detail
