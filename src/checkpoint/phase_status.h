#pragma once
// Internal: a collective protocol's phases end with every rank's status. Each phase gathers one
// error string per rank ("" for success); that gather is also the phase's barrier, so an error on
// one rank is raised on every rank and no rank leaves a phase before all entered it.

#include <exception>
#include <string>
#include <vector>

#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::checkpoint::detail {

/// The message of an exception, without a c10::Error's backtrace.
std::string message_of(const std::exception& e);
/// Raises (on the calling rank) the first rank's error, if any rank has one: "<fn>: rank R
/// failed <phase>: <error>".
void raise_if_any_failed(const char* fn, const std::vector<std::string>& errors, const std::string& phase);
/// Gathers every rank's `my_error` over `group`, then raise_if_any_failed. Collective.
void check_all(const char* fn, const comm::Group& group, const std::string& my_error,
               const std::string& phase);

}  // namespace hyper_parallel::checkpoint::detail
