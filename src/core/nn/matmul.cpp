#include <hyper_parallel/core/nn/matmul.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>

namespace hyper_parallel::nn {

namespace {

// The ISA libtorch 1.13 asks of the CPU before it hands bf16 products to oneDNN.
bool cpu_has_onednn_bfloat16_isa() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq");
  return has;
#else
  return false;
#endif
}

// libtorch 1.13 sends only products of more than 16·16·16 multiply-adds to oneDNN.
constexpr double kOneDnnMinimumProduct = 16.0 * 16.0 * 16.0;

// Whether libtorch's own kernel accumulates [m, k] @ [k, n] of this dtype and device in float32.
bool native_accumulates_in_float(const at::Tensor& a, int64_t m, int64_t k, int64_t n) {
  if (!a.is_cpu()) return true;
  switch (a.scalar_type()) {
    case at::kBFloat16:
      return native_bfloat16_matmul_accumulates_in_float(m, k, n);
    case at::kHalf:
      return false;  // no CPU float16 matmul in libtorch 1.13
    default:
      return true;
  }
}

at::Tensor as_float(const at::Tensor& t) { return t.defined() ? t.to(at::kFloat) : t; }

// Operands libtorch must see as they are: its own errors name what is wrong with them.
bool malformed_product(const at::Tensor& a, const at::Tensor& b) {
  return !a.defined() || !b.defined() || a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0) ||
         a.scalar_type() != b.scalar_type();
}

bool take_native(const at::Tensor& a, const at::Tensor& b) {
  return malformed_product(a, b) || native_accumulates_in_float(a, a.size(0), a.size(1), b.size(1));
}

}  // namespace

bool native_bfloat16_matmul_accumulates_in_float(int64_t m, int64_t k, int64_t n) {
  return at::globalContext().userEnabledMkldnn() && cpu_has_onednn_bfloat16_isa() &&
         static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n) > kOneDnnMinimumProduct;
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  if (take_native(a, b)) {
    return at::mm(a, b);  // libtorch's kernel, or its own error for bad shapes
  }
  return at::mm(as_float(a), as_float(b)).to(a.scalar_type());
}

void mm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  // An out of another dtype or shape gets libtorch's own handling (its error, or its resize).
  if (take_native(a, b) || out.scalar_type() != a.scalar_type() ||
      out.sizes() != at::IntArrayRef{a.size(0), b.size(1)}) {
    at::mm_out(out, a, b);
    return;
  }
  out.copy_(at::mm(as_float(a), as_float(b)));
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const bool malformed = !x.defined() || !weight.defined() || weight.dim() != 2 || x.dim() < 1 ||
                         x.size(-1) != weight.size(1) || x.scalar_type() != weight.scalar_type() ||
                         (bias.defined() && bias.scalar_type() != x.scalar_type());
  if (malformed) return at::linear(x, weight, bias);
  const int64_t k = weight.size(1);
  const int64_t m = k == 0 ? 0 : x.numel() / k;
  if (native_accumulates_in_float(x, m, k, weight.size(0))) return at::linear(x, weight, bias);
  return at::linear(as_float(x), as_float(weight), as_float(bias)).to(x.scalar_type());
}

}  // namespace hyper_parallel::nn
