#include "parallelize.h"

#include <memory>

#include <hyper_parallel/core/tensor_parallel.h>

namespace llama3 {

namespace tp = hyper_parallel::tensor_parallel;
using hyper_parallel::dtensor::Replicate;
using hyper_parallel::dtensor::Shard;

void parallelize_llama3(TransformerImpl& model, const hyper_parallel::dtensor::DeviceMesh& tp_mesh,
                        const ParallelizeOptions& options) {
  tp::check_tp_mesh("parallelize_llama3", tp_mesh);
  const auto& a = model.args;
  const int64_t tp_size = tp_mesh.size(0);
  TORCH_CHECK(a.n_heads % tp_size == 0, "parallelize_llama3: expected n_heads (", a.n_heads,
              ") divisible by the TP size (", tp_size, ")");
  TORCH_CHECK(a.n_kv_heads % tp_size == 0, "parallelize_llama3: expected n_kv_heads (",
              a.n_kv_heads, ") divisible by the TP size (", tp_size, ")");
  const bool sp = options.enable_sequence_parallel();
  const int64_t seq_len = options.seq_len().value_or(a.max_seq_len);
  if (sp) {
    TORCH_CHECK(seq_len % tp_size == 0, "parallelize_llama3: expected seq_len (", seq_len,
                ") divisible by the TP size (", tp_size, ") with sequence parallelism");
  }
  const bool loss_parallel = options.enable_loss_parallel();
  const bool mc2 = options.enable_mc2();
  TORCH_CHECK(!mc2 || sp, "parallelize_llama3: enable_mc2 requires enable_sequence_parallel (MC2 "
              "fuses the sequence all-gather / reduce-scatter into the FFN matmuls)");

  // Between blocks activations are Shard(1) (sequence) with SP, Replicate without.
  const auto residual = sp ? Shard(1) : Replicate();
  tp::ParallelizePlan plan{
      {"tok_embeddings",
       std::make_shared<tp::RowwiseParallel>(
           tp::RowwiseParallelOptions().input_layouts(Replicate()).output_layouts(residual))},
      {"output", std::make_shared<tp::ColwiseParallel>(
                     tp::ColwiseParallelOptions()
                         .input_layouts(residual)
                         .output_layouts(loss_parallel ? Shard(-1) : Replicate()))},
  };
  if (sp) plan.emplace_back("norm", std::make_shared<tp::SequenceParallel>());

  auto colwise = std::make_shared<tp::ColwiseParallel>();
  auto rowwise_out = std::make_shared<tp::RowwiseParallel>(
      tp::RowwiseParallelOptions().output_layouts(residual));
  if (sp) {
    auto gather_input = std::make_shared<tp::PrepareModuleInput>(
        tp::PrepareModuleInputOptions().input_layouts({Shard(1)}).desired_input_layouts({Replicate()}));
    auto seq_parallel = std::make_shared<tp::SequenceParallel>();
    plan.emplace_back("layers.*.attention_norm", seq_parallel);
    plan.emplace_back("layers.*.attention", gather_input);
    plan.emplace_back("layers.*.ffn_norm", seq_parallel);
    // With MC2 the feed-forward keeps its Shard(1) input: the fused op gathers it.
    if (!mc2) plan.emplace_back("layers.*.feed_forward", gather_input);
  }
  for (const char* name : {"layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv"}) {
    plan.emplace_back(name, colwise);
  }
  plan.emplace_back("layers.*.attention.wo", rowwise_out);
  if (mc2) {
    auto mc2_col = std::make_shared<tp::MC2ColwiseParallel>(
        tp::MC2ColwiseParallelOptions()
            .input_layouts(Shard(1))
            .contract(options.mc2_contract())
            .mc2_options(options.mc2_options()));
    plan.emplace_back("layers.*.feed_forward.w1", mc2_col);
    plan.emplace_back("layers.*.feed_forward.w3", mc2_col);
    plan.emplace_back("layers.*.feed_forward.w2",
                      std::make_shared<tp::MC2RowwiseParallel>(
                          tp::MC2RowwiseParallelOptions()
                              .input_layouts(Shard(-1))
                              .output_layouts(Shard(1))
                              .contract(options.mc2_contract())
                              .mc2_options(options.mc2_options())));
  } else {
    plan.emplace_back("layers.*.feed_forward.w1", colwise);
    plan.emplace_back("layers.*.feed_forward.w3", colwise);
    plan.emplace_back("layers.*.feed_forward.w2", rowwise_out);
  }
  tp::parallelize_module(model, tp_mesh, plan);
}

}  // namespace llama3
