#include "parallelize.h"

#include <memory>

#include <hyper_parallel/core/tensor_parallel.h>

namespace llama3 {

namespace tp = hyper_parallel::tensor_parallel;
using hyper_parallel::dtensor::Replicate;
using hyper_parallel::dtensor::Shard;

MC2Scope mc2_scope_from_string(const std::string& scope) {
  if (scope == "ffn") return MC2Scope::kFfn;
  if (scope == "all") return MC2Scope::kAll;
  TORCH_CHECK_VALUE(false, "parallelize_llama3: expected mc2_scope 'ffn' or 'all', got '", scope, "'");
}

const char* to_string(MC2Scope scope) { return scope == MC2Scope::kFfn ? "ffn" : "all"; }

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
              "fuses the sequence all-gather / reduce-scatter into the matmuls)");
  TORCH_CHECK(mc2 || options.mc2_scope() == MC2Scope::kFfn, "parallelize_llama3: mc2_scope '",
              to_string(options.mc2_scope()), "' needs enable_mc2");
  const bool mc2_ffn = mc2, mc2_attention = mc2 && options.mc2_scope() == MC2Scope::kAll;
  const bool mc2_output = mc2_attention && loss_parallel;

  // The style factories, chosen once; the plan below is one table over them. Between blocks
  // activations are Shard(1) (the sequence) with SP, Replicate without.
  const auto residual = sp ? Shard(1) : Replicate();
  auto colwise = std::make_shared<tp::ColwiseParallel>();
  auto rowwise_out = std::make_shared<tp::RowwiseParallel>(
      tp::RowwiseParallelOptions().output_layouts(residual));
  auto mc2_colwise = std::make_shared<tp::MC2ColwiseParallel>(
      tp::MC2ColwiseParallelOptions()
          .input_layouts(Shard(1))
          .contract(options.mc2_contract())
          .mc2_options(options.mc2_options()));
  auto mc2_rowwise = std::make_shared<tp::MC2RowwiseParallel>(
      tp::MC2RowwiseParallelOptions()
          .input_layouts(Shard(-1))
          .output_layouts(Shard(1))
          .contract(options.mc2_contract())
          .mc2_options(options.mc2_options()));
  auto gather_input = std::make_shared<tp::PrepareModuleInput>(
      tp::PrepareModuleInputOptions().input_layouts({Shard(1)}).desired_input_layouts({Replicate()}));
  auto seq_parallel = std::make_shared<tp::SequenceParallel>();
  std::shared_ptr<tp::ParallelStyle> output;
  if (mc2_output) {
    // The final norm's output stays sequence-sharded; the fused op gathers it.
    output = std::make_shared<tp::MC2ColwiseParallel>(tp::MC2ColwiseParallelOptions()
                                                           .input_layouts(Shard(1))
                                                           .output_layouts(Shard(-1))
                                                           .contract(options.mc2_contract())
                                                           .mc2_options(options.mc2_options()));
  } else {
    output = std::make_shared<tp::ColwiseParallel>(tp::ColwiseParallelOptions()
                                                       .input_layouts(residual)
                                                       .output_layouts(loss_parallel ? Shard(-1) : Replicate()));
  }
  // A fused column layer takes its input sequence-sharded; a plain one needs it gathered first.
  const auto column = [&](bool fused) -> std::shared_ptr<tp::ParallelStyle> {
    return fused ? std::static_pointer_cast<tp::ParallelStyle>(mc2_colwise) : colwise;
  };
  const auto row = [&](bool fused) -> std::shared_ptr<tp::ParallelStyle> {
    return fused ? std::static_pointer_cast<tp::ParallelStyle>(mc2_rowwise) : rowwise_out;
  };

  tp::ParallelizePlan plan{
      {"tok_embeddings", std::make_shared<tp::RowwiseParallel>(
                             tp::RowwiseParallelOptions().input_layouts(Replicate()).output_layouts(residual))},
      {"output", output},
      {"layers.*.attention.wq", column(mc2_attention)},
      {"layers.*.attention.wk", column(mc2_attention)},
      {"layers.*.attention.wv", column(mc2_attention)},
      {"layers.*.attention.wo", row(mc2_attention)},
      {"layers.*.feed_forward.w1", column(mc2_ffn)},
      {"layers.*.feed_forward.w3", column(mc2_ffn)},
      {"layers.*.feed_forward.w2", row(mc2_ffn)},
  };
  if (sp) {
    plan.emplace_back("norm", seq_parallel);
    plan.emplace_back("layers.*.attention_norm", seq_parallel);
    plan.emplace_back("layers.*.ffn_norm", seq_parallel);
    if (!mc2_attention) plan.emplace_back("layers.*.attention", gather_input);
    if (!mc2_ffn) plan.emplace_back("layers.*.feed_forward", gather_input);
  }
  tp::parallelize_module(model, tp_mesh, plan);
}

}  // namespace llama3
