#pragma once
// Stuck-rank diagnosis. hyper_parallel's flight recorder makes a rank that fails, or is stopped,
// print "hp-waiting-on: rank R peer P ..." (waiting for global rank P inside a collective) or
// "hp-waiting-on: rank R none". Following "R waits for P" until a rank that waits for nobody, or
// printed nothing, names the rank the others were waiting on: the rank that noticed first is
// often only its neighbour.

#include <optional>
#include <string_view>
#include <vector>

namespace hp_run {

/// "hp-waiting-on: rank R peer P op ..." -> P; "hp-waiting-on: rank R none" -> -1; other lines
/// -> nullopt.
std::optional<int> parse_waiting_on(std::string_view line);

/// What a rank said and did, for the diagnosis.
struct RankReport {
  int global_rank = 0;
  /// From its last hp-waiting-on line: the global rank it waited for, -1 for none; unset if it
  /// printed no such line. A peer outlives a later "none" (e.g. the SIGTERM report after the
  /// failure it already reported): see observe_line.
  std::optional<int> waiting_on;
  /// Still running when the grace after SIGTERM ran out.
  bool unresponsive = false;

  /// Updates waiting_on from one line of the rank's output.
  void observe_line(std::string_view line);
};

/// "hp-run: rank(s) 0, 1, 3 were waiting on rank 2; <its state>" for each rank waited on, on
/// stderr; nothing if no rank reported waiting.
void report_waited_on(const std::vector<RankReport>& ranks);

}  // namespace hp_run
