#include "async_writer.h"

#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <utility>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/counters.h>

#include "phase_status.h"
#include "save_phases.h"
#include "../core/comm/test_hooks.h"

namespace hyper_parallel::checkpoint::detail {
namespace {

// The writer yields the CPU to training (nice 19, never starved outright): where every core
// trains, a writer at training's priority delays one rank's step, and through its collectives
// every rank's; at the lowest priority it runs in what training leaves (waits for peers, the
// optimizer's memory-bound phases) and otherwise takes longer.
void lower_priority() {
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);  // this thread; best effort
}

double thread_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

}  // namespace

AsyncWriter& AsyncWriter::get() {
  static AsyncWriter writer;
  return writer;
}

const comm::Group& AsyncWriter::group() {
  if (!has_group_) {
    std::vector<int64_t> ranks(static_cast<size_t>(comm::world().size()));
    std::iota(ranks.begin(), ranks.end(), 0);
    group_ = comm::new_group(ranks);
    has_group_ = true;
  }
  return group_;
}

void AsyncWriter::snapshot(const State& state, const SavePlan& plan) {
  buffers_.resize(plan.mine.size());
  for (size_t j = 0; j < plan.mine.size(); ++j) {
    const auto& local = (state.begin() + static_cast<std::ptrdiff_t>(plan.mine[j]))->second.local;
    auto& buffer = buffers_[j];
    if (!buffer.defined() || buffer.sizes() != local.sizes() || buffer.scalar_type() != local.scalar_type()) {
      buffer = at::empty(local.sizes(), local.options().device(at::kCPU));
    }
    buffer.copy_(local.detach());
  }
}

SaveResult AsyncWriter::start(const char* fn, const std::string& root, SavePlan plan, const State& state,
                              int64_t step, bool durable) {
  TORCH_INTERNAL_ASSERT(!thread_.joinable(), "AsyncWriter::start: a save is still in flight");
  snapshot(state, plan);
  SaveResult promised{step_dir(root, step), plan.total_bytes, 0};
  for (const auto& b : buffers_) promised.bytes_written += b.numel() * static_cast<int64_t>(b.element_size());
  path_ = promised.path;  // result_ and error_ are empty: wait() collected the last save
  thread_ = std::thread([this, fn, root, plan = std::move(plan), step, durable] {
    lower_priority();
    comm::detail::mark_library_thread();                      // its waits do not hold up the training thread
    const comm::test_hooks::BackgroundSaveThread background;  // where the async_write fault may fire
    const auto t0 = std::chrono::steady_clock::now();
    const double cpu0 = thread_cpu_seconds();
    try {
      comm::CommRegion region("checkpoint");
      auto result = write_and_publish(fn, root, plan, buffers_, step, durable, group_);
      result.background_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      result.background_cpu_seconds = thread_cpu_seconds() - cpu0;
      result_ = std::move(result);
    } catch (...) {
      error_ = std::current_exception();
    }
  });
  return promised;
}

std::optional<SaveResult> AsyncWriter::wait() {
  if (!thread_.joinable()) return std::nullopt;
  thread_.join();
  if (error_) {
    const auto error = error_;
    error_ = nullptr;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "checkpoint: the asynchronous save of ", path_, " failed: ", message_of(e));
    }
  }
  return std::exchange(result_, std::nullopt);
}

AsyncWriter::~AsyncWriter() {
  if (!thread_.joinable()) return;
  thread_.join();
  if (!error_) return;
  try {
    std::rethrow_exception(error_);
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "checkpoint: the asynchronous save of %s failed, and no save or finish() followed: %s\n",
                 path_.c_str(), message_of(e).c_str());
  }
}

}  // namespace hyper_parallel::checkpoint::detail
