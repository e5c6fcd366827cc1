"""attnkit.dist under mpirun (every rank runs every test; the tests are
collective), against the float64 PyTorch references of the single-process
suite (tests/python/torch_ref.py, test_mla.py), with that suite's bounds:

    mpirun -np 3 /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/python_dist

Each test does all of its collective calls before asserting, so a failure
on one rank cannot leave the others waiting in a collective.
"""
import os
import sys

import numpy as np
import pytest
import torch
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

import attnkit  # noqa: E402
import attnkit.dist as dist  # noqa: E402
import test_mla  # noqa: E402
from torch_ref import (check_close, eight_bit_bound, hf_attention_ref, kv_stored,  # noqa: E402
                       layer_tolerance, random_weights, rng, sdpa_bounds, sdpa_ref)

torch.set_num_threads(1)
COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def same_everywhere(a):
    """Whether every rank holds the same array, bit for bit."""
    return all(np.array_equal(a, other) for other in COMM.allgather(a))


def gqa_weights(cfg, seed):
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    shapes = {"q_proj.weight": (h * hd, d), "k_proj.weight": (kv * hd, d),
              "v_proj.weight": (kv * hd, d), "o_proj.weight": (d, h * hd)}
    if cfg["model_type"] == "qwen2":
        shapes.update({"q_proj.bias": (h * hd,), "k_proj.bias": (kv * hd,),
                       "v_proj.bias": (kv * hd,)})
    if cfg["model_type"] == "qwen3":
        shapes.update({"q_norm.weight": (hd,), "k_norm.weight": (hd,)})
    return random_weights(rng(seed), shapes)


# GQA split (8/2) or replicated, uneven shares (6 heads, 3 kv heads), MHA
# with qk-norm, a sliding window shorter than the sequence, softcap.
CONFIGS = {
    "llama_gqa": {"model_type": "llama", "hidden_size": 40, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "head_dim": 6},
    "qwen2_bias_uneven": {"model_type": "qwen2", "hidden_size": 36, "num_attention_heads": 6,
                          "num_key_value_heads": 3, "head_dim": 8},
    "qwen3_qknorm_mha": {"model_type": "qwen3", "hidden_size": 32, "num_attention_heads": 4,
                         "num_key_value_heads": 4, "head_dim": 8},
    "mistral_window": {"model_type": "mistral", "hidden_size": 32, "num_attention_heads": 4,
                       "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 3},
    "gemma2_softcap": {"model_type": "gemma2", "hidden_size": 32, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 8, "attn_logit_softcapping": 2.0,
                       "query_pre_attn_scalar": 8, "sliding_window": 4},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_head_parallel_matches_torch_with_and_without_cache(name):
    cfg = CONFIGS[name]
    sd = gqa_weights(cfg, 1)
    prefixed = {"model.layers.1.self_attn." + k: v for k, v in sd.items()}
    layer = dist.HeadParallelAttention(COMM, cfg, prefixed, prefix="model.layers.1.self_attn",
                                       layer_index=1)
    x = rng(2).standard_normal((2, 7, cfg["hidden_size"])).astype(np.float32)
    whole = layer.forward(x)
    cache = layer.new_cache(batch_size=2, max_seq_len=7)
    steps = [layer.forward(x[:, :4], cache=cache)]
    steps += [layer(x[:, t:t + 1], cache=cache) for t in range(4, 7)]
    stepped = np.concatenate(steps, axis=1)
    identical = same_everywhere(whole)
    want, _ = hf_attention_ref(cfg, sd, x, layer_index=1)
    check_close("whole", whole, want, layer_tolerance(want))
    check_close("prefill + decode", stepped, want, layer_tolerance(want))
    assert identical
    assert cache.length == 7


@pytest.mark.parametrize("q_lora", [True, False])
def test_head_parallel_mla_matches_torch(q_lora):
    cfg = test_mla.config(q_lora=q_lora, num_attention_heads=5)
    w = test_mla.random_weights(cfg, 3)
    layer = dist.HeadParallelAttention(COMM, cfg, w)
    x = rng(4).standard_normal((1, 6, cfg["hidden_size"])).astype(np.float32)
    forms = {f: layer.forward(x, form=f) for f in ("naive", "absorbed")}
    cache = layer.new_cache(1, 6)
    stepped = np.concatenate([layer.forward(x[:, :3], cache=cache)] +
                             [layer.forward(x[:, t:t + 1], cache=cache) for t in range(3, 6)],
                             axis=1)
    want, _ = test_mla.mla_ref(cfg, w, x, np.arange(6))
    for f, got in forms.items():
        test_mla.check_rel(f, got, want)
    test_mla.check_rel("prefill + decode", stepped, want)
    assert layer.share["q_heads"] == dist.head_share(5, 5, SIZE, RANK)["q_heads"]


def split_tokens(split, S):
    if split == "contiguous":
        return [t for t in range(S) if t * SIZE // S == RANK]
    if split == "round_robin":
        return [t for t in range(S) if t % SIZE == RANK]
    # everything on rank 0
    return list(range(S)) if RANK == 0 else []


@pytest.mark.parametrize("split", ["contiguous", "round_robin", "rank0_only"])
@pytest.mark.parametrize("merge", ["allreduce", "allgather"])
def test_context_parallel_decode_matches_torch(split, merge):
    g = rng(5)
    B, Tq, H, K, D, Dv, S = 2, 2, 6, 2, 8, 12, 23
    q = g.standard_normal((B, Tq, H, D)).astype(np.float32)
    k = g.standard_normal((B, S, K, D)).astype(np.float32)
    v = g.standard_normal((B, S, K, Dv)).astype(np.float32)
    mine = split_tokens(split, S)
    out, lse = dist.context_parallel_decode(COMM, q, k[:, mine], v[:, mine], softcap=3.0,
                                            return_lse=True, merge=merge)
    identical = same_everywhere(out) and same_everywhere(lse)
    want, want_lse, _ = sdpa_ref(q, k, v, softcap=3.0)
    bounds = sdpa_bounds(q, k, v)
    check_close("out", out, want, bounds["out"])
    check_close("lse", lse, want_lse, bounds["lse"])
    assert identical


@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("merge", ["allreduce", "allgather"])
def test_context_parallel_decode_over_paged_pools(kv_dtype, merge):
    # Each rank's PagedKVCache holds a round-robin share of every sequence
    # (sequence 1 has fewer tokens than ranks, so some ranks hold none of
    # it); the ranks attend two new queries per sequence over their shares
    # (attend_held) and merge by log-sum-exp.
    g = rng(8)
    H, K, D, Dv, Tq = 6, 2, 8, 12, 2
    lengths = [21, 1, 9]
    q = g.standard_normal((len(lengths) * Tq, H, D)).astype(np.float32)
    k = [g.standard_normal((n, K, D)).astype(np.float32) for n in lengths]
    v = [g.standard_normal((n, K, Dv)).astype(np.float32) for n in lengths]
    mine = [[t for t in range(n) if t % SIZE == RANK] for n in lengths]
    pool = attnkit.PagedKVCache(num_pages=16, page_size=2, num_kv_heads=K, head_dim=D,
                                head_dim_v=Dv, kv_dtype=kv_dtype)
    ids = [pool.add_sequence() for _ in lengths]
    pool.append(ids, [len(m) for m in mine])
    cu = np.cumsum([0] + [len(m) for m in mine]).astype(np.int32)
    pool.store(0, np.concatenate([k[s][m] for s, m in enumerate(mine)]).reshape(-1, K, D),
               np.concatenate([v[s][m] for s, m in enumerate(mine)]).reshape(-1, K, Dv), cu, ids)
    cu_q = np.arange(0, len(lengths) * Tq + 1, Tq, dtype=np.int32)
    out_l, lse_l = pool.attend_held(0, q, cu_q, ids, softcap=3.0, return_lse=True)
    out, lse = dist.merge_partial_attention(COMM, out_l[None], lse_l[None], return_lse=True,
                                            merge=merge)
    identical = same_everywhere(out) and same_everywhere(lse)
    for s in range(len(lengths)):
        rows = slice(s * Tq, (s + 1) * Tq)
        ks, vs = kv_stored(k[s], kv_dtype)[None], kv_stored(v[s], kv_dtype)[None]
        want, want_lse, _ = sdpa_ref(q[None, rows], ks, vs, softcap=3.0)
        if kv_dtype == "float32":
            bounds = sdpa_bounds(q[None, rows], ks, vs)
            check_close(f"lse {s}", lse[:, :, rows], want_lse, bounds["lse"])
            bound = bounds["out"]
        else:
            bound = eight_bit_bound(q[None, rows], ks, vs, kv_dtype)
        check_close(f"out {s}", out[:, rows], want, bound)
    assert identical
    assert [pool.written(i, 0) for i in ids] == [len(m) for m in mine]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S", [13, 2])
def test_ring_attention_matches_torch(causal, S):
    g = rng(6)
    B, H, K, D = 1, 4, 2, 8
    q = g.standard_normal((B, S, H, D)).astype(np.float32)
    k = g.standard_normal((B, S, K, D)).astype(np.float32)
    v = g.standard_normal((B, S, K, D)).astype(np.float32)
    (a0, a1), (b0, b1) = dist.ring_chunks(S, SIZE, RANK)
    mine = list(range(a0, a1)) + list(range(b0, b1))
    out, lse = dist.ring_attention(COMM, q[:, mine], k[:, mine], v[:, mine], causal=causal,
                                   return_lse=True)
    want, want_lse, _ = sdpa_ref(q, k, v, causal=causal)
    bounds = sdpa_bounds(q, k, v)
    check_close("out", out, want[:, mine], bounds["out"])
    check_close("lse", lse, want_lse[:, :, mine], bounds["lse"])


def expect_everywhere(call, *words):
    """call() must raise ValueError on this rank; returns its message."""
    with pytest.raises(ValueError) as e:
        call()
    for w in words:
        assert w in str(e.value), str(e.value)
    return str(e.value)


def test_errors_on_one_rank_raise_on_every_rank():
    last = SIZE - 1
    cfg = CONFIGS["llama_gqa"]
    layer = dist.HeadParallelAttention(COMM, cfg, gqa_weights(cfg, 7))
    x = np.ones((1, 2, cfg["hidden_size"]), np.float32)
    cache = layer.new_cache(1, 4)
    layer.forward(x, cache=cache)
    # A wrong array rank, caught while converting the arguments.
    expect_everywhere(lambda: layer.forward(x if RANK != last else x[0], cache=cache),
                      "x must have rank 3", f"(on rank {last} of {SIZE})")
    # A wrong hidden size, caught by the C++ layer.
    bad = np.ones((1, 1, cfg["hidden_size"] + 1), np.float32)
    expect_everywhere(lambda: layer.forward(bad if RANK == last else x[:, :1], cache=cache),
                      "x.shape[2] (hidden_size)", f"(on rank {last} of {SIZE})")
    # Overflowing one rank's cache would change the others': nobody moves.
    small = layer.new_cache(1, 3 if RANK == last else 8)
    layer.forward(x, cache=small)
    expect_everywhere(lambda: layer.forward(x, cache=small), "max_seq_len = 3")
    assert cache.length == 2 and small.length == 2
    # A config one rank cannot read.
    expect_everywhere(lambda: dist.HeadParallelAttention(COMM, cfg if RANK != last else 42, {}),
                      "config must be a dict", f"(on rank {last} of {SIZE})")
    # Bad options in the free functions.
    q = np.ones((1, 1, 4, 8), np.float32)
    kv = np.ones((1, 3, 2, 8), np.float32)
    expect_everywhere(lambda: dist.context_parallel_decode(
        COMM, q, kv, kv, merge="allreduce" if RANK != last else "bogus"), "merge = 'bogus'")
    (a0, a1), (b0, b1) = dist.ring_chunks(4 * SIZE, SIZE, RANK)
    n = a1 - a0 + b1 - b0 + (1 if RANK == last and SIZE > 1 else 0)
    qs = np.ones((1, n, 4, 8), np.float32)
    ks = np.ones((1, n, 2, 8), np.float32)
    if SIZE > 1:
        expect_everywhere(lambda: dist.ring_attention(COMM, qs, ks, ks), "does not fit the layout")
    with pytest.raises(ValueError, match="mpi4py intracommunicator"):
        dist.ring_attention("not a comm", qs, ks, ks)
