// A downstream program built against an installed attnkit: one MQA call,
// checked against the softmax it must produce (two keys, one visible row),
// and one layer forward, whose projections run through the GEMM library
// attnkit links (so the installed package must carry that dependency).
#include <attnkit/attention.h>
#include <attnkit/attention_layer.h>
#include <attnkit/config.h>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

// An MHA layer (2 heads of 2, no RoPE, no bias) whose four projections are
// the identity: one token attends only to itself, so out == x.
int check_layer() {
  auto config = attnkit::attention_config_from_variant("mha", 4, 2, /*bias=*/false);
  if (!config.ok()) return std::printf("config: %s\n", config.status().to_string().c_str()), 1;
  auto layer = attnkit::AttentionLayer::create(*config);
  if (!layer.ok()) return std::printf("create: %s\n", layer.status().to_string().c_str()), 1;
  std::vector<float> eye(16, 0.0f);
  for (int i = 0; i < 4; ++i) eye[i * 5] = 1.0f;
  const attnkit::TensorView w = attnkit::make_view(eye.data(), attnkit::DType::kF32, {4, 4});
  const attnkit::WeightMap weights{
      {"q_proj.weight", w}, {"k_proj.weight", w}, {"v_proj.weight", w}, {"o_proj.weight", w}};
  if (attnkit::Status st = layer->load_weights(weights); !st.ok())
    return std::printf("load_weights: %s\n", st.to_string().c_str()), 1;
  float x[4] = {0.5f, -1.0f, 2.0f, 0.25f}, y[4] = {};
  const attnkit::Status st = layer->forward(attnkit::make_view(x, attnkit::DType::kF32, {1, 1, 4}),
                                            attnkit::make_view(y, attnkit::DType::kF32, {1, 1, 4}));
  if (!st.ok()) return std::printf("forward: %s\n", st.to_string().c_str()), 1;
  for (int i = 0; i < 4; ++i)
    if (std::fabs(y[i] - x[i]) > 1e-6f)
      return std::printf("layer: out[%d] = %f, expected %f\n", i, y[i], x[i]), 1;
  return 0;
}

}  // namespace

int main() {
  float q[2] = {1.0f, 0.0f};              // [1, 1, 1, 2]
  float k[4] = {1.0f, 0.0f, 0.0f, 0.0f};  // [1, 2, 1, 2]
  float v[4] = {1.0f, 2.0f, 3.0f, 4.0f};  // [1, 2, 1, 2]
  float out[2] = {0.0f, 0.0f};
  attnkit::AttentionOptions opt;
  opt.softmax_scale = 1.0f;
  attnkit::Status st =
      attnkit::sdpa(attnkit::make_view(q, attnkit::DType::kF32, {1, 1, 1, 2}),
                    attnkit::make_view(k, attnkit::DType::kF32, {1, 2, 1, 2}),
                    attnkit::make_view(v, attnkit::DType::kF32, {1, 2, 1, 2}),
                    attnkit::make_view(out, attnkit::DType::kF32, {1, 1, 1, 2}), opt);
  if (!st.ok()) {
    std::printf("sdpa failed: %s\n", st.to_string().c_str());
    return 1;
  }
  const double w0 = std::exp(1.0) / (std::exp(1.0) + 1.0);
  const double e0 = w0 * 1 + (1 - w0) * 3, e1 = w0 * 2 + (1 - w0) * 4;
  if (std::fabs(out[0] - e0) > 1e-5 || std::fabs(out[1] - e1) > 1e-5) {
    std::printf("wrong result: %f %f, expected %f %f\n", out[0], out[1], e0, e1);
    return 1;
  }
  if (check_layer() != 0) return 1;
  std::printf("consumer ok\n");
  return 0;
}
