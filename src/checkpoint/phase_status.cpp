#include "phase_status.h"

#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/collectives.h>

namespace hyper_parallel::checkpoint::detail {

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

void raise_if_any_failed(const char* fn, const std::vector<std::string>& errors, const std::string& phase) {
  for (size_t r = 0; r < errors.size(); ++r) {
    TORCH_CHECK(errors[r].empty(), fn, ": rank ", r, " failed ", phase, ": ", errors[r]);
  }
}

void check_all(const char* fn, const comm::Group& group, const std::string& my_error,
               const std::string& phase) {
  raise_if_any_failed(fn, comm::all_gather_strings(my_error, group), phase);
}

}  // namespace hyper_parallel::checkpoint::detail
