"""attnkit.Engine over attnkit.SyntheticModel: continuous batching from
Python. The reference for a request is the same request served alone (one
sequence at a time, its prompt in one step): with the reference kernels a
sequence's logits depend on its own tokens only, so its greedy tokens must
not change with what shares its steps, how its prompt is chunked or whether
it is preempted. Bad requests raise ValueError naming the argument and the
engine goes on serving the others.

attnkit.Model loaded from a tiny random checkpoint (test_model.py's writer)
is served the same way, and its greedy tokens are those of greedy decoding
with model.forward on the growing sequence."""
import numpy as np
import pytest

import attnkit
from test_model import FAMILIES, VOCAB, random_weights, write_checkpoint

# hidden 32, 4 query heads and 2 kv heads of 8, two layers.
TINY = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "rope_theta": 10000.0}


def model(**kw):
    return attnkit.SyntheticModel(TINY, layers=2, seed=3, weights="float32", **kw)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, size=int(rng.integers(1, 24))).tolist() for _ in range(n)]


def serve(engine, reqs, max_tokens):
    """Every request added at once, stepped to the end: {id: tokens}."""
    ids = [engine.add_request(p, m) for p, m in zip(reqs, max_tokens)]
    tokens = {i: [] for i in ids}
    finished = {i: 0 for i in ids}
    while engine.has_unfinished():
        for rid, new, done in engine.step():
            assert len(new) <= 1
            tokens[rid] += new
            finished[rid] += done
    assert all(f == 1 for f in finished.values())
    return [tokens[i] for i in ids]


def test_sixteen_concurrent_requests_give_each_one_alone_greedy_tokens():
    m = model()
    assert isinstance(m, attnkit.StepModel) and m.vocab_size == 512
    reqs, lengths = prompts(16), [12] * 16
    together = attnkit.Engine(m, kv_memory="1MiB", backend="reference")
    got = serve(together, reqs, lengths)
    assert together.stats["peak_running"] == 16
    for p, want_len, tokens in zip(reqs, lengths, got):
        alone = attnkit.Engine(m, kv_memory="1MiB", max_seqs=1, backend="reference")
        assert serve(alone, [p], [want_len]) == [tokens]
        assert len(tokens) == want_len and all(0 <= t < 512 for t in tokens)


def test_fast_kernels_batch_invariant_by_default_and_optionally_not():
    """On the fast kernels the default (batch_invariant=True) still gives
    each request its alone tokens; batch_invariant=False serves every
    request in full (its rows agree to rounding only, so tokens may
    differ at near-ties: tests/ops/paged_invariance_test.cc bounds them)."""
    m = model()
    reqs, lengths = prompts(8, seed=4), [6] * 8
    got = serve(attnkit.Engine(m, kv_memory="1MiB"), reqs, lengths)
    for p, n, tokens in zip(reqs, lengths, got):
        assert serve(attnkit.Engine(m, kv_memory="1MiB", max_seqs=1), [p], [n]) == [tokens]
    fast = serve(attnkit.Engine(m, kv_memory="1MiB", batch_invariant=False), reqs, lengths)
    assert [len(t) for t in fast] == lengths


def test_a_tight_pool_preempts_and_chunks_without_changing_tokens():
    m = model()
    reqs = prompts(10, seed=1)
    lengths = [3 + i % 7 for i in range(10)]
    # 16 pages of 2 tokens, at most 5 tokens a step.
    page = 2 * 2 * 2 * 8 * 2 * 2  # tokens x (k, v) x kv heads x head_dim x bf16 x layers
    tight = attnkit.Engine(m, kv_memory=16 * page, page_size=2, max_tokens_per_step=5,
                           backend="reference")
    got = serve(tight, reqs, lengths)
    assert tight.stats["preemptions"] > 0 and tight.stats["pool_pages"] == 16
    alone = attnkit.Engine(m, kv_memory="1MiB", max_seqs=1, backend="reference")
    assert serve(alone, reqs, lengths) == got


def test_prefix_caching_changes_no_token_and_skips_the_shared_prefill():
    m = model()
    system = prompts(1, seed=5)[0] * 3  # a shared system prompt of whole pages and more
    reqs = [system + p for p in prompts(6, seed=6)]
    runs = {}
    for on in (False, True):
        e = attnkit.Engine(m, kv_memory="1MiB", page_size=4, prefix_caching=on, max_seqs=1,
                           backend="reference")
        runs[on] = (serve(e, reqs, [5] * 6), e.stats)
    assert runs[True][0] == runs[False][0]
    on, off = runs[True][1], runs[False][1]
    assert on["prompt_tokens_cached"] >= 5 * (len(system) // 4) * 4  # all but the first
    assert on["prompt_tokens_computed"] + on["prompt_tokens_cached"] == off["prompt_tokens_computed"]
    assert on["prefix_cache"]["hit_tokens"] == on["prompt_tokens_cached"]
    assert off["prefix_cache"]["hit_tokens"] == 0


def test_metrics_follow_the_engine_clock():
    e = attnkit.Engine(model(), kv_memory="1MiB")
    serve(e, prompts(3, seed=2), [4, 1, 6])
    for rid, n in enumerate([4, 1, 6]):
        q = e.metrics(rid)
        assert q["output_tokens"] == n and q["error"] is None
        assert q["arrival_s"] <= q["admitted_s"] <= q["first_token_s"] <= q["finish_s"]
    s = e.stats
    assert s["forward_s"] <= s["busy_s"] <= s["wall_s"]
    assert s["prompt_tokens_computed"] == s["prompt_tokens_admitted"]
    with pytest.raises(ValueError, match=r"Engine.metrics: request_id = 9 is not a request"):
        e.metrics(9)


def test_a_sample_callback_picks_the_tokens():
    seen = []

    def last_but_one(logits):
        assert logits.dtype == np.float32 and logits.shape == (512,)
        seen.append(logits.copy())
        return int(np.argsort(logits)[-2])

    e = attnkit.Engine(model(), kv_memory="1MiB", sample=last_but_one, backend="reference")
    (tokens,) = serve(e, [[1, 2, 3]], [5])
    assert len(seen) == 5
    assert tokens == [int(np.argsort(lg)[-2]) for lg in seen]


def test_bad_requests_raise_by_name_and_the_others_are_served():
    e = attnkit.Engine(model(), kv_memory=8 * 4 * 2 * 2 * 8 * 2 * 2, page_size=4)  # 8 pages
    good = serve(attnkit.Engine(model(), kv_memory="1MiB"), [[5, 6, 7]], [4])
    with pytest.raises(ValueError, match=r"Engine.add_request: prompt_token_ids\[1\] = 600 is "
                                         r"outside the model's vocabulary \[0, 512\)"):
        e.add_request([5, 600, 7], 4)
    with pytest.raises(ValueError, match=r"Engine.add_request: max_tokens = 0 must be >= 1"):
        e.add_request([5, 6, 7], 0)
    with pytest.raises(ValueError, match=r"40 prompt tokens \+ max_tokens 4 - 1 = 43 token "
                                         r"slots need 11 pages of 4 tokens"):
        e.add_request(list(range(40)), 4)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] = 4294967296 does not fit"):
        e.add_request([2 ** 32], 4)
    assert not e.has_unfinished()
    assert serve(e, [[5, 6, 7]], [4]) == good


def test_a_failing_sample_ends_its_request_only():
    calls = []

    def flaky(logits):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("no token")
        return int(np.argmax(logits))

    e = attnkit.Engine(model(), kv_memory="1MiB", sample=flaky)
    got = serve(e, prompts(3, seed=4), [3, 3, 3])
    errors = [e.metrics(i)["error"] for i in range(3)]
    assert sum(err is not None for err in errors) == 1
    assert "Engine.step: sample returned token -1" in next(x for x in errors if x)
    # The second call is the second request's first token (all three prefill at once).
    assert [len(t) for t in got] == [3, 0, 3]


@pytest.mark.parametrize("kw, says", [
    ({"kv_memory": "12XB"}, "kv_memory = '12XB' must be a positive size"),
    ({"kv_memory": 0}, "kv_memory = 0 must be >= 1 byte"),
    ({"kv_dtype": "int3"}, "kv_dtype = 'int3' must be"),
    ({"page_size": 0}, "Engine.create: page_size = 0 must be >= 1"),
    ({"kv_memory": 100}, "holds no page"),
    ({"sample": 3}, "sample must be callable or None"),
])
def test_bad_engine_options_raise_by_name(kw, says):
    with pytest.raises(ValueError, match=None) as e:
        attnkit.Engine(model(), **kw)
    assert says in str(e.value)


def test_synthetic_model_reads_configs_and_refuses_what_it_cannot_serve():
    assert attnkit.SyntheticModel(TINY, layers=1).hidden_size == 32
    with pytest.raises(ValueError, match=r"layers = 3 must be in \[1, 2\]"):
        attnkit.SyntheticModel(TINY, layers=3)
    with pytest.raises(ValueError, match="is neither a readable file nor a preset"):
        attnkit.SyntheticModel("no-such-model")
    with pytest.raises(ValueError, match=r"vocab_size = 0 must be in \[1, 2\^24\]"):
        attnkit.SyntheticModel(TINY, vocab_size=0)


@pytest.mark.parametrize("family, bf16", [("llama", True), ("gemma2", False),
                                          ("deepseek_v3", False)])
def test_a_checkpoint_serves_model_forwards_greedy_tokens(tmp_path, family, bf16):
    """16 requests at once, prompts chunked under a 48-token step budget, with
    and without the prefix cache (pairs of requests share a 9-token system
    prompt, two whole pages of 4): every request's tokens are those of
    greedy decoding with model.forward, which runs the reference kernels
    over an f32 pool as the engine does here."""
    c = FAMILIES[family]
    write_checkpoint(str(tmp_path), c, random_weights(c, seed=2), bf16=bf16)
    m = attnkit.Model.from_pretrained(str(tmp_path), backend="reference")
    assert isinstance(m, attnkit.StepModel) and m.vocab_size == VOCAB
    rng = np.random.default_rng(8)
    systems = [rng.integers(0, VOCAB, size=9).tolist() for _ in range(8)]
    reqs = [systems[i // 2] + rng.integers(0, VOCAB, size=1 + i % 6).tolist()
            for i in range(16)]
    want = []
    for p in reqs:
        seq = list(p)
        for _ in range(6):
            seq.append(int(np.argmax(m.forward(np.array(seq))[-1])))
        want.append(seq[len(p):])
    for prefix in (False, True):
        e = attnkit.Engine(m, kv_memory="4MiB", page_size=4, kv_dtype="float32",
                           prefix_caching=prefix, max_tokens_per_step=48, backend="reference")
        assert serve(e, reqs, [6] * 16) == want, f"prefix_caching={prefix}"
        assert e.stats["peak_running"] == 16
        assert (e.stats["prompt_tokens_cached"] > 0) == prefix
