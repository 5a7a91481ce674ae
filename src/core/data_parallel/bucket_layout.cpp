#include "bucket_layout.h"

#include <algorithm>
#include <sstream>

#include <c10/util/Exception.h>

namespace hyper_parallel::data_parallel::detail {

namespace {

bool is_row_sparse(const BucketCaps& caps, int64_t param) {
  return param < static_cast<int64_t>(caps.row_sparse.size()) && caps.row_sparse[param];
}

}  // namespace

std::vector<int64_t> reverse_order(int64_t count) {
  std::vector<int64_t> order(count);
  for (int64_t i = 0; i < count; ++i) order[i] = count - 1 - i;
  return order;
}

std::vector<int64_t> bytes_after_in_order(const std::vector<at::Tensor>& params,
                                          const std::vector<int64_t>& order) {
  int64_t after = 0;
  for (const auto& p : params) after += p.numel() * p.element_size();
  std::vector<int64_t> out;
  for (const int64_t i : order) {
    after -= params[i].numel() * params[i].element_size();
    out.push_back(after);
  }
  return out;
}

std::vector<BucketSpan> lay_out_buckets(const std::vector<at::Tensor>& params,
                                        const std::vector<int64_t>& order,
                                        const std::vector<int64_t>& bytes_after, const BucketCaps& caps) {
  TORCH_INTERNAL_ASSERT(order.size() == params.size() && bytes_after.size() == params.size(),
                        "lay_out_buckets: expected an order and bytes_after for each of the ", params.size(),
                        " parameters, got ", order.size(), " and ", bytes_after.size());
  std::vector<BucketSpan> buckets;
  int64_t bytes_before = 0;  // the gradient bytes of the buckets before the last one
  for (size_t k = 0; k < order.size(); ++k) {
    const auto& p = params[order[k]];
    int64_t cap = buckets.size() == 1 ? std::min(caps.cap_bytes, caps.first_cap_bytes) : caps.cap_bytes;
    if (caps.grow_first) cap = std::min(cap, std::max(caps.first_cap_bytes, bytes_before));
    if (caps.shrink_last) cap = std::min(cap, std::max(caps.first_cap_bytes, bytes_after[k]));
    const bool fits = !buckets.empty() && params[buckets.back().params[0]].scalar_type() == p.scalar_type() &&
                      (buckets.back().numel + p.numel()) * p.element_size() <= cap &&
                      !is_row_sparse(caps, order[k]) && !buckets.back().row_sparse;
    if (!fits) {
      if (!buckets.empty())
        bytes_before += buckets.back().numel * params[buckets.back().params[0]].element_size();
      buckets.emplace_back();
    }
    auto& bucket = buckets.back();
    bucket.params.push_back(order[k]);
    bucket.offsets.push_back(bucket.numel);
    bucket.numels.push_back(p.numel());
    bucket.numel += p.numel();
    bucket.row_sparse = is_row_sparse(caps, order[k]);
  }
  return buckets;
}

std::string describe_buckets(const std::vector<BucketSpan>& buckets, const std::vector<at::Tensor>& params) {
  std::ostringstream s;
  s << buckets.size() << " buckets:";
  for (size_t b = 0; b < buckets.size(); ++b) {
    s << (b ? "," : "") << " [" << (buckets[b].row_sparse ? "row-sparse " : "")
      << params[buckets[b].params[0]].scalar_type();
    for (auto p : buckets[b].params) s << " " << params[p].sizes();
    s << "]";
  }
  return s.str();
}

}  // namespace hyper_parallel::data_parallel::detail
