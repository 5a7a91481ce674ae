#pragma once
// What a group's link costs one message, measured with the group's own transport: a ring in
// which every rank sends to the next and receives from the previous, timed at two message sizes
// while another thread of this process multiplies matrices, as it does while a fused op's
// transfers are in flight (on a transport that runs on the CPU, a message then waits for a core).
// The MC2 ops' automatic chunk count reads it (core/tensor_parallel/mc2/chunking.h).
//
// Contract: a probe is a collective. All ranks of the group call link_estimate (the first time)
// and probe_link at the same point of the collective order; a rank that calls another op there
// gets the agreement error (op.h), naming "link_probe".

#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::comm {

/// One message of `bytes` from a rank to its neighbour takes latency_s + bytes / bytes_per_s,
/// as seen by this rank (each rank measures its own side; nothing is agreed).
/// One rank: no link, infinitely fast.
struct LinkEstimate {
  double bytes_per_s = 0;
  double latency_s = 0;
  double seconds(double bytes) const { return latency_s + bytes / bytes_per_s; }
};

/// The group's estimate: measured by the first call (collective, a few MiB in all) and kept on
/// the group; later calls return it without communicating.
LinkEstimate link_estimate(const Group& group);

/// Measures again and keeps the new estimate (collective), e.g. after the link's rate changed.
LinkEstimate probe_link(const Group& group);

}  // namespace hyper_parallel::comm
