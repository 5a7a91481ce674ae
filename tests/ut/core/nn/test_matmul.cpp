// nn::mm and nn::linear: 16-bit CPU operands accumulate in float32 and round once on every CPU,
// including where libtorch 1.13 would round the running sum to bf16 (no AVX-512, mkldnn off, or a
// product of at most 16·16·16 multiply-adds); libtorch's own kernel is kept where it accumulates
// in float32, bit for bit.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <hyper_parallel/core/nn/matmul.h>

#include "common/test_util.h"

namespace nn = hyper_parallel::nn;

namespace {

// Largest |actual - exact| / (|exact| + 1) over the elements, against a float64 product.
double relative_error(const at::Tensor& actual, const at::Tensor& exact) {
  auto a = actual.to(at::kDouble), e = exact.to(at::kDouble);
  return ((a - e).abs() / (e.abs() + 1)).max().item<double>();
}

at::Tensor bits(const at::Tensor& t) { return t.contiguous().view(at::kShort); }

// Positive operands, so a sum rounded to bf16 at every step drifts far from the exact one.
std::pair<at::Tensor, at::Tensor> operands(int64_t m, int64_t k, int64_t n, at::ScalarType dtype) {
  at::manual_seed(m * 131 + k * 7 + n);
  return {(at::rand({m, k}) + 0.5).to(dtype), (at::rand({k, n}) + 0.5).to(dtype)};
}

}  // namespace

TEST(FloatAccumulatedMatmul, WithoutOneDnnBfloat16IsTheFloatProductRoundedOnce) {
  hp_test::OneDnnDisabled cpu_without_avx512;
  EXPECT_FALSE(nn::native_bfloat16_matmul_accumulates_in_float(512, 512, 512));
  auto [a, b] = operands(32, 512, 48, at::kBFloat16);
  const auto exact = at::mm(a.to(at::kDouble), b.to(at::kDouble));
  const auto y = nn::mm(a, b);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(bits(y).equal(bits(at::mm(a.to(at::kFloat), b.to(at::kFloat)).to(at::kBFloat16))));
  EXPECT_LT(relative_error(y, exact), 1e-2);
  // What libtorch itself gives here: the sum rounded to bf16 at every step.
  EXPECT_GT(relative_error(at::mm(a, b), exact), 2e-2);
  auto out = at::empty({32, 48}, at::kBFloat16);
  nn::mm_out(out, a, b);
  EXPECT_TRUE(bits(out).equal(bits(y)));
  // An out of another shape is libtorch's to resize, not a float32 result broadcast into it.
  auto wrong = at::empty({1, 48}, at::kBFloat16);
  nn::mm_out(wrong, a, b);
  EXPECT_EQ(wrong.sizes(), (at::IntArrayRef{32, 48}));
}

TEST(FloatAccumulatedMatmul, SmallBfloat16ProductsAccumulateInFloatOnEveryCpu) {
  // 1 x 4096 x 1 is at the oneDNN threshold: libtorch takes its bf16 loop on any CPU.
  EXPECT_FALSE(nn::native_bfloat16_matmul_accumulates_in_float(1, 4096, 1));
  auto [a, b] = operands(1, 4096, 1, at::kBFloat16);
  const auto exact = at::mm(a.to(at::kDouble), b.to(at::kDouble));
  EXPECT_LT(relative_error(nn::mm(a, b), exact), 1e-2);
  EXPECT_GT(relative_error(at::mm(a, b), exact), 2e-2);
}

TEST(FloatAccumulatedMatmul, OneDnnProductsAreLibtorchsOwnBits) {
  if (!nn::native_bfloat16_matmul_accumulates_in_float(64, 512, 64)) {
    GTEST_SKIP() << "this CPU has no AVX-512 BW/VL/DQ: libtorch has no float32-accumulating bf16 kernel";
  }
  auto [a, b] = operands(64, 512, 64, at::kBFloat16);
  EXPECT_TRUE(bits(nn::mm(a, b)).equal(bits(at::mm(a, b))));
  auto x = a.view({2, 32, 512});
  auto w = b.t().contiguous();
  EXPECT_TRUE(bits(nn::linear(x, w)).equal(bits(at::linear(x, w))));
}

TEST(FloatAccumulatedMatmul, LinearForwardAndBackwardWithoutOneDnn) {
  hp_test::OneDnnDisabled cpu_without_avx512;
  at::manual_seed(5);
  auto x = (at::rand({2, 16, 512}) + 0.5).to(at::kBFloat16).requires_grad_(true);
  auto w = (at::rand({64, 512}) + 0.5).to(at::kBFloat16).requires_grad_(true);
  auto bias = at::rand({64}).to(at::kBFloat16).requires_grad_(true);
  auto upstream = (at::rand({2, 16, 64}) + 0.5).to(at::kBFloat16);
  auto y = nn::linear(x, w, bias);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  (y * upstream).sum().backward();
  auto xd = x.detach().to(at::kDouble).requires_grad_(true);
  auto wd = w.detach().to(at::kDouble).requires_grad_(true);
  auto bd = bias.detach().to(at::kDouble).requires_grad_(true);
  auto yd = at::linear(xd, wd, bd);
  (yd * upstream.to(at::kDouble)).sum().backward();
  EXPECT_LT(relative_error(y, yd), 1e-2);
  EXPECT_LT(relative_error(x.grad(), xd.grad()), 1e-2);
  EXPECT_LT(relative_error(w.grad(), wd.grad()), 1e-2);
  EXPECT_LT(relative_error(bias.grad(), bd.grad()), 1e-2);
  EXPECT_EQ(w.grad().scalar_type(), at::kBFloat16);
}

TEST(FloatAccumulatedMatmul, Float16ComputesInFloat32) {
  auto [a, b] = operands(8, 256, 8, at::kHalf);
  const auto y = nn::mm(a, b);
  EXPECT_EQ(y.scalar_type(), at::kHalf);
  EXPECT_TRUE(bits(y).equal(bits(at::mm(a.to(at::kFloat), b.to(at::kFloat)).to(at::kHalf))));
  auto w = b.t().contiguous();
  EXPECT_TRUE(bits(nn::linear(a, w)).equal(bits(y)));
}

TEST(FloatAccumulatedMatmul, OtherDtypesAreLibtorchsOwn) {
  hp_test::OneDnnDisabled cpu_without_avx512;
  for (auto dtype : {at::kFloat, at::kDouble}) {
    auto [a, b] = operands(8, 64, 8, dtype);
    EXPECT_TRUE(nn::mm(a, b).equal(at::mm(a, b)));
    EXPECT_TRUE(nn::linear(a, b.t()).equal(at::linear(a, b.t())));
  }
}

TEST(FloatAccumulatedMatmul, BadOperandsGetLibtorchsErrorsNotAnUpcast) {
  hp_test::OneDnnDisabled cpu_without_avx512;
  auto a = at::ones({2, 3}, at::kBFloat16);
  EXPECT_THROW(nn::mm(a, at::ones({4, 5}, at::kBFloat16)), c10::Error);
  EXPECT_THROW(nn::mm(a, at::ones({3, 5}, at::kFloat)), c10::Error);
  EXPECT_THROW(nn::linear(a, at::ones({5, 3}, at::kFloat)), c10::Error);
  EXPECT_THROW(nn::linear(a, at::ones({5, 4}, at::kBFloat16)), c10::Error);
}
