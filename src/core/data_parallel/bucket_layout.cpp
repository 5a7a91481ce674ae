#include "bucket_layout.h"

#include <algorithm>
#include <sstream>

namespace hyper_parallel::data_parallel::detail {

std::vector<BucketSpan> lay_out_buckets(const std::vector<at::Tensor>& params, int64_t cap_bytes,
                                        int64_t first_cap_bytes) {
  std::vector<BucketSpan> buckets;
  for (int64_t i = static_cast<int64_t>(params.size()) - 1; i >= 0; --i) {
    const auto& p = params[i];
    const int64_t cap = buckets.size() == 1 ? std::min(cap_bytes, first_cap_bytes) : cap_bytes;
    const bool fits = !buckets.empty() && params[buckets.back().params[0]].scalar_type() == p.scalar_type() &&
                      (buckets.back().numel + p.numel()) * p.element_size() <= cap;
    if (!fits) buckets.emplace_back();
    auto& bucket = buckets.back();
    bucket.params.push_back(i);
    bucket.offsets.push_back(bucket.numel);
    bucket.numels.push_back(p.numel());
    bucket.numel += p.numel();
  }
  return buckets;
}

std::string describe_buckets(const std::vector<BucketSpan>& buckets, const std::vector<at::Tensor>& params) {
  std::ostringstream s;
  s << buckets.size() << " buckets:";
  for (size_t b = 0; b < buckets.size(); ++b) {
    s << (b ? "," : "") << " [" << params[buckets[b].params[0]].scalar_type();
    for (auto p : buckets[b].params) s << " " << params[p].sizes();
    s << "]";
  }
  return s.str();
}

}  // namespace hyper_parallel::data_parallel::detail
