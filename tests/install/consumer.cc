// A downstream program built against an installed attnkit: one MQA call,
// checked against the softmax it must produce (two keys, one visible row).
#include <attnkit/attention.h>

#include <cmath>
#include <cstdio>

int main() {
  float q[2] = {1.0f, 0.0f};                  // [1, 1, 1, 2]
  float k[4] = {1.0f, 0.0f, 0.0f, 0.0f};      // [1, 2, 1, 2]
  float v[4] = {1.0f, 2.0f, 3.0f, 4.0f};      // [1, 2, 1, 2]
  float out[2] = {0.0f, 0.0f};
  attnkit::AttentionOptions opt;
  opt.softmax_scale = 1.0f;
  attnkit::Status st = attnkit::sdpa(attnkit::make_view(q, attnkit::DType::kF32, {1, 1, 1, 2}),
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
  std::printf("consumer ok\n");
  return 0;
}
