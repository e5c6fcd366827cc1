// attnkit bench: the attention kernel (public sdpa) timed over a sweep of
// variants x contexts x batches x KV dtypes, decode and prefill, each
// figure also given as a fraction of this machine's fp32 peak and read
// bandwidth (measured in the same process), as a ratio to the reference
// kernel and as a ratio to the seeds' naive PyTorch attention on the same
// shapes (tools/attnkit/torch_baseline.py, run by /usr/bin/python3).
//
// Shapes: query heads H and head_dim D = d_model / H; kv heads per variant.
// MLA decode is its absorbed form as FlashMLA runs it: H query heads over
// one latent kv head, key = [c ; k_rope] (d_c + d_r), value = c (a view of
// the key's first d_c values, so the latent is read once). MLA prefill is
// its naive form: H heads of d_n + d_r, values of d_v.
//
// Decode rows rotate enough K/V buffers that their total is >= 128 MiB
// (four times this machine's 32 MiB L3): consecutive calls do not find
// their K/V in the last-level cache, so GB/s is DRAM's.
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "attnkit/attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/machine.h"
#include "cli.h"
#include "commands.h"
#include "measure.h"

namespace attnkit::cli {
namespace {

// Without --reference, the reference kernel (scalar loops in double,
// about 1 GFLOP/s) runs only on rows of at most this many FLOPs, so it
// adds at most a few seconds to a sweep.
constexpr double kReferenceMaxFlops = 2.5e8;

struct Options {
  int64_t d_model = 2048, heads = 32, q_tokens = 1, threads = 0, mla_rank = 0, mla_rope_dim = 0;
  std::vector<std::string> variants = {"mha", "gqa-8", "mqa", "mla"};
  std::vector<int64_t> contexts = {1024, 4096, 16384}, batches = {1, 8}, prompts = {1024};
  std::vector<std::string> kv_dtypes = {"f32", "bf16"}, modes = {"decode", "prefill"};
  int64_t max_memory = int64_t{2} << 30;
  // Decode K/V rotation: four times this machine's 32 MiB L3, so that
  // whatever its replacement policy (AMD's L3 is a victim cache, not
  // strict LRU) little of a set survives until its next use.
  int64_t rotate = int64_t{128} << 20;
  double budget = 0.3, peak = 0, bw = 0;
  bool reference = false, no_torch = false, json = false, csv = false;
};

// One kernel shape to time.
struct Shape {
  std::string mode, variant, kv_name;
  int64_t batch = 1, seqlen_q = 1, seqlen_k = 1, heads = 1, kv_heads = 1, head_dim = 1,
          head_dim_v = 1;
  bool v_is_k_prefix = false;  // MLA absorbed: V = K[..., :head_dim_v]
  float scale = 0;
  int64_t rotate_bytes = 0;  // decode: K/V sets rotate until they total this
  DType kv = DType::kF32;

  double pairs() const {  // visible (query, key) pairs, causal bottom-right
    const double T = static_cast<double>(seqlen_q), L = static_cast<double>(seqlen_k);
    return T * (L - T) + T * (T + 1) / 2;
  }
  double flops() const {
    return 2.0 * static_cast<double>(batch * heads * (head_dim + head_dim_v)) * pairs();
  }
  int64_t kv_elems() const {
    return batch * seqlen_k * kv_heads * (head_dim + (v_is_k_prefix ? 0 : head_dim_v));
  }
  bool eight_bit() const { return kv == DType::kI8 || kv == DType::kFp8E4M3; }
  double kv_bytes() const {  // 8-bit types: one fp32 scale per K (and V) row too
    const int64_t rows = batch * seqlen_k * kv_heads * (v_is_k_prefix ? 1 : 2);
    return static_cast<double>(kv_elems() * static_cast<int64_t>(dtype_size(kv)) +
                               (eight_bit() ? 4 * rows : 0));
  }
  double bytes() const {  // read K/V once, read q and write out
    return kv_bytes() +
           4.0 * static_cast<double>(batch * seqlen_q * heads * (head_dim + head_dim_v));
  }
  int buffers() const {
    if (mode == "prefill") return 1;
    return static_cast<int>(
        std::max(1.0, std::ceil(static_cast<double>(rotate_bytes) / kv_bytes())));
  }
  // torch runs f32 whatever the row's KV dtype: the seeds' dtype, and
  // rows differing only in KV dtype share one torch measurement.
  std::string torch_key() const {
    char b[160];
    std::snprintf(b, sizeof b, "%s/%lld/%lld/%lld/%lld/%lld/%lld/%lld/%d", mode.c_str(),
                  (long long)batch, (long long)seqlen_q, (long long)seqlen_k, (long long)heads,
                  (long long)kv_heads, (long long)head_dim, (long long)head_dim_v,
                  v_is_k_prefix ? 1 : 0);
    return b;
  }
};

struct Row {
  Shape s;
  std::optional<Timing> fast, ref;
  std::optional<double> torch_seconds;
  std::string note;  // why something is missing
};

// K/V buffers for one shape, `n` sets, each [batch, seqlen_k, kv_heads, dk+dv].
// Decode reads them laid out as attnkit's KVCache lays out its storage:
// token rows of whole 2 KiB are one 64-byte line apart (kv_token_stride),
// 8-bit rows carry their scales (always in that layout).
struct Buffers {
  std::vector<Tensor> k, v;  // [batch, seqlen_k, row elements]
  bool cache = false;        // KVCache's layout, else contiguous
  TensorView shaped(const Tensor& t, const Shape& s, int64_t dim) const {
    return cache ? kv_cache_view(t.data(), s.kv, s.batch, s.seqlen_k, s.kv_heads, dim)
                 : make_view(t.data(), s.kv, {s.batch, s.seqlen_k, s.kv_heads, dim});
  }
  TensorView kview(size_t i, const Shape& s) const { return shaped(k[i], s, s.head_dim); }
  TensorView vview(size_t i, const Shape& s) const {
    if (!s.v_is_k_prefix) return shaped(v[i], s, s.head_dim_v);
    TensorView view = kview(i, s);
    view.shape[3] = s.head_dim_v;  // same strides: a view of the first head_dim_v features
    return view;
  }
  // 8-bit: the scales of set i's K (V) rows; absent otherwise. MLA's V
  // shares K's rows and scales.
  TensorView kscales(size_t i, const Shape& s) const {
    return kv_cache_scales_view(k[i].data(), s.kv, s.batch, s.seqlen_k, s.kv_heads, s.head_dim);
  }
  TensorView vscales(size_t i, const Shape& s) const {
    if (s.v_is_k_prefix) return kscales(i, s);
    return kv_cache_scales_view(v[i].data(), s.kv, s.batch, s.seqlen_k, s.kv_heads, s.head_dim_v);
  }
};

// 8-bit rows: codes of values uniform in [-1, 1] (a splitmix64 stream from
// `seed`) and every scale 1 / code max, in a KVCache's row layout.
void fill_8bit(const Tensor& t, const Shape& s, int64_t dim, uint64_t seed) {
  const TensorView codes = kv_cache_view(t.data(), s.kv, s.batch, s.seqlen_k, s.kv_heads, dim);
  const TensorView scales =
      kv_cache_scales_view(t.data(), s.kv, s.batch, s.seqlen_k, s.kv_heads, dim);
  const float scale = s.kv == DType::kI8 ? 1.0f / 127 : 1.0f / 448;
  uint64_t state = seed * 0x9E3779B97F4A7C15ull;
  auto uniform = [&state] {  // in [-1, 1)
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return static_cast<float>(static_cast<double>((z ^ (z >> 31)) >> 11) * 0x1.0p-52 - 1.0);
  };
  uint8_t* c = codes.ptr<uint8_t>();
  for (int64_t r = 0; r < s.batch * s.seqlen_k; ++r)
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      for (int64_t x = 0; x < dim; ++x)
        c[r * codes.strides[1] + h * codes.strides[2] + x] =
            s.kv == DType::kI8 ? static_cast<uint8_t>(static_cast<int8_t>(uniform() * 127))
                               : float_to_fp8_e4m3(uniform() * 448);
      scales.ptr<float>()[r * scales.strides[1] + h * scales.strides[2]] = scale;
    }
}

Tensor alloc(DType dtype, std::initializer_list<int64_t> shape) {
  return value_or_throw(Tensor::zeros(dtype, shape), "allocating a bench buffer");
}

Buffers make_buffers(const Shape& s, int n) {
  Buffers b;
  b.cache = (s.mode == "decode" && !s.v_is_k_prefix) || s.eight_bit();
  const int64_t k_row =
      b.cache ? kv_token_stride(s.kv_heads, s.head_dim, s.kv) : s.kv_heads * s.head_dim;
  const int64_t v_row =
      b.cache ? kv_token_stride(s.kv_heads, s.head_dim_v, s.kv) : s.kv_heads * s.head_dim_v;
  for (int i = 0; i < n; ++i) {
    b.k.push_back(alloc(s.kv, {s.batch, s.seqlen_k, k_row}));
    if (!s.v_is_k_prefix) b.v.push_back(alloc(s.kv, {s.batch, s.seqlen_k, v_row}));
  }
  // Every set gets its own random values, as distinct caches hold.
  for (int i = 0; i < n; ++i) {
    const uint64_t seed = 11 + 2 * static_cast<uint64_t>(i);
    const size_t at = static_cast<size_t>(i);
    if (s.eight_bit()) {
      fill_8bit(b.k[at], s, s.head_dim, seed);
      if (!b.v.empty()) fill_8bit(b.v[at], s, s.head_dim_v, seed + 1);
      continue;
    }
    fill_uniform(b.k[at].view(), seed, 1.0);
    if (!b.v.empty()) fill_uniform(b.v[at].view(), seed + 1, 1.0);
  }
  return b;
}

Timing time_sdpa(const Shape& s, const Buffers& buf, int n, Backend backend, int threads,
                 double budget, int min_samples) {
  Tensor q = alloc(DType::kF32, {s.batch, s.seqlen_q, s.heads, s.head_dim});
  Tensor out = alloc(DType::kF32, {s.batch, s.seqlen_q, s.heads, s.head_dim_v});
  fill_uniform(q.view(), 13, 1.0);
  AttentionOptions opt;
  opt.causal = true;
  opt.softmax_scale = s.scale;
  opt.backend = backend;
  opt.num_threads = threads;
  return time_median(
      [&](int64_t i) {
        const size_t r = static_cast<size_t>(i % n);
        opt.k_scales = buf.kscales(r, s);
        opt.v_scales = buf.vscales(r, s);
        ok_or_throw(sdpa(q.view(), buf.kview(r, s), buf.vview(r, s), out.view(), opt), "sdpa");
      },
      budget, min_samples, 200);
}

std::vector<Shape> plan_shapes(const Options& o) {
  const int64_t D = o.d_model / o.heads;
  const int64_t rank = o.mla_rank ? o.mla_rank : 4 * D;
  const int64_t rope =
      o.mla_rope_dim ? o.mla_rope_dim : std::max<int64_t>(2, std::min<int64_t>(64, D / 2) / 2 * 2);
  if (rope >= D) throw UsageError{"--mla-rope-dim must be < head_dim = " + std::to_string(D)};
  const int64_t nope = D - rope;  // q.k width per head = MHA's head_dim, as analyze's MLA
  std::vector<Shape> out;
  for (const std::string& mode : o.modes) {
    const std::vector<int64_t>& lengths = mode == "decode" ? o.contexts : o.prompts;
    const std::vector<int64_t> batches = mode == "decode" ? o.batches : std::vector<int64_t>{1};
    for (const std::string& v : o.variants)
      for (int64_t L : lengths)
        for (int64_t B : batches)
          for (const std::string& kvn : o.kv_dtypes) {
            Shape s;
            s.mode = mode;
            s.variant = v;
            s.kv_name = kvn;
            s.kv = kv_dtype_of(kvn);
            s.batch = B;
            s.seqlen_k = L;
            s.seqlen_q = mode == "decode" ? std::min(o.q_tokens, L) : L;
            s.heads = o.heads;
            s.head_dim = s.head_dim_v = D;
            s.rotate_bytes = o.rotate;
            if (v == "mla") {
              s.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(nope + rope)));
              if (mode == "decode") {
                s.kv_heads = 1;
                s.head_dim = rank + rope;
                s.head_dim_v = rank;
                s.v_is_k_prefix = true;
              } else {
                s.kv_heads = o.heads;
                s.head_dim = nope + rope;
              }
            } else if (v == "mha") {
              s.kv_heads = o.heads;
            } else if (v == "mqa") {
              s.kv_heads = 1;
            } else {
              s.kv_heads = std::stoll(v.substr(4));
            }
            out.push_back(s);
          }
  }
  return out;
}

void check_variant(const std::string& v, int64_t heads) {
  if (v == "mha" || v == "mqa" || v == "mla") return;
  if (v.rfind("gqa-", 0) == 0 && v.size() > 4 &&
      v.find_first_not_of("0123456789", 4) == std::string::npos && v.size() < 12) {
    const int64_t g = std::stoll(v.substr(4));
    if (g >= 1 && heads % g == 0) return;
    throw UsageError{"--variants: " + v + ": " + std::to_string(g) +
                     " kv heads must divide --heads " + std::to_string(heads)};
  }
  throw UsageError{"--variants: unknown variant '" + v + "' (mha, mqa, gqa-N, mla)"};
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The torch baseline script: $ATTNKIT_TORCH_BASELINE, next to this source
// file (a build tree), or share/attnkit/ beside an installed binary.
std::string find_torch_script() {
  namespace fs = std::filesystem;
  std::vector<fs::path> candidates;
  if (const char* env = std::getenv("ATTNKIT_TORCH_BASELINE")) candidates.emplace_back(env);
  candidates.push_back(fs::path(__FILE__).parent_path() / "torch_baseline.py");
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec)
    candidates.push_back(exe.parent_path() / ".." / "share" / "attnkit" / "torch_baseline.py");
  for (const fs::path& p : candidates)
    if (fs::is_regular_file(p, ec)) return p.string();
  return "";
}

std::string python_path() {
  const char* env = std::getenv("ATTNKIT_PYTHON");
  return env ? env : "/usr/bin/python3";
}

// Runs the torch baseline on every distinct shape; fills rows'
// torch_seconds or notes; returns a one-line summary for the footer.
std::string run_torch(std::vector<Row>& rows, const Options& o, int threads) {
  const std::string py = python_path(), script = find_torch_script();
  if (access(py.c_str(), X_OK) != 0) return "torch baseline skipped: " + py + " not found";
  if (script.empty())
    return "torch baseline skipped: torch_baseline.py not found (set ATTNKIT_TORCH_BASELINE)";
  std::vector<std::string> keys;
  nlohmann::json shapes = nlohmann::json::array();
  for (const Row& r : rows) {
    if (!r.fast) continue;
    const std::string key = r.s.torch_key();
    if (std::find(keys.begin(), keys.end(), key) != keys.end()) continue;
    keys.push_back(key);
    shapes.push_back(
        {{"id", keys.size() - 1},
         {"batch", r.s.batch},
         {"seqlen_q", r.s.seqlen_q},
         {"seqlen_k", r.s.seqlen_k},
         {"num_heads", r.s.heads},
         {"num_kv_heads", r.s.kv_heads},
         {"head_dim", r.s.head_dim},
         {"head_dim_v", r.s.head_dim_v},
         {"v_is_k_prefix", r.s.v_is_k_prefix},
         {"softmax_scale",
          r.s.scale > 0 ? r.s.scale : 1.0 / std::sqrt(static_cast<double>(r.s.head_dim))}});
  }
  if (keys.empty()) return "";
  char tmpl[] = "/tmp/attnkit-bench-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return "torch baseline skipped: cannot create a temporary file";
  close(fd);
  {
    std::ofstream in(tmpl);
    in << nlohmann::json{{"threads", threads},
                         {"budget_s", o.budget},
                         {"max_bytes", o.max_memory},
                         {"rotate_bytes", o.rotate},
                         {"shapes", shapes}}
              .dump();
  }
  const std::string cmd = shell_quote(py) + " " + shell_quote(script) + " " + shell_quote(tmpl);
  std::string text;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) text.append(buf, n);
    pclose(p);
  }
  std::remove(tmpl);
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return "torch baseline failed: no JSON from " + script;
  if (j.contains("error")) return "torch baseline skipped: " + j["error"].get<std::string>();
  std::vector<std::optional<double>> secs(keys.size());
  std::vector<std::string> why(keys.size());
  for (const auto& r : j["results"]) {
    const size_t id = r["id"].get<size_t>();
    if (id >= keys.size()) continue;
    if (r.contains("seconds"))
      secs[id] = r["seconds"].get<double>();
    else
      why[id] = "torch: " + r.value("skipped", std::string("skipped"));
  }
  for (Row& r : rows) {
    const auto it = std::find(keys.begin(), keys.end(), r.s.torch_key());
    if (it == keys.end()) continue;
    const size_t id = static_cast<size_t>(it - keys.begin());
    r.torch_seconds = secs[id];
    if (!why[id].empty()) r.note += (r.note.empty() ? "" : "; ") + why[id];
  }
  return "torch " + j.value("torch", std::string("?")) + ", the seeds' naive attention in f32 (" +
         std::to_string(j.value("threads", 0)) + " threads)";
}

std::string csv_cell(const nlohmann::ordered_json& v) {
  if (v.is_null()) return "";
  if (v.is_string()) {
    std::string s = v.get<std::string>(), out = "\"";
    for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
    return out + "\"";
  }
  return v.dump();
}

using ojson = nlohmann::ordered_json;

// The flags, described; false when --help was given.
bool parse_options(int argc, char** argv, Options* po) {
  Options& o = *po;
  Flags f(
      "bench",
      "Times the attention kernel (sdpa) over variants x contexts x batches x KV dtypes: decode\n"
      "(--q-tokens queries against a cache of `context` tokens) and causal prefill (--prompts\n"
      "tokens, batch 1). Every figure is a median, printed with GFLOP/s and GB/s, as a fraction\n"
      "of this machine's fp32 FMA peak and DRAM read bandwidth (measured first, in this\n"
      "process), as a ratio to the reference kernel, and as a ratio to the seeds' naive PyTorch\n"
      "attention (repeat_interleave + matmul + masked softmax + matmul, f32, /usr/bin/python3)\n"
      "on the same shapes. Decode rows rotate >= 128 MiB of K/V buffers, so they measure DRAM,\n"
      "not the last-level cache (--rotate). A progress bar goes to stderr when it is a terminal.",
      {"attnkit bench",
       "attnkit bench --variants mha,gqa-8 --contexts 2048,8192 --batches 1 --kv-dtypes bf16",
       "attnkit bench --modes decode --q-tokens 4 --csv > decode.csv",
       "attnkit bench --json > bench.json && attnkit plot --input bench.json --out plots",
       "attnkit bench --d-model 64 --heads 4 --contexts 64 --prompts 64 --no-torch   # seconds"});
  f.add_int("--d-model", &o.d_model, "hidden size (default 2048)", 1);
  f.add_int("--heads", &o.heads, "query heads (default 32); head_dim = d_model / heads", 1);
  f.add_string_list("--variants", &o.variants, "mha, mqa, gqa-N, mla (default mha,gqa-8,mqa,mla)");
  f.add_int_list("--contexts", &o.contexts, "decode: cached tokens (default 1024,4096,16384)");
  f.add_int_list("--batches", &o.batches, "decode: sequences (default 1,8)");
  f.add_string_list("--kv-dtypes", &o.kv_dtypes, "f32, bf16, int8, fp8_e4m3 (default f32,bf16)");
  f.add_string_list("--modes", &o.modes, "decode, prefill (default both)");
  f.add_int_list("--prompts", &o.prompts, "prefill: tokens, batch 1 (default 1024)");
  f.add_int("--q-tokens", &o.q_tokens, "decode: new tokens per step (default 1)", 1);
  f.add_int("--mla-rank", &o.mla_rank, "MLA kv_lora_rank (default 4 x head_dim)", 0);
  f.add_int("--mla-rope-dim", &o.mla_rope_dim, "MLA qk_rope_head_dim (default head_dim / 2)", 0);
  f.add_int("--threads", &o.threads, "threads (default 0 = all cores)", 0);
  f.add_double("--budget", &o.budget, "seconds of samples per measurement (default 0.3)");
  f.add_bytes("--max-memory", &o.max_memory, "skip rows needing more (default 2GiB)");
  f.add_bytes("--rotate", &o.rotate,
              "decode K/V buffers rotate until they total this (default 128MiB; 0 = one)");
  f.add_bool("--reference", &o.reference,
             "time the reference kernel on every row (default: rows of <= 0.25 GFLOP)");
  f.add_bool("--no-torch", &o.no_torch, "skip the PyTorch baseline");
  f.add_double("--peak-gflops", &o.peak, "use this fp32 peak instead of measuring");
  f.add_double("--bandwidth-gbps", &o.bw, "use this read bandwidth instead of measuring");
  f.add_bool("--json", &o.json, "print JSON instead of a table");
  f.add_bool("--csv", &o.csv, "print CSV (one line per row) instead of a table");
  return f.parse(argc, argv, 2);
}

// Checks what the flags ask for (exit 2 on anything wrong) and returns the
// shapes to time.
std::vector<Shape> check_options(Options* po) {
  Options& o = *po;
  if (o.json && o.csv) throw UsageError{"give at most one of --json and --csv"};
  if (o.d_model % o.heads != 0)
    throw UsageError{"--d-model " + std::to_string(o.d_model) + " must be divisible by --heads " +
                     std::to_string(o.heads)};
  if (!(o.budget >= 0) || o.budget > 60) throw UsageError{"--budget must be in [0, 60] seconds"};
  // The default list drops the GQA sizes a smaller --heads cannot have.
  if (o.variants == Options{}.variants)
    std::erase_if(o.variants, [&](const std::string& v) {
      return v.rfind("gqa-", 0) == 0 &&
             (o.heads <= std::stoll(v.substr(4)) || o.heads % std::stoll(v.substr(4)));
    });
  for (const std::string& v : o.variants) check_variant(v, o.heads);
  for (const std::string& d : o.kv_dtypes)
    if (d != "f32" && d != "bf16" && d != "int8" && d != "fp8_e4m3")
      throw UsageError{"--kv-dtypes entries must be f32, bf16, int8 or fp8_e4m3, got '" + d + "'"};
  for (const std::string& m : o.modes)
    if (m != "decode" && m != "prefill")
      throw UsageError{"--modes entries must be decode or prefill, got '" + m + "'"};
  return plan_shapes(o);
}

// Times one shape: the fast kernel, and the reference where it is cheap
// enough or asked for; a row that needs more than --max-memory says so.
Row time_shape(const Shape& s, const Options& o) {
  Row r;
  r.s = s;
  const int n = s.buffers();
  const double need = s.kv_bytes() * n;
  if (need > static_cast<double>(o.max_memory)) {
    r.note = "skipped: K/V " + format_bytes(need) + " > --max-memory " +
             format_bytes(static_cast<double>(o.max_memory));
    return r;
  }
  const Buffers buf = make_buffers(s, n);
  r.fast = time_sdpa(s, buf, n, Backend::kFast, static_cast<int>(o.threads), o.budget, 5);
  if (o.reference || s.flops() <= kReferenceMaxFlops)
    r.ref = time_sdpa(s, buf, n, Backend::kReference, static_cast<int>(o.threads), o.budget, 3);
  return r;
}

// Everything the sweep measured, and the machine's figures to judge it by.
struct Sweep {
  std::vector<Row> rows;
  std::string torch_note;
  MachineCheck check;
  int threads = 0;
  double seconds = 0;
};

Sweep run_sweep(const Options& o, const std::vector<Shape>& shapes) {
  Sweep sw;
  const double t_start = now_seconds();
  MachineProfile mp;
  if (o.peak > 0 && o.bw > 0) {
    mp = machine_profile(o.peak, o.bw);
  } else {
    mp = measure_machine(static_cast<int>(o.threads), /*quick=*/false);
    if (o.peak > 0) mp.fp32_peak_gflops = o.peak;
    if (o.bw > 0) mp.dram_read_gbps = o.bw;
  }
  sw.threads = o.threads > 0 ? static_cast<int>(o.threads) : mp.threads;
  Progress progress("bench", static_cast<int64_t>(shapes.size()));
  for (const Shape& s : shapes) {
    char what[96];
    std::snprintf(what, sizeof what, "%s %s ctx %lld b%lld %s", s.mode.c_str(), s.variant.c_str(),
                  (long long)s.seqlen_k, (long long)s.batch, s.kv_name.c_str());
    progress.step(what);
    sw.rows.push_back(time_shape(s, o));
  }
  progress.finish();
  sw.torch_note =
      o.no_torch ? "torch baseline skipped (--no-torch)" : run_torch(sw.rows, o, sw.threads);
  // The yardstick again, after the sweep: a busy spell during either
  // measurement shows as a disagreement, and the fractions use the
  // better figures.
  sw.check = remeasure_machine(mp, o.peak, o.bw, static_cast<int>(o.threads), /*quick=*/false);
  sw.seconds = now_seconds() - t_start;
  return sw;
}

// A row's compute roof as a fraction of the fp32 peak: bf16 K/V, and 8-bit
// K/V dequantized for prefill, may run on the bf16 dot product
// (vdpbf16ps), whose peak is higher.
double compute_roof(const Shape& s, const MachineProfile& mp) {
  const double bf16_roof = std::max(1.0, mp.bf16_dot_peak_gflops / mp.fp32_peak_gflops);
  return s.kv != DType::kF32 ? bf16_roof : 1.0;
}

ojson row_json(const Row& r, const MachineProfile& mp) {
  const Shape& s = r.s;
  const double peak = mp.fp32_peak_gflops * 1e9, bw = mp.dram_read_gbps * 1e9;
  ojson j = {{"mode", s.mode},           {"variant", s.variant},
             {"batch", s.batch},         {"context", s.seqlen_k},
             {"q_tokens", s.seqlen_q},   {"kv_dtype", s.kv_name},
             {"num_heads", s.heads},     {"num_kv_heads", s.kv_heads},
             {"head_dim", s.head_dim},   {"head_dim_v", s.head_dim_v},
             {"flops", s.flops()},       {"bytes", s.bytes()},
             {"kv_buffers", s.buffers()}};
  const auto opt = [](bool has, double v) { return has ? ojson(v) : ojson(nullptr); };
  const bool fast = r.fast.has_value();
  const double t = fast ? r.fast->median : 0;
  j["seconds"] = opt(fast, t);
  j["gflops"] = opt(fast, fast ? s.flops() / t / 1e9 : 0);
  j["gbps"] = opt(fast, fast ? s.bytes() / t / 1e9 : 0);
  j["peak_fraction"] = opt(fast, fast ? s.flops() / t / peak : 0);
  j["bandwidth_fraction"] = opt(fast, fast ? s.bytes() / t / bw : 0);
  j["above_roof"] =
      fast && (s.flops() / t / peak > compute_roof(s, mp) || s.bytes() / t / bw > 1.0);
  j["arithmetic_intensity"] = s.flops() / s.bytes();
  j["reference_seconds"] = opt(r.ref.has_value(), r.ref ? r.ref->median : 0);
  j["speedup_vs_reference"] = opt(fast && r.ref.has_value(), r.ref && fast ? r.ref->median / t : 0);
  j["torch_seconds"] = opt(r.torch_seconds.has_value(), r.torch_seconds.value_or(0));
  j["speedup_vs_torch"] =
      opt(fast && r.torch_seconds.has_value(), fast ? r.torch_seconds.value_or(0) / t : 0);
  j["samples"] = fast ? r.fast->samples : 0;
  j["note"] = r.note;
  return j;
}

void print_csv(const ojson& jrows) {
  for (const ojson& j : jrows) {
    if (&j == &jrows[0]) {
      for (auto it = j.begin(); it != j.end(); ++it)
        std::printf("%s%s", it == j.begin() ? "" : ",", it.key().c_str());
      std::printf("\n");
    }
    for (auto it = j.begin(); it != j.end(); ++it)
      std::printf("%s%s", it == j.begin() ? "" : ",", csv_cell(*it).c_str());
    std::printf("\n");
  }
}

void print_json(const Options& o, const Sweep& sw, const ojson& jrows,
                const std::vector<std::string>& warnings) {
  // KV bytes per token of one layer, per variant, for plots of memory
  // against context.
  Options one = o;
  one.modes = {"decode"};
  one.contexts = one.batches = {1};
  one.kv_dtypes = {"f32", "bf16", "int8"};
  ojson per_token = ojson::object();
  for (const Shape& s : plan_shapes(one)) per_token[s.variant][s.kv_name] = s.kv_bytes();
  ojson j = {{"config",
              {{"d_model", o.d_model},
               {"num_heads", o.heads},
               {"head_dim", o.d_model / o.heads},
               {"q_tokens", o.q_tokens},
               {"threads", sw.threads},
               {"budget_s", o.budget},
               {"rotate_bytes", o.rotate}}},
             {"machine", machine_json(sw.check)},
             {"warnings", warnings},
             {"torch", sw.torch_note},
             {"kv_bytes_per_token", per_token},
             {"rows", jrows},
             {"seconds", sw.seconds}};
  std::printf("%s\n", j.dump(2).c_str());
}

std::vector<std::string> row_cells(const Row& r, const ojson& j, const MachineProfile& mp) {
  const bool fast = r.fast.has_value();
  auto cell = [&](const char* key, auto fmt) {
    return j[key].is_null() ? std::string("-") : fmt(j[key].get<double>());
  };
  const Shape& s = r.s;
  return {
      s.mode,
      s.variant,
      std::to_string(s.batch),
      std::to_string(s.seqlen_k) +
          (s.mode == "decode" && s.seqlen_q > 1 ? " (q " + std::to_string(s.seqlen_q) + ")" : ""),
      s.kv_name,
      fast ? format_seconds(r.fast->median) : "-",
      cell("gflops", [](double v) { return format_rate(v * 1e9); }),
      cell("gbps", [](double v) { return format_bandwidth(v * 1e9); }),
      cell("peak_fraction", [&](double v) { return roof_percent(v, compute_roof(s, mp)); }),
      cell("bandwidth_fraction", [](double v) { return roof_percent(v); }),
      cell("speedup_vs_reference", format_ratio),
      cell("speedup_vs_torch", format_ratio),
      r.note};
}

void print_text(const Options& o, const Sweep& sw, const ojson& jrows,
                const std::vector<std::string>& warnings) {
  const MachineProfile& mp = sw.check.best;
  Table table({"mode", "variant", "batch", "context", "KV", "time", "GFLOP/s", "GB/s", "% peak",
               "% BW", "vs ref", "vs torch", "note"});
  for (size_t i = 0; i < sw.rows.size(); ++i) table.add(row_cells(sw.rows[i], jrows[i], mp));
  std::printf(
      "sdpa kernels: d_model %lld, %lld query heads of %lld; MLA decode = absorbed (1 latent kv "
      "head), "
      "prefill = naive\n\n",
      (long long)o.d_model, (long long)o.heads, (long long)(o.d_model / o.heads));
  std::fputs(table.str().c_str(), stdout);
  std::printf("\nmachine (%s): %s%d threads, fp32 peak %.0f GFLOP/s, read bandwidth %.1f GB/s\n",
              mp.simd == "given" ? "given" : "measured before and after, the better of the two",
              mp.simd == "given" ? "" : (mp.simd + ", ").c_str(), mp.threads, mp.fp32_peak_gflops,
              mp.dram_read_gbps);
  std::printf("time = median; vs ref / vs torch = their time / ours; %s. Took %.0f s.\n",
              sw.torch_note.c_str(), sw.seconds);
  for (const std::string& w : warnings) std::printf("%s\n", w.c_str());
}

}  // namespace

int run_bench(int argc, char** argv) {
  Options o;
  if (!parse_options(argc, argv, &o)) return 0;
  const std::vector<Shape> shapes = check_options(&o);
  try {
    const Sweep sw = run_sweep(o, shapes);
    std::vector<std::string> warnings = machine_warnings(sw.check);
    ojson jrows = ojson::array();
    int above = 0;
    for (const Row& r : sw.rows) {
      jrows.push_back(row_json(r, sw.check.best));
      above += jrows.back()["above_roof"].get<bool>();
    }
    if (above > 0) warnings.push_back(above_roof_warning(above, "row(s)"));
    if (o.csv)
      print_csv(jrows);
    else if (o.json)
      print_json(o, sw, jrows, warnings);
    else
      print_text(o, sw, jrows, warnings);
    return 0;
  } catch (const RunError& e) {
    std::fprintf(stderr, "attnkit bench: %s\n", e.message.c_str());
    return 1;
  }
}

}  // namespace attnkit::cli
