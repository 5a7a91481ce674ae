#pragma once
// Internal: the worker thread that completes asynchronous collectives in the order they were
// started (a PendingAllReduce's second phase: wait for the partials, sum, send the result). It
// posts transfers only for ops the calling thread has started (and reserved tags for), so the
// one-thread-per-group rule for starting ops (op.h) holds. Gloo's send and receive works do not
// report completion until waited for, so polling cannot replace it.

#include "group_impl.h"
#include "worker_thread.h"

namespace hyper_parallel::comm::detail {

/// The completion thread of `group`'s asynchronous collectives: one per group, so that a small
/// all-reduce on one group (a tensor-parallel gradient sum) never queues behind a large one on
/// another (a data-parallel bucket) that is still waiting for its partials.
WorkerThread& completion_thread(const GroupImpl& group);

}  // namespace hyper_parallel::comm::detail
