#include <hyper_parallel/core/data_parallel/replica_sync.h>

#include <sstream>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/collectives.h>

namespace hyper_parallel::data_parallel {
namespace {

constexpr const char* kFn = "data_parallel::ReplicaSync";

std::string layout_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << t.sizes();
  return os.str();
}

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// The states' layouts, one line each, compared with group rank 0's on every rank: each rank sees
// every rank's layouts, so all raise the same error (no rank goes on to a broadcast alone).
void agree_on_layouts(const std::vector<at::Tensor>& states, const std::vector<std::string>& names,
                      const comm::Group& group) {
  std::string mine = std::to_string(states.size()) + "\n";
  for (const auto& s : states) mine += layout_of(s) + "\n";
  const auto all = comm::all_gather_strings(mine, group);
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    std::istringstream first(all[0]), other(all[r]);
    std::string a, b;
    std::getline(first, a);
    std::getline(other, b);
    TORCH_CHECK_VALUE(a == b, kFn,
                      ": expected every rank of the data-parallel group to hold as many states as rank 0 (",
                      a, "), got ", b, " on rank ", r);
    for (size_t i = 0; std::getline(first, a) && std::getline(other, b); ++i) {
      TORCH_CHECK_VALUE(a == b, kFn, ": expected ", names[i], " to be ", a, " as on rank 0, got ", b,
                        " on rank ", r, " (the replicas must be the same model)");
    }
  }
}

}  // namespace

ReplicaSync::ReplicaSync(std::vector<at::Tensor> states, const dtensor::DeviceMesh& mesh,
                         std::vector<std::string> names, int64_t bucket_cap_bytes)
    : states_(std::move(states)), group_(mesh.get_group(0)) {
  TORCH_CHECK_VALUE(mesh.ndim() == 1, kFn, ": expected a 1-D mesh (the data-parallel dimension), got a ",
                    mesh.ndim(), "-D mesh");
  TORCH_CHECK_VALUE(names.empty() || names.size() == states_.size(), kFn, ": expected a name per state (",
                    states_.size(), "), got ", names.size());
  TORCH_CHECK_VALUE(bucket_cap_bytes > 0, kFn, ": expected bucket_cap_bytes > 0, got ", bucket_cap_bytes);
  for (size_t i = 0; i < states_.size(); ++i) {
    if (names.size() < states_.size()) names.push_back("state " + std::to_string(i));
    TORCH_CHECK_VALUE(states_[i].defined() && states_[i].layout() == at::kStrided, kFn,
                      ": expected dense tensors, got ", names[i], " ",
                      states_[i].defined() ? "of another layout" : "undefined");
  }
  if (group_.size() == 1) return;
  agree_on_layouts(states_, names, group_);
  int64_t filled = 0;
  for (size_t i = 0; i < states_.size(); ++i) {
    const int64_t bytes = bytes_of(states_[i]);
    if (bucket_ends_.empty() || (filled > 0 && filled + bytes > bucket_cap_bytes)) {
      bucket_ends_.push_back(i);
      filled = 0;
    }
    bucket_ends_.back() = i + 1;
    filled += bytes;
  }
}

void ReplicaSync::operator()() const {
  if (group_.size() == 1) return;
  const at::NoGradGuard no_grad;
  size_t begin = 0;
  for (const size_t end : bucket_ends_) {
    std::vector<at::Tensor> bytes;
    for (size_t i = begin; i < end; ++i) bytes.push_back(states_[i].detach().reshape({-1}).view(at::kByte));
    const auto packed = comm::broadcast(at::cat(bytes), 0, group_);
    if (group_.rank() != 0) {
      int64_t offset = 0;
      for (size_t i = begin; i < end; ++i) {
        const int64_t n = bytes_of(states_[i]);
        auto piece = packed.narrow(0, offset, n);
        // A view as a wider dtype must start on its alignment; after a narrower state it may not.
        if (offset % states_[i].element_size() != 0) piece = piece.clone();
        states_[i].copy_(piece.view(states_[i].scalar_type()).view(states_[i].sizes()));
        offset += n;
      }
    }
    begin = end;
  }
}

}  // namespace hyper_parallel::data_parallel
