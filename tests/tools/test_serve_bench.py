"""`attnkit serve-bench`: the serving benchmark's contract on a tiny model —
every request served with exactly its output tokens, KV figures that agree
with hand-computed values, smaller caches admitting more sequences, paged
admitting at least as many as static, traces read from files, and one clear
line with exit code 2 for malformed traces, impossible budgets and bad
flags. No test asserts on a time."""
import json
import os
import subprocess

import pytest

CLI = os.environ.get("ATTNKIT_CLI", "build/attnkit")

# hidden 64, 4 query heads and 2 kv heads of 16: a llama-shaped config small
# enough that a whole trace takes a fraction of a second.
TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 2, "rope_theta": 10000.0,
               "intermediate_size": 96, "hidden_act": "silu"}
TRACE = ["--requests", "10", "--prompt-tokens", "4-20", "--output-tokens", "2-8"]


def run(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(TINY_CONFIG))
    return str(p)


def serve_json(config, *args):
    r = run("serve-bench", "--config", config, "--layers", "1", *TRACE, "--json", *args)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no progress bar when stderr is not a terminal
    return json.loads(r.stdout)


ROW_FIELDS = {"variant", "kv_dtype", "cache", "memory_bytes", "kv_bytes_per_token",
              "state_bytes_per_sequence", "pool_releases_pages", "pool_pages",
              "static_slots", "static_max_seq_len", "requests", "output_tokens", "duration_s",
              "busy_s", "output_tokens_per_s", "output_tokens_per_s_runs", "requests_per_s", "ttft_s",
              "tpot_s", "peak_running",
              "mean_running", "kv_used_bytes", "kv_reserved_bytes", "preemptions", "steps",
              "tokens_computed", "weight_bytes", "prefix_cache", "queue_s",
              "prefill_tokens_computed", "prefix_hit_rate", "weights", "model_dir",
              "index_key_bytes_per_token", "indexer"}


def test_rows_have_the_documented_fields_and_exact_kv_arithmetic(config):
    j = serve_json(config, "--kv-dtypes", "bf16,f32", "--memory", "64KiB")
    assert j["kind"] == "serve-bench"
    assert j["config"]["layers"] == 1 and j["config"]["weights"] == "bf16"
    assert j["config"]["model_dir"] is None
    trace = j["trace"]
    assert trace["requests"] == 10
    # The default variants of a 4-head GQA model: as configured, mqa, mla.
    assert [r["variant"] for r in j["rows"]] == ["gqa-2", "gqa-2", "mqa", "mqa", "mla", "mla"]
    per_token = {"gqa-2": 2 * 2 * 16, "mqa": 2 * 1 * 16, "mla": 4 * 16 + 8}  # values, one layer
    for r in j["rows"]:
        assert set(r) == ROW_FIELDS
        assert r["kv_bytes_per_token"] == per_token[r["variant"]] * (2 if r["kv_dtype"] == "bf16" else 4)
        assert r["memory_bytes"] == 64 << 10
        assert r["pool_pages"] == (64 << 10) // (16 * r["kv_bytes_per_token"])
        assert r["requests"] == 10 and r["output_tokens"] == trace["output_tokens"]
        assert r["tokens_computed"] >= trace["token_slots"]
        for key in ("ttft_s", "tpot_s"):
            assert r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"]
        assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
        assert r["output_tokens_per_s_runs"] == [r["output_tokens_per_s"]]
        assert 1 <= r["mean_running"] <= r["peak_running"] <= 10
        assert r["kv_used_bytes"]["peak"] <= r["kv_reserved_bytes"]["peak"] <= 64 << 10
        assert r["static_slots"] is None
        assert r["weights"] == "bf16" and r["model_dir"] is None


def test_eight_bit_kv_dtypes_count_their_scales_and_admit_more(config):
    # An 8-bit token row holds its codes, then one fp32 scale per kv head
    # (MLA: per 64 channels of its latent row of 64 + 8), K and V each
    # (kv_cache.h, paged_kv_cache.h); one layer.
    per_token = {"gqa-2": 2 * (2 * 16 + 2 * 4), "mqa": 2 * (16 + 4), "mla": (64 + 8) + 2 * 4}
    j = serve_json(config, "--kv-dtypes", "int8,fp8_e4m3,bf16", "--memory", "8KiB",
                   "--page-size", "4")
    assert [r["kv_dtype"] for r in j["rows"]] == ["int8", "fp8_e4m3", "bf16"] * 3
    rows = {(r["variant"], r["kv_dtype"]): r for r in j["rows"]}
    for (variant, dtype), r in rows.items():
        if dtype != "bf16":
            assert r["kv_bytes_per_token"] == per_token[variant]
        assert r["pool_pages"] == (8 << 10) // (4 * r["kv_bytes_per_token"])
        assert r["output_tokens"] == j["trace"]["output_tokens"]
    # 8 KiB holds 25 pages of gqa-2's int8 rows against 16 of its bf16 ones.
    assert rows["gqa-2", "int8"]["peak_running"] >= rows["gqa-2", "bf16"]["peak_running"]


def test_smaller_caches_and_paging_admit_more(config):
    # 16 KiB holds 128 tokens of MHA (bf16, one layer): a few requests at a time.
    j = serve_json(config, "--variants", "mha,gqa-2,mqa", "--cache", "paged,static",
                   "--memory", "16KiB", "--page-size", "4")
    rows = {(r["variant"], r["cache"]): r for r in j["rows"]}
    peak = {k: r["peak_running"] for k, r in rows.items()}
    assert peak["mqa", "paged"] >= peak["gqa-2", "paged"] >= peak["mha", "paged"]
    assert peak["mqa", "paged"] > peak["mha", "paged"]
    for v in ("mha", "gqa-2", "mqa"):
        s = rows[v, "static"]
        assert peak[v, "paged"] >= peak[v, "static"]
        assert s["preemptions"] == 0 and s["peak_running"] <= s["static_slots"]
        # A static slot reserves the longest request the trace allows: the
        # longest prompt (20) and output (8), less the last output's slot.
        assert s["static_max_seq_len"] == 20 + 8 - 1
        assert s["static_slots"] == (16 << 10) // (27 * s["kv_bytes_per_token"])
    lines = j["conclusions"]
    assert any(l.startswith("paged bf16 16.0 KiB: output tokens/s ") for l in lines)
    assert any("paged serves" in l and "the static cache's output tokens/s" in l for l in lines)


def test_repeats_run_every_configuration_and_report_the_median(config):
    j = serve_json(config, "--variants", "mqa", "--cache", "paged,static", "--repeats", "3")
    assert j["config"]["repeats"] == 3
    for r in j["rows"]:
        runs = r["output_tokens_per_s_runs"]
        assert len(runs) == 3 and r["output_tokens_per_s"] == sorted(runs)[1]


def test_a_trace_file_is_served_as_given(config, tmp_path):
    trace = tmp_path / "trace.jsonl"
    reqs = [{"arrival_s": 0.0, "prompt_tokens": 7, "output_tokens": 3},
            {"arrival_s": 0.01, "prompt_tokens": 12, "output_tokens": 1},
            {"arrival_s": 0.2, "prompt_tokens": 3, "output_tokens": 9}]
    trace.write_text("\n".join(json.dumps(r) for r in reqs) + "\n\n")
    r = run("serve-bench", "--config", config, "--layers", "1", "--trace", str(trace),
            "--variants", "mqa", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["trace"]["source"] == str(trace)
    assert j["trace"]["requests"] == 3 and j["trace"]["output_tokens"] == 13
    assert j["trace"]["token_slots"] == (7 + 2) + 12 + (3 + 8)
    row = j["rows"][0]
    assert row["output_tokens"] == 13
    assert row["duration_s"] >= 0.2  # the last request arrives at 0.2 s


@pytest.mark.parametrize("text, says", [
    ("{not json\n", "line 1: not a JSON object"),
    ('{"arrival_s": 0, "prompt_tokens": 4}\n', "line 1: output_tokens must be an integer in [1, 2^30], got nothing"),
    ('\n{"arrival_s": -1, "prompt_tokens": 4, "output_tokens": 2}\n', "line 2: arrival_s must be a number >= 0"),
    ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 2}\n', "prompt_tokens must be an integer in [1, 2^30], got 0"),
    ('{"arrival_s": 0, "prompt_tokens": 2.5, "output_tokens": 2}\n', "prompt_tokens must be an integer in [1, 2^30], got 2.5"),
    ('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2, "user": 1}\n', 'unknown field "user"'),
    ("[1, 2]\n", "line 1: not a JSON object"),
    ("\n\n", "holds no requests"),
])
def test_malformed_traces_exit_2_with_one_line(config, tmp_path, text, says):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(text)
    r = run("serve-bench", "--config", config, "--trace", str(trace))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnkit serve-bench: ") and says in lines[0], r.stderr


def test_an_impossible_budget_exits_2_naming_the_request(config, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2}\n'
                     '{"arrival_s": 0, "prompt_tokens": 300, "output_tokens": 30}\n')
    # mqa, bf16, one layer: 64 B per token, pages of 16 tokens = 1 KiB; 8 KiB holds 8 pages.
    r = run("serve-bench", "--config", config, "--layers", "1", "--variants", "mqa", "--trace",
            str(trace), "--memory", "8KiB")
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "attnkit serve-bench: mqa bf16 paged --memory 8.00 KiB: request 1 (300 prompt + 30 output "
        "tokens) needs 21 pages of 16 tokens (1024 bytes each), but the budget of 8192 bytes holds 8")
    s = run("serve-bench", "--config", config, "--layers", "1", "--variants", "mqa", "--trace",
            str(trace), "--memory", "8KiB", "--cache", "static")
    assert s.returncode == 2 and "a static cache slot of 329 tokens needs 21056 bytes" in s.stderr


@pytest.mark.parametrize("args, says", [
    (["--cache", "dense"], "--cache entries must be paged or static, got 'dense'"),
    (["--kv-dtypes", "int3"], "--kv-dtypes entries must be f32, bf16, int8 or fp8_e4m3, got 'int3'"),
    (["--weights", "f16"], "--weights must be f32 or bf16, got 'f16'"),
    (["--variants", "gqa-3"], "--variants: gqa-3: 3 kv heads must divide the model's 4 heads"),
    (["--variants", "mha,bogus"],
     "--variants: unknown variant 'bogus' (mha, mqa, gqa-N, mla, mla-dsa, all-full)"),
    (["--rate", "0"], "--rate must be a number > 0 (requests per second) or inf, got '0'"),
    (["--prompt-tokens", "9-3"], "--prompt-tokens must be N or A-B with 1 <= A <= B, got '9-3'"),
    (["--output-tokens", "x"], "--output-tokens must be N or A-B (token counts >= 1), got 'x'"),
    (["--memory", "12XB"], "--memory: unknown size unit 'XB' in '12XB'"),
    (["--memory", "0"], "--memory entries must be > 0, got '0'"),
    (["--json", "--csv"], "give at most one of --json and --csv"),
    (["--trace", "t.jsonl", "--requests", "4"], "--requests describes a synthetic trace; it cannot go with --trace"),
])
def test_bad_flags_exit_2_with_one_line(config, args, says):
    r = run("serve-bench", "--config", config, *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnkit serve-bench: ") and says in lines[0], r.stderr


def test_mlp_needs_the_config_and_runs_dense_and_moe(config, tmp_path):
    r = run("serve-bench", "--mlp")
    assert r.returncode == 2 and "--mlp needs --config" in r.stderr
    j = serve_json(config, "--mlp", "--variants", "mqa")
    assert j["config"]["mlp"] and j["rows"][0]["output_tokens"] == j["trace"]["output_tokens"]
    # q, k, v, o of mqa, then the dense SwiGLU (gate, up, down of 64 x 96) as a
    # one-expert MoE, whose router is one row of 64; all bf16.
    attention = (64 * 64 + 2 * 16 * 64 + 64 * 64) * 2
    assert j["rows"][0]["weight_bytes"] == attention + (64 + 3 * 64 * 96) * 2
    moe = dict(TINY_CONFIG, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    p = tmp_path / "mixtral.json"
    p.write_text(json.dumps(moe))
    m = serve_json(str(p), "--mlp", "--variants", "mqa")
    assert m["rows"][0]["weight_bytes"] == attention + (4 * 64 + 4 * 3 * 64 * 96) * 2


def test_mlp_errors_name_the_config_and_oversized_models_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(TINY_CONFIG, model_type="mixtral", num_local_experts=4,
                                   num_experts_per_tok=9)))
    r = run("serve-bench", "--config", str(bad), "--mlp")
    assert r.returncode == 2 and r.stderr.startswith(f"attnkit serve-bench: --mlp: {bad}: ")
    assert "num_experts_per_tok" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # 2^16 experts of 4096 x 14336: petabytes, refused before anything is allocated.
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 4096,
                                "num_attention_heads": 32, "num_key_value_heads": 8,
                                "num_hidden_layers": 32, "intermediate_size": 14336,
                                "num_local_experts": 65536,
                                "num_experts_per_tok": 2}))
    h = run("serve-bench", "--config", str(huge), "--mlp", "--variants", "gqa-8")
    assert h.returncode == 2 and "the served layers' weights would take " in h.stderr
    assert "more than this machine's" in h.stderr and "leave out --mlp" in h.stderr


def test_prefix_cache_rows_and_shared_prefix_traces(config):
    j = serve_json(config, "--variants", "mqa", "--prefix-cache", "off,on", "--shared-prefix",
                   "32", "--prefix-groups", "2", "--turns", "2", "--memory", "256KiB")
    assert j["trace"]["requests"] == 20  # 10 conversations of 2 turns
    assert (j["trace"]["shared_prefix"], j["trace"]["prefix_groups"], j["trace"]["turns"]) == (32, 2, 2)
    off, on = j["rows"]
    assert (off["prefix_cache"], on["prefix_cache"]) == (False, True)
    assert off["prefix_hit_rate"] == 0 and on["prefix_hit_rate"] > 0.3
    assert off["prefill_tokens_computed"] == j["trace"]["prompt_tokens"]
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert on["output_tokens"] == off["output_tokens"] == j["trace"]["output_tokens"]
    assert any("the prefix cache took over" in line for line in j["conclusions"])
    r = run("serve-bench", "--config", config, "--prefix-cache", "on", "--cache", "static")
    assert r.returncode == 2 and "--prefix-cache on needs --cache paged" in r.stderr
    r = run("serve-bench", "--config", config, "--prefix-cache", "maybe")
    assert r.returncode == 2 and "--prefix-cache entries must be on or off, got 'maybe'" in r.stderr


def test_trace_files_may_give_prompt_token_ids(config, tmp_path):
    trace = tmp_path / "trace.jsonl"
    reqs = [{"arrival_s": 0.0, "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "output_tokens": 3},
            {"arrival_s": 0.0, "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 10], "output_tokens": 2,
             "prompt_tokens": 9}]
    trace.write_text("\n".join(json.dumps(r) for r in reqs) + "\n")
    r = run("serve-bench", "--config", config, "--layers", "1", "--trace", str(trace),
            "--variants", "mqa", "--page-size", "4", "--max-seqs", "1", "--prefix-cache", "on",
            "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)["rows"][0]
    assert row["prefill_tokens_computed"] == 9 + 1  # the second reuses two pages of 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_token_ids": [1, 512], "output_tokens": 2}\n')
    r = run("serve-bench", "--config", config, "--trace", str(bad))
    assert r.returncode == 2 and "prompt_token_ids entries must be integers in [0, 512)" in r.stderr


def test_table_and_csv(config):
    r = run("serve-bench", "--config", config, "--layers", "1", *TRACE, "--variants", "mha,mqa",
            "--memory", "32KiB")
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0].startswith("serving " + config + ": 1 layer, bf16 weights")
    header = next(l for l in lines if l.startswith("variant"))
    for col in ("out tok/s", "TTFT p50", "TPOT p50", "seqs peak", "KV used", "reserved", "preempt"):
        assert col in header
    assert all(l == l.rstrip() for l in lines)
    assert "What this means here:" in lines
    c = run("serve-bench", "--config", config, "--layers", "1", *TRACE, "--variants", "mha,mqa",
            "--memory", "32KiB", "--csv")
    assert c.returncode == 0, c.stderr
    rows = c.stdout.strip().splitlines()
    assert len(rows) == 3
    assert rows[0].split(",")[:3] == ["variant", "kv_dtype", "cache"]
    assert "ttft_s_p99" in rows[0].split(",") and "kv_used_bytes_peak" in rows[0].split(",")


def test_plot_draws_throughput_and_concurrency_against_memory(config, tmp_path):
    pytest.importorskip("matplotlib")
    j = serve_json(config, "--variants", "mha,mqa", "--memory", "16KiB,64KiB", "--cache",
                   "paged,static")
    assert sorted({r["memory_bytes"] for r in j["rows"]}) == [16 << 10, 64 << 10]
    result = tmp_path / "serve.json"
    result.write_text(json.dumps(j))
    out = tmp_path / "plots"
    p = run("plot", "--input", str(result), "--out", str(out), "--format", "png,svg", "--json")
    assert p.returncode == 0, p.stderr
    assert "Warning" not in p.stderr, p.stderr  # matplotlib's, e.g. a line style given twice
    names = {f["plot"] for f in json.loads(p.stdout)["files"]}
    assert names == {"serve_throughput_vs_memory", "serve_concurrency_vs_memory"}
    for name in names:
        png = (out / (name + ".png")).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
        assert b"<svg" in (out / (name + ".svg")).read_bytes()[:2000]


def test_compare_has_a_serving_section():
    tiny = ["compare", "--d-model", "64", "--heads", "4", "--context", "32", "--prompt", "8",
            "--steps", "1", "--repeats", "1", "--peak-gflops", "300", "--bandwidth-gbps", "35"]
    r = run(*tiny, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["serving"]
    rows = {row["variant"]: row for row in s["rows"]}
    assert set(rows) == {"mha", "mqa", "mla"}
    # One layer, f32 KV: K and V of 4 heads of 16 for mha, of one head for mqa.
    assert rows["mha"]["kv_bytes_per_token"] == 2 * 4 * 16 * 4
    assert rows["mqa"]["kv_bytes_per_token"] == 2 * 1 * 16 * 4
    # The budget is MHA's cache for 4 of the 16 requests, in whole pages.
    assert s["requests"] == 16
    pages = (s["token_slots"] * 4 // 16 + 15) // 16
    assert s["budget_bytes"] == pages * 16 * rows["mha"]["kv_bytes_per_token"]
    assert rows["mqa"]["mean_running"] > rows["mha"]["mean_running"]
    assert rows["mqa"]["peak_running"] >= rows["mla"]["peak_running"] >= rows["mha"]["peak_running"]
    assert s["sentence"].startswith("With the KV cache capped at ")
    assert "mqa (128 B per token) ran " in s["sentence"] and "mha (512 B)" in s["sentence"]
    t = run(*tiny)
    assert t.returncode == 0 and t.stderr == ""
    assert "\nServing (continuous batching over a paged KV pool of " in t.stdout
    assert "With the KV cache capped at" in t.stdout
    n = run(*tiny, "--no-serve", "--json")
    assert n.returncode == 0 and "serving" not in json.loads(n.stdout)


def test_the_gemm_field_names_what_ran_for_the_weights_used(config):
    # f32 weights run oneDNN's f32 kernels: nothing is widened or streamed;
    # bf16 weights name their own GEMM (the stream GEMM for decode rows, or
    # oneDNN), never the f32 one's name alone.
    f32 = serve_json(config, "--variants", "mqa", "--weights", "f32")["config"]["gemm"]
    bf16 = serve_json(config, "--variants", "mqa", "--weights", "bf16")["config"]["gemm"]
    assert f32.startswith("oneDNN") and "widened" not in f32 and "stream" not in f32, f32
    assert "bf16" in bf16 or "widened" in bf16, bf16
    assert f32 != bf16


def write_checkpoint(path, vocab=50, drop=None):
    """A 2-layer Llama of hidden 32 (4 query heads, 2 kv heads of 8): its
    matrices stored as float16, its norms as float32, N(0, 1/in) and
    1 + N(0, 0.1); `drop` leaves one tensor out."""
    import numpy as np
    import attnkit
    os.makedirs(path, exist_ok=True)
    config = {"model_type": "llama", "vocab_size": vocab, "hidden_size": 32,
              "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (vocab, 32), "lm_head.weight": (vocab, 32),
              "model.norm.weight": (32,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (32,),
                       p + "post_attention_layernorm.weight": (32,),
                       p + "self_attn.q_proj.weight": (32, 32),
                       p + "self_attn.k_proj.weight": (16, 32),
                       p + "self_attn.v_proj.weight": (16, 32),
                       p + "self_attn.o_proj.weight": (32, 32),
                       p + "mlp.gate_proj.weight": (48, 32), p + "mlp.up_proj.weight": (48, 32),
                       p + "mlp.down_proj.weight": (32, 48)})
    g = np.random.default_rng(0)
    tensors = {n: (1 + 0.1 * g.standard_normal(s)).astype(np.float32) if len(s) == 1
               else (g.standard_normal(s) / np.sqrt(s[1])).astype(np.float16)
               for n, s in shapes.items() if n != drop}
    attnkit.save_safetensors(str(path / "model.safetensors"), tensors)
    return str(path)


def test_model_dir_serves_the_checkpoint_through_the_same_engine(tmp_path):
    d = write_checkpoint(tmp_path / "llama")
    r = run("serve-bench", "--model-dir", d, *TRACE, "--shared-prefix", "16",
            "--prefix-cache", "off,on", "--page-size", "4", "--max-seqs", "2", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    c = j["config"]
    assert c["model_dir"] == d and c["layers"] == 2 and c["mlp"] and c["weights"] == "f16+f32"
    off, on = j["rows"]
    for row in (off, on):
        assert set(row) == ROW_FIELDS
        assert row["model_dir"] == d and row["weights"] == "f16+f32" and row["variant"] == "gqa-2"
        # The synthetic prompts' ids are below the checkpoint's 50 (the
        # engine refuses any other), and every request got its tokens.
        assert row["output_tokens"] == j["trace"]["output_tokens"]
        assert row["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 2  # (k, v) x kv heads x 8 x bf16 x layers
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"] == j["trace"]["prompt_tokens"]
    table = run("serve-bench", "--model-dir", d, *TRACE)
    assert table.returncode == 0, table.stderr
    assert f"serving {d}: 2 layers + feed-forward, f16+f32 weights" in table.stdout
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_token_ids": [1, 50], "output_tokens": 2}\n')
    bad = run("serve-bench", "--model-dir", d, "--trace", str(trace))
    assert bad.returncode == 2 and "must be integers in [0, 50)" in bad.stderr


@pytest.mark.parametrize("flag", [["--layers", "1"], ["--variants", "mqa"], ["--weights", "f32"],
                                  ["--mlp"], ["--model", "llama-3-8b"], ["--config", "c.json"]])
def test_model_dir_refuses_the_random_models_flags_by_name(tmp_path, flag):
    r = run("serve-bench", "--model-dir", write_checkpoint(tmp_path / "llama"), *flag)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"attnkit serve-bench: {flag[0]} does not apply with --model-dir "
                                "(the checkpoint gives its layers, attention, feed-forward and "
                                "weights)")


def test_model_dir_bad_checkpoints_exit_2_naming_what(tmp_path):
    r = run("serve-bench", "--model-dir", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "--model-dir '" in r.stderr and "is not a directory" in r.stderr
    d = write_checkpoint(tmp_path / "llama", drop="model.layers.1.mlp.up_proj.weight")
    r = run("serve-bench", "--model-dir", d)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--model-dir: Model::from_pretrained" in r.stderr
    assert "model.layers.1.mlp.up_proj.weight' is missing" in r.stderr


# A DeepSeek-V3.2 indexer key per token and layer: index_head_dim fp8 codes
# and one f32 scale per 128 of them.
def index_key_bytes(index_head_dim):
    return index_head_dim + 4 * (index_head_dim // 128)


def test_dsa_model_serves_mla_and_mla_dsa_with_the_indexer_keys_in_the_pool():
    r = run("serve-bench", "--model", "deepseek-v3.2", "--layers", "1", "--variants", "mla,mla-dsa",
            "--requests", "2", "--prompt-tokens", "8-12", "--output-tokens", "2", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    rows = {row["variant"]: row for row in j["rows"]}
    assert [row["variant"] for row in j["rows"]] == ["mla", "mla-dsa"]
    mla, dsa = rows["mla"], rows["mla-dsa"]
    # One layer of bf16 latent [512 + 64]; DSA adds its 128-dim indexer key.
    assert mla["kv_bytes_per_token"] == 2 * (512 + 64)
    assert dsa["kv_bytes_per_token"] - mla["kv_bytes_per_token"] == index_key_bytes(128) == 132
    assert dsa["index_key_bytes_per_token"] == 132 and mla["index_key_bytes_per_token"] == 0
    assert mla["indexer"] is None
    assert dsa["indexer"] == {"n_heads": 64, "head_dim": 128, "topk": 2048, "scales": "ue8m0",
                              "from": "config", "key_bytes_per_token_per_layer": 132}
    for row in (mla, dsa):
        assert row["output_tokens"] == j["trace"]["output_tokens"]
    assert dsa["weight_bytes"] > mla["weight_bytes"]  # the indexer's projections
    assert any(line.startswith("paged bf16 ") and "mla-dsa (top-2048) serves" in line
               for line in j["conclusions"])


TINY_MLA = {"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "rope_theta": 10000.0}


def test_mla_dsa_of_a_plain_mla_model_takes_deepseek_v32_indexer_and_a_dsa_config_its_own(
        tmp_path):
    plain = tmp_path / "mla.json"
    plain.write_text(json.dumps(TINY_MLA))
    j = serve_json(str(plain), "--variants", "mla,mla-dsa", "--kv-dtypes", "bf16,f32")
    rows = {(r["variant"], r["kv_dtype"]): r for r in j["rows"]}
    for dtype, size in (("bf16", 2), ("f32", 4)):
        assert rows["mla", dtype]["kv_bytes_per_token"] == size * (32 + 8)
        assert (rows["mla-dsa", dtype]["kv_bytes_per_token"]
                == size * (32 + 8) + index_key_bytes(128))
        assert rows["mla-dsa", dtype]["indexer"]["from"] == "DeepSeek-V3.2 defaults"
        assert rows["mla-dsa", dtype]["indexer"]["topk"] == 2048
    # A deepseek_v32 config: its own indexer, 2 layers of 256-dim keys; by
    # default both variants.
    v32 = dict(TINY_MLA, model_type="deepseek_v32", index_n_heads=2, index_head_dim=256,
               index_topk=8)
    (tmp_path / "v32.json").write_text(json.dumps(v32))
    r = run("serve-bench", "--config", str(tmp_path / "v32.json"), "--layers", "2", *TRACE,
            "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["variant"]: row for row in json.loads(r.stdout)["rows"]}
    assert list(rows) == ["mla", "mla-dsa"]
    assert rows["mla-dsa"]["indexer"]["from"] == "config"
    assert rows["mla-dsa"]["indexer"]["n_heads"] == 2 and rows["mla-dsa"]["indexer"]["topk"] == 8
    assert rows["mla-dsa"]["index_key_bytes_per_token"] == 2 * index_key_bytes(256)
    assert (rows["mla-dsa"]["kv_bytes_per_token"] - rows["mla"]["kv_bytes_per_token"]
            == 2 * index_key_bytes(256))


def test_mla_dsa_is_refused_where_it_is_not_defined(config, tmp_path):
    r = run("serve-bench", "--config", config, "--layers", "1", *TRACE, "--variants", "mla-dsa")
    assert r.returncode == 2
    assert "mla-dsa" in r.stderr and "is not MLA" in r.stderr
    no_q = dict(TINY_MLA)
    no_q["q_lora_rank"] = None  # DeepSeek-V2-Lite's: no query compression
    (tmp_path / "noq.json").write_text(json.dumps(no_q))
    r = run("serve-bench", "--config", str(tmp_path / "noq.json"), "--layers", "1", *TRACE,
            "--variants", "mla-dsa")
    assert r.returncode == 2
    assert "q_lora_rank" in r.stderr and "mla-dsa" in r.stderr
