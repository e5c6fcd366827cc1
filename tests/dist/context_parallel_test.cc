// Context-parallel decode against the float64 attention oracle and the
// single-process sdpa over all keys: GQA, MQA and MHA shapes, head_dim_v !=
// head_dim, bf16 keys, softcap, token splits that are contiguous,
// round-robin, uneven, empty on a rank or ragged per sequence, both merge
// methods; the merge alone on a partial computed elsewhere; and collective
// errors that leave the output untouched.
#include <gtest/gtest.h>
#include <mpi.h>

#include <limits>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/dist.h"
#include "attnkit/paged_kv_cache.h"
#include "dist/dist_testing.h"

namespace {

using attnkit::DType;
using attnkit::Status;
using attnkit::TensorView;
using attnkit::dist::ContextParallelOptions;
using attnkit::dist::MergeMethod;
using namespace attnkit_dist_test;

struct Shape {
  const char* name;
  int64_t B, H, K, D, Dv;
  float softcap;
  bool bf16;
};
constexpr Shape kShapes[] = {
    {"gqa", 2, 8, 2, 16, 16, 0.0f, false},
    {"mqa_dv_softcap", 1, 4, 1, 8, 12, 5.0f, false},
    {"mha", 2, 3, 3, 8, 8, 0.0f, false},
    {"gqa_bf16", 1, 4, 2, 16, 8, 0.0f, true},
};

// The tokens of [0, S) this rank holds under a split.
std::vector<int64_t> share(const std::string& split, int64_t S, int rank, int ranks) {
  std::vector<int64_t> t;
  for (int64_t i = 0; i < S; ++i) {
    int owner = 0;
    if (split == "contiguous") owner = int(i * ranks / S);
    if (split == "round_robin") owner = int(i % ranks);
    // The last rank holds nothing (when there are others to hold it all).
    if (split == "empty_last") owner = ranks == 1 ? 0 : int(i * (ranks - 1) / S);
    if (owner == rank) t.push_back(i);
  }
  return t;
}

TEST(ContextParallelDecode, EverySplitAndMergeMatchesTheWholeSequence) {
  const int rank = world_rank(), ranks = world_size();
  for (const Shape& s : kShapes)
    for (const char* split : {"contiguous", "round_robin", "empty_last"})
      for (MergeMethod method : {MergeMethod::kAllreduce, MergeMethod::kAllgather}) {
        SCOPED_TRACE(std::string(s.name) + " " + split + " merge " + std::to_string(int(method)));
        const int64_t B = s.B, H = s.H, K = s.K, D = s.D, Dv = s.Dv, S = 37, Tq = 2;
        const std::vector<float> q = uniform(size_t(B * Tq * H * D), 1);
        std::vector<float> k = uniform(size_t(B * S * K * D), 2),
                           v = uniform(size_t(B * S * K * Dv), 3);
        if (s.bf16) {
          k = round_bf16(k);
          v = round_bf16(v);
        }
        const attnkit_test::OracleResult ref =
            oracle({B, Tq, S, H, K, D, Dv}, q, k, v, false, s.softcap);

        // Single process, whole sequence, same dtype.
        const std::vector<attnkit::bf16> kb = to_bf16(k), vb = to_bf16(v);
        const DType kvt = s.bf16 ? DType::kBF16 : DType::kF32;
        const void* kp = s.bf16 ? static_cast<const void*>(kb.data()) : k.data();
        const void* vp = s.bf16 ? static_cast<const void*>(vb.data()) : v.data();
        attnkit::AttentionOptions opt;
        opt.softcap = s.softcap;
        std::vector<float> want(size_t(B * Tq * H * Dv)), want_lse(size_t(B * H * Tq));
        const TensorView qv = attnkit::make_view(q.data(), DType::kF32, {B, Tq, H, D});
        ASSERT_TRUE(attnkit::sdpa(qv, attnkit::make_view(kp, kvt, {B, S, K, D}),
                                  attnkit::make_view(vp, kvt, {B, S, K, Dv}),
                                  attnkit::make_view(want.data(), DType::kF32, {B, Tq, H, Dv}), opt,
                                  attnkit::make_view(want_lse.data(), DType::kF32, {B, H, Tq}))
                        .ok());

        // This rank's share.
        const std::vector<int64_t> mine = share(split, S, rank, ranks);
        const int64_t n = int64_t(mine.size());
        const std::vector<float> kl = take(k, B, S, K * D, mine), vl = take(v, B, S, K * Dv, mine);
        const std::vector<attnkit::bf16> klb = to_bf16(kl), vlb = to_bf16(vl);
        const void* klp = s.bf16 ? static_cast<const void*>(klb.data()) : kl.data();
        const void* vlp = s.bf16 ? static_cast<const void*>(vlb.data()) : vl.data();
        std::vector<float> got(want.size()), got_lse(want_lse.size());
        ContextParallelOptions cp;
        cp.softcap = s.softcap;
        cp.merge = method;
        const Status st = attnkit::dist::context_parallel_decode(
            MPI_COMM_WORLD, qv, attnkit::make_view(klp, kvt, {B, n, K, D}),
            attnkit::make_view(vlp, kvt, {B, n, K, Dv}),
            attnkit::make_view(got.data(), DType::kF32, {B, Tq, H, Dv}), cp,
            attnkit::make_view(got_lse.data(), DType::kF32, {B, H, Tq}));
        ASSERT_TRUE(st.ok()) << st.to_string();
        EXPECT_TRUE(within_twice_single("out", got, want, ref.out, std::max(D, S)));
        EXPECT_TRUE(within_twice_single("lse", got_lse, want_lse, ref.lse, std::max(D, S)));
        EXPECT_TRUE(same_on_every_rank(got));
        EXPECT_TRUE(same_on_every_rank(got_lse));
      }
}

TEST(ContextParallelDecode, RaggedBatchThroughSeqlensK) {
  // Sequence 0 has 23 keys, sequence 1 has 6; each rank holds a contiguous
  // share of each, padded to the longest local share.
  const int rank = world_rank(), ranks = world_size();
  const int64_t B = 2, H = 4, K = 2, D = 8, Tq = 1, S = 23;
  const int32_t lengths[2] = {23, 6};
  const std::vector<float> q = uniform(size_t(B * Tq * H * D), 5),
                           k = uniform(size_t(B * S * K * D), 6),
                           v = uniform(size_t(B * S * K * D), 7);
  const attnkit_test::OracleResult ref =
      oracle({B, Tq, S, H, K, D, D}, q, k, v, false, 0.0, {lengths[0], lengths[1]});
  attnkit::AttentionOptions opt;
  opt.seqlens_k = lengths;
  std::vector<float> want(size_t(B * H * D));
  const TensorView qv = attnkit::make_view(q.data(), DType::kF32, {B, Tq, H, D});
  ASSERT_TRUE(attnkit::sdpa(qv, attnkit::make_view(k.data(), DType::kF32, {B, S, K, D}),
                            attnkit::make_view(v.data(), DType::kF32, {B, S, K, D}),
                            attnkit::make_view(want.data(), DType::kF32, {B, Tq, H, D}), opt)
                  .ok());
  // Local [B, pad, K, D]: sequence b's tokens [L_b r / N, L_b (r+1) / N).
  int32_t local_len[2];
  int64_t pad = 0;
  for (int b = 0; b < 2; ++b) {
    local_len[b] = int32_t(lengths[b] * (rank + 1) / ranks - lengths[b] * rank / ranks);
    pad = std::max<int64_t>(pad, local_len[b]);
  }
  std::vector<float> kl(size_t(B * pad * K * D), 0.0f), vl(kl.size(), 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < local_len[b]; ++t) {
      const int64_t src = b * S + lengths[b] * rank / ranks + t;
      std::copy_n(k.begin() + src * K * D, K * D, kl.begin() + (b * pad + t) * K * D);
      std::copy_n(v.begin() + src * K * D, K * D, vl.begin() + (b * pad + t) * K * D);
    }
  ContextParallelOptions cp;
  cp.seqlens_k = local_len;
  std::vector<float> got(want.size());
  ASSERT_TRUE(attnkit::dist::context_parallel_decode(
                  MPI_COMM_WORLD, qv, attnkit::make_view(kl.data(), DType::kF32, {B, pad, K, D}),
                  attnkit::make_view(vl.data(), DType::kF32, {B, pad, K, D}),
                  attnkit::make_view(got.data(), DType::kF32, {B, Tq, H, D}), cp)
                  .ok());
  EXPECT_TRUE(within_twice_single("out", got, want, ref.out, S));
}

TEST(ContextParallelDecode, MergeOfAnyPartialIsTheHookForOtherCaches) {
  // Each rank computes its partial itself (here with sdpa into a strided
  // [B, H, Tq, Dv]-ordered buffer, as another kernel might) and merges it
  // with merge_partial_attention: the result equals context_parallel_decode's.
  const int rank = world_rank(), ranks = world_size();
  const int64_t B = 1, H = 4, K = 2, D = 8, Tq = 3, S = 11;
  const std::vector<float> q = uniform(size_t(B * Tq * H * D), 21),
                           k = uniform(size_t(B * S * K * D), 22),
                           v = uniform(size_t(B * S * K * D), 23);
  const std::vector<int64_t> mine = share("round_robin", S, rank, ranks);
  const int64_t n = int64_t(mine.size());
  const std::vector<float> kl = take(k, B, S, K * D, mine), vl = take(v, B, S, K * D, mine);
  const TensorView qv = attnkit::make_view(q.data(), DType::kF32, {B, Tq, H, D});
  const TensorView klv = attnkit::make_view(kl.data(), DType::kF32, {B, n, K, D});
  const TensorView vlv = attnkit::make_view(vl.data(), DType::kF32, {B, n, K, D});
  std::vector<float> part(size_t(B * H * Tq * D)), part_lse(size_t(B * H * Tq));
  TensorView pv = attnkit::make_view(part.data(), DType::kF32, {B, Tq, H, D});
  pv.strides = {H * Tq * D, D, Tq * D, 1};  // stored [B, H, Tq, D]
  ASSERT_TRUE(attnkit::sdpa(qv, klv, vlv, pv, {},
                            attnkit::make_view(part_lse.data(), DType::kF32, {B, H, Tq}))
                  .ok());
  std::vector<float> merged(size_t(B * Tq * H * D)), direct(merged.size());
  ASSERT_TRUE(attnkit::dist::merge_partial_attention(
                  MPI_COMM_WORLD, pv, attnkit::make_view(part_lse.data(), DType::kF32, {B, H, Tq}),
                  attnkit::make_view(merged.data(), DType::kF32, {B, Tq, H, D}))
                  .ok());
  ASSERT_TRUE(attnkit::dist::context_parallel_decode(
                  MPI_COMM_WORLD, qv, klv, vlv,
                  attnkit::make_view(direct.data(), DType::kF32, {B, Tq, H, D}))
                  .ok());
  EXPECT_EQ(merged, direct);
}

TEST(ContextParallelDecode, ErrorsOnOneRankFailEveryRankAndWriteNothing) {
  const int rank = world_rank(), ranks = world_size(), last = ranks - 1;
  const int64_t B = 1, H = 4, K = 2, D = 8, n = 5;
  std::vector<float> q = uniform(size_t(2 * H * D), 1), k = uniform(size_t(n * K * (D + 1)), 2),
                     v = uniform(size_t(n * K * D), 3);
  std::vector<float> out(size_t(2 * H * D), 42.0f);
  const auto call = [&](int64_t Tq, int64_t kd) {
    return attnkit::dist::context_parallel_decode(
        MPI_COMM_WORLD, attnkit::make_view(q.data(), DType::kF32, {B, Tq, H, D}),
        attnkit::make_view(k.data(), DType::kF32, {B, n, K, kd}),
        attnkit::make_view(v.data(), DType::kF32, {B, n, K, D}),
        attnkit::make_view(out.data(), DType::kF32, {B, Tq, H, D}));
  };
  // The last rank's keys have the wrong head_dim (sdpa's own check).
  Status st = call(1, rank == last ? D + 1 : D);
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(st.message().rfind("context_parallel_decode: sdpa: ", 0) == 0) << st.message();
  EXPECT_NE(st.message().find("(on rank " + std::to_string(last) + " of"), std::string::npos)
      << st.message();
  EXPECT_EQ(out, std::vector<float>(out.size(), 42.0f));
  if (ranks > 1) {
    st = call(rank == 0 ? 1 : 2, D);
    EXPECT_EQ(st.message(),
              "context_parallel_decode: seqlen_q = 1 on rank 0 but 2 on rank 1; every rank must "
              "pass the same");
    EXPECT_EQ(out, std::vector<float>(out.size(), 42.0f));
  }
}

}  // namespace

TEST(ContextParallelDecode, PagedPoolsHoldingSharesAttendWhatTheyHold) {
  // Each rank's PagedKVCache holds a round-robin share of one sequence's
  // tokens; the new query attends each share (attend_held) and the
  // partials merge. Then a decode step: the rank whose turn it is stores
  // the new token's K/V in its pool, and all attend again.
  const int rank = world_rank(), ranks = world_size();
  const int64_t H = 6, K = 2, D = 8, Dv = 12, S = 29;
  const std::vector<float> q = uniform(size_t(2 * H * D), 31), k = uniform(size_t(S * K * D), 32),
                           v = uniform(size_t(S * K * Dv), 33);
  attnkit::PagedKVCacheSpec spec;
  spec.num_pages = 16;
  spec.page_size = 3;
  spec.num_kv_heads = K;
  spec.head_dim = D;
  spec.head_dim_v = Dv;
  auto pool = attnkit::PagedKVCache::create(spec).value();
  const int64_t id = pool.add_sequence();
  const std::vector<int64_t> ids{id};
  // Stores tokens [from, to) that fall to this rank.
  auto hold = [&](int64_t from, int64_t to) {
    std::vector<int64_t> mine;
    for (int64_t t = from; t < to; ++t)
      if (t % ranks == rank) mine.push_back(t);
    const int64_t n = int64_t(mine.size());
    if (n == 0) return;
    ASSERT_TRUE(pool.append(ids, std::vector<int64_t>{n}).ok());
    const std::vector<float> kl = take(k, 1, S, K * D, mine), vl = take(v, 1, S, K * Dv, mine);
    ASSERT_TRUE(pool.store(0, attnkit::make_view(kl.data(), DType::kF32, {n, K, D}),
                           attnkit::make_view(vl.data(), DType::kF32, {n, K, Dv}),
                           std::vector<int32_t>{0, int32_t(n)}, ids)
                    .ok());
  };
  // Query row `row` of q over tokens [0, keys): distributed, single-process
  // and float64.
  auto check = [&](int64_t row, int64_t keys) {
    SCOPED_TRACE("keys " + std::to_string(keys));
    const float* qr = q.data() + row * H * D;
    std::vector<float> part(size_t(H * Dv)), part_lse(static_cast<size_t>(H)), got(part.size());
    ASSERT_TRUE(pool.attend_held(0, attnkit::make_view(qr, DType::kF32, {1, H, D}),
                                 std::vector<int32_t>{0, 1}, ids,
                                 attnkit::make_view(part.data(), DType::kF32, {1, H, Dv}), {},
                                 attnkit::make_view(part_lse.data(), DType::kF32, {H, 1}))
                    .ok());
    ASSERT_TRUE(attnkit::dist::merge_partial_attention(
                    MPI_COMM_WORLD, attnkit::make_view(part.data(), DType::kF32, {1, 1, H, Dv}),
                    attnkit::make_view(part_lse.data(), DType::kF32, {1, H, 1}),
                    attnkit::make_view(got.data(), DType::kF32, {1, 1, H, Dv}))
                    .ok());
    const std::vector<float> qv(qr, qr + H * D), kk(k.begin(), k.begin() + keys * K * D),
        vv(v.begin(), v.begin() + keys * K * Dv);
    const attnkit_test::OracleResult ref = oracle({1, 1, keys, H, K, D, Dv}, qv, kk, vv, false, 0);
    std::vector<float> want(got.size());
    ASSERT_TRUE(attnkit::sdpa(attnkit::make_view(qr, DType::kF32, {1, 1, H, D}),
                              attnkit::make_view(kk.data(), DType::kF32, {1, keys, K, D}),
                              attnkit::make_view(vv.data(), DType::kF32, {1, keys, K, Dv}),
                              attnkit::make_view(want.data(), DType::kF32, {1, 1, H, Dv}))
                    .ok());
    EXPECT_TRUE(within_twice_single("out", got, want, ref.out, std::max(D, keys)));
    EXPECT_TRUE(same_on_every_rank(got));
  };
  hold(0, S - 1);
  check(0, S - 1);
  hold(S - 1, S);  // the decode step's token, on rank (S - 1) % ranks
  check(1, S);
  int64_t held = 0;
  for (int64_t t = 0; t < S; ++t) held += t % ranks == rank;
  EXPECT_EQ(pool.written(id, 0).value(), held);
}
