#pragma once
// Internal: the control channel of a group, on which ops exchange their signatures before any
// payload moves (op.h). One tag per group, below the operations' tag blocks, matched in order
// per peer; signatures are neither counted as payload nor traced. It has connections of its own,
// made by the group's first op that uses it: on one connection Gloo writes messages in the order
// they were posted, so a signature would wait behind every byte of payload already posted (a
// gather in flight). They meet through a store client of their own, closed once they are made;
// a world whose store is not a TCPStore offers no such client, and its groups' channels are their
// own connections. A group's first use of its channel needs the world store's master alive; its
// rendezvous keys (under hyper_parallel_control/<name>) stay in the store, as a group's do. A
// timeout on one set of connections fails that set's pending transfers; the other set's fail at
// their own timeout.

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/comm/work.h>

namespace hyper_parallel::comm::detail {

/// Posts a control message: a send or receive of `tensor` with group rank `peer`.
Work post_control(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group);

/// Posts a payload transfer (counted and traced, as isend/irecv) on the control channel's
/// connections, with the op's own `tag`: for an op whose caller waits for it at once while others
/// may be on the link (an embedding's row gather, in a forward that follows prefetched gathers).
/// Both ranks of a transfer post it here. It shares the link with the group's other connections
/// instead of waiting behind every byte posted on them.
Work post_express(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group, int tag);

}  // namespace hyper_parallel::comm::detail
