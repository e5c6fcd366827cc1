// Model's state (internal to src/model/): the layers from_pretrained built
// and the step scratch. model_load.cc fills it; model.cc runs it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnkit/attention_layer.h"
#include "attnkit/gated_deltanet.h"
#include "attnkit/latent_attention.h"
#include "attnkit/model.h"
#include "attnkit/moe.h"
#include "attnkit/tensor.h"

namespace attnkit {

// The dense feed-forward: down(act(gate(x)) * up(x)), no biases.
struct DenseMlp {
  Tensor gate, up;  // [intermediate, hidden] f32 or bf16 (as stored)
  Tensor down;      // [hidden, intermediate]
  int64_t intermediate = 0;
  bool gelu_tanh = false;  // gelu_pytorch_tanh; else silu
};

// One decoder layer: which mixer and feed-forward run it, and its norms'
// gains (f32 [hidden], already 1 + w for Gemma's and Qwen3-Next's
// zero-centred norms). post_attn_norm and
// post_ffn_norm are empty outside the Gemma families, whose
// pre_feedforward_layernorm is pre_ffn_norm; elsewhere pre_ffn_norm holds
// post_attention_layernorm.
struct Block {
  LayerKind kind = LayerKind::kAttention;
  // Index into attention / latent (= its layer in the paged pool) or into
  // linear (= its layer in the LinearStatePool).
  int64_t mixer = 0;
  bool moe = false;
  int64_t ffn = 0;  // index into moe / mlp
  Tensor input_norm, post_attn_norm, pre_ffn_norm, post_ffn_norm;
};

struct Model::Impl {
  ModelSpec spec;
  ModelLoadOptions options;
  Tensor embed;    // [vocab, hidden] f32 or bf16 (as stored)
  Tensor lm_head;  // [vocab, hidden]; empty when tied to embed
  Tensor final_norm;
  // Gemma: sqrt(hidden) rounded to the embedding's dtype; 1 otherwise.
  float embed_scale = 1.0f;
  std::vector<AttentionLayer> attention;
  std::vector<LatentAttention> latent;
  std::vector<GatedDeltaNet> linear;  // Qwen3-Next's linear-attention layers
  std::vector<MoeLayer> moe;
  std::vector<DenseMlp> mlp;
  std::vector<Block> blocks;
  size_t weight_bytes = 0;
  // Step scratch, grown to the largest step: h, x, y [tokens, hidden];
  // a, b [tokens, intermediate]; rows_h [rows, hidden] (the rows whose
  // logits are asked for).
  std::vector<float> h, x, y, a, b, rows_h;

  const Tensor& head() const { return lm_head.data() != nullptr ? lm_head : embed; }
};

}  // namespace attnkit
