#pragma once
// Internal: how a checkpoint root names its steps. root/step-N is step N; root/latest holds
// "step-N\n".

#include <cstdint>
#include <optional>
#include <string>

namespace hyper_parallel::checkpoint::detail {

/// "step-N".
std::string step_name(int64_t step);
/// N for "step-N" (decimal digits only, at most 18), else nullopt.
std::optional<int64_t> parse_step_name(const std::string& name);
/// The step directory root/latest names, and its step: a c10::Error naming the file and its
/// content if it is not "step-N". `fn` starts the message.
std::pair<std::string, int64_t> read_latest(const char* fn, const std::string& root);

}  // namespace hyper_parallel::checkpoint::detail
