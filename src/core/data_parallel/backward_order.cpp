#include "backward_order.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/collectives.h>

namespace hyper_parallel::data_parallel::detail {

void BackwardOrder::begin_pass() {
  order_.clear();
  ready_us_.clear();
  end_us_ = -1;
  start_ = std::chrono::steady_clock::now();
}

void BackwardOrder::record(int64_t param) {
  order_.push_back(param);
  ready_us_.push_back(microseconds_since_start());
}

void BackwardOrder::end_pass() { end_us_ = microseconds_since_start(); }

void BackwardOrder::fail_pass() { end_us_ = -1; }

int64_t BackwardOrder::microseconds_since_start() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start_)
      .count();
}

std::optional<std::vector<BucketSpan>> BackwardOrder::agreed_layout(const std::vector<at::Tensor>& params,
                                                                    const BucketCaps& caps,
                                                                    const comm::Group& group) {
  const auto n = static_cast<int64_t>(params.size());
  // The parameters the backward did not reach follow, in reverse order, ready at its end.
  std::vector<bool> listed(n, false);
  for (auto p : order_) listed[p] = true;
  for (auto p : reverse_order(n)) {
    if (listed[p]) continue;
    order_.push_back(p);
    ready_us_.push_back(std::max<int64_t>(end_us_, 0));
  }
  std::vector<int64_t> mine = order_;
  mine.insert(mine.end(), ready_us_.begin(), ready_us_.end());
  mine.push_back(end_us_);
  const auto rank0 = comm::broadcast(at::tensor(mine, at::kLong), 0, group);
  const auto* data = rank0.data_ptr<int64_t>();
  const std::vector<int64_t> order(data, data + n), ready_us(data + n, data + 2 * n);
  const int64_t end_us = data[2 * n];
  std::vector<bool> seen(n, false);
  for (auto p : order) {
    TORCH_CHECK(p >= 0 && p < n && !seen[p],
                "GradientReducer::rebuild_buckets: expected rank 0's backward order to name each of the ", n,
                " parameters once, got parameter ", p, " out of range or repeated");
    seen[p] = true;
  }
  if (end_us < 0) return std::nullopt;
  // What the backward produces after each gradient: counted in time where it took any (the share
  // of the backward still to run, times all the gradient bytes: gradients ready together, as a
  // layer's q, k and v projections are, count as nothing after each other), else in bytes.
  auto bytes_after = bytes_after_in_order(params, order);
  if (end_us > 0) {
    double total = 0;
    for (const auto& p : params) total += static_cast<double>(p.nbytes());
    for (size_t k = 0; k < order.size(); ++k) {
      const double left = std::clamp(1.0 - static_cast<double>(ready_us[k]) / end_us, 0.0, 1.0);
      bytes_after[k] = static_cast<int64_t>(total * left);
    }
  }
  return lay_out_buckets(params, order, bytes_after, caps);
}

}  // namespace hyper_parallel::data_parallel::detail
