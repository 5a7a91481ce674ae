// state_digest: SHA-256 of everything a behaviour-preserving change must leave bit for bit the
// same. Run under hp-run at world sizes 1, 2, 3, 4 and 8 (tests/tools/state_digest.sh compares
// the result with the committed reference).
//
// Per rank it prints
//   item   <section> <name> <sha256>   for every collective result, fused-op result, loss,
//                                      gradient norm, gradient and parameter (the local shard);
//   digest <section> <sha256>          one hash over the section's item hashes, in order.
// Sections: the collectives (all_gather, reduce_scatter sum / avg, all_reduce, all_to_all,
// broadcast) for each dtype over sizes 0, 1, 7, 3P + 1 and 1000; both fused ops for float32,
// bfloat16 and float16 at 1-3 chunks per rank; and 3 AdamW steps of a small Llama (seed 42) with
// plain TP, MC2 over the feed-forward and MC2 over every Linear (with loss parallel), in float32
// and bfloat16 (MC2 under its relaxed contract, so every world size runs it). The model has 24
// heads and 24 tokens per sequence, so TP 1, 2, 3, 4 and 8 all divide it.
#include <openssl/evp.h>

#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/tensor_parallel.h>

#include "common/run_main.h"
#include "llama3/trainer.h"

namespace {

namespace hp = hyper_parallel;
namespace comm = hp::comm;
namespace tp = hp::tensor_parallel;

std::string hex(const unsigned char* bytes, unsigned int n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < n; ++i) {
    out += digits[bytes[i] >> 4];
    out += digits[bytes[i] & 15];
  }
  return out;
}

std::string sha256(const void* data, size_t n) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  TORCH_CHECK(EVP_Digest(data, n, md, &len, EVP_sha256(), nullptr) == 1, "state_digest: SHA-256 failed");
  return hex(md, len);
}

// The bytes of a tensor together with its dtype and shape, so that a change of either changes
// the hash even where the bytes do not.
std::string tensor_sha(const at::Tensor& t) {
  if (!t.defined()) return sha256("undefined", 9);
  const auto c = t.detach().cpu().contiguous();
  std::string bytes = std::string(c10::toString(c.scalar_type())) + c10::str(c.sizes()) + ":";
  bytes.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
  return sha256(bytes.data(), bytes.size());
}

// One section's item lines, then its digest line.
class Section {
 public:
  explicit Section(std::string name) : name_(std::move(name)) {}
  void add(const std::string& item, const std::string& sha) {
    std::printf("item %s %s %s\n", name_.c_str(), item.c_str(), sha.c_str());
    all_ += sha;
  }
  void add(const std::string& item, const at::Tensor& t) { add(item, tensor_sha(t)); }
  ~Section() {
    std::printf("digest %s %s\n", name_.c_str(), sha256(all_.data(), all_.size()).c_str());
    std::fflush(stdout);
  }

 private:
  std::string name_, all_;
};

// Deterministic values that differ per rank; integers stay small so sums are exact.
at::Tensor values(at::ScalarType dtype, std::vector<int64_t> shape, int64_t salt) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + static_cast<uint64_t>(salt) * 7919 +
                                                      static_cast<uint64_t>(comm::global_rank()));
  if (at::isFloatingType(dtype)) return at::randn(shape, gen, at::kDouble).to(dtype);
  return at::randint(-50, 50, shape, gen, at::kLong).to(dtype);
}

void digest_collectives(const comm::Group& world) {
  const int64_t p = world.size();
  const std::vector<at::ScalarType> dtypes{at::kFloat, at::kDouble, at::kBFloat16,
                                           at::kHalf,  at::kLong,   at::kInt};
  for (const auto dtype : dtypes) {
    Section section(std::string("collectives/") + c10::toString(dtype));
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, 3 * p + 1, int64_t{1000}}) {
      const auto item = [n](const char* op) { return std::string(op) + ".n" + std::to_string(n); };
      const auto x = values(dtype, {n, 3}, n);
      section.add(item("all_gather"), comm::all_gather(x, 0, world));
      section.add(item("reduce_scatter_sum"), comm::reduce_scatter(x, 0, comm::ReduceOp::kSum, world));
      if (at::isFloatingType(dtype)) {
        section.add(item("reduce_scatter_avg"), comm::reduce_scatter(x, 0, comm::ReduceOp::kAvg, world));
      }
      section.add(item("all_reduce"), comm::all_reduce(x, comm::ReduceOp::kSum, world));
      section.add(item("all_to_all"), comm::all_to_all(x, 0, 1, world));
      section.add(item("broadcast"), comm::broadcast(x, p - 1, world));
    }
  }
}

void digest_fused_ops(const comm::Group& world) {
  const int64_t p = world.size(), k = 48, n = 40;
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    Section section(std::string("fused/") + c10::toString(dtype));
    for (const int64_t chunks : {1, 2, 3}) {
      const auto options = tp::MC2Options().chunks_per_rank(chunks);
      for (const int64_t m : {0, 5, 64}) {
        const auto item = [m, chunks](const char* op) {
          return std::string(op) + ".m" + std::to_string(m) + ".chunks" + std::to_string(chunks);
        };
        const auto w = values(dtype, {n, k}, 17 * m + chunks);
        const auto [y, gathered] =
            tp::all_gather_matmul(values(dtype, {m, k}, m + chunks), w, world, options);
        section.add(item("all_gather_matmul.y"), y);
        section.add(item("all_gather_matmul.gathered"), gathered);
        section.add(item("matmul_reduce_scatter"),
                    tp::matmul_reduce_scatter(values(dtype, {p * m, k}, 3 * m + chunks), w, world, options));
      }
    }
  }
}

// 24 heads, 24 tokens: every TP size of the digest divides both.
llama3::ModelArgs digest_model() {
  llama3::ModelArgs a;
  a.dim = 192;
  a.n_layers = 2;
  a.n_heads = 24;
  a.n_kv_heads = 24;
  a.vocab_size = 96;
  a.multiple_of = 64;
  a.ffn_dim_multiplier = 1.0;
  a.max_seq_len = 24;
  return a;
}

void digest_training(const std::string& name, llama3::TrainOptions options) {
  Section section("train/" + name);
  // A fixed chunk count: the digest is of one schedule, not of what this machine's timings choose.
  options.model_args(digest_model()).steps(3).batch_size(2).seed(42).log(false).relaxed_mc2_contract(true);
  options.mc2_chunks_per_rank(2);
  const auto results = llama3::train(options, [&](int64_t step, llama3::TransformerImpl& model) {
    const auto s = "step" + std::to_string(step) + ".";
    // Before the optimizer step: the parameters this step read, and their gradients.
    for (const auto& item : model.named_parameters()) {
      section.add(s + "param." + item.key(), item.value());
      section.add(s + "grad." + item.key(), item.value().grad());
    }
  });
  for (const auto& r : results) {
    const auto s = "step" + std::to_string(r.step) + ".";
    section.add(s + "loss", at::tensor({r.loss}, at::kDouble));
    section.add(s + "grad_norm", at::tensor({r.grad_norm}, at::kDouble));
  }
}

}  // namespace

int main() {
  return hp_examples::run_main("state_digest", [] {
    comm::init_process_group();
    const auto world = comm::world();
    digest_collectives(world);
    digest_fused_ops(world);
    for (const std::string dtype : {"fp32", "bf16"}) {
      const auto base = llama3::TrainOptions().dtype(dtype);
      digest_training("plain_tp/" + dtype, base);
      digest_training("mc2_ffn/" + dtype, llama3::TrainOptions(base).enable_mc2(true));
      digest_training(
          "mc2_all_loss_parallel/" + dtype,
          llama3::TrainOptions(base).enable_mc2(true).mc2_scope("all").enable_loss_parallel(true));
    }
    comm::destroy_process_group();
    return 0;
  });
}
