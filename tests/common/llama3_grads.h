#pragma once
// The Llama 3 tests' gradient checks: the full gradients after the backward of two steps, the
// first and the last of 5. Gathering them at every step took a fifth of test_llama3's time; a
// wrong gradient at steps 2 to 4 shows in the losses and gradient norms after it and in step 5's
// gradients, which come from the parameters those steps updated.

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <hyper_parallel/hyper_parallel.h>

#include "llama3/model.h"

namespace hp_test {

/// Per compared step, every parameter's name and full gradient.
using Grads = std::vector<std::vector<std::pair<std::string, at::Tensor>>>;

inline constexpr std::array<int64_t, 2> kGradSteps = {1, 5};

/// A llama3::train step callback that appends the model's full gradients to `grads` at
/// kGradSteps (a no-op when `enabled` is false: runs whose gradients are not compared).
inline std::function<void(int64_t, llama3::TransformerImpl&)> gather_grads_at_checked_steps(
    Grads& grads, bool enabled = true) {
  return [&grads, enabled](int64_t step, llama3::TransformerImpl& model) {
    if (enabled && (step == kGradSteps[0] || step == kGradSteps[1]))
      grads.push_back(hyper_parallel::tensor_parallel::full_named_parameters(model, /*gradients=*/true));
  };
}

/// Every gradient of `got` within rtol / atol of `expected`, each failure naming its step and
/// parameter.
inline void expect_close_grads(const Grads& got, const Grads& expected, double rtol, double atol) {
  ASSERT_EQ(expected.size(), kGradSteps.size());
  ASSERT_EQ(got.size(), kGradSteps.size());
  for (size_t step = 0; step < expected.size(); ++step) {
    ASSERT_EQ(got[step].size(), expected[step].size());
    for (size_t i = 0; i < expected[step].size(); ++i) {
      const auto& [name, g] = got[step][i];
      EXPECT_EQ(name, expected[step][i].first);
      EXPECT_TRUE(at::allclose(g, expected[step][i].second, rtol, atol))
          << "step " << kGradSteps[step] << " " << name << ": max abs diff "
          << (g - expected[step][i].second).abs().max().item<double>();
    }
  }
}

}  // namespace hp_test
