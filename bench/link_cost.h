#pragma once
// What the link costs, measured alone: its rate, and the CPU its transfers take, seen three ways
// (this process's, the whole machine's, and the matmul time lost beside them). Benchmarks use the
// last for the floor of a step that overlaps transfers with compute on shared cores.

#include <cstdint>
#include <functional>

#include <hyper_parallel/core/comm/process_group.h>

namespace bench {

/// CPU seconds the whole machine has been busy so far (/proc/stat: user, nice, system, irq and
/// softirq of every core; in a container, possibly the host's), or -1 where /proc/stat cannot be
/// read. Unlike process_cpu_seconds it counts the kernel's network work done in softirq context
/// on an otherwise idle core, which no process is charged for.
double machine_busy_seconds();

/// The ranks on this machine (LOCAL_WORLD_SIZE, set by hp-run), at least 1.
int64_t local_ranks();

/// What one call of `transfers` costs the compute running beside it, in seconds: a thread runs
/// bf16 matmuls while `transfers` runs on the calling thread, and the matmuls it completes are
/// compared with those it completes alone over as long. The slowest rank's median of `iters`.
/// This is the cost an overlapped step pays: the transport's CPU (the process's and the
/// kernel's) taken from the cores, and the caches it evicts. Collective (`transfers` is).
double compute_lost_seconds(const hyper_parallel::comm::Group& group, int iters,
                            const std::function<void()>& transfers);

/// The link's rate and its transfers' cost per MB this rank sent (as many arrived), in ms/MB.
struct LinkCost {
  double bytes_per_s = 0;
  double cpu_ms_per_mb = 0;           // this process's user + system CPU
  double machine_ms_per_mb = 0;       // the machine's busy time per local rank (-1: no /proc/stat)
  double compute_lost_ms_per_mb = 0;  // matmul time lost beside the stream
};

/// Streams about `bytes` (rank 0's count) to the next rank in 1 MiB messages while as much
/// arrives from the previous one: the slowest rank's rate over 3 timed runs after a warm-up, the
/// CPU over those runs, and the matmul time lost beside streams of at least half a second.
/// Collective.
LinkCost measure_link(const hyper_parallel::comm::Group& group, int64_t bytes);

}  // namespace bench
