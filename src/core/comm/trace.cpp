#include <hyper_parallel/core/comm/trace.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <vector>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

namespace hyper_parallel::comm::trace {
namespace {

struct Event {
  std::string name;
  const char* category;
  int64_t ts_us, dur_us, tid, op, bytes;
  std::string detail;
};

// Events are kept in memory and written at flush; a run that records more than this keeps the
// first ones (and says so in the file).
constexpr size_t kMaxEvents = 2'000'000;

struct State {
  std::mutex mutex;
  std::atomic<bool> on{false};
  std::string dir;
  int64_t rank = 0;
  std::vector<Event> events;
  size_t dropped = 0;
  std::atomic<int64_t> next_op{0};
  std::atomic<int64_t> next_thread{0};
};

State& state() {
  static State* s = new State();  // outlives every thread that may still record at exit
  return *s;
}

// The compute threads: small ids in the order they first record (the main thread is 0).
// Transfer lanes (waiter threads) are 1000 + lane.
int64_t thread_id() {
  thread_local int64_t id = state().next_thread.fetch_add(1);
  return id;
}

thread_local int64_t t_current_op = -1;

void record(Event e) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.events.size() >= kMaxEvents) {
    ++s.dropped;
    return;
  }
  s.events.push_back(std::move(e));
}

}  // namespace

bool enabled() { return state().on.load(std::memory_order_relaxed); }

Span::Span(const char* name, const char* category) : name_(name), category_(category), op_(-1) {
  if (!enabled()) return;
  start_us_ = detail::now_us();
  op_ = t_current_op;
}

Span::~Span() {
  if (start_us_ < 0) return;
  record({name_, category_, start_us_, detail::now_us() - start_us_, thread_id(), op_, 0, {}});
}

OpSpan::OpSpan(std::string name, std::string detail) : name_(std::move(name)), detail_(std::move(detail)) {
  if (!enabled()) return;
  start_us_ = detail::now_us();
  outermost_ = t_current_op < 0;
  id_ = outermost_ ? state().next_op.fetch_add(1) : t_current_op;
  if (outermost_) t_current_op = id_;
}

OpSpan::~OpSpan() {
  if (start_us_ < 0) return;
  if (outermost_) t_current_op = -1;
  record({name_, outermost_ ? "op" : "nested_op", start_us_, detail::now_us() - start_us_, thread_id(), id_,
          0, detail_});
}

void flush() {
  auto& s = state();
  if (!enabled()) return;
  std::vector<Event> events;
  size_t dropped;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    events = s.events;
    dropped = s.dropped;
  }
  nlohmann::json out;
  auto& list = out["traceEvents"] = nlohmann::json::array();
  list.push_back({{"name", "process_name"},
                  {"ph", "M"},
                  {"pid", s.rank},
                  {"tid", 0},
                  {"args", {{"name", "rank " + std::to_string(s.rank)}}}});
  std::vector<int64_t> named;
  for (const auto& e : events) {
    if (std::find(named.begin(), named.end(), e.tid) == named.end()) {
      named.push_back(e.tid);
      const std::string thread =
          e.tid >= 1000 ? "transfers " + std::to_string(e.tid - 1000) : "compute " + std::to_string(e.tid);
      list.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", s.rank},
                      {"tid", e.tid},
                      {"args", {{"name", thread}}}});
    }
    nlohmann::json args = {{"op", e.op}};
    if (e.bytes > 0) args["bytes"] = e.bytes;
    if (!e.detail.empty()) args["detail"] = e.detail;
    list.push_back({{"name", e.name},
                    {"cat", e.category},
                    {"ph", "X"},
                    {"ts", e.ts_us},
                    {"dur", e.dur_us},
                    {"pid", s.rank},
                    {"tid", e.tid},
                    {"args", args}});
  }
  out["otherData"] = {{"rank", s.rank}, {"dropped_events", dropped}};
  std::filesystem::create_directories(s.dir);
  const auto path = std::filesystem::path(s.dir) / ("rank" + std::to_string(s.rank) + ".json");
  std::ofstream file(path);
  TORCH_CHECK(file.good(), "trace::flush: cannot write ", path.string());
  file << out.dump() << "\n";
}

namespace detail {

void start(int64_t rank) {
  auto& s = state();
  const char* dir = std::getenv("HP_TRACE");
  std::lock_guard<std::mutex> lock(s.mutex);
  s.rank = rank;
  s.events.clear();
  s.dropped = 0;
  s.dir = dir ? dir : "";
  s.on = !s.dir.empty();
}

int64_t now_us() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1'000'000 + t.tv_nsec / 1000;
}

int64_t current_op() { return t_current_op; }

CurrentOpGuard::CurrentOpGuard(int64_t op) : previous_(t_current_op) { t_current_op = op; }
CurrentOpGuard::~CurrentOpGuard() { t_current_op = previous_; }

void record_transfer(const std::string& name, int64_t op, int64_t post_us, int64_t end_us, int64_t bytes,
                     int64_t lane) {
  record({name, "transfer", post_us, end_us - post_us, 1000 + lane, op, bytes, {}});
}

}  // namespace detail

}  // namespace hyper_parallel::comm::trace
