// attnkit/model.h — a whole decoder loaded from a Hugging Face checkpoint.
//
// Model::from_pretrained(dir) reads dir/config.json once into the model
// description (attnkit/model_spec.h) and the weights from
// dir/model.safetensors, or from the shards that
// dir/model.safetensors.index.json names (its weight_map: tensor name ->
// shard file). The shards are memory-mapped (SafetensorsFile); each layer
// copies its weights out of the mapping in the dtype they are stored in
// where it runs that dtype (bf16 projections, experts, embedding and LM
// head stay bf16; f16 and f64 become f32), and the mappings are closed
// when loading ends.
//
// What runs, for token ids t [tokens] (docs/MODEL.md walks through each
// family with its Hugging Face source):
//   h = embed_tokens[t]            (Gemma: * sqrt(hidden), rounded to the
//                                   embedding's dtype, as HF does)
//   each decoder layer l, as the description says:
//     h = h + post_attn_norm?(mixer(input_layernorm(h)))
//     h = h + post_ffn_norm?(ffn(pre_ffn_norm(h)))
//   mixer: AttentionLayer (self_attn.*: MHA/GQA, window, qk-norm, sinks,
//          output gate, ...), LatentAttention (self_attn.*: DeepSeek's MLA)
//          or GatedDeltaNet (linear_attn.*: Qwen3-Next's linear-attention
//          layers, one state per sequence in a LinearStatePool)
//   ffn:   dense gate/up/down MLP (mlp.*, Llama 4: feed_forward.*; SiLU or
//          GELU-tanh) or MoeLayer (mlp.* / block_sparse_moe.* /
//          feed_forward.*; Qwen2-MoE / Qwen3-Next's gated shared expert and
//          Llama 4's input-scaled routing included)
//   logits = norm(h) lm_head^T     (lm_head.weight, or embed_tokens when
//                                   tie_word_embeddings); Gemma-2:
//                                   cap * tanh(logits / cap)
// RMSNorms are x / sqrt(mean(x^2) + eps) * w, Gemma's and Qwen3-Next's
// (zero-centred) * (1 + w); the
// Gemma families carry the post-attention and pre/post-feed-forward
// ("sandwich") norms, the others input_layernorm and
// post_attention_layernorm (which is then the pre-feed-forward norm).
// Hidden states are f32 throughout; sums are fp32 or wider.
//
// forward() and forward_step() share the model's step scratch (grown to
// the largest step, then reused): one call at a time per Model.
//
// Loading is strict: every tensor the description implies must be present
// with its exact shape, and a tensor nothing reads is an error naming it
// (rotary_emb.inv_freq buffers excepted, Qwen3-Next's mtp.* multi-
// token-prediction head, which Hugging Face also skips, and a multimodal
// wrapper's vision tower and projector, by their exact prefixes), so a
// checkpoint and a config that disagree never load silently.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "attnkit/config.h"
#include "attnkit/linear_state_pool.h"
#include "attnkit/model_spec.h"
#include "attnkit/paged_kv_cache.h"
#include "attnkit/status.h"
#include "attnkit/step_model.h"
#include "attnkit/tensor.h"

namespace attnkit {

struct ModelLoadOptions {
  // The backend and threads forward() runs with (forward_step takes its
  // own per call).
  RunOptions run;
};

// Families from_pretrained loads (config.json's model_type): "llama",
// "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
// "qwen3_next", "gemma2", "gemma3_text", "deepseek_v2", "deepseek_v3",
// "deepseek_v32" (sparse attention: the pool carries the indexer keys),
// "gpt_oss", "llama4_text". The text model of a multimodal wrapper's
// checkpoint loads too: "gemma3" (Gemma3ForConditionalGeneration, its
// language_model.model.* / model.language_model.* tensors) and "llama4"
// (language_model.*), the vision tower and projector unread (docs/MODEL.md
// has the names). Other families and wrappers, and quantized checkpoints
// (quantization_config), are refused by name.
std::span<const char* const> supported_model_types();

class Model final : public StepModel {
 public:
  static Result<Model> from_pretrained(const std::string& dir,
                                       const ModelLoadOptions& options = {});

  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  ~Model() override;

  const ModelSpec& spec() const;
  int64_t vocab_size() const override;
  int64_t num_layers() const;
  int64_t hidden_size() const;
  // Bytes of the weights as kept (all layers, embedding, LM head).
  size_t weight_bytes() const;

  // Logits of every position of each row of token_ids, causal within the
  // row, through a private pool (and state pool) sized for the call:
  //   token_ids [batch, seq]  int32 or int64, each in [0, vocab_size)
  //   returns   [batch, seq, vocab_size] f32
  Result<Tensor> forward(const TensorView& token_ids);

  Result<PagedKVCache> new_pool(int64_t num_pages, int64_t page_size, DType kv_dtype,
                                bool prefix_caching) const override;
  bool pool_releases_pages() const override;
  Result<LinearStatePool> new_state_pool(int64_t max_sequences) const override;
  int64_t state_bytes_per_sequence() const override;
  Status forward_step(std::span<const int32_t> token_ids, std::span<const int32_t> cu_seqlens,
                      std::span<const int64_t> seq_ids, PagedKVCache& pool, LinearStatePool& states,
                      std::span<float> logits, const RunOptions& run) override;

  // The loaded layers and step scratch, opaque outside src/model/.
  struct Impl;
  explicit Model(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnkit
