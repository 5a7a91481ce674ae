#pragma once
// Collective counters: every collective this library runs is recorded here, per kind and per
// region, so tests can assert exact counts (e.g. "forward: 1 all_gather; backward: 1
// reduce_scatter") and HP_COMM_DEBUG=1 prints each one as it runs. The payload bytes sent are
// counted per region too.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <hyper_parallel/core/comm/op.h>

namespace hyper_parallel::comm {

/// Records one collective in the current region. Called by this library's communication code.
void record_collective(CollectiveKind kind, std::string_view detail = {});

/// How many collectives of `kind` ran in `region` since the last reset; region "" = all regions.
int64_t collective_count(CollectiveKind kind, std::string_view region = {});
/// Total over all kinds (in `region`, "" = all).
int64_t total_collective_count(std::string_view region = {});
/// Payload bytes this rank handed to the transport (the data of every send, not the transport's
/// headers) in `region` ("" = all) since the last reset. E.g. a bfloat16 matmul_reduce_scatter of
/// [M, n] sends (P - 1) / P · M · n · 2 bytes.
int64_t payload_bytes_sent(std::string_view region = {});
/// Time a thread that calls this library's collectives (not the library's own worker threads)
/// spent blocked waiting for their transfers, under one region and one op: the communication
/// that computation did not hide.
struct ExposedWait {
  std::string region;  // the CommRegion ("default" outside any)
  std::string op;      // the collective waited in (e.g. "all_gather_matmul"), "pending all_reduce"
                       // for a started all-reduce's wait, "other" outside any op
  double seconds = 0;
};
/// Every (region, op) with its blocked seconds since the last reset, ordered by region, then op.
std::vector<ExposedWait> exposed_waits();
/// Resets the collective counts, the payload bytes and the exposed waits.
void reset_collective_counts();
/// "forward: all_gather=2 reduce_scatter=1; backward: ..." for messages and logs: per region, the
/// kinds that ran, by name.
std::string collective_counts_summary();

namespace detail {
/// Records `bytes` of payload sent in the current region. Called by comm's send.
void record_payload_bytes(int64_t bytes);
/// Records `seconds` the calling thread was blocked in a wait inside `op`, in the current
/// region, unless the calling thread is one of the library's own (mark_library_thread).
void record_exposed_wait(std::string_view op, double seconds);
/// Marks the calling thread as one of the library's worker threads: its waits hide nothing
/// from the training thread and are not recorded as exposed.
void mark_library_thread();
/// The calling thread's innermost region ("default" outside any), so that work handed to
/// another thread for this thread (a pending all-reduce's second phase) is counted under it.
const std::string& current_region();
}  // namespace detail

/// Labels the collectives the calling thread records while it is alive (nests; the innermost
/// wins; another thread, e.g. the asynchronous checkpoint writer, has its own regions).
/// Unlabelled collectives go to region "default".
///
/// Usage:
///   { CommRegion forward("forward"); y = model(x); }
///   { CommRegion backward("backward"); y.sum().backward(); }
class CommRegion {
 public:
  explicit CommRegion(std::string name);
  ~CommRegion();
  CommRegion(const CommRegion&) = delete;
  CommRegion& operator=(const CommRegion&) = delete;
};

}  // namespace hyper_parallel::comm
