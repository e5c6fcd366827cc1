// Ring attention against the float64 attention oracle and the
// single-process sdpa over the whole sequence: GQA, MQA and MHA shapes,
// head_dim_v != head_dim, bf16 keys, softcap, causal or not, with even,
// uneven and partly empty chunks; decode after a ring prefill through the
// ranks' own K/V; and errors on one rank, before or during the ring, that
// fail every rank without a hang and leave the outputs untouched.
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/dist.h"
#include "attnkit/parallel_cost.h"
#include "dist/dist_testing.h"

namespace {

using attnkit::DType;
using attnkit::Status;
using attnkit::dist::RingOptions;
using namespace attnkit_dist_test;

struct RingCase {
  const char* name;
  int64_t B, H, K, D, Dv;
  bool causal, bf16;
  float softcap;
};
constexpr RingCase kRingCases[] = {
    {"gqa_causal", 2, 4, 2, 16, 16, true, false, 0.0f},
    {"mqa_causal_dv_softcap", 1, 4, 1, 8, 12, true, false, 4.0f},
    {"mha_full", 1, 3, 3, 8, 8, false, false, 0.0f},
    {"gqa_causal_bf16", 1, 4, 2, 8, 8, true, true, 0.0f},
};

std::vector<int64_t> ring_tokens(int64_t S, int ranks, int rank) {
  const attnkit::RingChunks c = *attnkit::ring_chunks(S, ranks, rank);
  std::vector<int64_t> t;
  for (const attnkit::TokenRange& r : {c.first, c.second})
    for (int64_t i = r.begin; i < r.end; ++i) t.push_back(i);
  return t;
}

TEST(RingAttention, EvenUnevenAndEmptyChunksMatchTheWholeSequence) {
  const int rank = world_rank(), ranks = world_size();
  for (const RingCase& c : kRingCases)
    for (int64_t S : {int64_t(6 * ranks), int64_t(6 * ranks + 5), int64_t(ranks + 1), int64_t(1)}) {
      SCOPED_TRACE(std::string(c.name) + " S " + std::to_string(S));
      const int64_t B = c.B, H = c.H, K = c.K, D = c.D, Dv = c.Dv;
      const std::vector<float> q = uniform(size_t(B * S * H * D), 31);
      std::vector<float> k = uniform(size_t(B * S * K * D), 32),
                         v = uniform(size_t(B * S * K * Dv), 33);
      if (c.bf16) {
        k = round_bf16(k);
        v = round_bf16(v);
      }
      const attnkit_test::OracleResult ref =
          oracle({B, S, S, H, K, D, Dv}, q, k, v, c.causal, c.softcap);
      const std::vector<attnkit::bf16> kb = to_bf16(k), vb = to_bf16(v);
      const DType kvt = c.bf16 ? DType::kBF16 : DType::kF32;
      attnkit::AttentionOptions opt;
      opt.causal = c.causal;
      opt.softcap = c.softcap;
      std::vector<float> single(size_t(B * S * H * Dv)), single_lse(size_t(B * H * S));
      ASSERT_TRUE(
          attnkit::sdpa(attnkit::make_view(q.data(), DType::kF32, {B, S, H, D}),
                        attnkit::make_view(c.bf16 ? static_cast<const void*>(kb.data()) : k.data(),
                                           kvt, {B, S, K, D}),
                        attnkit::make_view(c.bf16 ? static_cast<const void*>(vb.data()) : v.data(),
                                           kvt, {B, S, K, Dv}),
                        attnkit::make_view(single.data(), DType::kF32, {B, S, H, Dv}), opt,
                        attnkit::make_view(single_lse.data(), DType::kF32, {B, H, S}))
              .ok());

      const std::vector<int64_t> mine = ring_tokens(S, ranks, rank);
      const int64_t n = int64_t(mine.size());
      const std::vector<float> ql = take(q, B, S, H * D, mine), kl = take(k, B, S, K * D, mine),
                               vl = take(v, B, S, K * Dv, mine);
      const std::vector<attnkit::bf16> klb = to_bf16(kl), vlb = to_bf16(vl);
      std::vector<float> got(size_t(B * n * H * Dv)), got_lse(size_t(B * H * n));
      RingOptions ro;
      ro.causal = c.causal;
      ro.softcap = c.softcap;
      const Status st = attnkit::dist::ring_attention(
          MPI_COMM_WORLD, attnkit::make_view(ql.data(), DType::kF32, {B, n, H, D}),
          attnkit::make_view(c.bf16 ? static_cast<const void*>(klb.data()) : kl.data(), kvt,
                             {B, n, K, D}),
          attnkit::make_view(c.bf16 ? static_cast<const void*>(vlb.data()) : vl.data(), kvt,
                             {B, n, K, Dv}),
          attnkit::make_view(got.data(), DType::kF32, {B, n, H, Dv}), ro,
          attnkit::make_view(got_lse.data(), DType::kF32, {B, H, n}));
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_TRUE(within_twice_single("out", got, take(single, B, S, H * Dv, mine),
                                      take(ref.out, B, S, H * Dv, mine), std::max(D, S)));
      EXPECT_TRUE(within_twice_single("lse", got_lse, take_lse(single_lse, B * H, S, mine),
                                      take_lse(ref.lse, B * H, S, mine), std::max(D, S)));
    }
}

TEST(RingAttention, DecodeAfterRingPrefillThroughEachRanksKeys) {
  // Ring prefill of S tokens; each rank keeps the K/V of its chunks, decode
  // token j's K/V joins rank j mod N, and context_parallel_decode attends
  // the new query over every rank's keys: the rows of a causal pass over
  // all S + 3 tokens.
  const int rank = world_rank(), ranks = world_size();
  const int64_t B = 1, H = 4, K = 2, D = 8, S = 4 * ranks + 3, total = S + 3;
  const std::vector<float> q = uniform(size_t(B * total * H * D), 41),
                           k = uniform(size_t(B * total * K * D), 42),
                           v = uniform(size_t(B * total * K * D), 43);
  const attnkit_test::OracleResult ref = oracle({B, total, total, H, K, D, D}, q, k, v, true);
  attnkit::AttentionOptions opt;
  opt.causal = true;
  std::vector<float> single(size_t(total * H * D));
  ASSERT_TRUE(attnkit::sdpa(attnkit::make_view(q.data(), DType::kF32, {B, total, H, D}),
                            attnkit::make_view(k.data(), DType::kF32, {B, total, K, D}),
                            attnkit::make_view(v.data(), DType::kF32, {B, total, K, D}),
                            attnkit::make_view(single.data(), DType::kF32, {B, total, H, D}), opt)
                  .ok());

  std::vector<int64_t> mine = ring_tokens(S, ranks, rank);
  const std::vector<float> ql = take(q, B, total, H * D, mine);
  std::vector<float> got(size_t(mine.size() * H * D));
  const int64_t n = int64_t(mine.size());
  {
    const std::vector<float> kl = take(k, B, total, K * D, mine),
                             vl = take(v, B, total, K * D, mine);
    ASSERT_TRUE(attnkit::dist::ring_attention(
                    MPI_COMM_WORLD, attnkit::make_view(ql.data(), DType::kF32, {B, n, H, D}),
                    attnkit::make_view(kl.data(), DType::kF32, {B, n, K, D}),
                    attnkit::make_view(vl.data(), DType::kF32, {B, n, K, D}),
                    attnkit::make_view(got.data(), DType::kF32, {B, n, H, D}))
                    .ok());
  }
  EXPECT_TRUE(within_twice_single("prefill", got, take(single, B, total, H * D, mine),
                                  take(ref.out, B, total, H * D, mine), S));
  for (int64_t j = 0; j < 3; ++j) {
    const int64_t t = S + j;
    if (j % ranks == rank) mine.push_back(t);
    const int64_t m = int64_t(mine.size());
    const std::vector<float> kl = take(k, B, total, K * D, mine),
                             vl = take(v, B, total, K * D, mine);
    const std::vector<float> qt = take(q, B, total, H * D, {t});
    std::vector<float> out(size_t(H * D));
    ASSERT_TRUE(attnkit::dist::context_parallel_decode(
                    MPI_COMM_WORLD, attnkit::make_view(qt.data(), DType::kF32, {B, 1, H, D}),
                    attnkit::make_view(kl.data(), DType::kF32, {B, m, K, D}),
                    attnkit::make_view(vl.data(), DType::kF32, {B, m, K, D}),
                    attnkit::make_view(out.data(), DType::kF32, {B, 1, H, D}))
                    .ok());
    EXPECT_TRUE(within_twice_single("decode " + std::to_string(j), out,
                                    take(single, B, total, H * D, {t}),
                                    take(ref.out, B, total, H * D, {t}), total));
  }
}

TEST(RingAttention, ErrorsOnOneRankFailEveryRankWithoutAHang) {
  const int rank = world_rank(), ranks = world_size(), last = ranks - 1;
  const int64_t B = 1, H = 2, K = 1, D = 4, S = 4 * ranks;
  const int64_t n = ring_tokens(S, ranks, rank).size();
  std::vector<float> q = uniform(size_t((n + 1) * H * D), 1),
                     k = uniform(size_t((n + 1) * K * D), 2),
                     v = uniform(size_t((n + 1) * K * D), 3);
  std::vector<float> out(size_t((n + 1) * H * D), 42.0f);
  const auto call = [&](int64_t rows, const RingOptions& ro) {
    return attnkit::dist::ring_attention(
        MPI_COMM_WORLD, attnkit::make_view(q.data(), DType::kF32, {B, rows, H, D}),
        attnkit::make_view(k.data(), DType::kF32, {B, rows, K, D}),
        attnkit::make_view(v.data(), DType::kF32, {B, rows, K, D}),
        attnkit::make_view(out.data(), DType::kF32, {B, rows, H, D}), ro);
  };
  const std::vector<float> untouched(out.size(), 42.0f);
  // One token too many on the last rank: it does not fit the layout (one
  // rank holds the whole sequence, whatever its length).
  Status st;
  if (ranks > 1) {
    st = call(rank == last ? n + 1 : n, {});
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("does not fit the layout"), std::string::npos) << st.message();
    EXPECT_EQ(out, untouched);
  }
  // An option only sdpa checks, bad on the last rank: it fails mid-ring,
  // keeps forwarding blocks, and the end agreement fails every rank.
  RingOptions bad;
  if (rank == last) bad.backend = static_cast<attnkit::Backend>(9);
  st = call(n, bad);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("backend"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("(on rank " + std::to_string(last) + " of"), std::string::npos)
      << st.message();
  EXPECT_EQ(out, untouched);
  if (ranks > 1) {
    RingOptions capped;
    if (rank == 1) capped.softcap = 2.0f;
    st = call(n, capped);
    EXPECT_NE(st.message().find("options.softcap (bits) = 0 on rank 0 but"), std::string::npos)
        << st.message();
    EXPECT_EQ(out, untouched);
  }
}

}  // namespace
