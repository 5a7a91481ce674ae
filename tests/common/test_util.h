#pragma once
// Helpers shared by the tests.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>

namespace hp_test {

/// Tolerances by dtype (relative, absolute) for comparing against a float64 reference.
inline std::pair<double, double> tolerance(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return {1e-12, 1e-12};
    case at::kFloat:
      return {1e-5, 1e-5};
    case at::kBFloat16:
      return {2e-2, 2e-2};
    case at::kHalf:
      return {2e-3, 2e-3};
    default:
      return {0, 0};
  }
}

/// EXPECTs `actual` (any dtype) to equal `expected` within the dtype's tolerance.
inline void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what = "") {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  auto [rtol, atol] = tolerance(actual.scalar_type());
  auto a = actual.to(at::kDouble), e = expected.to(at::kDouble);
  const bool ok = at::allclose(a, e, rtol, atol);
  EXPECT_TRUE(ok) << what << ": max abs diff " << (a - e).abs().max().item<double>() << " (rtol " << rtol
                  << ", atol " << atol << ")";
}

/// EXPECTs the statement to throw a c10::Error whose message contains `substring`.
#define HP_EXPECT_THROW_MSG(statement, substring)                                  \
  do {                                                                             \
    try {                                                                          \
      statement;                                                                   \
      ADD_FAILURE() << "expected an exception containing '" << (substring) << "'"; \
    } catch (const c10::Error& e) {                                                \
      EXPECT_NE(std::string(e.what()).find(substring), std::string::npos)          \
          << "message was: " << e.what_without_backtrace();                        \
    }                                                                              \
  } while (0)

/// While alive, libtorch runs as on a CPU without AVX-512: mkldnn off, so its bf16 matmuls take
/// the fallback that rounds the running sum to bf16 (the library must still accumulate in float32).
class OneDnnDisabled {
 public:
  OneDnnDisabled() : was_enabled_(at::globalContext().userEnabledMkldnn()) {
    at::globalContext().setUserEnabledMkldnn(false);
  }
  ~OneDnnDisabled() { at::globalContext().setUserEnabledMkldnn(was_enabled_); }
  OneDnnDisabled(const OneDnnDisabled&) = delete;
  OneDnnDisabled& operator=(const OneDnnDisabled&) = delete;

 private:
  bool was_enabled_;
};

inline int64_t world_size() { return hyper_parallel::comm::world_size(); }
inline int64_t rank() { return hyper_parallel::comm::global_rank(); }

}  // namespace hp_test

#include <c10/util/Exception.h>
#include <torch/version.h>

namespace hp_test {

/// Collects TORCH_WARN messages while alive.
class CapturedWarnings : public c10::WarningHandler {
 public:
  CapturedWarnings() : guard_(this) {}
#if TORCH_VERSION_MAJOR >= 2
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    messages.push_back(msg);
  }
#endif
  bool contains(const std::string& text) const {
    for (const auto& m : messages) {
      if (m.find(text) != std::string::npos) return true;
    }
    return false;
  }
  std::vector<std::string> messages;

 private:
#if TORCH_VERSION_MAJOR >= 2
  c10::WarningUtils::WarningHandlerGuard guard_;
#else
  c10::Warning::WarningHandlerGuard guard_;
#endif
};

}  // namespace hp_test
