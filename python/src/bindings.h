// One function per binding file, each binding one area the way src/ splits
// it; module.cc calls them in order.
#pragma once

#include <pybind11/pybind11.h>

namespace attnkit::python {

void bind_sdpa(pybind11::module_& m);             // sdpa.cc: sdpa, merge_attention_states
void bind_rope(pybind11::module_& m);             // rope.cc: Rope, apply_rope
void bind_kv_cache(pybind11::module_& m);         // kv_cache.cc: KVCache
void bind_attention_layer(pybind11::module_& m);  // attention_layer.cc: AttentionLayer
void bind_safetensors(pybind11::module_& m);      // safetensors.cc: load/save_safetensors
void bind_mla(pybind11::module_& m);              // mla.cc: LatentAttention and its cache
void bind_moe(pybind11::module_& m);              // moe.cc: the MoE feed-forward
void bind_gated_deltanet(pybind11::module_& m);   // gated_deltanet.cc: GatedDeltaNet, its state
void bind_paged(pybind11::module_& m);       // paged.cc: PagedKVCache, batch_attention, sdpa_varlen
void bind_model_spec(pybind11::module_& m);  // model_spec.cc: the model description
// sparse_attention.cc: indexer_quantize, lightning_indexer_topk
void bind_sparse_attention(pybind11::module_& m);
void bind_serve(pybind11::module_& m);  // serve.cc: StepModel, SyntheticModel, Engine
void bind_model(pybind11::module_& m);  // model.cc: Model (a decoder from a checkpoint)

}  // namespace attnkit::python
