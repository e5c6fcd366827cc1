// Context-parallel decode: each rank attends over its own keys with sdpa()
// and returns its log-sum-exp; the ranks' partials are merged with
// merge_attention_states in one collective.
//
// A partial travels as one packed f32 buffer of R = batch * seqlen_q *
// num_heads rows: first the R output rows of head_dim_v values, then the R
// log-sum-exps, both in (batch, query, head) order, so that row i of one
// block pairs with entry i of the other. The custom MPI operation sees the
// whole buffer as a single element of an MPI_Type_vector(R, head_dim_v + 1,
// head_dim_v + 1, MPI_FLOAT): covering the buffer exactly, and recording R
// and head_dim_v in its envelope, which the operation reads back with
// MPI_Type_get_contents (no global state, so concurrent calls with
// different shapes cannot mix).
#include <cmath>
#include <cstring>
#include <limits>
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

constexpr const char* kMerge = "merge_partial_attention";
constexpr const char* kDecode = "context_parallel_decode";

// The packed partial of `rows` rows of `dv` values.
struct Packed {
  int64_t rows = 0, dv = 0;
  Tensor buffer;    // [rows * dv + rows] f32
  Tensor gathered;  // [ranks, rows * dv + rows] f32, for MergeMethod::kAllgather only
  float* out() const { return buffer.ptr<float>(); }
  float* lse() const { return buffer.ptr<float>() + rows * dv; }
  int64_t floats() const { return rows * (dv + 1); }
};

// Allocates a packed partial, and with gather_ranks > 0 kAllgather's receive
// buffer for that many ranks too, before the agreement, so that an
// allocation failure is agreed on.
Status pack_alloc(const char* fn, int64_t rows, int64_t dv, int gather_ranks, Packed* p) {
  const auto alloc = [&](int64_t n, Tensor* t) {
    Result<Tensor> r = Tensor::zeros(DType::kF32, {n});
    if (!r.ok()) return Status(r.status().code(), std::string(fn) + ": " + r.status().message());
    *t = std::move(r).value();
    return Status::Ok();
  };
  p->rows = rows;
  p->dv = dv;
  ATTNKIT_RETURN_IF_ERROR(alloc(p->floats(), &p->buffer));
  if (gather_ranks > 0) ATTNKIT_RETURN_IF_ERROR(alloc(p->floats() * gather_ranks, &p->gathered));
  return Status::Ok();
}

// Views of a packed buffer in merge_attention_states' layouts: out as
// [rows, 1, 1, dv] and lse as [rows, 1, 1].
TensorView out_view(float* base, int64_t rows, int64_t dv) {
  return make_view(base, DType::kF32, {rows, 1, 1, dv});
}
TensorView lse_view(float* base, int64_t rows, int64_t dv) {
  return make_view(base + rows * dv, DType::kF32, {rows, 1, 1});
}

// The MPI operation: inout = merge(inout, in), for every element of the
// datatype built by merge_type().
void merge_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  int ints[3] = {0, 0, 0};
  MPI_Aint addrs[1];
  MPI_Datatype old[1];
  MPI_Type_get_contents(*type, 3, 0, 1, ints, addrs, old);
  const int64_t rows = ints[0], dv = ints[1] - 1;
  for (int e = 0; e < *len; ++e) {
    float* a = static_cast<float*>(inout) + e * rows * (dv + 1);
    float* b = static_cast<float*>(in) + e * rows * (dv + 1);
    // Cannot fail: the views are well-formed by construction, and out/lse
    // alias exactly out_a/lse_a, which the function allows.
    (void)merge_attention_states(out_view(a, rows, dv), lse_view(a, rows, dv),
                                 out_view(b, rows, dv), lse_view(b, rows, dv),
                                 out_view(a, rows, dv), lse_view(a, rows, dv));
  }
}

// Merges every rank's packed partial into `p`, on every rank.
Status merge_collective(MPI_Comm comm, const char* fn, MergeMethod method, Packed* p) {
  const int count = static_cast<int>(p->floats());
  if (method == MergeMethod::kAllgather) {
    const int ranks = static_cast<int>(p->gathered.numel() / count);
    ATTNKIT_RETURN_IF_ERROR(mpi_status(
        fn, "MPI_Allgather",
        MPI_Allgather(p->out(), count, MPI_FLOAT, p->gathered.data(), count, MPI_FLOAT, comm)));
    // Rank order on every rank, so every rank computes the same bits.
    float* acc = p->gathered.ptr<float>();
    for (int r = 1; r < ranks; ++r) {
      float* next = acc + static_cast<int64_t>(r) * count;
      (void)merge_attention_states(out_view(acc, p->rows, p->dv), lse_view(acc, p->rows, p->dv),
                                   out_view(next, p->rows, p->dv), lse_view(next, p->rows, p->dv),
                                   out_view(acc, p->rows, p->dv), lse_view(acc, p->rows, p->dv));
    }
    std::memcpy(p->out(), acc, static_cast<size_t>(count) * sizeof(float));
    return Status::Ok();
  }
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  int rc = MPI_Type_vector(static_cast<int>(p->rows), static_cast<int>(p->dv + 1),
                           static_cast<int>(p->dv + 1), MPI_FLOAT, &type);
  if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&type);
  // Commutative: merging a with b gives the same bits as b with a (every
  // step of merge_attention_states is symmetric in its two inputs).
  if (rc == MPI_SUCCESS) rc = MPI_Op_create(&merge_op, 1, &op);
  if (rc == MPI_SUCCESS) rc = MPI_Allreduce(MPI_IN_PLACE, p->out(), 1, type, op, comm);
  if (op != MPI_OP_NULL) MPI_Op_free(&op);
  if (type != MPI_DATATYPE_NULL) MPI_Type_free(&type);
  return mpi_status(fn, "MPI_Allreduce (merge)", rc);
}

// Copies the merged packed rows into out [B, Tq, H, Dv] and lse [B, H, Tq].
void unpack(const Packed& p, int64_t B, int64_t Tq, int64_t H, const TensorView& out,
            const TensorView& lse) {
  std::memcpy(out.data, p.out(), static_cast<size_t>(p.rows * p.dv) * sizeof(float));
  if (!lse.present()) return;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tq; ++t)
      for (int64_t h = 0; h < H; ++h)
        lse.ptr<float>()[(b * H + h) * Tq + t] = p.lse()[(b * Tq + t) * H + h];
}

Status check_method(const char* fn, MergeMethod m) {
  if (m == MergeMethod::kAllreduce || m == MergeMethod::kAllgather) return Status::Ok();
  return invalid_argument(std::string(fn) + ": merge method " +
                          std::to_string(static_cast<int>(m)) + " is not a MergeMethod value");
}

Status check_rows(const char* fn, int64_t rows, int64_t dv) {
  if (rows * (dv + 1) <= std::numeric_limits<int>::max()) return Status::Ok();
  return invalid_argument(std::string(fn) + ": batch * seqlen_q * num_heads * (head_dim_v + 1) = " +
                          std::to_string(rows * (dv + 1)) +
                          " must fit an int (one MPI message); split the call");
}

// The facts the ranks' partials must agree on: their shape.
constexpr const char* kShapeNames[] = {"batch", "seqlen_q", "num_heads", "head_dim_v"};

Status agree_and_merge(MPI_Comm comm, const char* fn, Status local, const int64_t (&shape)[4],
                       std::span<const int64_t> more, std::span<const char* const> more_names,
                       MergeMethod method, Packed* p, const TensorView& out,
                       const TensorView& lse) {
  std::vector<int64_t> facts(shape, shape + 4);
  facts.insert(facts.end(), more.begin(), more.end());
  Result<Agreement> a = Agreement::reach(comm, fn, local, facts);
  if (!a.ok()) return a.status();
  for (size_t i = 0; i < 4; ++i) ATTNKIT_RETURN_IF_ERROR(a->same(i, kShapeNames[i]));
  for (size_t i = 0; i < more.size(); ++i) ATTNKIT_RETURN_IF_ERROR(a->same(4 + i, more_names[i]));
  if (p->rows == 0) return Status::Ok();
  ATTNKIT_RETURN_IF_ERROR(merge_collective(comm, fn, method, p));
  unpack(*p, shape[0], shape[1], shape[2], out, lse);
  return Status::Ok();
}

}  // namespace

Status merge_partial_attention(MPI_Comm comm, const TensorView& out_local_arg,
                               const TensorView& lse_local_arg, const TensorView& out_arg,
                               const TensorView& lse_arg, MergeMethod method) {
  const TensorView out_local = internal::with_placeholder_if_empty(out_local_arg),
                   lse_local = internal::with_placeholder_if_empty(lse_local_arg),
                   out = internal::with_placeholder_if_empty(out_arg),
                   lse = internal::with_placeholder_if_empty(lse_arg);
  int rank = 0, ranks = 0;
  ATTNKIT_RETURN_IF_ERROR(check_comm(kMerge, comm, &rank, &ranks));
  const bool shaped = out_local.present() && out_local.rank == 4;
  const int64_t shape[4] = {shaped ? out_local.shape[0] : 0, shaped ? out_local.shape[1] : 0,
                            shaped ? out_local.shape[2] : 0, shaped ? out_local.shape[3] : 0};
  const int64_t lse_shape[3] = {shape[0], shape[2], shape[1]};
  Status local = check_method(kMerge, method);
  if (local.ok() && !shaped)
    local = invalid_argument(std::string(kMerge) + ": out_local " + out_local.describe() +
                             " must be f32 [batch, seqlen_q, num_heads, head_dim_v]");
  if (local.ok())
    local = internal::check_output(kMerge, "out", out, shape,
                                   "[batch, seqlen_q, num_heads, head_dim_v]", false);
  if (local.ok())
    local =
        internal::check_output(kMerge, "lse", lse, lse_shape, "[batch, num_heads, seqlen_q]", true);
  const int64_t rows = shape[0] * shape[1] * shape[2];
  if (local.ok()) local = check_rows(kMerge, rows, shape[3]);
  Packed p;
  if (local.ok())
    local = pack_alloc(kMerge, rows, shape[3], method == MergeMethod::kAllgather ? ranks : 0, &p);
  if (local.ok() && rows > 0) {
    // Copy into the packed layout through merge_attention_states itself,
    // merging with an empty state (lse -inf): it validates out_local and
    // lse_local (dtype, shape, strides) and copies the rows exactly.
    Packed empty;
    local = pack_alloc(kMerge, rows, shape[3], 0, &empty);
    if (local.ok()) {
      std::fill(empty.lse(), empty.lse() + rows, -std::numeric_limits<float>::infinity());
      const int64_t B = shape[0], T = shape[1], H = shape[2], Dv = shape[3];
      const TensorView po =
          make_view(p.out(), DType::kF32, {B, T, H, Dv});          // [batch, seqlen_q, heads, dv]
      TensorView pl = make_view(p.lse(), DType::kF32, {B, H, T});  // stored (b, t, h)
      pl.strides = {T * H, 1, H, 0};
      const TensorView eo = make_view(empty.out(), DType::kF32, {B, T, H, Dv});
      TensorView el = make_view(empty.lse(), DType::kF32, {B, H, T});
      el.strides = pl.strides;
      local = merge_attention_states(out_local, lse_local, eo, el, po, pl);
      if (!local.ok()) local = Status(local.code(), std::string(kMerge) + ": " + local.message());
    }
  }
  return agree_and_merge(comm, kMerge, local, shape, {}, {}, method, &p, out, lse);
}

Status context_parallel_decode(MPI_Comm comm, const TensorView& q_arg,
                               const TensorView& k_local_arg, const TensorView& v_local_arg,
                               const TensorView& out_arg, const ContextParallelOptions& options,
                               const TensorView& lse_arg) {
  const TensorView q = internal::with_placeholder_if_empty(q_arg),
                   k_local = internal::with_placeholder_if_empty(k_local_arg),
                   v_local = internal::with_placeholder_if_empty(v_local_arg),
                   out = internal::with_placeholder_if_empty(out_arg),
                   lse = internal::with_placeholder_if_empty(lse_arg);
  int rank = 0, ranks = 0;
  ATTNKIT_RETURN_IF_ERROR(check_comm(kDecode, comm, &rank, &ranks));
  const std::string f = kDecode;
  Status local = check_method(kDecode, options.merge);
  if (local.ok() && (!q.present() || q.rank != 4))
    local = invalid_argument(f + ": q " + q.describe() +
                             " must be [batch, seqlen_q, num_heads, head_dim]");
  if (local.ok() && (!v_local.present() || v_local.rank != 4))
    local = invalid_argument(f + ": v_local " + v_local.describe() +
                             " must be [batch, seqlen_k, num_kv_heads, head_dim_v]");
  const bool shaped = local.ok();
  const int64_t shape[4] = {shaped ? q.shape[0] : 0, shaped ? q.shape[1] : 0,
                            shaped ? q.shape[2] : 0, shaped ? v_local.shape[3] : 0};
  const int64_t lse_shape[3] = {shape[0], shape[2], shape[1]};
  const int64_t B = shape[0], T = shape[1], H = shape[2], Dv = shape[3];
  if (local.ok())
    local = internal::check_output(kDecode, "out", out, shape,
                                   "[batch, seqlen_q, num_heads, head_dim_v]", false);
  if (local.ok())
    local = internal::check_output(kDecode, "lse", lse, lse_shape, "[batch, num_heads, seqlen_q]",
                                   true);
  if (local.ok()) local = check_rows(kDecode, B * T * H, Dv);
  Packed p;
  if (local.ok())
    local = pack_alloc(kDecode, B * T * H, Dv, options.merge == MergeMethod::kAllgather ? ranks : 0,
                       &p);
  if (local.ok() && B * T * H > 0) {
    // The local partial straight into the packed layout; sdpa validates
    // q, k_local, v_local and the options.
    AttentionOptions opt;
    opt.softmax_scale = options.softmax_scale;
    opt.softcap = options.softcap;
    opt.seqlens_k = options.seqlens_k;
    opt.backend = options.backend;
    opt.num_threads = options.num_threads;
    const TensorView po = make_view(p.out(), DType::kF32, {B, T, H, Dv});
    TensorView pl = make_view(p.lse(), DType::kF32, {B, H, T});
    pl.strides = {T * H, 1, H, 0};  // (b, t, h) order, as the output rows
    local = sdpa(q, k_local, v_local, po, opt, pl);
    if (!local.ok()) local = Status(local.code(), f + ": " + local.message());
  }
  // head_dim and num_kv_heads must match too, or the ranks attend different
  // things; the dtype need not (each rank reads its own keys).
  const int64_t more[] = {shaped ? q.shape[3] : 0, shaped ? v_local.shape[2] : 0};
  const char* const more_names[] = {"head_dim", "num_kv_heads"};
  return agree_and_merge(comm, kDecode, local, shape, more, more_names, options.merge, &p, out,
                         lse);
}

}  // namespace attnkit::dist
