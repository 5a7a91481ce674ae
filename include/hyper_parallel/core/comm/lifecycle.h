#pragma once
// The life of a launch: which restart of the job this is, whether the ranks were asked to stop
// (a scheduler's preemption notice, which hp-run passes on as SIGUSR1), and a fault point for
// tests.
//
// A preemption-aware training loop asks at every step boundary:
//   if (comm::agree_on_preemption(comm::world())) { save a checkpoint; stop; }
// Every rank gets the same answer, so all of them stop after the same step.

#include <cstdint>

#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::comm {

/// Which restart of the job this launch is: HP_RESTART_COUNT, else TORCHELASTIC_RESTART_COUNT
/// (hp-run and torchrun set them), else 0.
int64_t restart_count();

/// Whether this process was asked to stop: SIGUSR1 arrived since init_process_group (which
/// installs the handler when SIGUSR1 still has its default action).
bool preemption_requested();

/// Whether any rank of `group` was asked to stop. Collective: one all_reduce of one element
/// (counted in CommRegion "preemption"), so every rank gets the same answer.
bool agree_on_preemption(const Group& group);

/// The fault points of a step, for tests, on the first attempt only (restart_count() == 0), so
/// that a restarted job runs through:
/// - HP_FAULT_KILL_AT_STEP="<rank>:<step>" makes global rank <rank> SIGKILL itself when step
///   <step> begins;
/// - HP_FAULT_STOP_AT_STEP="<rank>:<step>" makes it SIGSTOP itself there (it waits, stopped,
///   until a SIGCONT or a SIGKILL): a hung rank, or one parked for a test to act on from outside
///   at a known step, whatever the machine's load.
/// A malformed value is a c10::Error naming it.
void maybe_kill_at_step(int64_t step);

namespace detail {
/// Called by init_process_group: installs the SIGUSR1 handler (if SIGUSR1 has its default
/// action).
void install_preemption_handler();
/// Forgets a stop request (tests ask several times in one process).
void clear_preemption_request();
}  // namespace detail

}  // namespace hyper_parallel::comm
