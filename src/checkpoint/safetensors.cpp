#include "safetensors.h"

#include <algorithm>
#include <sstream>

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <nlohmann/json.hpp>

namespace hyper_parallel::checkpoint::detail {

// The data bytes are the host's: the format is little-endian.
// (The compiler's macro, not C++20's std::endian: clang-tidy reads this file as C++17.)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "checkpoint files are little-endian; this host is not");

namespace {

struct DtypeName {
  at::ScalarType dtype;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kFloat, "F32"}, {at::kBFloat16, "BF16"}, {at::kHalf, "F16"},  {at::kDouble, "F64"},
    {at::kLong, "I64"},  {at::kInt, "I32"},       {at::kShort, "I16"}, {at::kChar, "I8"},
    {at::kByte, "U8"},   {at::kBool, "BOOL"},
};

// A header larger than this is not one this library wrote (it guards the allocation).
constexpr uint64_t kMaxHeaderBytes = uint64_t{1} << 30;

}  // namespace

std::string dtype_name(const char* fn, at::ScalarType dtype, const std::string& what) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  TORCH_CHECK(false, fn, ": ", what, ": expected a dtype of float32, bfloat16, float16, float64, ",
              "int64, int32, int16, int8, uint8 or bool, got ", dtype);
}

at::ScalarType dtype_from_name(const char* fn, const std::string& name, const std::string& where) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  TORCH_CHECK(false, fn, ": ", where, ": unknown dtype '", name, "'");
}

std::string encode_header(const std::vector<TensorRecord>& tensors, const Metadata& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  auto& meta = header["__metadata__"] = nlohmann::ordered_json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  uint64_t n = json.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json;
}

SafetensorsReader::SafetensorsReader(const char* fn, const std::string& path) : file_(File::open(fn, path)) {
  const int64_t size = file_.size();
  TORCH_CHECK(size >= 8, fn, ": ", path, " is truncated: ", size,
              " bytes, shorter than the 8-byte header length");
  unsigned char len[8];
  file_.pread_exact(len, 8, 0);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  TORCH_CHECK(n <= kMaxHeaderBytes, fn, ": ", path, ": expected a safetensors header length below ",
              kMaxHeaderBytes, ", got ", n, " (not a safetensors file?)");
  TORCH_CHECK(static_cast<int64_t>(n) <= size - 8, fn, ": ", path, " is truncated: its header ", "needs ", n,
              " bytes, the file has ", size - 8, " after the length");
  std::string text(n, '\0');
  file_.pread_exact(text.data(), static_cast<int64_t>(n), 8);
  data_start_ = 8 + static_cast<int64_t>(n);
  int64_t data_end = 0;
  try {
    const auto header = nlohmann::ordered_json::parse(text);
    TORCH_CHECK(header.is_object(), fn, ": ", path, ": expected a JSON object as header");
    for (const auto& [name, v] : header.items()) {
      if (name == "__metadata__") continue;
      TensorRecord r;
      r.name = name;
      r.dtype = v.at("dtype").get<std::string>();
      r.shape = v.at("shape").get<std::vector<int64_t>>();
      const auto offsets = v.at("data_offsets").get<std::vector<int64_t>>();
      TORCH_CHECK(offsets.size() == 2 && 0 <= offsets[0] && offsets[0] <= offsets[1], fn, ": ", path,
                  ": tensor ", name, ": expected data_offsets [begin, end] with 0 <= begin <= end");
      r.begin = offsets[0];
      r.end = offsets[1];
      const auto dtype = dtype_from_name(fn, r.dtype, std::string(path).append(": tensor ").append(name));
      const int64_t expected =
          c10::multiply_integers(r.shape) * static_cast<int64_t>(c10::elementSize(dtype));
      TORCH_CHECK(r.end - r.begin == expected, fn, ": ", path, ": tensor ", name, ": expected ", expected,
                  " bytes for ", r.dtype, " ", c10::IntArrayRef(r.shape), ", got data_offsets [", r.begin,
                  ", ", r.end, ")");
      data_end = std::max(data_end, r.end);
      by_name_.emplace(name, tensors_.size());
      tensors_.push_back(std::move(r));
    }
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, fn, ": ", path, ": malformed safetensors header: ", e.what());
  }
  TORCH_CHECK(data_start_ + data_end <= size, fn, ": ", path, " is truncated: its header describes ",
              data_end, " bytes of data, the file holds ", size - data_start_);
}

const TensorRecord* SafetensorsReader::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsReader::read(void* dst, int64_t n, int64_t offset) const {
  file_.pread_exact(dst, n, offset);
  count_read(n);
}

}  // namespace hyper_parallel::checkpoint::detail
