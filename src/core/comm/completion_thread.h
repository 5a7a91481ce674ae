#pragma once
// Internal: the worker thread that completes asynchronous collectives in the order they were
// started (a PendingAllReduce's second phase: wait for the partials, sum, send the result). It
// posts transfers only for ops the calling thread has started (and reserved tags for), so the
// one-thread-per-group rule for starting ops (op.h) holds. Gloo's send and receive works do not
// report completion until waited for, so polling cannot replace it.

#include "worker_thread.h"

namespace hyper_parallel::comm::detail {

WorkerThread& completion_thread();

}  // namespace hyper_parallel::comm::detail
