#include <hyper_parallel/core/comm/lifecycle.h>

#include <signal.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/counters.h>

#include "env.h"
#include "test_hooks.h"

namespace hyper_parallel::comm {
namespace {

volatile sig_atomic_t g_stop_requested = 0;

extern "C" void on_preemption_signal(int) { g_stop_requested = 1; }

}  // namespace

int64_t restart_count() {
  return detail::int_from_env({"HP_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"},
                              "hyper_parallel::comm::restart_count")
      .value_or(0);
}

bool preemption_requested() { return g_stop_requested != 0; }

bool agree_on_preemption(const Group& group) {
  if (group.size() == 1) return preemption_requested();
  auto flag = at::full({1}, preemption_requested() ? 1 : 0, at::kInt);
  CommRegion region("preemption");
  // The max over ranks of 0/1 flags: their sum is positive exactly when one of them is set.
  return all_reduce(flag, ReduceOp::kSum, group).item<int>() > 0;
}

void maybe_kill_at_step(int64_t step) {
  if (test_hooks::step_fault("HP_FAULT_KILL_AT_STEP", step)) ::kill(::getpid(), SIGKILL);
  if (test_hooks::step_fault("HP_FAULT_STOP_AT_STEP", step)) ::kill(::getpid(), SIGSTOP);
}

namespace detail {

void install_preemption_handler() {
  struct sigaction previous {};
  if (::sigaction(SIGUSR1, nullptr, &previous) != 0 || previous.sa_handler != SIG_DFL) return;
  struct sigaction action {};
  action.sa_handler = on_preemption_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGUSR1, &action, nullptr);
}

void clear_preemption_request() { g_stop_requested = 0; }

}  // namespace detail

}  // namespace hyper_parallel::comm
