#include <hyper_parallel/core/comm/skip_transfers.h>

namespace hyper_parallel::comm::detail {
namespace {
thread_local bool t_skip_transfers = false;
}  // namespace

SkipTransfers::SkipTransfers() : previous_(t_skip_transfers) { t_skip_transfers = true; }
SkipTransfers::~SkipTransfers() { t_skip_transfers = previous_; }
bool transfers_skipped() { return t_skip_transfers; }

}  // namespace hyper_parallel::comm::detail
