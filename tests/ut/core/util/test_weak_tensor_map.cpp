// The library's one side table keyed by tensor identity (src/core/util/weak_tensor_map.h).
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "core/util/weak_tensor_map.h"

namespace {

using hyper_parallel::detail::WeakTensorMap;

TEST(WeakTensorMap, FindsTheTensorItWasGivenAndNoOther) {
  WeakTensorMap<std::string> table;
  auto a = at::zeros({4}), b = at::zeros({4});
  table.insert_or_assign(a, "a");
  EXPECT_EQ(table.find(a), "a");
  EXPECT_FALSE(table.find(b).has_value());
  EXPECT_FALSE(table.find(a.detach()).has_value()) << "an alias is another tensor";
  EXPECT_FALSE(table.find(at::Tensor()).has_value());
  table.insert_or_assign(a, "a2");
  EXPECT_EQ(table.find(a), "a2");
}

TEST(WeakTensorMap, NeverKeepsATensorAlive) {
  WeakTensorMap<int> table;
  auto a = at::zeros({4});
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> watch(a.getIntrusivePtr());
  table.insert_or_assign(a, 1);
  a.reset();
  EXPECT_TRUE(watch.expired());
}

TEST(WeakTensorMap, TryInsertKeepsAnExistingValue) {
  WeakTensorMap<int> table;
  auto a = at::zeros({4});
  EXPECT_TRUE(table.try_insert(a, 1));
  EXPECT_FALSE(table.try_insert(a, 2));
  EXPECT_EQ(table.find(a), 1);
}

TEST(WeakTensorMap, FindIfSeesOnlyLiveTensors) {
  WeakTensorMap<int> table;
  auto live = at::arange(4.0);
  {
    auto dead = at::arange(4.0);
    table.insert_or_assign(dead, 1);
  }
  table.insert_or_assign(live, 2);
  auto alias = live.detach();
  EXPECT_EQ(table.find_if([&](const at::Tensor& t) { return t.data_ptr() == alias.data_ptr(); }), 2);
  EXPECT_EQ(table.find_if([](const at::Tensor&) { return true; }), 2);
  EXPECT_FALSE(table.find_if([](const at::Tensor& t) { return t.numel() == 5; }).has_value());
}

// Dead tensors' entries go at the next sweep: making and dropping tensors keeps the table near
// twice its live entries, whatever the number of inserts.
TEST(WeakTensorMap, DeadEntriesAreSweptAsTheTableGrows) {
  WeakTensorMap<int> table;
  std::vector<at::Tensor> live;
  for (int i = 0; i < 300; ++i) {
    live.push_back(at::zeros({1}));
    table.insert_or_assign(live.back(), i);
  }
  for (int i = 0; i < 10000; ++i) table.insert_or_assign(at::zeros({1}), i);  // each dies at once
  EXPECT_LE(table.size(), 2 * live.size() + 1);
  for (int i = 0; i < 300; ++i) EXPECT_EQ(table.find(live[i]), i);
}

}  // namespace
