#include "control_channel.h"

#include "tags.h"
#include "transfer.h"

namespace hyper_parallel::comm::detail {

Work post_control(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group) {
  return post_transfer(is_send, tensor, peer, group, kControlTag, /*traceable=*/false);
}

}  // namespace hyper_parallel::comm::detail
