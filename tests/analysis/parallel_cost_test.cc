// Head and token ownership (every head and token owned exactly once, the
// documented layouts) and the cost model against figures worked out by
// hand in the comments from the published Llama-3-8B and DeepSeek-V3
// configs.
#include "attnkit/parallel_cost.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace attnkit {
namespace {

TEST(HeadShare, EveryQueryHeadOnceAndItsKvHeadOnTheSameRank) {
  for (int64_t kv : {1, 2, 3, 4, 8})
    for (int64_t g : {1, 2, 3, 4})
      for (int64_t ranks = 1; ranks <= 9; ++ranks) {
        const int64_t heads = kv * g;
        if (heads < ranks) continue;
        SCOPED_TRACE("heads " + std::to_string(heads) + " kv " + std::to_string(kv) + " ranks " +
                     std::to_string(ranks));
        std::vector<int> owners(static_cast<size_t>(heads), 0);
        int64_t next = 0, smallest = heads, largest = 0;
        for (int64_t r = 0; r < ranks; ++r) {
          Result<HeadShare> s = head_share(heads, kv, ranks, r);
          ASSERT_TRUE(s.ok()) << s.status().to_string();
          // Contiguous, in rank order, at least one head each.
          EXPECT_EQ(s->q_begin, next);
          EXPECT_GE(s->num_heads(), 1);
          next = s->q_end;
          smallest = std::min(smallest, s->num_heads());
          largest = std::max(largest, s->num_heads());
          for (int64_t h = s->q_begin; h < s->q_end; ++h) {
            ++owners[static_cast<size_t>(h)];
            // The rank holds the kv head its query heads read.
            EXPECT_GE(h / g, s->kv_begin);
            EXPECT_LT(h / g, s->kv_end);
          }
          // Uniform grouping inside the shard, so an AttentionLayer can run it.
          EXPECT_EQ(s->num_heads() % s->num_kv_heads(), 0);
          EXPECT_EQ(s->num_heads() / s->num_kv_heads(), kv >= ranks ? g : s->num_heads());
        }
        EXPECT_EQ(next, heads);
        for (int o : owners) EXPECT_EQ(o, 1);
        if (kv >= ranks) {
          EXPECT_LE(largest - smallest, g);  // shares differ by one kv head at most
        }
      }
}

TEST(HeadShare, DocumentedLayouts) {
  // 32 query heads, 8 kv heads, 3 ranks: kv [0,2) [2,5) [5,8), 4 query heads each.
  const int64_t want[3][4] = {{0, 8, 0, 2}, {8, 20, 2, 5}, {20, 32, 5, 8}};
  for (int r = 0; r < 3; ++r) {
    HeadShare s = *head_share(32, 8, 3, r);
    EXPECT_EQ(s.q_begin, want[r][0]);
    EXPECT_EQ(s.q_end, want[r][1]);
    EXPECT_EQ(s.kv_begin, want[r][2]);
    EXPECT_EQ(s.kv_end, want[r][3]);
  }
  // 8 query heads, 2 kv heads, 3 ranks: kv head 0 on ranks 0-1 (2 query heads each),
  // kv head 1 on rank 2 (all 4 of its query heads).
  const int64_t rep[3][4] = {{0, 2, 0, 1}, {2, 4, 0, 1}, {4, 8, 1, 2}};
  for (int r = 0; r < 3; ++r) {
    HeadShare s = *head_share(8, 2, 3, r);
    EXPECT_EQ(s.q_begin, rep[r][0]);
    EXPECT_EQ(s.q_end, rep[r][1]);
    EXPECT_EQ(s.kv_begin, rep[r][2]);
    EXPECT_EQ(s.kv_end, rep[r][3]);
  }
}

TEST(HeadShare, Errors) {
  const struct {
    int64_t heads, kv, ranks, rank;
    const char* words;
  } cases[] = {
      {4, 4, 5, 0, "num_heads = 4 must be >= ranks = 5"},
      {6, 4, 2, 0, "num_kv_heads = 4 must be >= 1 and divide num_heads = 6"},
      {8, 2, 2, 2, "rank = 2 must be in [0, ranks = 2)"},
      {8, 2, 0, 0, "ranks = 0 must be >= 1"},
      {0, 1, 1, 0, "num_heads = 0 must be >= 1"},
  };
  for (const auto& c : cases) {
    Result<HeadShare> s = head_share(c.heads, c.kv, c.ranks, c.rank);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(c.words), std::string::npos) << s.status().message();
    EXPECT_EQ(s.status().message().rfind("head_share: ", 0), 0u);
  }
}

TEST(RingChunks, DocumentedLayoutAndEveryTokenOnce) {
  RingChunks r0 = *ring_chunks(8, 2, 0), r1 = *ring_chunks(8, 2, 1);
  EXPECT_EQ(r0.first.begin, 0);
  EXPECT_EQ(r0.first.end, 2);
  EXPECT_EQ(r0.second.begin, 6);
  EXPECT_EQ(r0.second.end, 8);
  EXPECT_EQ(r1.first.begin, 2);
  EXPECT_EQ(r1.first.end, 4);
  EXPECT_EQ(r1.second.begin, 4);
  EXPECT_EQ(r1.second.end, 6);
  // Uneven: 5 tokens, 4 chunks at 0, 1, 2, 3, 5 -> rank 0 [0,1)+[3,5), rank 1 [1,2)+[2,3).
  RingChunks u0 = *ring_chunks(5, 2, 0), u1 = *ring_chunks(5, 2, 1);
  EXPECT_EQ(u0.size(), 3);
  EXPECT_EQ(u0.second.begin, 3);
  EXPECT_EQ(u1.size(), 2);
  for (int64_t ranks = 1; ranks <= 5; ++ranks)
    for (int64_t seqlen : {0, 1, 3, 7, 10, 64, 101}) {
      std::vector<int> owners(static_cast<size_t>(seqlen), 0);
      for (int64_t r = 0; r < ranks; ++r) {
        RingChunks c = *ring_chunks(seqlen, ranks, r);
        for (const TokenRange& t : {c.first, c.second}) {
          EXPECT_LE(t.begin, t.end);
          for (int64_t i = t.begin; i < t.end; ++i) ++owners[static_cast<size_t>(i)];
        }
        // Chunk sizes differ by at most one token.
        EXPECT_LE(c.size(), 2 * ((seqlen + 2 * ranks - 1) / (2 * ranks)));
      }
      for (int o : owners) EXPECT_EQ(o, 1) << "seqlen " << seqlen << " ranks " << ranks;
    }
  EXPECT_FALSE(ring_chunks(-1, 2, 0).ok());
  EXPECT_FALSE(ring_chunks(4, 2, 2).ok());
}

TEST(RingChunks, CausalWorkIsEvenWhenChunksAre) {
  // With chunk size c, rank r scores c * r c + c (c+1)/2 pairs in chunk r and
  // c (2N-1-r) c + c (c+1)/2 in chunk 2N-1-r: c^2 (2N-1) + c (c+1) for every r.
  const int64_t ranks = 4, c = 16, seqlen = 2 * ranks * c;
  for (int64_t r = 0; r < ranks; ++r) {
    RingChunks ch = *ring_chunks(seqlen, ranks, r);
    int64_t pairs = 0;
    for (const TokenRange& t : {ch.first, ch.second})
      for (int64_t i = t.begin; i < t.end; ++i) pairs += i + 1;
    EXPECT_EQ(pairs, c * c * (2 * ranks - 1) + c * (c + 1)) << "rank " << r;
  }
}

// ---- the cost model ----------------------------------------------------

const StrategyCost& find(const std::vector<StrategyCost>& v, ParallelStrategy s) {
  for (const StrategyCost& c : v)
    if (c.strategy == s) return c;
  ADD_FAILURE() << "no strategy " << parallel_strategy_name(s);
  return v.front();
}

TEST(ParallelCosts, Llama3_8bOnFourRanksByHand) {
  const ModelShape m = *model_preset("llama-3-8b");  // d 4096, H 32, K 8, D 128, 32 layers
  ParallelWorkload w;
  w.batch = 1;
  w.context = 4096;
  const KernelRates rates{1000.0, 100.0};
  const LinkModel link{100.0, 5.0};  // beta = 12.5e9 B/s
  const std::vector<StrategyCost> v = *parallel_costs(m, 4, w, rates, link);
  ASSERT_EQ(v.size(), 3u);

  const StrategyCost& single = find(v, ParallelStrategy::kSingle);
  // Weights 41,943,040 params * 2 B * 32 layers; KV 2048 values * 2 B * 4096 * 32.
  EXPECT_DOUBLE_EQ(single.weight_bytes_per_rank, 2684354560.0);
  EXPECT_DOUBLE_EQ(single.kv_bytes_per_rank, 536870912.0);
  // Decode reads 83,886,080 weight + 16,777,216 KV bytes at 100 GB/s (the
  // 150,994,944 FLOPs take 0.15 ms at 1 TFLOP/s, so memory bounds it).
  EXPECT_DOUBLE_EQ(single.decode.compute_s, 100663296.0 / 100e9);
  EXPECT_EQ(single.decode.bytes_sent, 0.0);

  const StrategyCost& hp = find(v, ParallelStrategy::kHeadParallel);
  ASSERT_TRUE(hp.feasible);
  // 2 kv heads and 8 query heads per rank: a quarter of every projection.
  EXPECT_DOUBLE_EQ(hp.weight_bytes_per_rank, 671088640.0);
  EXPECT_DOUBLE_EQ(hp.kv_bytes_per_rank, 134217728.0);
  // All-reduce of 4096 f32: 2 * 3/4 * 16384 B in 2 log2(4) = 4 messages.
  EXPECT_DOUBLE_EQ(hp.decode.bytes_sent, 24576.0);
  EXPECT_DOUBLE_EQ(hp.decode.bytes_per_token, 24576.0);
  EXPECT_EQ(hp.decode.messages, 4);
  EXPECT_DOUBLE_EQ(hp.decode.exposed_comm_s, 4 * 5e-6 + 24576.0 / 12.5e9);
  EXPECT_DOUBLE_EQ(hp.prefill.bytes_sent, 1.5 * 4096.0 * 4096.0 * 4.0);
  EXPECT_DOUBLE_EQ(hp.prefill.bytes_per_token, 24576.0);
  EXPECT_DOUBLE_EQ(hp.decode.step_s, hp.decode.compute_s + hp.decode.exposed_comm_s);

  const StrategyCost& cp = find(v, ParallelStrategy::kContextParallel);
  ASSERT_TRUE(cp.feasible);
  EXPECT_DOUBLE_EQ(cp.weight_bytes_per_rank, single.weight_bytes_per_rank);
  EXPECT_DOUBLE_EQ(cp.kv_bytes_per_rank, single.kv_bytes_per_rank / 4);
  // Three blocks of 1024 tokens * 2048 values * 2 B forwarded in the ring.
  EXPECT_DOUBLE_EQ(cp.prefill.bytes_sent, 3.0 * 1024 * 2048 * 2);
  EXPECT_DOUBLE_EQ(cp.prefill.bytes_per_token, 3072.0);
  EXPECT_EQ(cp.prefill.messages, 3);
  // Merge: the other 3 ranks' 32 heads * (128 + 1) f32 in log2(4) = 2 messages.
  EXPECT_DOUBLE_EQ(cp.decode.bytes_sent, 3.0 * 32 * 129 * 4);
  EXPECT_EQ(cp.decode.messages, 2);
  EXPECT_DOUBLE_EQ(cp.decode.exposed_comm_s, 2.0 * 5e-6 + 3.0 * 16512.0 / 12.5e9);
  // Each step's 4 MiB block takes 0.34 ms at 100 Gb/s while a step computes
  // for 8.6 ms (2,097,664 causal pairs per rank * 16,384 FLOPs / 4 steps at
  // 1 TFLOP/s): the ring hides all of it. At 1 Gb/s a block takes 34 ms.
  EXPECT_EQ(cp.prefill.exposed_comm_s, 0.0);
  const std::vector<StrategyCost> slow = *parallel_costs(m, 4, w, rates, LinkModel{1.0, 5.0});
  EXPECT_GT(find(slow, ParallelStrategy::kContextParallel).prefill.exposed_comm_s, 0.0);
}

TEST(ParallelCosts, DeepSeekV3LatentCacheIsReplicatedUnderHeadParallelism) {
  const ModelShape m = *model_preset("deepseek-v3");  // 61 layers, H 128, d_c 512, d_r 64
  ParallelWorkload w;
  w.batch = 2;
  w.context = 1000;
  const std::vector<StrategyCost> v = *parallel_costs(m, 4, w, {500.0, 50.0}, {200.0, 2.0});
  const StrategyCost& hp = find(v, ParallelStrategy::kHeadParallel);
  ASSERT_TRUE(hp.feasible);
  // Per rank, 32 heads: q_a 11,010,048 + its norm 1,536 + q_b 9,437,184 +
  // kv_a 4,128,768 + its norm 512 + kv_b 4,194,304 + o 29,360,128 = 58,132,480.
  EXPECT_DOUBLE_EQ(hp.weight_bytes_per_rank, 58132480.0 * 2 * 61);
  // The whole latent cache on every rank: 576 values * 2 B * 1000 * 2 * 61.
  EXPECT_DOUBLE_EQ(hp.kv_bytes_per_rank, 576.0 * 2 * 1000 * 2 * 61);
  const StrategyCost& cp = find(v, ParallelStrategy::kContextParallel);
  // Merge: 3 partials of 2 * 128 latent outputs of 512 + 1 f32 values.
  EXPECT_DOUBLE_EQ(cp.decode.bytes_sent, 3.0 * 2 * 128 * 513 * 4);
  // 250 tokens per rank (chunks of 125); a ring block sends key and value
  // rows (576 + 512 values) of two sequences: 3 blocks.
  EXPECT_DOUBLE_EQ(cp.prefill.bytes_sent, 3.0 * 2 * 250 * 1088 * 2);
}

TEST(ParallelCosts, OneRankEqualsSingleAndInfeasibleSplitsSayWhy) {
  const ModelShape m = *model_preset("llama-3-8b");
  ParallelWorkload w;
  w.context = 512;
  const std::vector<StrategyCost> one = *parallel_costs(m, 1, w, {100.0, 10.0}, {10.0, 5.0});
  for (const StrategyCost& c : one) {
    EXPECT_EQ(c.prefill.bytes_sent, 0.0) << parallel_strategy_name(c.strategy);
    EXPECT_EQ(c.decode.exposed_comm_s, 0.0) << parallel_strategy_name(c.strategy);
    EXPECT_DOUBLE_EQ(c.kv_bytes_per_rank, one[0].kv_bytes_per_rank);
  }
  const std::vector<StrategyCost> many = *parallel_costs(m, 64, w, {100.0, 10.0}, {10.0, 5.0});
  const StrategyCost& hp = find(many, ParallelStrategy::kHeadParallel);
  EXPECT_FALSE(hp.feasible);
  EXPECT_NE(hp.infeasible_reason.find("num_heads = 32 must be >= ranks = 64"), std::string::npos)
      << hp.infeasible_reason;
  EXPECT_TRUE(find(many, ParallelStrategy::kContextParallel).feasible);
}

TEST(ParallelCosts, Errors) {
  const ModelShape m = *model_preset("llama-3-8b");
  ParallelWorkload w;
  w.context = 16;
  const auto message = [&](int64_t ranks, const ParallelWorkload& wl, KernelRates r, LinkModel l) {
    Result<std::vector<StrategyCost>> c = parallel_costs(m, ranks, wl, r, l);
    EXPECT_FALSE(c.ok());
    return c.ok() ? std::string() : c.status().message();
  };
  EXPECT_EQ(message(0, w, {1, 1}, {1, 1}), "parallel_costs: ranks = 0 must be >= 1");
  EXPECT_NE(message(2, w, {1, 1}, {0, 1}).find("link.gbps = 0.000000 must be finite and > 0"),
            std::string::npos);
  EXPECT_NE(message(2, w, {1, 1}, {1, -1}).find("link.latency_us"), std::string::npos);
  ParallelWorkload bad = w;
  bad.context = 0;
  EXPECT_NE(message(2, bad, {1, 1}, {1, 1}).find("workload.context = 0 must be >= 1"),
            std::string::npos);
  bad = w;
  bad.kv_dtype = DType::kI32;
  EXPECT_NE(message(2, bad, {1, 1}, {1, 1}).find("workload.kv_dtype = i32"), std::string::npos);
}

}  // namespace
}  // namespace attnkit
