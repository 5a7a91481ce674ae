#pragma once
// Helpers of the checkpoint tests: a directory every rank of a launch shares, and a minimal
// safetensors reader written independently of the library's (length, JSON header, raw bytes).

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <hyper_parallel/core/comm.h>

namespace hp_checkpoint_test {

inline int64_t world_size() { return hyper_parallel::comm::world_size(); }
inline int64_t rank() { return hyper_parallel::comm::global_rank(); }

/// EXPECTs `statement` to throw a c10::Error whose message contains every one of `substrings`;
/// returns the message.
template <typename Statement>
std::string expect_error(Statement&& statement, const std::vector<std::string>& substrings) {
  try {
    statement();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const auto& s : substrings) {
      EXPECT_NE(message.find(s), std::string::npos) << "expected '" << s << "' in: " << message;
    }
    return message;
  }
  ADD_FAILURE() << "expected a c10::Error containing '" << (substrings.empty() ? "" : substrings[0]) << "'";
  return "";
}

/// A fresh directory with the same path on every rank (rank 0's pid, broadcast), removed by rank
/// 0 when the object dies. Collective: every rank constructs it.
class SharedTmpDir {
 public:
  explicit SharedTmpDir(const std::string& name) {
    namespace comm = hyper_parallel::comm;
    auto id = at::full({1}, comm::global_rank() == 0 ? static_cast<int64_t>(::getpid()) : 0, at::kLong);
    id = comm::broadcast(id, 0, comm::world());
    path_ = (std::filesystem::temp_directory_path() /
             ("hp_checkpoint_test_" + std::to_string(id.item<int64_t>()) + "_" + name))
                .string();
    if (comm::global_rank() == 0) {
      std::filesystem::remove_all(path_);
      std::filesystem::create_directories(path_);
    }
    comm::barrier(comm::world());
  }
  ~SharedTmpDir() {
    namespace comm = hyper_parallel::comm;
    comm::barrier(comm::world());
    if (comm::global_rank() == 0) {
      std::error_code ignored;
      std::filesystem::remove_all(path_, ignored);
    }
  }
  SharedTmpDir(const SharedTmpDir&) = delete;
  SharedTmpDir& operator=(const SharedTmpDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& child) const { return path_ + "/" + child; }

 private:
  std::string path_;
};

inline at::ScalarType dtype_of(const std::string& name) {
  static const std::map<std::string, at::ScalarType> kDtypes{
      {"F32", at::kFloat}, {"F64", at::kDouble}, {"BF16", at::kBFloat16}, {"F16", at::kHalf},
      {"I64", at::kLong},  {"I32", at::kInt},    {"U8", at::kByte},       {"BOOL", at::kBool}};
  return kDtypes.at(name);
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

inline std::string read_bytes(const std::string& path, int64_t begin, int64_t end) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(begin);
  std::string bytes(static_cast<size_t>(end - begin), '\0');
  in.read(bytes.data(), end - begin);
  EXPECT_EQ(in.gcount(), end - begin) << path;
  return bytes;
}

/// Every tensor of a safetensors file, by name (the "__metadata__" entry left out).
inline std::map<std::string, at::Tensor> read_safetensors(const std::string& path,
                                                          nlohmann::json* metadata = nullptr) {
  std::ifstream in(path, std::ios::binary);
  unsigned char len[8] = {};
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  const auto json = nlohmann::json::parse(header);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, v] : json.items()) {
    if (name == "__metadata__") {
      if (metadata) *metadata = v;
      continue;
    }
    const auto offsets = v.at("data_offsets").get<std::vector<int64_t>>();
    auto t = at::empty(v.at("shape").get<std::vector<int64_t>>(), dtype_of(v.at("dtype")));
    const auto bytes =
        read_bytes(path, 8 + static_cast<int64_t>(n) + offsets[0], 8 + static_cast<int64_t>(n) + offsets[1]);
    EXPECT_EQ(static_cast<int64_t>(bytes.size()), t.numel() * static_cast<int64_t>(t.element_size())) << name;
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    out.emplace(name, t);
  }
  return out;
}

}  // namespace hp_checkpoint_test
