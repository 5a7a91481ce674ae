#pragma once
// Internal: the environment variables comm reads (a launcher's RANK / WORLD_SIZE / MASTER_*, the
// restart count, HP_TIMEOUT_S). An empty value counts as unset.

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace hyper_parallel::comm::detail {

/// The value of `name`; nullopt when unset or empty.
std::optional<std::string> env(const char* name);
/// `text` as a base-10 integer; otherwise a c10::Error "<fn>: expected an integer for <what>,
/// got '<text>'".
int64_t parse_int(const std::string& text, const char* what, const char* fn);
/// The first of `names` that is set, parsed as an integer (errors as parse_int's).
std::optional<int64_t> int_from_env(std::initializer_list<const char*> names, const char* fn);

}  // namespace hyper_parallel::comm::detail
