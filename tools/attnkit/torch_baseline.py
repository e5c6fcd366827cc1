"""The seeds' naive PyTorch attention, timed on the shapes `attnkit bench` gives it.

Run by `attnkit bench` as `/usr/bin/python3 torch_baseline.py INPUT.json`;
prints one JSON object on stdout:

    {"torch": "1.13.1", "threads": 2,
     "results": [{"id": 0, "seconds": 0.0123, "samples": 9} or
                 {"id": 1, "skipped": "why"}, ...]}

or {"error": "why"} when torch cannot be imported (bench then prints the
note and carries on). INPUT.json is

    {"threads": 2, "budget_s": 0.3, "max_bytes": 2147483648, "rotate_bytes": 67108864,
     "shapes": [{"id": 0, "batch": 1, "seqlen_q": 1, "seqlen_k": 4096,
                 "num_heads": 32, "num_kv_heads": 8, "head_dim": 64, "head_dim_v": 64,
                 "v_is_k_prefix": false, "softmax_scale": 0.125}, ...]}

The attention is the seeds' code path (repeat_interleave the K/V heads to
every query head, matmul, masked_fill with a causal mask aligned
bottom-right, softmax, matmul) in float32, the seeds' dtype. Like bench,
decode shapes rotate several K/V sets whose total exceeds `rotate_bytes`
so the time is that of memory, not of the last-level cache.
"""
import json
import math
import statistics
import sys
import time


def naive_attention(torch, q, k, v, mask, scale):
    group = q.shape[1] // k.shape[1]
    if group > 1:  # the seeds' MHA has nothing to repeat (and torch 1.13's
        # repeat_interleave(1) takes milliseconds even on tiny tensors)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(mask == 0, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, v)


def kv_sets(s, rotate_bytes):
    """(K/V sets to rotate, bytes of one set); prefill (seqlen_q = seqlen_k) uses one."""
    b, l, hkv = s["batch"], s["seqlen_k"], s["num_kv_heads"]
    kv_bytes = b * hkv * l * (s["head_dim"] + (0 if s["v_is_k_prefix"] else s["head_dim_v"])) * 4
    if s["seqlen_q"] == l and l > 1:
        return 1, kv_bytes
    return max(1, math.ceil(rotate_bytes / max(kv_bytes, 1))), kv_bytes


def memory_needed(s, rotate_bytes):
    """Bytes of the K/V sets plus what one call allocates: expanded K/V, scores (x3)."""
    b, t, l, h = s["batch"], s["seqlen_q"], s["seqlen_k"], s["num_heads"]
    sets, kv_bytes = kv_sets(s, rotate_bytes)
    expanded = b * l * h * (s["head_dim"] + s["head_dim_v"]) * 4
    return sets * kv_bytes + expanded + 3 * b * h * t * l * 4


def time_shape(torch, s, budget_s, rotate_bytes):
    b, t, l = s["batch"], s["seqlen_q"], s["seqlen_k"]
    h, hkv, d, dv = s["num_heads"], s["num_kv_heads"], s["head_dim"], s["head_dim_v"]
    sets, _ = kv_sets(s, rotate_bytes)
    gen = torch.Generator().manual_seed(0)
    q = torch.rand(b, h, t, d, generator=gen) - 0.5
    ks, vs = [], []
    for _ in range(sets):
        k = torch.rand(b, hkv, l, d, generator=gen) - 0.5
        ks.append(k)
        vs.append(k[..., :dv] if s["v_is_k_prefix"] else torch.rand(b, hkv, l, dv, generator=gen) - 0.5)
    mask = torch.ones(t, l).tril(l - t)  # bottom-right causal, as attnkit
    scale = s["softmax_scale"]
    with torch.no_grad():
        naive_attention(torch, q, ks[0], vs[0], mask, scale)  # warm-up
        per_call, i, start = [], 1, time.perf_counter()
        while len(per_call) < 3 or (time.perf_counter() - start < budget_s and len(per_call) < 200):
            t0 = time.perf_counter()
            naive_attention(torch, q, ks[i % sets], vs[i % sets], mask, scale)
            per_call.append(time.perf_counter() - t0)
            i += 1
    return {"seconds": statistics.median(per_call), "samples": len(per_call), "kv_sets": sets}


def main():
    spec = json.load(open(sys.argv[1]))
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "no baseline"
        print(json.dumps({"error": "torch is not importable (%s)" % e}))
        return
    torch.set_num_threads(max(1, int(spec.get("threads", 1))))
    results = []
    tty = sys.stderr.isatty()
    shapes = spec["shapes"]
    for n, s in enumerate(shapes):
        if tty:
            sys.stderr.write("\r\033[Ktorch baseline %d/%d" % (n + 1, len(shapes)))
            sys.stderr.flush()
        need = memory_needed(s, spec["rotate_bytes"])
        if need > spec["max_bytes"]:
            results.append({"id": s["id"], "skipped": "needs %.1f GiB > --max-memory" % (need / 2**30)})
            continue
        try:
            r = time_shape(torch, s, spec["budget_s"], spec["rotate_bytes"])
        except RuntimeError as e:  # e.g. out of memory
            results.append({"id": s["id"], "skipped": str(e).splitlines()[0][:120]})
            continue
        r["id"] = s["id"]
        results.append(r)
    if tty:
        sys.stderr.write("\r\033[K")
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
