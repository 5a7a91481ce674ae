#include "flight_recorder.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>
#include <system_error>
#include <thread>

#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/trace.h>

namespace hyper_parallel::comm::detail {
namespace {

thread_local std::shared_ptr<OpRecord> t_current;
thread_local int64_t t_step = -1, t_chunk = -1;

const char* state_name(OpRecord::State s) {
  switch (s) {
    case OpRecord::State::kAgreeing:
      return "agreeing on shapes";
    case OpRecord::State::kRunning:
      return "running";
    case OpRecord::State::kWaiting:
      return "waiting";
    case OpRecord::State::kDone:
      return "done";
    case OpRecord::State::kFailed:
      return "failed";
  }
  return "?";
}

}  // namespace

FlightRecorder::FlightRecorder() : records_(kCapacity) {}

FlightRecorder& FlightRecorder::get() {
  static FlightRecorder* recorder = new FlightRecorder();  // used from a signal-report thread
  return *recorder;
}

std::shared_ptr<OpRecord> FlightRecorder::begin(std::string kind, int64_t seq, std::string group,
                                                std::string shape) {
  auto record = std::make_shared<OpRecord>();
  record->kind = std::move(kind);
  record->seq = seq;
  record->group = std::move(group);
  record->shape = std::move(shape);
  record->start_us = trace::detail::now_us();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    record->id = next_id_++;
    records_[next_ % kCapacity] = record;
    ++next_;
  }
  t_current = record;
  return record;
}

void FlightRecorder::end(const std::shared_ptr<OpRecord>& record, bool ok) {
  std::lock_guard<std::mutex> lock(mutex_);
  record->state = ok ? OpRecord::State::kDone : OpRecord::State::kFailed;
  record->end_us = trace::detail::now_us();
  if (t_current == record) t_current.reset();
}

std::shared_ptr<OpRecord> FlightRecorder::current() { return t_current; }

void FlightRecorder::set_current(std::shared_ptr<OpRecord> record) { t_current = std::move(record); }

void FlightRecorder::set_running() {
  if (!t_current) return;
  std::lock_guard<std::mutex> lock(mutex_);
  t_current->state = OpRecord::State::kRunning;
}

void FlightRecorder::set_waiting(int64_t peer, std::string what) {
  if (!t_current) return;
  std::lock_guard<std::mutex> lock(mutex_);
  t_current->state = OpRecord::State::kWaiting;
  t_current->peer = peer;
  t_current->waiting = std::move(what);
}

void FlightRecorder::clear_waiting() {
  if (!t_current) return;
  std::lock_guard<std::mutex> lock(mutex_);
  t_current->state = OpRecord::State::kRunning;
  t_current->peer = -1;
  t_current->waiting.clear();
  t_step = t_chunk = -1;
}

void FlightRecorder::set_chunk(int64_t step, int64_t chunk) {
  t_step = step;
  t_chunk = chunk;
}

std::string FlightRecorder::chunk_label() {
  if (t_chunk < 0) return {};
  return "chunk " + std::to_string(t_chunk) + " of step " + std::to_string(t_step);
}

std::string FlightRecorder::dump() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::ostringstream out;
  const size_t count = std::min(next_, kCapacity);
  for (size_t i = next_ - count; i < next_; ++i) {
    const auto& r = records_[i % kCapacity];
    out << "  #" << r->id << " " << r->kind << " seq " << r->seq << " on " << r->group << ": " << r->shape
        << " — " << state_name(r->state);
    if (r->peer >= 0) out << " while waiting on rank " << r->peer << " (" << r->waiting << ")";
    if (r->peer < 0 && !r->waiting.empty()) out << " while waiting on " << r->waiting;
    const int64_t end = r->end_us ? r->end_us : trace::detail::now_us();
    out << ", " << (end - r->start_us) / 1000 << " ms\n";
  }
  return out.str();
}

std::string FlightRecorder::waiting_on_line(int64_t rank) const {
  std::lock_guard<std::mutex> lock(mutex_);
  // The newest op that is waiting on a peer (any thread).
  const size_t count = std::min(next_, kCapacity);
  for (size_t i = next_; i > next_ - count; --i) {
    const auto& r = records_[(i - 1) % kCapacity];
    // A failed op keeps the peer it was waiting for when the wait failed.
    const bool waited = r->state == OpRecord::State::kWaiting || r->state == OpRecord::State::kFailed;
    if (waited && r->peer >= 0) {
      return "hp-waiting-on: rank " + std::to_string(rank) + " peer " + std::to_string(r->peer) + " op " +
             r->kind + " seq " + std::to_string(r->seq) + " group " + r->group;
    }
  }
  return "hp-waiting-on: rank " + std::to_string(rank) + " none";
}

void FlightRecorder::report(int64_t rank, const std::string& reason) const {
  std::ostringstream out;
  out << "hyper_parallel flight recorder, rank " << rank << " (" << reason << "), last ops:\n"
      << dump() << waiting_on_line(rank) << "\n";
  const auto text = out.str();
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}

namespace {

int g_stop_pipe[2] = {-1, -1};
int64_t g_report_rank = 0;
std::terminate_handler g_previous_terminate = nullptr;
std::mutex g_joining_mutex;
std::string g_joining;  // JoiningStoreNote's `where`, while one lives

// The transport's own threads terminate the process when a peer closes its connections while
// this rank waits for nothing (e.g. it is busy in its own code when the others fail), with the
// socket's std::system_error. Nothing can catch that; report what this rank was doing, then
// terminate as before.
std::string terminate_reason() {
  std::string reason = "terminated";
  auto error = std::current_exception();
  if (!error) return reason;
  try {
    std::rethrow_exception(error);
  } catch (const std::system_error& e) {
    reason += " by an uncaught exception on a transport thread: " + std::string(e.what());
    const std::unique_lock<std::mutex> lock(g_joining_mutex, std::try_to_lock);  // never wait here
    if (e.code() == std::errc::connection_reset && lock.owns_lock() && !g_joining.empty()) {
      reason += "; this rank was joining the store at " + g_joining +
                ": expected rank 0's store listening there, got a connection reset, which another "
                "program listening on that port does (pick a free MASTER_PORT, or let hp-run pick one)";
    }
  } catch (const c10::Error& e) {
    reason += " by an uncaught exception: " + std::string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    reason += " by an uncaught exception: " + std::string(e.what());
  } catch (...) {
  }
  return reason;
}

[[noreturn]] void report_then_terminate() {
  const std::string reason = terminate_reason();
  FlightRecorder::get().report(g_report_rank, reason);
  if (g_previous_terminate) g_previous_terminate();
  std::abort();
}

extern "C" void on_stop_signal(int) {
  const char byte = 1;
  [[maybe_unused]] const ssize_t n = ::write(g_stop_pipe[1], &byte, 1);
}

}  // namespace

void install_stop_report(int64_t rank) {
  static bool installed = false;
  if (installed) return;
  const char* off = std::getenv("HP_FLIGHT_RECORDER");
  if (off != nullptr && std::string(off) == "0") return;
  struct sigaction previous {};
  if (::sigaction(SIGTERM, nullptr, &previous) != 0 || previous.sa_handler != SIG_DFL) return;
  if (::pipe(g_stop_pipe) != 0) return;
  installed = true;
  g_report_rank = rank;
  g_previous_terminate = std::set_terminate(report_then_terminate);
  // The report runs on this thread, outside the signal handler (which only writes a byte).
  std::thread([rank] {
    char byte;
    while (::read(g_stop_pipe[0], &byte, 1) < 0 && errno == EINTR) {
    }
    FlightRecorder::get().report(rank, "stopped by SIGTERM");
    ::signal(SIGTERM, SIG_DFL);
    ::kill(::getpid(), SIGTERM);
  }).detach();
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGTERM, &action, nullptr);
}

JoiningStoreNote::JoiningStoreNote(std::string where) {
  const std::lock_guard<std::mutex> lock(g_joining_mutex);
  g_joining = std::move(where);
}

JoiningStoreNote::~JoiningStoreNote() {
  const std::lock_guard<std::mutex> lock(g_joining_mutex);
  g_joining.clear();
}

}  // namespace hyper_parallel::comm::detail
