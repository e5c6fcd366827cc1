// Ring attention over load-balanced chunk pairs (ring_chunks): the ranks'
// K/V blocks travel around the ring while each rank attends its queries to
// the block it holds, merging the partial results by log-sum-exp.
//
// Rank r holds q chunks A = r and B' = 2N-1-r. At ring step t it holds the
// K/V block of rank s = r - t (mod N): chunks s and 2N-1-s. Under the causal
// mask (chunk i sees chunk j fully when j < i, causally when j = i, not
// at all when j > i):
//   s == r  A against chunk r (causal), and B' against both chunks at once
//           (causal with bottom-right alignment: B''s row i sits at key
//           |A| + i, after all of chunk r and at its own place in chunk B')
//   s <  r  A and B' against chunk s (whole); chunk 2N-1-s > 2N-1-r comes later
//   s >  r  B' against both chunks (whole); A precedes both
// So every step costs about two chunk-pairs of work on every rank. Without
// the mask every query attends every block whole.
//
// A failed sdpa (an argument only sdpa checks, on one rank) must not stop
// that rank's part of the ring, or its neighbours would wait for ever: the
// rank keeps forwarding blocks, and the outcome is agreed on at the end.
// Results go to scratch accumulators and reach out_local only then.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/dist.h"
#include "dist/common.h"

namespace attnkit::dist {
namespace {

using internal::Agreement;
using internal::check_comm;
using internal::mpi_status;

constexpr const char* kFn = "ring_attention";

Status check_input(const char* name, const TensorView& v, const char* shape,
                   std::initializer_list<DType> dtypes) {
  const std::string f = std::string(kFn) + ": " + name;
  if (!v.present()) return invalid_argument(f + " is absent (data is null)");
  if (v.rank != 4)
    return invalid_argument(f + ".rank = " + std::to_string(v.rank) + " must be 4 (" + shape + ")");
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok = dtype_ok || v.dtype == d;
  if (!dtype_ok)
    return invalid_argument(f + ".dtype = " + dtype_name(v.dtype) +
                            (dtypes.size() == 1 ? " must be f32" : " must be f32 or bf16"));
  for (int i = 0; i < 4; ++i)
    if (v.shape[i] < 0 || v.strides[i] < 0)
      return invalid_argument(f + " " + v.describe() + " has a negative size or stride");
  return Status::Ok();
}

// Copies a [B, n, K, dim] view of `elt`-byte elements into contiguous memory.
void pack(const TensorView& v, size_t elt, char* dst) {
  for (int64_t b = 0; b < v.shape[0]; ++b)
    for (int64_t t = 0; t < v.shape[1]; ++t)
      for (int64_t h = 0; h < v.shape[2]; ++h) {
        const int64_t base = b * v.strides[0] + t * v.strides[1] + h * v.strides[2];
        const char* src = static_cast<const char*>(v.data);
        if (v.strides[3] == 1) {
          std::memcpy(dst, src + base * static_cast<int64_t>(elt),
                      static_cast<size_t>(v.shape[3]) * elt);
          dst += v.shape[3] * static_cast<int64_t>(elt);
          continue;
        }
        for (int64_t d = 0; d < v.shape[3]; ++d, dst += elt)
          std::memcpy(dst, src + (base + d * v.strides[3]) * static_cast<int64_t>(elt), elt);
      }
}

// Row ranges [a, b) (dim 1) of views.
TensorView rows_of(TensorView v, int64_t a, int64_t b) {
  v.data =
      static_cast<char*>(v.data) + a * v.strides[1] * static_cast<int64_t>(dtype_size(v.dtype));
  v.shape[1] = b - a;
  return v;
}
// [B, H, n] lse views: queries along dim 2.
TensorView lse_rows_of(TensorView v, int64_t a, int64_t b) {
  v.data =
      static_cast<char*>(v.data) + a * v.strides[2] * static_cast<int64_t>(dtype_size(v.dtype));
  v.shape[2] = b - a;
  return v;
}

// The facts every rank must share, in ring_attention's order; after them
// each rank's own token count, fact kTokens.
constexpr const char* kFactNames[] = {"batch",
                                      "num_heads",
                                      "num_kv_heads",
                                      "head_dim",
                                      "head_dim_v",
                                      "k_local.dtype",
                                      "options.causal",
                                      "options.softmax_scale (bits)",
                                      "options.softcap (bits)"};
constexpr size_t kTokens = std::size(kFactNames);

int64_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

}  // namespace

Status ring_attention(MPI_Comm comm, const TensorView& q_arg, const TensorView& k_arg,
                      const TensorView& v_arg, const TensorView& out_arg,
                      const RingOptions& options, const TensorView& lse_arg) {
  const TensorView q_local = internal::with_placeholder_if_empty(q_arg),
                   k_local = internal::with_placeholder_if_empty(k_arg),
                   v_local = internal::with_placeholder_if_empty(v_arg),
                   out_local = internal::with_placeholder_if_empty(out_arg),
                   lse_local = internal::with_placeholder_if_empty(lse_arg);
  int rank = 0, ranks = 0;
  ATTNKIT_RETURN_IF_ERROR(check_comm(kFn, comm, &rank, &ranks));
  const std::string f = kFn;
  // ---- local checks (sdpa checks the rest, during the ring) ------------
  Status local = check_input("q_local", q_local, "[batch, n, num_heads, head_dim]", {DType::kF32});
  if (local.ok())
    local = check_input("k_local", k_local, "[batch, n, num_kv_heads, head_dim]",
                        {DType::kF32, DType::kBF16});
  if (local.ok())
    local = check_input("v_local", v_local, "[batch, n, num_kv_heads, head_dim_v]",
                        {DType::kF32, DType::kBF16});
  if (local.ok() && v_local.dtype != k_local.dtype)
    local = invalid_argument(f + ": v_local.dtype = " + dtype_name(v_local.dtype) +
                             " must equal k_local.dtype = " + dtype_name(k_local.dtype));
  const TensorView* kv[] = {&k_local, &v_local};
  const char* kv_names[] = {"k_local", "v_local"};
  for (int i = 0; i < 2 && local.ok(); ++i)
    for (int d : {0, 1})
      if (kv[i]->shape[d] != q_local.shape[d]) {
        local = invalid_argument(f + ": " + kv_names[i] + ".shape[" + std::to_string(d) + "] = " +
                                 std::to_string(kv[i]->shape[d]) + " must equal q_local.shape[" +
                                 std::to_string(d) + "] = " + std::to_string(q_local.shape[d]) +
                                 (d ? " (n: queries and keys are the same tokens)" : " (batch)"));
        break;
      }
  if (local.ok() && v_local.shape[2] != k_local.shape[2])
    local = invalid_argument(
        f + ": v_local.shape[2] = " + std::to_string(v_local.shape[2]) +
        " must equal k_local.shape[2] (num_kv_heads) = " + std::to_string(k_local.shape[2]));
  const bool shaped = local.ok();
  const int64_t B = shaped ? q_local.shape[0] : 0, n = shaped ? q_local.shape[1] : 0,
                H = shaped ? q_local.shape[2] : 0, K = shaped ? k_local.shape[2] : 0,
                D = shaped ? q_local.shape[3] : 0, Dv = shaped ? v_local.shape[3] : 0;
  const int64_t out_shape[] = {B, n, H, Dv}, lse_shape[] = {B, H, n};
  if (local.ok())
    local = internal::check_output(kFn, "out_local", out_local, out_shape,
                                   "[batch, n, num_heads, head_dim_v]", false);
  if (local.ok())
    local = internal::check_output(kFn, "lse_local", lse_local, lse_shape, "[batch, num_heads, n]",
                                   true);

  // ---- scratch: accumulators, one partial, two K/V blocks ---------------
  // Uninitialised: step 0 writes every accumulator row, a partial is
  // written before it is read, and a block is packed or received whole. A
  // block holds K then V of a rank's tokens, contiguous; with ring_chunks'
  // layout no rank has more than two tokens more than this one.
  const size_t elt = shaped ? dtype_size(k_local.dtype) : 0;
  const int64_t per_token = K * (D + Dv);
  const auto round_up = [](size_t bytes) { return (bytes + 63) / 64 * 64; };
  const size_t out_bytes = round_up(static_cast<size_t>(B * n * H * Dv) * sizeof(float)),
               lse_bytes = round_up(static_cast<size_t>(B * H * n) * sizeof(float)),
               block_bytes = round_up(static_cast<size_t>(B * (n + 2) * per_token) * elt);
  char* base = nullptr;
  if (local.ok()) {
    Result<char*> s =
        internal::thread_scratch(kFn, 2 * out_bytes + 2 * lse_bytes + 2 * block_bytes);
    if (s.ok())
      base = *s;
    else
      local = s.status();
  }
  const auto at = [&](size_t offset) { return base ? base + offset : nullptr; };
  float* acc_out = reinterpret_cast<float*>(at(0));
  float* part_out = reinterpret_cast<float*>(at(out_bytes));
  float* acc_lse = reinterpret_cast<float*>(at(2 * out_bytes));
  float* part_lse = reinterpret_cast<float*>(at(2 * out_bytes + lse_bytes));
  char* blocks[2] = {at(2 * out_bytes + 2 * lse_bytes),
                     at(2 * out_bytes + 2 * lse_bytes + block_bytes)};

  // ---- agreement: shapes, options, and the token layout -----------------
  const int64_t facts[] = {B,
                           H,
                           K,
                           D,
                           Dv,
                           shaped ? static_cast<int64_t>(k_local.dtype) : 0,
                           options.causal ? 1 : 0,
                           float_bits(options.softmax_scale),
                           float_bits(options.softcap),
                           n};
  Result<Agreement> a = Agreement::reach(comm, kFn, local, facts);
  if (!a.ok()) return a.status();
  for (size_t i = 0; i < kTokens; ++i) ATTNKIT_RETURN_IF_ERROR(a->same(i, kFactNames[i]));
  std::vector<int64_t> tokens(static_cast<size_t>(ranks));
  int64_t seqlen = 0, most = 0;
  for (int r = 0; r < ranks; ++r) {
    tokens[static_cast<size_t>(r)] = a->fact(r, kTokens);
    seqlen += tokens[static_cast<size_t>(r)];
    most = std::max(most, tokens[static_cast<size_t>(r)]);
  }
  std::vector<RingChunks> chunks(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    chunks[static_cast<size_t>(r)] = *ring_chunks(seqlen, ranks, r);
    if (chunks[static_cast<size_t>(r)].size() != tokens[static_cast<size_t>(r)])
      return invalid_argument(
          f + ": q_local.shape[1] (n) = " + std::to_string(tokens[static_cast<size_t>(r)]) +
          " on rank " + std::to_string(r) +
          " does not fit the layout: of seqlen = " + std::to_string(seqlen) + " tokens over " +
          std::to_string(ranks) + " ranks, ring_chunks gives rank " + std::to_string(r) + " " +
          std::to_string(chunks[static_cast<size_t>(r)].size()));
  }
  if (B * most * per_token > std::numeric_limits<int>::max())
    return invalid_argument(f +
                            ": a K/V block of batch * n * num_kv_heads * (head_dim + "
                            "head_dim_v) = " +
                            std::to_string(B * most * per_token) +
                            " elements must fit an int (one MPI message); split the batch");
  if (seqlen == 0 || B == 0) return Status::Ok();

  // ---- the ring ------------------------------------------------------------
  const MPI_Datatype wire = elt == 4 ? MPI_FLOAT : MPI_UINT16_T;
  const int right = (rank + 1) % ranks, left = (rank + ranks - 1) % ranks;
  pack(k_local, elt, blocks[0]);
  pack(v_local, elt, blocks[0] + B * n * K * D * static_cast<int64_t>(elt));

  AttentionOptions opt;
  opt.softmax_scale = options.softmax_scale;
  opt.softcap = options.softcap;
  opt.backend = options.backend;
  opt.num_threads = options.num_threads;
  const TensorView q_all = q_local, acc_o = make_view(acc_out, DType::kF32, {B, n, H, Dv}),
                   acc_l = make_view(acc_lse, DType::kF32, {B, H, n}),
                   part_o = make_view(part_out, DType::kF32, {B, n, H, Dv}),
                   part_l = make_view(part_lse, DType::kF32, {B, H, n});
  const int64_t a_len = chunks[static_cast<size_t>(rank)].first.size();
  Status compute;  // the first local failure; the ring goes on regardless
  MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  Status comm_st;
  const auto progress = [&] {
    int done = 0;
    if (reqs[0] != MPI_REQUEST_NULL || reqs[1] != MPI_REQUEST_NULL)
      MPI_Testall(2, reqs, &done, MPI_STATUSES_IGNORE);
  };
  // Queries [q0, q1) against keys [k0, k1) of `block` (holding n_src
  // tokens). Step 0 attends every query row once (its own block), straight
  // into the accumulators; later steps merge a partial into them.
  const auto attend = [&](const char* block, int64_t n_src, int64_t q0, int64_t q1, int64_t k0,
                          int64_t k1, bool causal, bool first) {
    if (!compute.ok() || q1 <= q0 || k1 <= k0) return;
    TensorView kb = make_view(block, k_local.dtype, {B, n_src, K, D});
    TensorView vb = make_view(block + B * n_src * K * D * static_cast<int64_t>(elt), k_local.dtype,
                              {B, n_src, K, Dv});
    opt.causal = causal;
    const TensorView& o = first ? acc_o : part_o;
    const TensorView& l = first ? acc_l : part_l;
    compute = sdpa(rows_of(q_all, q0, q1), rows_of(kb, k0, k1), rows_of(vb, k0, k1),
                   rows_of(o, q0, q1), opt, lse_rows_of(l, q0, q1));
    if (compute.ok() && !first)
      compute = merge_attention_states(rows_of(acc_o, q0, q1), lse_rows_of(acc_l, q0, q1),
                                       rows_of(part_o, q0, q1), lse_rows_of(part_l, q0, q1),
                                       rows_of(acc_o, q0, q1), lse_rows_of(acc_l, q0, q1));
    if (!compute.ok()) compute = Status(compute.code(), f + ": " + compute.message());
    progress();
  };
  for (int t = 0; t < ranks && comm_st.ok(); ++t) {
    const int src = (rank - t + ranks) % ranks;
    const int64_t n_src = tokens[static_cast<size_t>(src)];
    char* cur = blocks[t % 2];
    if (t + 1 < ranks) {
      const int from = (src + ranks - 1) % ranks;  // whose block arrives next
      const int64_t n_next = tokens[static_cast<size_t>(from)];
      comm_st = mpi_status(kFn, "MPI_Irecv",
                           MPI_Irecv(blocks[(t + 1) % 2], static_cast<int>(B * n_next * per_token),
                                     wire, left, kRingTag, comm, &reqs[0]));
      if (comm_st.ok())
        comm_st = mpi_status(kFn, "MPI_Isend",
                             MPI_Isend(cur, static_cast<int>(B * n_src * per_token), wire, right,
                                       kRingTag, comm, &reqs[1]));
    }
    const int64_t c1 = chunks[static_cast<size_t>(src)].first.size();
    const bool first = t == 0;
    if (!options.causal)
      attend(cur, n_src, 0, n, 0, n_src, false, first);
    else if (src == rank) {
      attend(cur, n_src, 0, a_len, 0, a_len, true, first);
      attend(cur, n_src, a_len, n, 0, n_src, true, first);
    } else if (src < rank) {
      attend(cur, n_src, 0, n, 0, c1, false, first);
    } else {
      attend(cur, n_src, a_len, n, 0, n_src, false, first);
    }
    if (comm_st.ok() && t + 1 < ranks)
      comm_st = mpi_status(kFn, "MPI_Waitall", MPI_Waitall(2, reqs, MPI_STATUSES_IGNORE));
  }
  ATTNKIT_RETURN_IF_ERROR(comm_st);
  ATTNKIT_RETURN_IF_ERROR(internal::agree(comm, kFn, compute));
  if (n == 0) return Status::Ok();
  std::memcpy(out_local.data, acc_out, static_cast<size_t>(B * n * H * Dv) * sizeof(float));
  if (lse_local.present())
    std::memcpy(lse_local.data, acc_lse, static_cast<size_t>(B * H * n) * sizeof(float));
  return Status::Ok();
}

}  // namespace attnkit::dist
