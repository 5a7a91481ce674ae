#include "diagnosis.h"

#include <algorithm>
#include <charconv>
#include <string>

#include "io.h"

namespace hp_run {
namespace {

std::string list(const std::vector<int>& values) {
  std::string text;
  for (int x : values) text += (text.empty() ? "" : ", ") + std::to_string(x);
  return text;
}

const RankReport* find(const std::vector<RankReport>& ranks, int global) {
  for (const auto& rank : ranks) {
    if (rank.global_rank == global) return &rank;
  }
  return nullptr;
}

// The end of the chain of waits that starts at `rank`.
int waited_on_at_the_end(const std::vector<RankReport>& ranks, const RankReport& rank) {
  int at = *rank.waiting_on;
  for (size_t hops = 0; hops <= ranks.size(); ++hops) {
    const RankReport* next = find(ranks, at);
    if (next == nullptr || !next->waiting_on || *next->waiting_on < 0) break;
    at = *next->waiting_on;
  }
  return at;
}

std::string state_of(const RankReport* rank) {
  if (rank == nullptr) return "not on this node";
  if (rank->unresponsive) return "unresponsive: it did not exit on SIGTERM (stopped or hung in the kernel?)";
  if (!rank->waiting_on) return "it printed no flight-recorder line";
  return "it was not inside a collective (stuck in its own code?)";
}

}  // namespace

std::optional<int> parse_waiting_on(std::string_view line) {
  constexpr std::string_view kTag = "hp-waiting-on: rank ";
  const auto at = line.find(kTag);
  if (at == std::string_view::npos) return std::nullopt;
  line.remove_prefix(at + kTag.size());
  const auto space = line.find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  line.remove_prefix(space + 1);
  if (line.starts_with("none")) return -1;
  if (!line.starts_with("peer ")) return std::nullopt;
  line.remove_prefix(5);
  int peer = -1;
  const auto [end, error] = std::from_chars(line.data(), line.data() + line.size(), peer);
  if (error != std::errc() || peer < 0) return std::nullopt;
  return peer;
}

void RankReport::observe_line(std::string_view line) {
  const bool had_peer = waiting_on && *waiting_on >= 0;
  if (auto peer = parse_waiting_on(line); peer && !(had_peer && *peer < 0)) waiting_on = peer;
}

void report_waited_on(const std::vector<RankReport>& ranks) {
  std::vector<int> culprits, waiters;
  for (const auto& rank : ranks) {
    if (!rank.waiting_on || *rank.waiting_on < 0) continue;
    waiters.push_back(rank.global_rank);
    const int at = waited_on_at_the_end(ranks, rank);
    if (std::find(culprits.begin(), culprits.end(), at) == culprits.end()) culprits.push_back(at);
  }
  for (int culprit : culprits) {
    log_message("rank(s) " + list(waiters) + " were waiting on rank " + std::to_string(culprit) + "; " +
                state_of(find(ranks, culprit)));
  }
}

}  // namespace hp_run
