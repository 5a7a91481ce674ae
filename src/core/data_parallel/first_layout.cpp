#include "first_layout.h"

#include <algorithm>
#include <exception>
#include <sstream>
#include <string>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/collectives.h>

namespace hyper_parallel::data_parallel::detail {

namespace {

std::vector<at::Tensor> kept_parameters(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> kept;
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    TORCH_CHECK_VALUE(p.defined(),
                      "GradientReducer: expected defined parameters, got an undefined one at index ", i);
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    TORCH_CHECK_VALUE(p.is_leaf(),
                      "GradientReducer: expected leaf parameters, got a non-leaf tensor at index ", i);
    TORCH_CHECK_TYPE(at::isFloatingType(p.scalar_type()),
                     "GradientReducer: expected floating-point parameters, got ", p.scalar_type(),
                     " at index ", i);
    kept.push_back(p);
  }
  return kept;
}

// A rank's description when building its layout failed: its peers name the error instead of
// reporting a layout difference (a layout cannot start with it).
constexpr const char* kFailedPrefix = "\001failed: ";

// Every rank must lay out the same buckets: compared once, here, so that the buckets can start
// later without a round trip each. A peer that failed to build its layout is named with its
// error (it rethrows its own).
void check_layout_agrees(const std::string& mine, const std::vector<std::string>& all,
                         const comm::Group& group) {
  const std::string failed = kFailedPrefix;
  for (size_t q = 0; q < all.size(); ++q) {
    TORCH_CHECK_VALUE(all[q].rfind(failed, 0) != 0, "GradientReducer: expected every rank of ", group.name(),
                      " to build its gradient buckets, got an error on rank ", q, ": ",
                      all[q].substr(failed.size()));
  }
  for (const auto& other : all) {
    if (other == mine) continue;
    std::ostringstream ranks;
    for (size_t q = 0; q < all.size(); ++q) ranks << (q ? "; " : "") << "rank " << q << ": " << all[q];
    TORCH_CHECK_VALUE(false, "GradientReducer: expected every rank of ", group.name(),
                      " to lay out the same gradient buckets (the same parameters, shapes, dtypes and "
                      "bucket options), got ",
                      ranks.str());
  }
}

// Per kept parameter: whether `row_sparse` names it.
std::vector<bool> row_sparse_flags(const std::vector<at::Tensor>& params,
                                   const std::vector<at::Tensor>& row_sparse) {
  std::vector<bool> flags(params.size(), false);
  for (size_t k = 0; k < row_sparse.size(); ++k) {
    const auto& t = row_sparse[k];
    const auto at = std::find_if(params.begin(), params.end(), [&](const at::Tensor& p) {
      return t.defined() && p.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
    });
    TORCH_CHECK_VALUE(at != params.end(), "GradientReducer: expected row_sparse_parameters[", k,
                      "] to be one of the parameters it averages (defined, requiring grad), got ",
                      t.defined() ? "another tensor of sizes " + c10::str(t.sizes()) : "an undefined tensor");
    flags[at - params.begin()] = true;
  }
  return flags;
}

// This rank's first layout, and its description for the agreement: the layout and the options
// that shape a later one (a rank that rebuilds broadcasts, once, where the others would not, and
// the rebuilt layout follows the caps).
std::string lay_out_first(FirstLayout& out, const std::vector<at::Tensor>& params,
                          const GradientReducerOptions& options) {
  TORCH_CHECK_VALUE(options.bucket_cap_bytes() > 0 && options.first_bucket_cap_bytes() > 0,
                    "GradientReducer: expected bucket_cap_bytes > 0 and first_bucket_cap_bytes > 0, got ",
                    options.bucket_cap_bytes(), " and ", options.first_bucket_cap_bytes());
  out.params = kept_parameters(params);
  out.caps = {options.bucket_cap_bytes(), options.first_bucket_cap_bytes(), options.grow_first_buckets(),
              options.shrink_last_buckets(), row_sparse_flags(out.params, options.row_sparse_parameters())};
  const auto order = reverse_order(static_cast<int64_t>(out.params.size()));
  out.spans = lay_out_buckets(out.params, order, bytes_after_in_order(out.params, order), out.caps);
  return describe_buckets(out.spans, out.params) + ", caps " + std::to_string(options.bucket_cap_bytes()) +
         "/" + std::to_string(options.first_bucket_cap_bytes()) +
         (options.rebuild_buckets() ? ", rebuilt after the first backward" : "") +
         (options.grow_first_buckets() ? ", the first growing" : "") +
         (options.shrink_last_buckets() ? ", the last shrinking" : "");
}

}  // namespace

FirstLayout agree_on_first_layout(const std::vector<at::Tensor>& params,
                                  const GradientReducerOptions& options, const comm::Group& group) {
  FirstLayout out;
  std::string mine;
  std::exception_ptr failure;
  // A rank whose parameters or options are refused still joins the exchange, with its error, so
  // that its peers fail at once instead of waiting for it there until the timeout.
  try {
    mine = lay_out_first(out, params, options);
  } catch (const c10::Error& e) {
    failure = std::current_exception();
    mine = kFailedPrefix + std::string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    failure = std::current_exception();
    mine = kFailedPrefix + std::string(e.what());
  }
  const auto all = comm::all_gather_strings(mine, group);
  if (failure) std::rethrow_exception(failure);
  check_layout_agrees(mine, all, group);
  return out;
}

}  // namespace hyper_parallel::data_parallel::detail
