#include "steps.h"

#include <algorithm>
#include <cctype>
#include <filesystem>

#include <c10/util/Exception.h>

#include <hyper_parallel/checkpoint/checkpoint.h>

#include "file_io.h"

namespace hyper_parallel::checkpoint {

namespace detail {

namespace {
constexpr const char* kPrefix = "step-";
constexpr size_t kPrefixLength = 5;
}  // namespace

std::string step_name(int64_t step) { return kPrefix + std::to_string(step); }

std::optional<int64_t> parse_step_name(const std::string& name) {
  const bool well_formed = name.size() > kPrefixLength && name.rfind(kPrefix, 0) == 0 &&
                           name.size() <= kPrefixLength + 18 &&
                           std::all_of(name.begin() + kPrefixLength, name.end(),
                                       [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
  if (!well_formed) return std::nullopt;
  return std::stoll(name.substr(kPrefixLength));
}

std::pair<std::string, int64_t> read_latest(const char* fn, const std::string& root) {
  const auto path = (std::filesystem::path(root) / "latest").string();
  std::string text = read_text(fn, path);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  const auto step = parse_step_name(text);
  TORCH_CHECK(step.has_value(), fn, ": ", path, ": expected 'step-N', got '", text, "'");
  return {text, *step};
}

}  // namespace detail

std::string step_dir(const std::string& root, int64_t step) {
  return (std::filesystem::path(root) / detail::step_name(step)).string();
}

std::optional<int64_t> latest_step(const std::string& root) {
  if (!std::filesystem::exists(std::filesystem::path(root) / "latest")) return std::nullopt;
  return detail::read_latest("checkpoint::latest_step", root).second;
}

}  // namespace hyper_parallel::checkpoint
