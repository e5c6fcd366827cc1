"""The attnkit tool's contract: exit codes, one-line errors, JSON schemas,
and figures that agree with hand-computed values (shared/reference/mla.md)."""
import json
import os
import subprocess
import sys

import pytest

CLI = os.environ.get("ATTNKIT_CLI", "build/attnkit")
# Machine figures are given so no test measures the machine; compare and
# bench do time their work, but no test asserts on a time.
FIXED = ["--peak-gflops", "300", "--bandwidth-gbps", "35"]


def run(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0
    for cmd in ("compare", "analyze", "plan", "bench", "plot", "presets"):
        assert cmd in r.stdout


@pytest.mark.parametrize("args", [
    ["nonsense"],
    ["analyze", "--bogus"],
    ["analyze", "--model", "no-such-model"],
    ["analyze", "--config", "/nonexistent/config.json"],
    ["analyze", "--model", "llama-3-8b", "--config", "x.json"],
    ["analyze", "--model", "llama-3-8b", "--context", "abc"],
    ["analyze", "--model", "llama-3-8b", "--kv-dtype", "int3"],
    ["plan", "--model", "llama-3-8b", "--context", "4096"],
    ["plan", "--model", "llama-3-8b", "--memory", "24XB", "--context", "4096"],
    ["plan", "--model", "llama-3-8b", "--memory", "24GiB"],
    ["compare", "--kv-dtype", "int4"],
    ["compare", "--d-model", "100", "--heads", "3"],
    ["compare", "--variants", "mha,gqa-3"],
    ["compare", "--variants", "mha,,mqa"],
    ["compare", "--backend", "gpu"],
    ["compare", "--context", "0"],
    ["compare", "--steps"],
    ["bench", "--kv-dtypes", "f16"],
    ["bench", "--modes", "train"],
    ["bench", "--variants", "gqa-5"],
    ["bench", "--contexts", "0"],
    ["bench", "--json", "--csv"],
    ["bench", "--rotate", "12XB"],
    ["plot", "--format", "gif"],
    ["plot", "--input", "/nonexistent/bench.json"],
])
def test_bad_flags_exit_2_with_one_line(args):
    r = run(*args)
    assert r.returncode == 2
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("attnkit")


# The exact line for each kind of bad flag: the parser (CLI11) is wrapped so
# that every message names the flag, the value and the rule in the tool's
# own words, whatever CLI11 would have said.
@pytest.mark.parametrize("args, message", [
    (["analyze", "--bogus"], "attnkit analyze: unknown argument '--bogus' (see attnkit analyze --help)"),
    (["analyze", "--model", "llama-3-8b", "--context", "abc"],
     "attnkit analyze: --context expects an integer, got 'abc'"),
    (["analyze", "--model", "llama-3-8b", "--context=abc"],
     "attnkit analyze: --context expects an integer, got 'abc'"),
    (["analyze", "--model", "llama-3-8b", "--context", "0"],
     "attnkit analyze: --context must be >= 1, got 0"),
    (["analyze", "--model", "llama-3-8b", "--context"], "attnkit analyze: --context needs a value"),
    (["analyze", "--model", "llama-3-8b", "--context", "5", "6"],
     "attnkit analyze: unknown argument '6' (see attnkit analyze --help)"),
    (["analyze", "--model", "llama-3-8b", "--json=1"], "attnkit analyze: --json takes no value"),
    (["analyze", "--model", "llama-3-8b", "--json=true"], "attnkit analyze: --json takes no value"),
    (["analyze", "--model", "llama-3-8b", "--mla-ranks", "1,0"],
     "attnkit analyze: --mla-ranks values must be >= 1, got 0"),
    (["analyze", "--model", "llama-3-8b", "--peak-gflops", "inf"],
     "attnkit analyze: --peak-gflops expects a number, got 'inf'"),
    (["plan", "--model", "llama-3-8b", "--memory", "GiB", "--context", "5"],
     "attnkit plan: --memory: 'GiB' is not a size (try 24GiB, 512MiB, 4096)"),
    (["compare", "--variants", "mha,,mqa"], "attnkit compare: --variants has an empty entry in 'mha,,mqa'"),
    (["compare", "--threads", "-1"], "attnkit compare: --threads must be >= 0, got -1"),
    (["presets", "--x"], "attnkit presets: unknown argument '--x' (see attnkit presets --help)"),
])
def test_bad_flag_messages(args, message):
    r = run(*args)
    assert r.returncode == 2
    assert r.stderr.strip() == message


def test_integer_out_of_range_says_so():
    r = run("analyze", "--model", "llama-3-8b", "--context", "99999999999999999999")
    assert r.returncode == 2
    assert r.stderr.strip() == ("attnkit analyze: --context 99999999999999999999 is out of range "
                                "(at most 9223372036854775807)")


def test_sizes_accept_pib():
    r = run("plan", "--model", "llama-3-8b", "--memory", "2PiB", "--context", "4096", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["memory_bytes"] == 2 << 50


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("attnkit ") and r.stdout.strip()[-1].isdigit()


def test_a_flag_given_twice_keeps_the_last_value():
    r = run("analyze", "--model", "llama-3-8b", "--context", "5", "--context", "9", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["context"] == 9


def test_unreadable_config(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    r = run("analyze", "--config", str(p))
    assert r.returncode == 2 and "JSON" in r.stderr


def test_every_command_has_help():
    for cmd in ("compare", "analyze", "plan", "bench", "plot", "presets"):
        r = run(cmd, "--help")
        assert r.returncode == 0 and "usage: attnkit " + cmd in r.stdout
        if cmd != "presets":
            assert "examples:" in r.stdout and "--json" in r.stdout


def test_memory_zero_says_it_must_be_positive():
    r = run("plan", "--model", "llama-3-8b", "--memory", "0", "--context", "4096", *FIXED)
    assert r.returncode == 2
    assert r.stderr.strip() == "attnkit plan: --memory must be > 0, got 0 bytes"


def test_a_directory_as_config_says_it_is_a_directory(tmp_path):
    r = run("analyze", "--config", str(tmp_path), *FIXED)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"attnkit analyze: --config '{tmp_path}' is a directory; "
                                "give the config.json file")


@pytest.mark.parametrize("out", ["/proc/attnkit-plots", "/dev/null/plots"])
def test_plot_out_that_cannot_be_written_is_a_usage_error(tmp_path, out):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": [], "machine": {}}))
    r = run("plot", "--input", str(bench), "--out", out)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"attnkit plot: cannot create --out '{out}'")


def test_analyze_mla_family_without_mla_fields_is_rejected_as_from_config_rejects_it(tmp_path):
    attnkit = pytest.importorskip("attnkit")
    cfg = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
           "num_key_value_heads": 128, "num_hidden_layers": 61}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    r = run("analyze", "--config", str(p), *FIXED)
    assert r.returncode == 2
    with pytest.raises(ValueError) as e:
        attnkit.from_config(cfg)
    assert "q_lora_rank is missing" in str(e.value)
    # One reader: the same message, each under its own entry point's name.
    rule = str(e.value).split(": ", 1)[1]
    assert r.stderr.strip() == f"attnkit analyze: {p}: model_shape_from_json: {rule}"


def test_analyze_huge_context_and_batch_print_the_true_size():
    # 2e9 tokens x 2e9 sequences x 128 KiB/token: 5.2e23 B, past 2^63 B
    # (8 EiB), which an int64 would have capped at 8388608 TiB.
    r = run("analyze", "--model", "llama-3-8b", "--context", "2000000000", "--batch", "2000000000",
            "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["kv_cache_bytes"]["bf16"] == pytest.approx(131072 * 2e9 * 2e9, rel=1e-15)
    assert j["kv_cache_bytes"]["f32"] == pytest.approx(2 * 131072 * 2e9 * 2e9, rel=1e-15)
    t = run("analyze", "--model", "llama-3-8b", "--context", "2000000000", "--batch", "2000000000",
            *FIXED)
    row = next(l for l in t.stdout.splitlines() if l.startswith("KV cache @"))
    # 8-bit: 1 byte per value and an fp32 scale per row of a kv head
    # (65536 + 2048 bytes per token for Llama-3-8B).
    assert row.endswith("444 ZiB | 888 ZiB | 229 ZiB")


def test_analyze_what_if_bytes_follow_kv_dtype():
    r = run("analyze", "--model", "llama-3-8b", "--context", "1000", "--kv-dtype", "f32", *FIXED)
    assert r.returncode == 0, r.stderr
    header = next(l for l in r.stdout.splitlines() if l.startswith("variant"))
    assert "KV/token (f32)" in header and "bf16" not in header
    # gqa-8: 8 kv heads x (128 + 128) x 32 layers x 4 B = 256 KiB per token
    row = next(l for l in r.stdout.splitlines() if l.startswith("gqa-8 "))
    assert "256 KiB" in row
    j = json.loads(run("analyze", "--model", "llama-3-8b", "--context", "1000", "--kv-dtype", "f32",
                       "--json", *FIXED).stdout)
    gqa8 = next(s for s in j["sweep"] if s["variant"] == "gqa-8")
    assert gqa8["kv_bytes_per_token"] == 262144 and gqa8["kv_bytes_per_token_bf16"] == 131072


@pytest.mark.parametrize("args", [
    ["analyze", "--model", "deepseek-v3"],
    ["plan", "--model", "llama-3-8b", "--memory", "24GiB", "--context", "32768"],
    ["presets"],
])
def test_tables_have_no_trailing_spaces(args):
    r = run(*args, *([] if args[0] == "presets" else FIXED))
    assert r.returncode == 0, r.stderr
    assert [l for l in r.stdout.splitlines() if l != l.rstrip()] == []


def test_plan_caps_max_context_at_the_model_position_limit(tmp_path):
    # Mixtral: 32768 positions; 128 GiB would hold over a million tokens.
    cfg = {"model_type": "mixtral", "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "num_hidden_layers": 32, "max_position_embeddings": 32768,
           "sliding_window": None}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    r = run("plan", "--config", str(p), "--memory", "128GiB", "--batch", "1", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["max_position_embeddings"] == 32768
    for row in j["rows"]:
        assert row["context"] <= 32768
    row = next(r for r in j["rows"] if r["as_configured"] and r["kv_dtype"] == "bf16")
    assert row["context"] == 32768 and row["context_limited_by_model"]
    assert row["memory_max_context"] == (128 << 30) // 131072       # 128 KiB/token in bf16
    t = run("plan", "--config", str(p), "--memory", "128GiB", "--batch", "1", *FIXED)
    assert "32768 (model limit; memory allows 1048576)" in t.stdout
    # A --context past the limit is flagged.
    c = run("plan", "--config", str(p), "--memory", "128GiB", "--context", "100000", *FIXED)
    assert c.returncode == 0 and "past the model's max_position_embeddings (32768)" in c.stdout
    cj = json.loads(run("plan", "--config", str(p), "--memory", "128GiB", "--context", "100000",
                        "--json", *FIXED).stdout)
    assert cj["context_beyond_model_limit"]


def test_analyze_json_matches_hand_computed(tmp_path):
    r = run("analyze", "--model", "deepseek-v3", "--context", "4096", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["kv_bytes_per_token"]["bf16"] == 70272          # 576 values x 61 layers x 2 B
    assert j["mla_naive_kv_bytes_per_token"]["bf16"] == 4997120
    assert j["attention_params_per_layer"] == 187107328
    assert j["kv_cache_bytes"]["bf16"] == 70272 * 4096
    assert j["model"]["mla"]["kv_lora_rank"] == 512
    assert j["decode_bound"] in ("memory", "compute")
    assert all("kv_bytes_per_token_bf16" in row for row in j["sweep"])


def test_analyze_config_file_with_sliding_window(tmp_path):
    cfg = {"model_type": "mistral", "hidden_size": 256, "num_attention_heads": 8,
           "num_key_value_heads": 2, "num_hidden_layers": 4, "sliding_window": 100}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    r = run("analyze", "--config", str(p), "--context", "1000", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    per_token = 2 * 2 * 32 * 4 * 2                   # K+V, kv heads, head_dim, layers, bf16
    assert j["kv_bytes_per_token"]["bf16"] == per_token
    assert j["kv_cache_bytes"]["bf16"] == per_token * 100   # capped by the window
    kvs = sorted(row["num_kv_heads"] for row in j["sweep"] if row["variant"] != "mla")
    assert kvs == [1, 2, 4, 8]


def test_plan_answers_the_batch_question():
    # "How much KV cache does Llama-3-8B need at 32K in bf16, and which variant
    # fits batch 16 in 24 GiB?" -> one command.
    r = run("plan", "--model", "llama-3-8b", "--memory", "24GiB", "--context", "32768", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    rows = {(row["variant"], row["kv_dtype"]): row for row in j["rows"]}
    per_seq = 131072 * 32768                         # 128 KiB/token x 32K
    assert rows[("gqa-8", "bf16")]["batch"] == (24 << 30) // per_seq
    assert rows[("mqa", "bf16")]["batch"] == (24 << 30) // (per_seq // 8)
    assert not rows[("mha", "f32")]["fits"]
    assert rows[("mqa", "bf16")]["batch"] >= 16


def test_plan_ranks_models_the_parallel_strategies():
    # Llama-3-8B over 8 ranks at batch 2 x 8192: 8 kv heads, one per rank.
    r = run("plan", "--model", "llama-3-8b", "--memory", "24GiB", "--batch", "2",
            "--ranks", "8", "--link-gbps", "200", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["parallel"]
    assert p["ranks"] == 8 and p["batch"] == 2 and p["context"] == 8192
    assert p["link_gbps"] == 200 and p["link_latency_us"] == 5
    s = {x["strategy"]: x for x in p["strategies"]}
    assert set(s) == {"single", "head-parallel", "context-parallel"}
    single, heads, tokens = s["single"], s["head-parallel"], s["context-parallel"]
    kv = 2 * 8192 * 131072                               # 128 KiB/token in bf16, all layers
    assert single["kv_bytes_per_rank"] == kv
    assert heads["kv_bytes_per_rank"] == kv / 8          # one kv head of 8 per rank
    assert tokens["kv_bytes_per_rank"] == kv / 8         # 8192 tokens in 16 equal chunks
    assert tokens["weight_bytes_per_rank"] == single["weight_bytes_per_rank"]
    assert heads["weight_bytes_per_rank"] < single["weight_bytes_per_rank"] / 7
    # Head-parallel decode all-reduces the layer output of 2 tokens: 2 (N-1)/N x 2 x 4096 x 4 B.
    assert heads["decode_bytes_sent_per_layer"] == 2 * 7 / 8 * 2 * 4096 * 4
    assert single["decode_bytes_sent_per_layer"] == 0
    t = run("plan", "--model", "llama-3-8b", "--memory", "24GiB", "--batch", "2", "--ranks", "8",
            *FIXED)
    assert "across 8 ranks" in t.stdout and "head-parallel" in t.stdout


@pytest.mark.parametrize("args,message", [
    (["--link-gbps", "10"], "attnkit plan: --link-gbps and --link-latency-us need --ranks N"),
    (["--ranks", "0"], "attnkit plan: --ranks must be >= 1, got 0"),
    (["--ranks", "2", "--link-gbps", "0"], "attnkit plan: --link-gbps must be > 0, got 0.00"),
    (["--ranks", "64"], "head-parallel"),
])
def test_plan_ranks_errors(args, message):
    r = run("plan", "--model", "llama-3-8b", "--memory", "24GiB", "--context", "4096", *args,
            *FIXED)
    if message == "head-parallel":  # 64 ranks > 32 query heads: not an error, a note in the row
        assert r.returncode == 0 and "num_heads" in r.stdout, r.stdout
        return
    assert r.returncode == 2 and r.stderr.strip() == message, r.stderr


def test_plan_context_for_batch_window_capped():
    r = run("plan", "--model", "mistral-7b", "--memory", "24GiB", "--batch", "16", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    row = next(r for r in j["rows"] if r["as_configured"] and r["kv_dtype"] == "bf16")
    assert row["context_unbounded"]


def test_presets_lists_all_required_models():
    r = run("presets")
    assert r.returncode == 0, r.stderr
    for name in ["GPT-2", "BERT-base", "Llama-2-7B", "Llama-2-70B", "Llama-3-8B", "Llama-3-70B",
                 "Mistral-7B", "Falcon-7B", "Qwen2.5-7B", "Qwen3-8B", "Gemma-2-9B",
                 "DeepSeek-V2-Lite", "DeepSeek-V2", "DeepSeek-V3", "Kimi-K2"]:
        assert name in r.stdout


TINY = ["--d-model", "64", "--heads", "4"]


def test_compare_smoke_json():
    r = run("compare", *TINY, "--context", "64", "--prompt", "16", "--steps", "2", "--repeats", "1",
            "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    rows = {row["variant"]: row for row in j["variants"]}
    # With 4 heads the default gqa-8 / gqa-4 would be invalid or equal MHA.
    assert set(rows) == {"mha", "mqa", "mla"}
    mha = rows["mha"]
    # The diff column compares each variant with MHA on the same input:
    # exactly 0 for MHA itself, > 0 for a variant with pooled K/V heads.
    diffs = {k: v.get("diff_vs_mha") for k, v in rows.items()}
    assert diffs["mha"] == 0
    assert diffs["mqa"] is not None and diffs["mqa"] > 0
    assert mha["kv_bytes_per_token"] == 2 * 4 * 16 * 4      # K+V, 4 heads, head_dim 16, f32
    assert rows["mqa"]["kv_bytes_per_token"] == 2 * 1 * 16 * 4


def test_compare_gqa_derived_from_mha():
    r = run("compare", "--d-model", "64", "--heads", "8", "--variants", "mha,gqa-4,gqa-2,mqa",
            "--context", "32", "--prompt", "8", "--steps", "1", "--repeats", "1", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    rows = {row["variant"]: row for row in json.loads(r.stdout)["variants"]}
    assert [rows[v]["num_kv_heads"] for v in ("mha", "gqa-4", "gqa-2", "mqa")] == [8, 4, 2, 1]
    assert all(rows[v]["weights_derived_from_mha"] for v in ("gqa-4", "gqa-2", "mqa"))
    assert rows["mha"]["diff_vs_mha"] == 0
    assert all(rows[v]["diff_vs_mha"] > 0 for v in ("gqa-4", "gqa-2", "mqa"))


def test_compare_bad_variant():
    r = run("compare", *TINY, "--variants", "gqa-3")
    assert r.returncode == 2


def test_bench_smoke_json_and_csv():
    args = ["bench", *TINY, "--variants", "mha,mqa", "--contexts", "64", "--batches", "1",
            "--kv-dtypes", "f32", "--prompts", "32", "--budget", "0.01", "--rotate", "1MiB",
            "--no-torch", *FIXED]
    r = run(*args, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    rows = j["rows"]
    assert {row["variant"] for row in rows} == {"mha", "mqa"}
    assert {row["mode"] for row in rows} == {"decode", "prefill"}
    for row in rows:
        assert row["seconds"] > 0
    c = run(*args, "--csv")
    assert c.returncode == 0, c.stderr
    lines = c.stdout.strip().splitlines()
    assert len(lines) == 1 + len(rows) and "," in lines[0]


def tiny_bench_file(tmp_path, *args):
    """A small `attnkit bench --json` result saved as bench.json, for plot."""
    bench = tmp_path / "bench.json"
    r = run("bench", *TINY, "--batches", "1", "--kv-dtypes", "f32", "--budget", "0.01",
            "--rotate", "1MiB", "--no-torch", "--json", *args)
    assert r.returncode == 0, r.stderr
    bench.write_text(r.stdout)
    return bench


def test_plot_writes_png_and_svg(tmp_path):
    bench = tiny_bench_file(tmp_path, "--variants", "mha,mqa", "--contexts", "32,64",
                            "--prompts", "16", *FIXED)
    out = tmp_path / "plots"
    p = run("plot", "--input", str(bench), "--out", str(out), "--format", "png,svg", "--json")
    assert p.returncode == 0, p.stderr
    for name in ("kv_memory_vs_context", "decode_latency_vs_context", "roofline"):
        png = (out / (name + ".png")).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
        assert b"<svg" in (out / (name + ".svg")).read_bytes()[:2000]


def test_plot_bad_input(tmp_path):
    bad = tmp_path / "bench.json"
    bad.write_text("{not json")
    r = run("plot", "--input", str(bad), "--out", str(tmp_path / "p"))
    assert r.returncode == 2


def test_compare_mla_diff_is_null_and_pooling_one_head_per_group_is_exact():
    # gqa-4 with 4 heads pools groups of one head: the weights are copied
    # exactly, so the output must equal MHA's bit for bit.
    r = run("compare", *TINY, "--variants", "mha,gqa-4,gqa-2,mla", "--context", "32", "--prompt", "8",
            "--steps", "1", "--repeats", "1", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    rows = {row["variant"]: row for row in j["variants"]}
    assert rows["gqa-4"]["diff_vs_mha"] == 0
    assert rows["gqa-2"]["diff_vs_mha"] > 0
    assert rows["mla"]["diff_vs_mha"] is None and not rows["mla"]["weights_derived_from_mha"]
    # Default MLA ranks: kv_lora_rank = 4 x head_dim, rope = head_dim / 2;
    # its cache sits between MQA's and GQA-4's (2 and 8 x head_dim values).
    assert rows["mla"]["mla"]["kv_lora_rank"] == 64 and rows["mla"]["mla"]["qk_rope_head_dim"] == 8
    assert rows["mla"]["kv_bytes_per_token"] == (64 + 8) * 4
    assert j["config"]["context"] == 32 and j["config"]["kv_dtype"] == "f32"
    for row in j["variants"]:
        for key in ("params", "kv_cache_bytes", "prefill_flops", "prefill_seconds", "prefill_gflops",
                    "prefill_peak_fraction", "decode_flops", "decode_bytes", "decode_seconds",
                    "decode_gflops", "decode_gbps", "decode_bandwidth_fraction"):
            assert row[key] > 0, key
        assert row["kv_cache_bytes"] == row["kv_bytes_per_token"] * 32


def test_compare_mla_dsa_row_counts_the_indexer_and_the_sparse_path():
    """mla-dsa: the mla layer plus DeepSeek-V3.2's indexer (64 heads of 128,
    top --index-topk). Both MLA rows then have q_lora_rank 3 x kv_lora_rank;
    the DSA row's parameters add the indexer's and its decode step reads
    the weights, every cached token's fp8 indexer key (128 codes + one f32
    scale) and the chosen latent rows only."""
    r = run("compare", *TINY, "--variants", "mla,mla-dsa", "--context", "64", "--prompt", "16",
            "--steps", "1", "--repeats", "1", "--index-topk", "8", "--no-serve", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    rows = {row["variant"]: row for row in json.loads(r.stdout)["variants"]}
    mla, dsa = rows["mla"], rows["mla-dsa"]
    assert mla["mla"]["q_lora_rank"] == dsa["mla"]["q_lora_rank"] == 3 * 64
    assert "dsa" not in mla
    assert dsa["dsa"] == {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 8}
    q = 3 * 64
    indexer = 64 * 128 * q + 128 * 64 + 2 * 128 + 64 * 64  # wq_b, wk, k_norm, weights_proj
    assert dsa["params"] == mla["params"] + indexer
    latent_row = (64 + 8) * 4
    assert dsa["decode_bytes"] == dsa["params"] * 4 + 64 * (128 + 4) + 8 * latent_row
    assert dsa["kv_bytes_per_token"] == mla["kv_bytes_per_token"] + 128 + 4
    # Without mla-dsa the MLA row keeps its direct q_proj.
    r = run("compare", *TINY, "--variants", "mla", "--context", "16", "--prompt", "8", "--steps", "1",
            "--repeats", "1", "--no-serve", "--json", *FIXED)
    assert json.loads(r.stdout)["variants"][0]["mla"]["q_lora_rank"] == 0
    text = run("compare", *TINY, "--variants", "mla,mla-dsa", "--context", "64", "--prompt", "8",
               "--steps", "1", "--repeats", "1", "--index-topk", "8", "--no-serve", *FIXED)
    assert "DSA attends to 8 of 64 cached tokens" in text.stdout


def test_compare_table_has_units_and_no_progress_bar_when_piped():
    r = run("compare", *TINY, "--context", "32", "--prompt", "8", "--steps", "1", "--repeats", "1",
            "--kv-dtype", "bf16", *FIXED)
    assert r.returncode == 0 and r.stderr == ""
    for unit in ("KiB", "GFLOP/s", "GB/s", "n/a", "pooling drift"):
        assert unit in r.stdout


def test_compare_concludes_from_its_own_figures():
    r = run("compare", *TINY, "--variants", "mha,gqa-2,mqa,mla", "--context", "64", "--prompt", "8",
            "--steps", "2", "--repeats", "1", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    rows = {v["variant"]: v for v in j["variants"]}
    fastest = min(rows.values(), key=lambda v: v["decode_seconds"])["variant"]
    assert j["summary"]["fastest_decode"] == fastest
    assert j["summary"]["smallest_kv_cache"] == "mqa"            # 2 x 16 values, MLA 64 + 8
    mla, mha = rows["mla"], rows["mha"]
    assert j["summary"]["mla_kv_bytes_vs_mha"] == pytest.approx(
        mla["kv_bytes_per_token"] / mha["kv_bytes_per_token"])
    assert j["summary"]["mla_decode_flops_vs_mha"] > 1              # it trades FLOPs for bytes
    assert j["conclusions"][0].startswith("Fastest decode: " + fastest)
    t = run("compare", *TINY, "--variants", "mha,mqa,mla", "--context", "64", "--prompt", "8",
            "--steps", "2", "--repeats", "1", *FIXED)
    lines = t.stdout.splitlines()
    at = lines.index("What this means here:")
    said = lines[at + 1:]
    assert said[0].startswith("- Fastest decode: ")
    assert said[1] == "- Smallest cache: mqa, 128 B per token per layer; mha caches 4.00x as much (512 B)."
    assert said[2].startswith("- MLA trades arithmetic for bytes: its cache is 0.56x of mha's")
    # The drift column is explained as what pooling does, not read as an error.
    assert "not an\nerror of attnkit" in t.stdout or "not an error of attnkit" in " ".join(lines)


# Fields every bench row carries (docs/TOOL.md lists them).
BENCH_FIELDS = {"mode", "variant", "batch", "context", "q_tokens", "kv_dtype", "num_heads", "num_kv_heads",
                "head_dim", "head_dim_v", "flops", "bytes", "kv_buffers", "seconds", "gflops", "gbps",
                "peak_fraction", "bandwidth_fraction", "arithmetic_intensity", "reference_seconds",
                "speedup_vs_reference", "torch_seconds", "speedup_vs_torch", "samples", "note",
                "above_roof"}


def bench_tiny(*extra, env=None):
    args = ["bench", *TINY, "--variants", "mha,mqa,mla", "--contexts", "64", "--batches", "2",
            "--kv-dtypes", "f32,bf16", "--modes", "decode", "--budget", "0.01", "--rotate", "1MiB",
            "--json", *FIXED, *extra]
    r = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_bench_rows_have_documented_fields_and_exact_arithmetic():
    j, err = bench_tiny("--no-torch")
    assert err == ""                              # no progress bar when stderr is not a terminal
    assert j["machine"]["fp32_peak_gflops"] == 300 and j["machine"]["dram_read_gbps"] == 35
    rows = {(r["variant"], r["kv_dtype"]): r for r in j["rows"]}
    for r in j["rows"]:
        assert set(r) == BENCH_FIELDS
        assert r["kv_buffers"] * r["bytes"] >= 1 << 20   # rotated past --rotate
        assert r["gflops"] == pytest.approx(r["flops"] / r["seconds"] / 1e9)
        assert r["peak_fraction"] == pytest.approx(r["gflops"] / 300)
        assert r["bandwidth_fraction"] == pytest.approx(r["gbps"] / 35)
        # 64 x 2 x 4 heads x (D+Dv) x 2 FLOPs: the reference always runs at this size.
        assert r["speedup_vs_reference"] == pytest.approx(r["reference_seconds"] / r["seconds"])
        assert r["torch_seconds"] is None and r["speedup_vs_torch"] is None
    # decode: 2 FLOPs x heads x (head_dim + head_dim_v) x context x batch
    assert rows[("mha", "f32")]["flops"] == 2 * 4 * (16 + 16) * 64 * 2
    # MLA decode is absorbed: one latent kv head of kv_lora_rank + rope = 64 + 8,
    # values = its first 64 features, read once.
    mla = rows[("mla", "bf16")]
    assert (mla["num_kv_heads"], mla["head_dim"], mla["head_dim_v"]) == (1, 72, 64)
    assert mla["flops"] == 2 * 4 * (72 + 64) * 64 * 2
    assert mla["bytes"] == 2 * 64 * 72 * 2 + 4 * 2 * 1 * 4 * (72 + 64)
    assert rows[("mqa", "bf16")]["bytes"] == 2 * 64 * 1 * 32 * 2 + 4 * 2 * 1 * 4 * 32
    # 8-bit: one fp32 scale per latent row, as the bench lays its buffers out
    assert j["kv_bytes_per_token"]["mla"] == {"f32": 72 * 4, "bf16": 72 * 2, "int8": 72 + 4}


def test_bench_without_python_notes_and_carries_on():
    j, _ = bench_tiny(env={"ATTNKIT_PYTHON": "/nonexistent/python3"})
    assert "skipped" in j["torch"] and "/nonexistent/python3" in j["torch"]
    assert all(r["torch_seconds"] is None for r in j["rows"])


def test_bench_torch_baseline_on_same_shapes():
    pytest.importorskip("torch")
    j, _ = bench_tiny()
    assert j["torch"].startswith("torch ")
    for r in j["rows"]:
        assert r["torch_seconds"] > 0
        assert r["speedup_vs_torch"] == pytest.approx(r["torch_seconds"] / r["seconds"])
    # torch runs f32 whatever the KV dtype, so the two dtypes share one timing.
    by = {(r["variant"], r["kv_dtype"]): r["torch_seconds"] for r in j["rows"]}
    assert by[("mha", "f32")] == by[("mha", "bf16")]


def test_python_plot_module_rejects_a_non_bench_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"variants": []}))
    r = subprocess.run([sys.executable, "-m", "attnkit.plot", "--input", str(p), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not an `attnkit bench --json` result" in r.stderr


# A peak and bandwidth far below anything the kernels reach stand for a
# machine measured while busy: every fraction is then above 1, and no such
# fraction may be printed without a flag.
LOW_ROOF = ["--peak-gflops", "0.001", "--bandwidth-gbps", "0.001"]


def test_bench_flags_every_fraction_above_the_roof():
    args = ["bench", *TINY, "--variants", "mha,mqa", "--contexts", "64", "--batches", "1",
            "--kv-dtypes", "f32,bf16", "--modes", "decode", "--budget", "0.01", "--rotate", "1MiB",
            "--no-torch", *LOW_ROOF]
    j = json.loads(run(*args, "--json").stdout)
    assert all(r["above_roof"] for r in j["rows"])
    assert any("above this machine's measured roof" in w for w in j["warnings"])
    t = run(*args)
    assert t.returncode == 0, t.stderr
    rows = [l for l in t.stdout.splitlines() if l.startswith("decode")]
    assert rows and all(l.count("%*") == 2 for l in rows)      # % peak and % BW both flagged
    assert "warning: 4 row(s) above this machine's measured roof (marked *)" in t.stdout
    # With a roof no kernel reaches, nothing is flagged.
    high = json.loads(run(*args[:-4], "--peak-gflops", "1e9", "--bandwidth-gbps", "1e9",
                          "--json").stdout)
    assert not any(r["above_roof"] for r in high["rows"]) and high["warnings"] == []


def test_compare_flags_fractions_above_the_roof():
    args = ["compare", *TINY, "--context", "32", "--prompt", "8", "--steps", "1", "--repeats", "1",
            "--variants", "mha,mqa"]
    j = json.loads(run(*args, "--json", *LOW_ROOF).stdout)
    assert all(v["above_roof"] for v in j["variants"])
    assert any("above this machine's measured roof" in w for w in j["warnings"])
    t = run(*args, *LOW_ROOF)
    assert t.returncode == 0 and "%*" in t.stdout and "warning: 2 variant(s) above" in t.stdout


def test_machine_json_says_how_the_figures_were_measured():
    j = json.loads(run("compare", *TINY, "--context", "32", "--prompt", "8", "--steps", "1",
                       "--repeats", "1", "--variants", "mha", "--json", *FIXED).stdout)
    m = j["machine"]
    assert m["agree"] and m["fp32_peak_gflops"] == 300 and m["dram_read_gbps"] == 35
    assert m["before"]["fp32_peak_gflops"] == m["after"]["fp32_peak_gflops"] == 300


def test_plot_marks_points_above_the_roof(tmp_path):
    bench = tiny_bench_file(tmp_path, "--variants", "mha", "--contexts", "32", "--modes", "decode",
                            *LOW_ROOF)
    p = run("plot", "--input", str(bench), "--out", str(tmp_path / "plots"), "--json")
    assert p.returncode == 0, p.stderr
    notes = json.loads(p.stdout)["warnings"]
    assert len(notes) == 1 and notes[0].startswith("1 of 1 points lie above the measured roof")
    t = run("plot", "--input", str(bench), "--out", str(tmp_path / "plots"))
    assert "warning: 1 of 1 points lie above the measured roof" in t.stdout
    # The bench's own warnings pass through once, with one "warning: ".
    j = json.loads(bench.read_text())
    j["warnings"] = ["warning: the machine measured differently before and after the run (x)"]
    bench.write_text(json.dumps(j))
    t = run("plot", "--input", str(bench), "--out", str(tmp_path / "plots"))
    assert "\nwarning: the machine measured differently" in t.stdout
    assert "warning: warning:" not in t.stdout


# Layer by layer: the 2025 presets (their published config.json) and the
# bytes worked out by hand from the config's numbers.
KV_32K = {  # bf16 K/V of one sequence of 32768 tokens; kv heads x 2 x head_dim x 2 B per token
    "gpt-oss-20b": ("24 layers: 12 sliding 128, 12 full", (12 * 128 + 12 * 32768) * 8 * 2 * 64 * 2),
    "gpt-oss-120b": ("36 layers: 18 sliding 128, 18 full", (18 * 128 + 18 * 32768) * 8 * 2 * 64 * 2),
    "gemma-3-4b": ("34 layers: 29 sliding 1024, 5 full", (29 * 1024 + 5 * 32768) * 4 * 2 * 256 * 2),
    "gemma-3-27b": ("62 layers: 52 sliding 1024, 10 full",
                    (52 * 1024 + 10 * 32768) * 16 * 2 * 128 * 2),
    "llama-4-scout": ("48 layers: 36 chunked 8192, 12 full NoPE",
                      (36 * 8192 + 12 * 32768) * 8 * 2 * 128 * 2),
    "qwen3-next-80b-a3b": ("48 layers: 36 Gated DeltaNet, 12 full (gated)",
                           12 * 32768 * 2 * 2 * 256 * 2),
}
# Qwen3-Next's Gated DeltaNet layer: state 32 x 128 x 128 plus 3 conv inputs
# of 2 x 16 x 128 + 32 x 128 channels, f32, per sequence.
DELTANET_STATE = (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 4


def test_analyze_says_what_its_figures_leave_out(tmp_path):
    # gpt-oss ships MXFP4 experts: the figures count weights in the dtype
    # each row names, and say so.
    r = run("analyze", "--model", "gpt-oss-20b", *FIXED)
    assert r.returncode == 0, r.stderr
    assert "quantization_config mxfp4 is not applied here" in r.stdout
    j = json.loads(run("analyze", "--model", "gpt-oss-20b", "--json", *FIXED).stdout)
    assert j["model"]["weight_quantization"] == "mxfp4"
    assert j["model"]["index_topk"] == 0
    # DeepSeek-V3.2's main figures count dense MLA: analyze says so.
    with open(os.path.join(os.path.dirname(__file__), "..", "data", "configs",
                           "DeepSeek-V3.json")) as f:
        cfg = json.load(f)
    cfg.update(model_type="deepseek_v32", index_n_heads=64, index_head_dim=128,
               index_topk=2048)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = run("analyze", "--config", str(path), *FIXED)
    assert r.returncode == 0, r.stderr
    assert "DeepSeek sparse attention (index_topk 2048): the figures below count dense MLA" \
        in r.stdout
    assert "DSA pays from: decode FLOPs" in r.stdout
    r = run("analyze", "--model", "llama-3-8b", *FIXED)
    assert "not applied" not in r.stdout and "sparse attention" not in r.stdout


@pytest.mark.parametrize("preset", sorted(KV_32K))
def test_analyze_new_presets_kv_layer_by_layer(preset):
    mix, kv = KV_32K[preset]
    r = run("analyze", "--model", preset, "--context", "32768", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["model"]["layer_mix"] == mix
    assert j["kv_cache_bytes"]["bf16"] == kv
    state = 36 * DELTANET_STATE if preset.startswith("qwen3-next") else 0
    assert j["linear_state_bytes"] == state
    # The per-kind rows add up to the totals.
    assert sum(g["kv_bytes"] for g in j["per_layer"]) == kv
    assert sum(g["state_bytes"] for g in j["per_layer"]) == state
    assert sum(g["count"] for g in j["per_layer"]) == len(j["layer_kinds"])
    assert sum(g["prefill_flops"] for g in j["per_layer"]) == pytest.approx(j["prefill_flops"],
                                                                          rel=1e-12)
    t = run("analyze", "--model", preset, "--context", "32768", *FIXED)
    assert t.returncode == 0, t.stderr
    assert mix in t.stdout.splitlines()[1]


def test_analyze_per_layer_rows():
    r = run("analyze", "--model", "qwen3-next-80b-a3b", "--context", "32768", "--per-layer", *FIXED)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = lines.index(next(l for l in lines if l.startswith("layer kind")))
    assert lines[head].split() == ["layer", "kind", "layers", "tokens", "held", "KV", "(bf16)",
                                   "state", "(f32)", "prefill", "FLOPs", "decode", "FLOPs", "/",
                                   "step"]
    deltanet, full = lines[head + 2], lines[head + 3]
    assert deltanet.split()[:5] == ["Gated", "DeltaNet", "36", "0", "-"]
    assert "75.4 MiB" in deltanet          # 36 x 2195456 B
    assert full.split()[:6] == ["full", "(gated)", "12", "32768", "768", "MiB"]
    assert [l for l in lines if l != l.rstrip()] == []


def test_presets_list_the_2025_families():
    r = run("presets")
    assert r.returncode == 0, r.stderr
    for name in ("gpt-oss-20b", "gpt-oss-120b", "Gemma-3-4B", "Gemma-3-27B", "Llama-4-Scout",
                 "Qwen3-Next-80B-A3B"):
        assert name in r.stdout + r.stderr


def test_plan_counts_the_linear_state():
    # 1 GiB holds 768 MiB of K/V at 32K plus the 75.4 MiB state for one
    # sequence, not two.
    r = run("plan", "--model", "qwen3-next-80b-a3b", "--memory", "1GiB", "--context", "32768",
            "--kv-dtypes", "bf16", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    row = next(x for x in json.loads(r.stdout)["rows"] if x["as_configured"])
    assert row["batch"] == 1
    assert row["kv_cache_bytes"] == 768 * 2**20
    assert row["linear_state_bytes"] == 36 * DELTANET_STATE
    assert row["cache_bytes"] == 768 * 2**20 + 36 * DELTANET_STATE


SERVE_TINY = ["--requests", "2", "--prompt-tokens", "6", "--output-tokens", "2", "--json"]


@pytest.mark.parametrize("preset,layers,mix,variants", [
    # gpt-oss: sliding 128 and full layers with sinks, in one pool without a window.
    ("gpt-oss-20b", "2", "2 layers: 1 sliding 128, 1 full", ["gqa-8"]),
    # Gemma 3: five local layers and a global one.
    ("gemma-3-4b", "6", "6 layers: 5 sliding 1024, 1 full", ["gqa-4"]),
    # Llama 4: three chunked RoPE layers and a NoPE layer.
    ("llama-4-scout", "4", "4 layers: 3 chunked 8192, 1 full NoPE", ["gqa-8"]),
    # Qwen3-Next: three Gated DeltaNet layers and a gated full layer, and the
    # same stack with every layer full attention.
    ("qwen3-next-80b-a3b", "4", "4 layers: 3 Gated DeltaNet, 1 full (gated)", ["gqa-2", "all-full"]),
])
def test_serve_bench_serves_the_new_families_stacks(preset, layers, mix, variants):
    r = run("serve-bench", "--model", preset, "--layers", layers, *SERVE_TINY)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["config"]["layer_mix"] == mix
    assert [row["variant"] for row in j["rows"]] == variants
    for row in j["rows"]:
        assert row["output_tokens"] == 4  # every request finished
    mixed = len(mix.split(", ")) > 1 and "Gated" not in mix
    assert j["rows"][0]["pool_releases_pages"] == (not mixed)
    if preset.startswith("qwen3"):
        # 3 layers of 32 value heads x 128 x 128 f32 plus the conv's 3 inputs
        # of 8192 channels each.
        assert j["rows"][0]["state_bytes_per_sequence"] == 3 * DELTANET_STATE
        assert j["rows"][1]["state_bytes_per_sequence"] == 0
        # One full layer's K/V per token (2 kv heads x 256 x 2 x bf16), four
        # for all-full.
        assert j["rows"][0]["kv_bytes_per_token"] * 4 == j["rows"][1]["kv_bytes_per_token"]
        assert any("every layer full attention" in c for c in j["conclusions"])


@pytest.mark.parametrize("args,why", [
    (["--model", "qwen3-next-80b-a3b", "--layers", "1"], "hold no softmax-attention layer"),
    # Qwen3-Next's MoE (gated shared expert) now runs, so --mlp is refused
    # here for a preset without the feed-forward's sizes.
    (["--model", "gemma-2-9b", "--layers", "2", "--mlp"], "--mlp: "),
    (["--model", "gpt-oss-20b", "--layers", "2", "--variants", "mla"],
     "an MLA variant of them is not defined"),
])
def test_serve_bench_refuses_what_its_engine_cannot_run(args, why):
    r = run("serve-bench", *args, "--requests", "2")
    assert r.returncode == 2
    assert why in r.stderr and r.stderr.count("\n") == 1


def test_compare_takes_a_model_and_sums_it_layer_by_layer():
    r = run("compare", "--model", "gemma-3-4b", "--variants", "gqa-4,mqa", "--prompt", "8",
            "--context", "32", "--steps", "1", "--repeats", "1", "--no-serve", "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert (j["config"]["d_model"], j["config"]["num_heads"], j["config"]["head_dim"]) == (2560, 8,
                                                                                          256)
    assert j["model"]["layer_mix"] == "34 layers: 29 sliding 1024, 5 full"
    rows = {v["variant"]: v for v in j["model"]["variants"]}
    # 32 tokens fit every window: 34 layers x 32 tokens x kv heads x 512 values x 4 B (f32).
    assert rows["gqa-4"]["kv_cache_bytes"] == 34 * 32 * 4 * 512 * 4
    assert rows["mqa"]["kv_cache_bytes"] == 34 * 32 * 1 * 512 * 4


def test_analyze_layer_configs_and_serve_bench_agree_on_the_layer_mix(tmp_path):
    # Qwen2 with a window from layer 2 on: layers 0-1 full, 2-3 sliding 8.
    attnkit = pytest.importorskip("attnkit")
    cfg = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 128,
           "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    a = json.loads(run("analyze", "--config", str(p), "--json", *FIXED).stdout)
    assert a["layer_kinds"] == ["full", "full", "sliding 8", "sliding 8"]
    windows = [attnkit.from_config(cfg, i).config["sliding_window"] for i in range(4)]
    assert [f"sliding {w}" if w else "full" for w in windows] == a["layer_kinds"]
    spec = attnkit.model_spec_from_config(cfg)["layers"]
    assert [f"sliding {l['window']}" if l["window"] else "full" for l in spec] == a["layer_kinds"]
    # serve-bench serves the first --layers layers: two full ones, or three
    # (2 full, 1 sliding 8) in one pool without a window.
    s = run("serve-bench", "--config", str(p), "--layers", "2", "--requests", "2",
            "--prompt-tokens", "4", "--output-tokens", "2", "--memory", "64KiB", "--json")
    assert s.returncode == 0, s.stderr
    assert json.loads(s.stdout)["config"]["layer_mix"] == "2 layers: 2 full"
    s3 = run("serve-bench", "--config", str(p), "--layers", "3", "--requests", "2",
             "--prompt-tokens", "4", "--output-tokens", "2", "--memory", "64KiB", "--json")
    assert s3.returncode == 0, s3.stderr
    j3 = json.loads(s3.stdout)
    assert j3["config"]["layer_mix"] == "3 layers: 2 full, 1 sliding 8"
    assert not j3["rows"][0]["pool_releases_pages"]


def test_analyze_deepseek_v32_dense_vs_dsa():
    """The DSA rows against the counting rules written out by hand for
    DeepSeek-V3.2 (docs/ANALYSIS.md): H 128, d_c 512, d_r 64, indexer 64 x
    128, top 2048, 61 layers, bf16 latent and weights."""
    r = run("analyze", "--model", "deepseek-v3.2", "--context", "100000", "--batch", "4",
            "--json", *FIXED)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["model"]["model_type"] == "deepseek_v32"
    assert "deepseek-ai/DeepSeek-V3.2-Exp" in j["model"]["source"]
    dsa = j["dsa"]
    idx_params = 64 * 128 * 1536 + 128 * 7168 + 2 * 128 + 64 * 7168  # wq_b, wk, k_norm, weights_proj
    assert dsa["indexer_params_per_layer"] == idx_params
    assert dsa["indexer_key_bytes_per_token_per_layer"] == 128 + 4  # fp8 codes + one f32 scale
    # The cache stores the indexer key beside each latent row.
    assert j["kv_bytes_per_token"]["bf16"] == 61 * (576 * 2 + 132)
    params = j["attention_params_per_layer"]
    dense_pair, idx_key, absorbed = 2 * 128 * 576 + 2 * 128 * 512, 2 * 64 * 128 + 2 * 64, \
        2 * 128 * (2 * 512 + 64)
    b, k, L = 4, 2048, 100000
    row = next(x for x in dsa["rows"] if x["context"] == L)
    assert row["dense_decode_flops"] == pytest.approx(61 * b * (2 * params + dense_pair * L))
    assert row["dsa_decode_flops"] == pytest.approx(
        61 * b * (2 * (params + idx_params) + idx_key * L + absorbed * k))
    assert row["dsa_decode_bytes"] == pytest.approx(
        61 * ((params + idx_params) * 2 + b * (132 * L + 1152 * k)))
    pairs = L * (L + 1) / 2
    chosen = k * (k + 1) / 2 + (L - k) * k
    assert row["dsa_prefill_flops"] == pytest.approx(
        61 * b * (2 * L * (params + idx_params) + idx_key * pairs + absorbed * chosen))
    assert row["dense_prefill_flops"] == pytest.approx(
        61 * b * (2 * L * params + 2 * 128 * (192 + 128) * pairs))
    # At or below the top-k DSA runs dense MLA plus the indexer keys: never cheaper.
    small = next(x for x in dsa["rows"] if x["context"] == k)
    assert small["dsa_decode_flops"] > small["dense_decode_flops"]
    # Decode FLOPs cross where dense's per-token cost has paid for the
    # top-k's fixed cost: L > (absorbed k + 2 idx_params) / (dense_pair - idx_key).
    want = int((absorbed * k + 2 * idx_params) // (dense_pair - idx_key)) + 1
    assert dsa["pays_from"]["decode_flops"] == want
    for name in ("decode_bytes", "prefill_flops"):
        c = dsa["pays_from"][name]
        assert c > k
        for ctx, cheaper in ((c - 1, False), (c, True)):
            rr = json.loads(run("analyze", "--model", "deepseek-v3.2", "--context", str(ctx),
                                "--batch", "4", "--json", *FIXED).stdout)
            x = next(x for x in rr["dsa"]["rows"] if x["context"] == ctx)
            dense = x["dense_" + name]
            assert (x["dsa_" + name] < dense) == cheaper, (name, ctx)
    assert "dsa" not in json.loads(run("analyze", "--model", "deepseek-v3", "--json",
                                       *FIXED).stdout)


def test_plan_estimates_deepseek_v32_on_its_sparse_path():
    """plan's decode step for a DSA model is the roofline of the DSA figures
    analyze reports, not of dense MLA's."""
    r = run("plan", "--model", "deepseek-v3.2", "--memory", "64GiB", "--batch", "1", "--json",
            *FIXED)
    assert r.returncode == 0, r.stderr
    p = next(x for x in json.loads(r.stdout)["rows"] if x["kv_dtype"] == "bf16")
    assert p["context"] == 163840  # the model's limit; estimate there
    row = next(x for x in json.loads(run(
        "analyze", "--model", "deepseek-v3.2", "--context", "163840", "--json",
        *FIXED).stdout)["dsa"]["rows"] if x["context"] == 163840)
    want = max(row["dsa_decode_flops"] / 300e9, row["dsa_decode_bytes"] / 35e9)
    assert p["decode_step_seconds"] == pytest.approx(want)
    assert want < max(row["dense_decode_flops"] / 300e9, row["dense_decode_bytes"] / 35e9) / 5
