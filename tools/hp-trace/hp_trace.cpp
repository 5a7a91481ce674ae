// hp-trace: reads the Chrome trace files that HP_TRACE=DIR makes every rank write and reports,
// per op, how much of its transfer time was covered by matmuls (or by other compute spans).
//
//   hp-trace overlap DIR             one line per op name: instances, transfer ms, covered ms, share
//   hp-trace overlap DIR --json      the same as JSON (for scripts and tests)
//   hp-trace overlap DIR --by wgrad  covered by the spans named wgrad instead (repeatable)
//
// For one op instance (one args.op id on one rank): T = union of its transfer spans (post to
// completion, observed by the transport's waiter threads), M = union of its spans named by --by
// (default: matmul) on the compute thread; overlap = |T ∩ M| / |T|. Per op name the covered and transfer
// times are summed over instances and ranks. The files are merged by reading them all; no libtorch needed.
// Beside that share, which moves with the machine's load, the order of events, which does not:
// per op name, how many instances had a covering span start while a transfer was still in flight
// (before the instance's last transfer completed: the compute was issued into the transfer), and
// how many had covering spans only after every transfer completed (a serial schedule).

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

namespace {

using Interval = std::pair<int64_t, int64_t>;  // [begin, end) in µs

std::vector<Interval> merged(std::vector<Interval> spans) {
  std::sort(spans.begin(), spans.end());
  std::vector<Interval> out;
  for (const auto& s : spans) {
    if (s.second <= s.first) continue;
    if (!out.empty() && s.first <= out.back().second) {
      out.back().second = std::max(out.back().second, s.second);
    } else {
      out.push_back(s);
    }
  }
  return out;
}

int64_t length(const std::vector<Interval>& spans) {
  int64_t total = 0;
  for (const auto& s : spans) total += s.second - s.first;
  return total;
}

// |a ∩ b| for two merged (sorted, disjoint) lists.
int64_t intersection(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  int64_t total = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (hi > lo) total += hi - lo;
    (a[i].second < b[j].second) ? ++i : ++j;
  }
  return total;
}

struct Instance {
  std::string name;
  std::vector<Interval> transfers, matmuls;
};

struct Totals {
  int64_t instances = 0, transfer_us = 0, covered_us = 0;
  int64_t started_in_flight = 0;  // a covering span began before the last transfer completed
  int64_t started_after = 0;      // covering spans, all begun once every transfer had completed
};

void add_instance(Totals& total, const Instance& inst) {
  const auto t = merged(inst.transfers), m = merged(inst.matmuls);
  total.instances += 1;
  total.transfer_us += length(t);
  total.covered_us += intersection(t, m);
  if (t.empty() || m.empty()) return;
  const int64_t last_transfer_end = t.back().second, first_cover_start = m.front().first;
  (first_cover_start < last_transfer_end ? total.started_in_flight : total.started_after) += 1;
}

// The op instances of one rank's trace file, by op id; an error message if it does not parse.
std::optional<std::string> read_instances(const std::filesystem::path& path,
                                          const std::vector<std::string>& by,
                                          std::map<int64_t, Instance>& ops) {
  nlohmann::json trace;
  try {
    std::ifstream in(path);
    trace = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    return path.string() + ": not valid trace JSON: " + e.what();
  }
  if (!trace.contains("traceEvents") || !trace["traceEvents"].is_array()) {
    return path.string() + ": expected a traceEvents array";
  }
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("ph", "") != "X" || !e.contains("args")) continue;
    const int64_t op = e["args"].value("op", int64_t{-1});
    if (op < 0) continue;
    const int64_t ts = e.at("ts").get<int64_t>(), dur = e.at("dur").get<int64_t>();
    const std::string cat = e.value("cat", ""), name = e.value("name", "");
    auto& inst = ops[op];
    if (cat == "op") {
      inst.name = name;
    } else if (cat == "transfer") {
      inst.transfers.emplace_back(ts, ts + dur);
    } else if (std::find(by.begin(), by.end(), name) != by.end()) {
      inst.matmuls.emplace_back(ts, ts + dur);
    }
  }
  return std::nullopt;
}

double share(const Totals& t) { return t.transfer_us > 0 ? double(t.covered_us) / t.transfer_us : 0.0; }

int overlap(const std::string& dir, bool as_json, const std::vector<std::string>& by) {
  std::vector<std::filesystem::path> files;
  if (std::filesystem::is_directory(dir)) {
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const auto name = entry.path().filename().string();
      if (name.starts_with("rank") && entry.path().extension() == ".json") files.push_back(entry.path());
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "hp-trace: expected rank*.json trace files in '%s', got none\n", dir.c_str());
    return 1;
  }
  std::sort(files.begin(), files.end());
  std::map<std::string, Totals> by_name;
  for (const auto& path : files) {
    std::map<int64_t, Instance> ops;
    if (auto error = read_instances(path, by, ops)) {
      std::fprintf(stderr, "hp-trace: %s\n", error->c_str());
      return 1;
    }
    for (const auto& [id, inst] : ops) {
      if (!inst.name.empty()) add_instance(by_name[inst.name], inst);
    }
  }
  if (as_json) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& [name, t] : by_name) {
      out[name] = {{"instances", t.instances},
                   {"transfer_ms", t.transfer_us / 1e3},
                   {"covered_ms", t.covered_us / 1e3},
                   {"overlap", share(t)},
                   {"started_in_flight", t.started_in_flight},
                   {"started_after", t.started_after}};
    }
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("%-32s %9s %12s %12s %8s %10s %8s\n", "op", "instances", "transfer ms", "covered ms", "overlap",
              "in flight", "after");
  for (const auto& [name, t] : by_name) {
    std::printf("%-32s %9lld %12.2f %12.2f %8.2f %10lld %8lld\n", name.c_str(),
                static_cast<long long>(t.instances), t.transfer_us / 1e3, t.covered_us / 1e3, share(t),
                static_cast<long long>(t.started_in_flight), static_cast<long long>(t.started_after));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Reads the traces that HP_TRACE=DIR writes (one rank*.json per rank).", "hp-trace");
  app.require_subcommand(1);
  std::string dir;
  bool as_json = false;
  std::vector<std::string> by{"matmul"};
  auto* cmd = app.add_subcommand("overlap", "per op: the share of transfer time covered by matmuls");
  cmd->add_option("dir", dir, "the HP_TRACE directory")->required();
  cmd->add_flag("--json", as_json, "print JSON");
  cmd->add_option("--by", by, "names of the compute spans that count as covering (default: matmul)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return overlap(dir, as_json, by);
}
