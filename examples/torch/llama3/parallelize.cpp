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

namespace {

// The plan's validation, once, up front, naming the numbers.
void check_options(const ModelArgs& a, int64_t tp_size, const ParallelizeOptions& options) {
  TORCH_CHECK(a.n_heads % tp_size == 0, "parallelize_llama3: expected n_heads (", a.n_heads,
              ") divisible by the TP size (", tp_size, ")");
  TORCH_CHECK(a.n_kv_heads % tp_size == 0, "parallelize_llama3: expected n_kv_heads (", a.n_kv_heads,
              ") divisible by the TP size (", tp_size, ")");
  const bool sp = options.enable_sequence_parallel();
  const int64_t seq_len = options.seq_len().value_or(a.max_seq_len);
  TORCH_CHECK(!sp || seq_len % tp_size == 0, "parallelize_llama3: expected seq_len (", seq_len,
              ") divisible by the TP size (", tp_size, ") with sequence parallelism");
  TORCH_CHECK(!options.enable_mc2() || sp,
              "parallelize_llama3: enable_mc2 requires enable_sequence_parallel (MC2 "
              "fuses the sequence all-gather / reduce-scatter into the matmuls)");
  TORCH_CHECK(options.enable_mc2() || options.mc2_scope() == MC2Scope::kFfn,
              "parallelize_llama3: mc2_scope '", to_string(options.mc2_scope()), "' needs enable_mc2");
}

using StylePtr = std::shared_ptr<tp::ParallelStyle>;

// The style factories, chosen once; the plan is one table over them. Between blocks activations
// are Shard(1) (the sequence) with SP, Replicate without.
struct Styles {
  StylePtr colwise, rowwise_out, mc2_colwise, mc2_rowwise, gather_input, seq_parallel, embedding, output;

  explicit Styles(const ParallelizeOptions& o) {
    const bool sp = o.enable_sequence_parallel(), loss_parallel = o.enable_loss_parallel();
    const auto residual = sp ? Shard(1) : Replicate();
    colwise = std::make_shared<tp::ColwiseParallel>();
    rowwise_out =
        std::make_shared<tp::RowwiseParallel>(tp::RowwiseParallelOptions().output_layouts(residual));
    const auto mc2_column = tp::MC2ColwiseParallelOptions()
                                .input_layouts(Shard(1))
                                .contract(o.mc2_contract())
                                .mc2_options(o.mc2_options());
    mc2_colwise = std::make_shared<tp::MC2ColwiseParallel>(mc2_column);
    mc2_rowwise = std::make_shared<tp::MC2RowwiseParallel>(tp::MC2RowwiseParallelOptions()
                                                               .input_layouts(Shard(-1))
                                                               .output_layouts(Shard(1))
                                                               .contract(o.mc2_contract())
                                                               .mc2_options(o.mc2_options()));
    gather_input = std::make_shared<tp::PrepareModuleInput>(
        tp::PrepareModuleInputOptions().input_layouts({Shard(1)}).desired_input_layouts({Replicate()}));
    seq_parallel = std::make_shared<tp::SequenceParallel>();
    embedding = std::make_shared<tp::RowwiseParallel>(
        tp::RowwiseParallelOptions().input_layouts(Replicate()).output_layouts(residual));
    // With MC2 over the output projection (scope all + loss parallel), the final norm's output
    // stays sequence-sharded: the fused op gathers it.
    const bool mc2_output = o.enable_mc2() && o.mc2_scope() == MC2Scope::kAll && loss_parallel;
    output = mc2_output ? std::make_shared<tp::MC2ColwiseParallel>(mc2_column)
                        : StylePtr(std::make_shared<tp::ColwiseParallel>(
                              tp::ColwiseParallelOptions().input_layouts(residual).output_layouts(
                                  loss_parallel ? Shard(-1) : Replicate())));
  }
  // A fused column layer takes its input sequence-sharded; a plain one needs it gathered first.
  StylePtr column(bool fused) const { return fused ? mc2_colwise : colwise; }
  StylePtr row(bool fused) const { return fused ? mc2_rowwise : rowwise_out; }
};

}  // namespace

void parallelize_llama3(TransformerImpl& model, const hyper_parallel::dtensor::DeviceMesh& tp_mesh,
                        const ParallelizeOptions& options) {
  tp::check_tp_mesh("parallelize_llama3", tp_mesh);
  check_options(model.args, tp_mesh.size(0), options);
  const bool mc2_ffn = options.enable_mc2(), mc2_attention = mc2_ffn && options.mc2_scope() == MC2Scope::kAll;
  const Styles s(options);
  tp::ParallelizePlan plan{
      {"tok_embeddings", s.embedding},
      {"output", s.output},
      {"layers.*.attention.wq", s.column(mc2_attention)},
      {"layers.*.attention.wk", s.column(mc2_attention)},
      {"layers.*.attention.wv", s.column(mc2_attention)},
      {"layers.*.attention.wo", s.row(mc2_attention)},
      {"layers.*.feed_forward.w1", s.column(mc2_ffn)},
      {"layers.*.feed_forward.w3", s.column(mc2_ffn)},
      {"layers.*.feed_forward.w2", s.row(mc2_ffn)},
  };
  if (options.enable_sequence_parallel()) {
    plan.emplace_back("norm", s.seq_parallel);
    plan.emplace_back("layers.*.attention_norm", s.seq_parallel);
    plan.emplace_back("layers.*.ffn_norm", s.seq_parallel);
    if (!mc2_attention) plan.emplace_back("layers.*.attention", s.gather_input);
    if (!mc2_ffn) plan.emplace_back("layers.*.feed_forward", s.gather_input);
  }
  tp::parallelize_module(model, tp_mesh, plan);
}

}  // namespace llama3
