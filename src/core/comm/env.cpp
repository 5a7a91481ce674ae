#include "env.h"

#include <cstdlib>

#include <c10/util/Exception.h>

namespace hyper_parallel::comm::detail {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int64_t parse_int(const std::string& text, const char* what, const char* fn) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK(end != text.c_str() && *end == '\0', fn, ": expected an integer for ", what, ", got '", text,
              "'");
  return v;
}

std::optional<int64_t> int_from_env(std::initializer_list<const char*> names, const char* fn) {
  for (const char* n : names) {
    if (auto v = env(n)) return parse_int(*v, n, fn);
  }
  return std::nullopt;
}

}  // namespace hyper_parallel::comm::detail
