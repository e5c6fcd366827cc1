"""Every bad argument raises ValueError (OSError for I/O) with a message that
names the function and the argument; failed calls change nothing."""
import json

import numpy as np
import pytest

import attnkit
from torch_ref import randn, rng

G = rng(0)
Q, K, V = randn(G, 2, 3, 4, 8), randn(G, 2, 5, 2, 8), randn(G, 2, 5, 2, 6)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(q=Q[0]), r"sdpa: q must have rank 4 \[batch, seqlen_q, num_heads, head_dim\], "
                   r"got shape \(3, 4, 8\)"),
    (dict(k=K[..., :7]), r"sdpa: k.shape\[3\] \(head_dim\) = 7 must equal q.shape\[3\] = 8"),
    (dict(k=K[:, :, :1].repeat(3, axis=2), v=V[:, :, :1].repeat(3, axis=2)),
     r"sdpa: .*num_kv_heads.* = 3"),
    (dict(v=V[:, :4]), r"sdpa: v.shape\[1\] \(seqlen_k\) = 4"),
    (dict(v=V[:1]), r"sdpa: v.shape\[0\] \(batch\) = 1"),
    (dict(q=Q.astype(np.complex64)), r"sdpa: q has dtype complex64, must be floating or integer"),
    (dict(q="not an array"), r"sdpa: q must have rank 4"),
    (dict(q=object()), r"sdpa: q must"),
    (dict(mask=np.zeros((2, 3, 3, 5), bool)), r"sdpa: mask.shape\[1\] = 3 must be 1 or "
                                               r"num_heads = 4"),
    (dict(mask=np.zeros((3, 5), np.int64)), r"sdpa: mask has dtype int64, must be bool"),
    (dict(mask=np.zeros((1, 1, 1, 1, 5), bool)), r"sdpa: mask must have rank 1 to 4"),
    (dict(seqlens_k=[1, 6]), r"sdpa: seqlens_k\[1\] = 6 must be in \[0, seqlen_k = 5\]"),
    (dict(seqlens_k=[1]), r"sdpa: seqlens_k has 1 entries, must have batch = 2"),
    (dict(seqlens_k=[1.5, 2.0]), r"sdpa: seqlens_k has dtype float64, must be integer"),
    (dict(window_size=(1,)), r"sdpa: window_size = \(1,\) must be a pair"),
    (dict(window_size=(-2, 0)), r"sdpa: window_size.left = -2"),
    (dict(window_size=("a", 0)), r"sdpa: window_size\[0\] \(left\) must be an integer"),
    (dict(softmax_scale=0.0), r"sdpa: softmax_scale = 0.0 must be finite and > 0"),
    (dict(softmax_scale=float("nan")), r"sdpa: softmax_scale = nan"),
    (dict(softcap=-1.0), r"sdpa: softcap = -1"),
    (dict(sparse={"kind": "dense"}), r"sdpa: sparse\['kind'\] = 'dense' must be 'strided' or "
                                     r"'fixed'"),
    (dict(sparse={"kind": "fixed", "stride": 2, "summary": 3}), r"sdpa: sparse.summary = 3"),
    (dict(sparse={"kind": "strided", "stide": 2}), r"sdpa: sparse has unknown key 'stide'"),
    (dict(sparse={"stride": 2}), r"sdpa: sparse\['kind'\] is missing"),
    (dict(sparse=[1]), r"sdpa: sparse must be None or a dict"),
    (dict(backend="gpu"), r"sdpa: backend = 'gpu' must be 'auto', 'reference' or 'fast'"),
    (dict(num_threads=-1), r"sdpa: num_threads = -1 must be >= 0"),
    (dict(kv_dtype="float16"), r"sdpa: kv_dtype = 'float16' must be 'float32', 'bfloat16', "
                               r"'int8' or 'fp8_e4m3'"),
])
def test_sdpa_errors(kwargs, pattern):
    args = dict(q=Q, k=K, v=V)
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        attnkit.sdpa(**args)


def test_sdpa_varlen_takes_no_eight_bit_kv():
    q = np.zeros((4, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"sdpa_varlen: kv_dtype = 'int8' must be 'float32' or "
                                         r"'bfloat16' \(8-bit K/V carry scales"):
        attnkit.sdpa_varlen(q, q, q, [0, 4], [0, 4], kv_dtype="int8")


def test_merge_errors():
    out, lse = attnkit.sdpa(Q, K, V, return_lse=True)
    with pytest.raises(ValueError, match=r"merge_attention_states: lse_b must have rank 3"):
        attnkit.merge_attention_states(out, lse, out, lse[0])
    with pytest.raises(ValueError, match=r"merge_attention_states: .*out_b"):
        attnkit.merge_attention_states(out, lse, out[:, :2], lse[:, :, :2])


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(rotary_dim=7), r"rotary_dim = 7"),
    (dict(rotary_dim=10), r"rotary_dim = 10"),
    (dict(rotary_dim=0), r"apply_rope: rotary_dim = 0 must be > 0 \(None = head_dim\)"),
    (dict(theta=1.0), r"theta = 1"),
    (dict(scaling={"rope_type": "dynamic", "factor": 2.0}),
     r"apply_rope: scaling\['rope_type'\] = 'dynamic' is not supported"),
    (dict(scaling={"factor": 2.0}), r"apply_rope: scaling\['rope_type'\] is missing"),
    (dict(scaling={"rope_type": "linear", "factr": 2.0}),
     r"apply_rope: scaling has unknown key 'factr'"),
    (dict(scaling={"rope_type": "linear", "factor": "x"}),
     r"apply_rope: scaling\['factor'\] must be a number"),
    (dict(scaling={"rope_type": "linear", "factor": -2.0}), r"scaling.factor = -2"),
    (dict(scaling={"rope_type": "yarn", "factor": 2.0}),
     r"scaling.original_max_position_embeddings = 0 must be > 0"),
    (dict(scaling="llama3"), r"apply_rope: scaling must be None or a Hugging Face rope_scaling"),
    (dict(positions=np.array([0, 1, -1])),
     r"Rope.apply: positions\[2\] = -1 must be in \[0, 2\^53\)"),
    (dict(positions=np.arange(4)), r"positions has 4 entries, must have seq = 3"),
    (dict(positions=np.array([0.0, 1.0, 2.0])), r"apply_rope: positions has dtype float64, "
                                                r"must be integer"),
    (dict(positions=np.zeros((1, 1, 3), np.int64)), r"apply_rope: positions must have rank 1 "
                                                    r"to 2"),
])
def test_rope_errors(kwargs, pattern):
    args = dict(x=randn(G, 2, 3, 2, 8), positions=np.arange(3))
    args.update(kwargs)
    x_before = args["x"].copy()
    with pytest.raises(ValueError, match=pattern):
        attnkit.apply_rope(**args)
    np.testing.assert_array_equal(args["x"], x_before)


def test_rope_object_errors():
    with pytest.raises(ValueError, match="head_dim = 0"):
        attnkit.Rope(0)
    rope = attnkit.Rope(8)
    with pytest.raises(ValueError, match=r"head_dim|x.shape\[3\]"):
        rope.apply(randn(G, 1, 2, 1, 6))
    with pytest.raises(ValueError, match=r"Rope.apply: x must have rank 4"):
        rope.apply(randn(G, 2, 8))


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(dtype="float16"), r"KVCache: dtype = 'float16' must be 'float32', 'bfloat16', 'int8' "
                            r"or 'fp8_e4m3'"),
    (dict(batch_size=0), r"batch_size = 0"),
    (dict(max_seq_len=-1), r"max_seq_len = -1"),
    (dict(sliding_window=-2), r"sliding_window = -2"),
])
def test_kv_cache_construction_errors(kwargs, pattern):
    args = dict(batch_size=1, max_seq_len=8, num_kv_heads=2, head_dim=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        attnkit.KVCache(**args)


# --------------------------------------------------------------------------
# Configs and layers
# --------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rope_theta": 10000.0, "max_position_embeddings": 64,
         "num_hidden_layers": 2}


@pytest.mark.parametrize("change,pattern", [
    (dict(hidden_size=None), r"hidden_size"),
    (dict(num_key_value_heads=3), r"num_key_value_heads = 3 must divide num_attention_heads = 4"),
    (dict(hidden_size="32"), r"hidden_size"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_scaling.*dynamic"),
    (dict(sliding_window=-4), r"sliding_window = -4"),
    (dict(partial_rotary_factor=1.5), r"partial_rotary_factor = 1.5"),
])
def test_from_config_errors_name_the_field(change, pattern):
    cfg = dict(LLAMA, **change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError, match=pattern):
        attnkit.from_config(cfg)


def test_from_config_argument_errors(tmp_path):
    with pytest.raises(ValueError, match=r"from_config: config must be a dict"):
        attnkit.from_config(42)
    with pytest.raises(OSError):
        attnkit.from_config(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(json.JSONDecodeError):
        attnkit.from_config(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("args,pattern", [
    (("gqa-3", 32, 8), r"gqa-3"),
    (("moe", 32, 8), r"\"moe\" is not one of"),
    (("mha", 30, 8), r"d_model = 30 must be divisible by num_heads = 8"),
    (("mha", 32, 0), r"num_heads = 0"),
])
def test_variant_errors(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        attnkit.attention_from_variant(*args)


@pytest.mark.parametrize("change,pattern", [
    (dict(num_heads=5), r"num_heads"),
    (dict(num_heds=4), r"AttentionLayer: config has unknown key 'num_heds'"),
    (dict(rope={"theta": 10.0, "pairing": "x"}), r"config\['rope'\] has unknown key 'pairing'"),
    (dict(softmax_scale=-1.0), r"softmax_scale = -1.0 must be finite and > 0"),
    (dict(hidden_size="x"), r"config\['hidden_size'\] must be an integer"),
])
def test_layer_from_dict_errors(change, pattern):
    base = attnkit.from_config(LLAMA).config
    with pytest.raises(ValueError, match=pattern):
        attnkit.AttentionLayer(dict(base, **change))


def llama_weights(seed=0, prefix=""):
    g = rng(seed)
    shapes = {"q_proj.weight": (32, 32), "k_proj.weight": (16, 32), "v_proj.weight": (16, 32),
              "o_proj.weight": (32, 32)}
    return {prefix + n: (g.standard_normal(s) / 6).astype(np.float32) for n, s in shapes.items()}


@pytest.mark.parametrize("edit,pattern", [
    (lambda sd: sd.pop("p.k_proj.weight"), r"k_proj.weight"),
    (lambda sd: sd.update({"p.k_proj.weight": np.zeros((16, 31), np.float32)}), r"k_proj.weight"),
    (lambda sd: sd.update({"p.q_proj.bias": np.zeros(32, np.float32)}), r"q_proj.bias"),
    (lambda sd: sd.update({"p.v_proj.weight": np.zeros((16, 32), bool)}),
     r"AttentionLayer.load_state_dict: state_dict\['p.v_proj.weight'\] has dtype bool"),
    (lambda sd: sd.update({"p.o_proj.weight": np.zeros((2, 2, 2, 2, 2), np.float32)}),
     r"state_dict\['p.o_proj.weight'\] must have rank 1 to 4"),
    (lambda sd: sd.update({3: np.zeros(3)}), r"state_dict keys must be str"),
])
def test_bad_weights_raise_and_change_nothing(edit, pattern):
    layer = attnkit.from_config(LLAMA)
    good = llama_weights(0)
    layer.load_state_dict(good)
    x = randn(G, 1, 4, 32)
    before = layer.forward(x)
    sd = llama_weights(1, prefix="p.")
    edit(sd)
    with pytest.raises(ValueError, match=pattern):
        layer.load_state_dict(sd, prefix="p.")
    np.testing.assert_array_equal(layer.forward(x), before)
    for name, w in layer.state_dict().items():
        np.testing.assert_array_equal(w, good[name])


def test_strict_loading_skips_known_buffers_and_rejects_other_names():
    # Exports from older transformers versions keep the RoPE buffers beside
    # the projections; they are not weights.
    layer = attnkit.from_config(LLAMA)
    sd = llama_weights(0, prefix="model.layers.0.self_attn.")
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    layer.load_state_dict(sd, prefix="model.layers.0.self_attn.")
    sd["model.layers.0.self_attn.rotary_emb.freqs"] = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r"unexpected weight 'model.layers.0.self_attn.rotary_emb."
                                         r"freqs'.*rotary_emb.inv_freq.*are ignored"):
        layer.load_state_dict(sd, prefix="model.layers.0.self_attn.")


def test_errors_speak_python():
    """Messages from the C++ core name what a Python caller called: no '::',
    and the layers' loader is load_state_dict, not C++'s load_weights."""
    layer = attnkit.from_config(LLAMA)
    with pytest.raises(ValueError, match=r"^AttentionLayer\.forward: no weights loaded "
                                         r"\(call load_state_dict first\)$"):
        layer.forward(randn(G, 1, 4, 32))
    with pytest.raises(ValueError, match=r"^AttentionLayer\.state_dict: .*\(call load_state_dict\)"):
        layer.state_dict()
    with pytest.raises(ValueError, match=r"^AttentionLayer\.load_state_dict: "):
        layer.load_state_dict({"q_proj.weight": np.zeros((32, 31), np.float32)})
    cache = attnkit.KVCache(1, 4, 2, 16)
    with pytest.raises(ValueError, match=r"^KVCache\.attend: ") as e:
        q = np.zeros((1, 5, 4, 16), np.float32)
        kv = np.zeros((1, 5, 2, 16), np.float32)
        cache.attend(q, kv, kv)
    with pytest.raises(ValueError, match=r"^KVCache: ") as e2:
        attnkit.KVCache(1, 0, 2, 16)
    with pytest.raises(ValueError, match=r"^Rope: "):
        attnkit.Rope(7)
    for err in (e, e2):
        assert "::" not in str(err.value)


def test_load_state_dict_argument_type():
    layer = attnkit.from_config(LLAMA)
    with pytest.raises(ValueError, match=r"q_proj.weight is not loaded yet"):
        layer.state_dict()
    with pytest.raises(ValueError, match=r"state_dict must be a dict"):
        layer.load_state_dict([("q_proj.weight", np.zeros((32, 32)))])


def test_layer_forward_errors():
    layer = attnkit.from_config(LLAMA)
    layer.load_state_dict(llama_weights())
    with pytest.raises(ValueError, match=r"AttentionLayer.forward: x must have rank 3 "
                                         r"\[batch, seq, hidden\], got shape \(4, 32\)"):
        layer.forward(randn(G, 4, 32))
    with pytest.raises(ValueError, match=r"x.shape\[2\] \(hidden_size\) = 31"):
        layer.forward(randn(G, 1, 4, 31))
    with pytest.raises(ValueError, match=r"positions has 3 entries, must have 0 \(default\), "
                                         r"seq = 4 or batch \* seq = 4"):
        layer.forward(randn(G, 1, 4, 32), positions=np.arange(3))
    with pytest.raises(ValueError, match=r"positions\[0\] = -1 must be in \[0, 2\^53\)"):
        layer.forward(randn(G, 1, 4, 32), positions=-np.ones(4, np.int64))
    with pytest.raises(ValueError, match=r"AttentionLayer.forward: cache must be a KVCache"):
        layer.forward(randn(G, 1, 4, 32), cache="cache")
    with pytest.raises(ValueError, match=r"backend = 'cuda'"):
        layer.forward(randn(G, 1, 4, 32), backend="cuda")
    q = randn(G, 2, 3, 32)
    k = randn(G, 2, 5, 32)
    with pytest.raises(ValueError, match=r"AttentionLayer.forward_qkv: key_padding_mask has "
                                         r"shape \(2, 4\), must be \[batch, seqlen_k\] = \(2, 5\)"):
        layer.forward_qkv(q, k, k, key_padding_mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match=r"forward_qkv: key_padding_mask has dtype float64, "
                                         r"must be bool"):
        layer.forward_qkv(q, k, k, key_padding_mask=np.ones((2, 5)))
    with pytest.raises(ValueError, match=r"forward_qkv: mask.shape\[1\] = 3 must be 1 or "
                                         r"num_heads = 4"):
        layer.forward_qkv(q, k, k, mask=np.ones((2, 3, 3, 5), bool),
                          key_padding_mask=np.ones((2, 5), bool))
    with pytest.raises(ValueError, match=r"forward_qkv: value must have rank 3"):
        layer.forward_qkv(q, k, k[0])


def test_failed_forward_leaves_cache_unchanged():
    layer = attnkit.from_config(LLAMA)
    layer.load_state_dict(llama_weights())
    cache = layer.new_cache(1, 6)
    x = randn(G, 1, 8, 32)
    layer.forward(x[:, :4], cache=cache)
    keys, values = cache.keys(), cache.values()
    with pytest.raises(ValueError, match=r"max_seq_len"):
        layer.forward(x[:, 4:7], cache=cache)  # 4 + 3 > 6
    with pytest.raises(ValueError, match=r"hidden_size"):
        layer.forward(x[:, 4:5, :31], cache=cache)
    with pytest.raises(ValueError, match=r"cache spec.batch_size = 1 must equal x.shape\[0\]"):
        layer.forward(randn(G, 2, 1, 32), cache=cache)
    other = attnkit.from_config(dict(LLAMA, num_key_value_heads=4)).new_cache(1, 6)
    with pytest.raises(ValueError, match=r"cache spec.num_kv_heads = 4 must equal "
                                         r"config\(\).num_kv_heads = 2"):
        layer.forward(x[:, 4:5], cache=other)
    assert other.length == 0
    assert cache.length == 4
    np.testing.assert_array_equal(cache.keys(), keys)
    np.testing.assert_array_equal(cache.values(), values)
    layer.forward(x[:, 4:6], cache=cache)  # and it still works
    assert cache.length == 6


def test_new_cache_errors():
    layer = attnkit.from_config(LLAMA)
    with pytest.raises(ValueError, match=r"AttentionLayer.new_cache: dtype = 'int4' must be "
                                         r"'float32', 'bfloat16', 'int8' or 'fp8_e4m3'"):
        layer.new_cache(1, 4, dtype="int4")
    with pytest.raises(ValueError, match=r"max_seq_len = 0"):
        layer.new_cache(1, 0)


def test_non_causal_layer_rejects_cache():
    layer = attnkit.attention_from_variant("mha", 16, 2)
    layer.load_state_dict({n: np.zeros(s, np.float32) for n, s in
                           [("q_proj.weight", (16, 16)), ("k_proj.weight", (16, 16)),
                            ("v_proj.weight", (16, 16)), ("o_proj.weight", (16, 16)),
                            ("q_proj.bias", (16,)), ("k_proj.bias", (16,)),
                            ("v_proj.bias", (16,)), ("o_proj.bias", (16,))]})
    cache = layer.new_cache(1, 4)
    with pytest.raises(ValueError, match=r"causal"):
        layer.forward(randn(G, 1, 2, 16), cache=cache)
    assert cache.length == 0


def test_io_error_is_oserror(tmp_path):
    with pytest.raises(OSError):
        attnkit.save_safetensors(tmp_path / "no" / "such" / "dir.safetensors",
                                 {"a": np.zeros(2, np.float32)})


@pytest.mark.parametrize("cu_q,pattern", [
    ([0, 2**31 - 1], r"sdpa_varlen: cu_seqlens_q\[1\] = 2147483647 must equal q.shape\[0\] = 4"),
    ([0, -2**31, 4], r"sdpa_varlen: cu_seqlens_q\[1\] = -2147483648 must be >= "
                     r"cu_seqlens_q\[0\] = 0"),
    ([0, 3, 1, 4], r"sdpa_varlen: cu_seqlens_q\[2\] = 1 must be >= cu_seqlens_q\[1\] = 3"),
    ([2, 4], r"sdpa_varlen: cu_seqlens_q\[0\] = 2 must be 0"),
])
@pytest.mark.parametrize("return_probs", [False, True])
@pytest.mark.parametrize("max_seqlen_q", [None, 1])
def test_sdpa_varlen_checks_offsets_before_sizing_probs(cu_q, pattern, return_probs,
                                                        max_seqlen_q):
    # With return_probs the probabilities' shape comes from cu_seqlens_q: the
    # offsets are judged first, with the message that names them.
    q = np.zeros((4, 2, 8), np.float32)
    cu_k = [0] * (len(cu_q) - 1) + [4]
    with pytest.raises(ValueError, match=pattern):
        attnkit.sdpa_varlen(q, q, q, cu_q, cu_k, max_seqlen_q=max_seqlen_q,
                            return_probs=return_probs)


def _paged_pool():
    cache = attnkit.PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=2,
                                 head_dim=8)
    return cache, cache.add_sequence()


BIG = 2**63  # a Python int in [2^63, 2^64): numpy makes it uint64; it must not wrap


@pytest.mark.parametrize("call,pattern", [
    (lambda c, a: c.append([BIG], [1]),
     r"PagedKVCache.append: seq_ids\[0\] = 9223372036854775808 does not fit a 64-bit integer"),
    (lambda c, a: c.append([a], [2**64 - 1]),
     r"PagedKVCache.append: num_new_tokens\[0\] = 18446744073709551615 does not fit a 64-bit "
     r"integer"),
    (lambda c, a: c.append(np.array([a, BIG], np.uint64), [1, 1]),
     r"PagedKVCache.append: seq_ids\[1\] = 9223372036854775808 does not fit"),
    (lambda c, a: attnkit.batch_attention(np.zeros((1, 2, 8), np.float32),
                                          np.zeros((1, 2, 8), np.float32),
                                          np.zeros((1, 2, 8), np.float32), [0, 1], [BIG + 5], c, 0),
     r"batch_attention: seq_ids\[0\] = 9223372036854775813 does not fit a 64-bit integer"),
    (lambda c, a: attnkit.batch_attention(np.zeros((1, 2, 8), np.float32),
                                          np.zeros((1, 2, 8), np.float32),
                                          np.zeros((1, 2, 8), np.float32), [0, BIG], [a], c, 0),
     r"batch_attention: cu_seqlens_q\[1\] = 9223372036854775808 does not fit a 64-bit integer"),
])
def test_paged_integers_beyond_int64_are_reported_as_passed(call, pattern):
    cache, a = _paged_pool()
    with pytest.raises(ValueError, match=pattern):
        call(cache, a)
    assert cache.length(a) == 0 and cache.pages_in_use() == 0


def test_sdpa_integers_beyond_int64_are_reported_as_passed():
    q = np.zeros((1, 2, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"sdpa: seqlens_k\[1\] = 9223372036854775808 does not "
                                         r"fit a 64-bit integer"):
        attnkit.sdpa(q, q, q, seqlens_k=np.array([1, BIG], np.uint64))
    with pytest.raises(ValueError, match=r"sdpa: seqlens_k\[0\] = 9223372036854775808 does not"):
        attnkit.sdpa(q[:1], q, q, seqlens_k=[BIG])
    with pytest.raises(ValueError, match=r"sdpa: seqlens_k\[1\] = 1180591620717411303424 does not"):
        attnkit.sdpa(q, q, q, seqlens_k=(1, 2**70))
    qv = q[0]
    for name, args in [("cu_seqlens_q", ([0, BIG], [0, 2])), ("cu_seqlens_k", ([0, 2], [0, BIG]))]:
        with pytest.raises(ValueError, match=r"sdpa_varlen: " + name + r"\[1\] = "
                                             r"9223372036854775808 does not fit"):
            attnkit.sdpa_varlen(qv, qv, qv, *args, return_probs=True)
