#include <hyper_parallel/core/comm/counters.h>

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
  // region -> kind name -> count; a kind is known by its name, wherever it is defined.
  std::map<std::string, std::map<std::string, int64_t, std::less<>>, std::less<>> by_region;
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
  c.by_region[region][kind.name()] += 1;
  if (c.debug) std::cerr << "[hp comm] " << region << ": " << to_string(kind) << " " << detail << "\n";
}

int64_t collective_count(CollectiveKind kind, std::string_view region) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  int64_t total = 0;
  for (const auto& [name, counts] : c.by_region) {
    if (!region.empty() && name != region) continue;
    const auto it = counts.find(std::string_view(kind.name()));
    if (it != counts.end()) total += it->second;
  }
  return total;
}

int64_t total_collective_count(std::string_view region) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  int64_t total = 0;
  for (const auto& [name, counts] : c.by_region) {
    if (!region.empty() && name != region) continue;
    for (const auto& [kind, count] : counts) total += count;
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
    for (const auto& [kind, count] : counts) out << " " << kind << "=" << count;
  }
  return out.str();
}

CommRegion::CommRegion(std::string name) { t_regions.push_back(std::move(name)); }

CommRegion::~CommRegion() { t_regions.pop_back(); }

}  // namespace hyper_parallel::comm
