#pragma once
// The fused Linear of MC2 on 2-d local views (rows, features), W in Linear's (out, in) layout:
// its forward and backward passes as plain functions, and the differentiable Linear built on
// them. MC2Linear's autograd nodes run exactly these passes, and so do the Python front end's
// AllGatherMatmulFunction and MatmulReduceScatterFunction, so one implementation serves both.
//
//   column (kAllGather):     y = G Wᵀ + b, G = all_gather(x)
//                            dX = reduce_scatter(dY W + dG)   (one fused matmul_reduce_scatter)
//                            dW = dYᵀ G                        (G saved from forward: no second gather)
//                            db = Σ_rows dY
//   row (kReduceScatter):    y = reduce_scatter(x Wᵀ) + b     (the bias once, after the reduction)
//                            (dX, dY_full) = all_gather_matmul(dY, W untransposed)
//                            dW = dY_fullᵀ X, db = Σ_rows dY_full
// dG is the gradient other layers sent to a gather they shared (undefined when none did).

#include <cstdint>
#include <utility>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>

namespace hyper_parallel::tensor_parallel {

/// The gradients of a fused Linear's inputs; undefined where not asked for.
struct MC2LinearGrads {
  at::Tensor input, weight, bias;
};

/// Which gradients a backward computes.
struct MC2LinearNeeds {
  bool input = true, weight = true, bias = true;
};

/// The original's world_size argument next to its group: a c10::ValueError "<where>: expected
/// world_size to equal the group's size (P), got W" unless they agree.
void check_world_size_argument(const char* where, int64_t world_size, const comm::Group& group);

/// Column forward, no autograd: (y, G).
std::pair<at::Tensor, at::Tensor> mc2_column_forward(const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& bias, const comm::Group& group,
                                                     const MC2Options& options = {});
/// Column backward, no autograd. `dy` undefined counts as zeros; `d_gathered` may be undefined.
MC2LinearGrads mc2_column_backward(const at::Tensor& dy, const at::Tensor& d_gathered,
                                   const at::Tensor& gathered, const at::Tensor& w, const comm::Group& group,
                                   const MC2Options& options, MC2LinearNeeds needs);
/// Row forward, no autograd.
at::Tensor mc2_row_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                           const comm::Group& group, const MC2Options& options = {});
/// Row backward, no autograd.
MC2LinearGrads mc2_row_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                const comm::Group& group, const MC2Options& options, MC2LinearNeeds needs);

/// The differentiable column Linear: y (first) and G (second, differentiable too, so that other
/// layers reading the same activation can multiply it: mc2_shared_column_linear).
std::pair<at::Tensor, at::Tensor> mc2_column_linear_gathered(const at::Tensor& x, const at::Tensor& w,
                                                             const at::Tensor& bias, const comm::Group& group,
                                                             const MC2Options& options = {});
/// The differentiable column Linear's y alone.
at::Tensor mc2_column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                             const comm::Group& group, const MC2Options& options = {});
/// A column Linear on a gather another layer already made: y = G Wᵀ + b, no communication. Its
/// input gradient dG = dY W stays local and joins the gathering layer's reduce-scatter.
at::Tensor mc2_shared_column_linear(const at::Tensor& gathered, const at::Tensor& w, const at::Tensor& bias,
                                    const MC2Options& options = {});
/// The differentiable row Linear.
at::Tensor mc2_row_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                          const comm::Group& group, const MC2Options& options = {});

}  // namespace hyper_parallel::tensor_parallel
