#include <hyper_parallel/core/comm/chunks.h>

#include <algorithm>

#include <c10/util/Exception.h>

namespace hyper_parallel::comm {
namespace {

void check(const char* fn, int64_t global, int64_t parts) {
  TORCH_CHECK(parts >= 1, fn, ": expected parts >= 1, got ", parts);
  TORCH_CHECK(global >= 0, fn, ": expected global >= 0, got ", global);
}

void check_index(const char* fn, int64_t parts, int64_t index) {
  TORCH_CHECK(index >= 0 && index < parts, fn, ": expected index in [0, ", parts, "), got ", index);
}

int64_t piece(int64_t global, int64_t parts) { return (global + parts - 1) / parts; }

}  // namespace

int64_t chunk_size(int64_t global, int64_t parts, int64_t index) {
  check("chunk_size", global, parts);
  check_index("chunk_size", parts, index);
  return std::clamp<int64_t>(global - index * piece(global, parts), 0, piece(global, parts));
}

int64_t chunk_offset(int64_t global, int64_t parts, int64_t index) {
  check("chunk_offset", global, parts);
  check_index("chunk_offset", parts, index);
  return std::min(global, index * piece(global, parts));
}

std::vector<int64_t> chunk_sizes(int64_t global, int64_t parts) {
  check("chunk_sizes", global, parts);
  std::vector<int64_t> sizes(parts);
  for (int64_t i = 0; i < parts; ++i) sizes[i] = chunk_size(global, parts, i);
  return sizes;
}

}  // namespace hyper_parallel::comm
