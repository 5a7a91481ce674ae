#pragma once
// Matrix products whose 16-bit CPU operands accumulate in float32 on every CPU.
//
// libtorch 1.13 multiplies bf16 matrices on the CPU with oneDNN, which accumulates in float32,
// only where mkldnn is enabled, the CPU has AVX-512 (BW, VL and DQ) and the product has more than
// 16·16·16 multiply-adds. Everywhere else at::mm, at::addmm and at::linear fall back to a loop
// that rounds the running sum to bf16 after every addition: at k = 512 its error is about 10x
// oneDNN's, and it runs about 10x slower than float32 OpenBLAS. There is no CPU float16 matmul at
// all. These functions take libtorch's own kernel where it accumulates in float32, and otherwise
// compute in float32 and round once. Other dtypes and devices go to libtorch unchanged.
//
// Usage:
//   auto y = nn::linear(x, weight, bias);        // differentiable, as at::linear
//   auto c = nn::mm(a, b);                       // as at::mm

#include <ATen/core/Tensor.h>

namespace hyper_parallel::nn {

/// True where libtorch's own CPU bf16 product of [m, k] by [k, n] accumulates in float32: mkldnn
/// enabled (read at each call: at::globalContext().setUserEnabledMkldnn changes it), AVX-512 BW,
/// VL and DQ, and m·k·n above 16·16·16.
bool native_bfloat16_matmul_accumulates_in_float(int64_t m, int64_t k, int64_t n);

/// a [m, k] @ b [k, n], as at::mm, in the dtype of a.
at::Tensor mm(const at::Tensor& a, const at::Tensor& b);

/// out = a @ b, as at::mm_out.
void mm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

/// x [..., k] @ weightᵀ [k, n] + bias, as at::linear (differentiable: the backward's products
/// accumulate in float32 too); bias may be undefined.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

}  // namespace hyper_parallel::nn
