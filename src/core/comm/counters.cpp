#include <hyper_parallel/core/comm/counters.h>

#include <array>
#include <cstdlib>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

namespace hyper_parallel::comm {
namespace {

struct Counters {
  std::mutex mutex;
  std::map<std::string, std::array<int64_t, kNumCollectiveKinds>, std::less<>> by_region;
  std::map<std::string, int64_t, std::less<>> bytes_by_region;
  std::map<std::pair<std::string, std::string>, double> exposed;  // (region, op) -> seconds
  bool debug = std::getenv("HP_COMM_DEBUG") != nullptr;
};

Counters& counters() {
  static Counters c;
  return c;
}

// The calling thread's stack of active CommRegion names: a background thread (the asynchronous
// checkpoint writer) counts in its own regions, never in the training thread's.
thread_local std::vector<std::string> t_regions;
thread_local bool t_library_thread = false;

}  // namespace

namespace detail {

const std::string& current_region() {
  static const std::string kDefault = "default";
  return t_regions.empty() ? kDefault : t_regions.back();
}

}  // namespace detail

void record_collective(CollectiveKind kind, std::string_view detail) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  const std::string& region = detail::current_region();
  auto it = c.by_region.find(region);
  if (it == c.by_region.end())
    it = c.by_region.emplace(region, std::array<int64_t, kNumCollectiveKinds>{}).first;
  it->second[static_cast<int>(kind)] += 1;
  if (c.debug) std::cerr << "[hp comm] " << region << ": " << to_string(kind) << " " << detail << "\n";
}

int64_t collective_count(CollectiveKind kind, std::string_view region) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  int64_t total = 0;
  for (const auto& [name, counts] : c.by_region) {
    if (region.empty() || name == region) total += counts[static_cast<int>(kind)];
  }
  return total;
}

int64_t total_collective_count(std::string_view region) {
  int64_t total = 0;
  for (int k = 0; k < kNumCollectiveKinds; ++k) {
    total += collective_count(static_cast<CollectiveKind>(k), region);
  }
  return total;
}

void reset_collective_counts() {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.by_region.clear();
  c.bytes_by_region.clear();
  c.exposed.clear();
}

std::vector<ExposedWait> exposed_waits() {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  std::vector<ExposedWait> out;
  for (const auto& [key, seconds] : c.exposed) out.push_back({key.first, key.second, seconds});
  return out;
}

int64_t payload_bytes_sent(std::string_view region) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  int64_t total = 0;
  for (const auto& [name, bytes] : c.bytes_by_region) {
    if (region.empty() || name == region) total += bytes;
  }
  return total;
}

namespace detail {

void record_payload_bytes(int64_t bytes) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.bytes_by_region[current_region()] += bytes;
}

void record_exposed_wait(std::string_view op, double seconds) {
  if (t_library_thread) return;
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.exposed[{current_region(), std::string(op.empty() ? "other" : op)}] += seconds;
}

void mark_library_thread() { t_library_thread = true; }

}  // namespace detail

std::string collective_counts_summary() {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  std::ostringstream out;
  bool first_region = true;
  for (const auto& [name, counts] : c.by_region) {
    out << (first_region ? "" : "; ") << name << ":";
    first_region = false;
    for (int k = 0; k < kNumCollectiveKinds; ++k) {
      if (counts[k] != 0) out << " " << to_string(static_cast<CollectiveKind>(k)) << "=" << counts[k];
    }
  }
  return out.str();
}

CommRegion::CommRegion(std::string name) { t_regions.push_back(std::move(name)); }

CommRegion::~CommRegion() { t_regions.pop_back(); }

}  // namespace hyper_parallel::comm
