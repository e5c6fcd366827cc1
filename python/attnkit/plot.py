"""Plots of `attnkit bench --json` and `attnkit serve-bench --json` results
(matplotlib, Agg backend).

Three pictures, each from one bench result (a dict as loaded by load()):

- kv_memory_vs_context: KV-cache bytes against context for every variant
  and KV dtype (exact arithmetic from the bench's shapes, not measured);
- decode_latency_vs_context: the measured decode time per step against
  context, one line per variant and KV dtype (batch 1 by default), the
  seeds' naive PyTorch attention dashed where bench measured it;
- roofline: this machine's measured fp32 peak and read bandwidth, and
  every measured row at its arithmetic intensity.

Two from a serve-bench result (its "kind" is "serve-bench"):

- serve_throughput_vs_memory: measured output tokens/s against the KV
  memory budget, one line per variant (and KV dtype, cache mode);
- serve_concurrency_vs_memory: the mean number of sequences a step ran
  (the peak thin: dotted paged, dash-dotted static) against the budget,
  the same lines.

From a shell (this is what `attnkit plot` runs):

    attnkit bench --json > bench.json
    /usr/bin/python3 -m attnkit.plot --input bench.json --out plots --format png,svg

This file needs only the standard library and matplotlib, so it also runs
as a plain script (`python3 plot.py ...`) without the compiled module.
"""
import argparse
import json
import math
import os
import sys

__all__ = ["load", "kv_memory_vs_context", "decode_latency_vs_context", "roofline", "above_roof",
           "serve_throughput_vs_memory", "serve_concurrency_vs_memory", "plot_warnings", "plot_all",
           "main"]

_VARIANT_ORDER = ["mha", "gqa-16", "gqa-8", "gqa-4", "gqa-2", "mqa", "mla"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def is_serve(result):
    """Whether `result` is an `attnkit serve-bench --json` result."""
    return isinstance(result, dict) and result.get("kind") == "serve-bench"


def load(path):
    """Reads an `attnkit bench --json` or `attnkit serve-bench --json` file
    and checks it is one."""
    with open(path) as f:
        bench = json.load(f)
    if is_serve(bench) and isinstance(bench.get("rows"), list):
        return bench
    if not isinstance(bench, dict) or "rows" not in bench or "machine" not in bench:
        raise ValueError("%s is not an `attnkit bench --json` result (no 'rows'/'machine'), nor "
                         "an `attnkit serve-bench --json` one" % path)
    return bench


def _variants(bench):
    names = list(bench.get("kv_bytes_per_token", {}))
    for r in bench["rows"]:
        if r["variant"] not in names:
            names.append(r["variant"])
    rank = {v: i for i, v in enumerate(_VARIANT_ORDER)}
    return sorted(names, key=lambda v: (rank.get(v, len(rank)), v))


def _colors(variants):
    plt = _plt()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {v: cycle[i % len(cycle)] for i, v in enumerate(variants)}


def _bytes_label(b, _pos=None):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            v = b / scale
            return ("%.0f %s" if v >= 10 or v == int(v) else "%.1f %s") % (v, unit)
    return "%.0f B" % b


def _seconds_label(s, _pos=None):
    if s >= 1:
        return "%g s" % s
    if s >= 1e-3:
        return "%g ms" % round(s * 1e3, 6)
    return "%g us" % round(s * 1e6, 6)


def _context_label(n, _pos=None):
    n = int(round(n))
    return "%dK" % (n // 1024) if n >= 1024 and n % 1024 == 0 else str(n)


def _shape_title(bench):
    c = bench.get("config", {})
    return "d_model %s, %s query heads of %s" % (c.get("d_model", "?"), c.get("num_heads", "?"),
                                                  c.get("head_dim", "?"))


def _save(fig, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def kv_memory_vs_context(bench, path, layers=1, batch=1, contexts=None):
    """KV-cache bytes for `batch` sequences of every context, per variant
    and KV dtype (solid f32, dashed bf16, dotted 8-bit: int8 and fp8_e4m3
    take the same bytes), for `layers` layers of the
    bench's shape. Writes `path` (.png or .svg) and returns it."""
    from matplotlib.ticker import FuncFormatter

    plt = _plt()
    per_token = bench.get("kv_bytes_per_token")
    if not per_token:
        raise ValueError("the bench result has no kv_bytes_per_token (made by an older attnkit?)")
    contexts = contexts or [2**k for k in range(9, 18)]
    variants = _variants(bench)
    colors = _colors(variants)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for v in variants:
        for dtype, style in (("f32", "-"), ("bf16", "--"), ("int8", ":")):
            b = per_token.get(v, {}).get(dtype)
            if b is None:
                continue
            ax.plot(contexts, [b * c * layers * batch for c in contexts], style, color=colors[v],
                    marker="o" if dtype == "f32" else None, markersize=3,
                    label="%s %s" % (v, "8-bit" if dtype == "int8" else dtype))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_context_label))
    ax.yaxis.set_major_formatter(FuncFormatter(_bytes_label))
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("KV cache")
    ax.set_title("KV cache, %d layer%s x batch %d\n%s" % (layers, "" if layers == 1 else "s", batch,
                                                          _shape_title(bench)), fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return _save(fig, path)


def decode_latency_vs_context(bench, path, batch=1):
    """Measured decode time per step against context, batch `batch`, per
    variant and KV dtype; the PyTorch baseline (f32) dashed grey-tinted.
    Writes `path` and returns it."""
    from matplotlib.ticker import FuncFormatter

    plt = _plt()
    rows = [r for r in bench["rows"] if r["mode"] == "decode" and r["batch"] == batch]
    if not rows:
        raise ValueError("the bench result has no decode rows at batch %d" % batch)
    variants = _variants(bench)
    colors = _colors(variants)
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    for v in variants:
        for dtype, marker in (("f32", "o"), ("bf16", "^"), ("int8", "s"), ("fp8_e4m3", "D")):
            pts = sorted((r["context"], r["seconds"]) for r in rows
                         if r["variant"] == v and r["kv_dtype"] == dtype and r["seconds"] is not None)
            if pts:
                ax.plot(*zip(*pts), "-", marker=marker, color=colors[v], markersize=4,
                        label="%s %s" % (v, dtype))
        torch_pts = sorted({(r["context"], r["torch_seconds"]) for r in rows
                            if r["variant"] == v and r.get("torch_seconds") is not None})
        if torch_pts:
            ax.plot(*zip(*torch_pts), ":", color=colors[v], alpha=0.6, linewidth=1.5,
                    label="%s torch (f32)" % v)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_context_label))
    ax.yaxis.set_major_formatter(FuncFormatter(_seconds_label))
    ax.set_xlabel("context (cached tokens)")
    ax.set_ylabel("decode time per step (median)")
    m = bench["machine"]
    ax.set_title("sdpa decode, batch %d, %s\n%s, %s threads" % (batch, _shape_title(bench), m.get("simd", "?"),
                                                                m.get("threads", "?")), fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    # Outside the axes: the lines fill the plot from corner to corner.
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return _save(fig, path)


def _roof(bench, row):
    """The roof a row can reach: the fp32 FMA peak (the bf16 dot-product
    peak for bf16 and 8-bit K/V rows, which may run on it, where higher) or
    the read bandwidth times the row's arithmetic intensity, whichever is
    lower."""
    m = bench["machine"]
    peak = float(m["fp32_peak_gflops"])
    if row["kv_dtype"] != "f32":
        peak = max(peak, float(m.get("bf16_dot_peak_gflops") or 0))
    return min(peak, float(m["dram_read_gbps"]) * row["arithmetic_intensity"])


def above_roof(bench):
    """The measured rows drawn above their roof. A kernel cannot beat the
    machine, so each one says the roof was measured low (a busy machine
    halves the measured peak) or that the row's data came from cache."""
    return [r for r in bench["rows"]
            if r.get("gflops") is not None and r["gflops"] > _roof(bench, r)]


def plot_warnings(bench):
    """What a reader of the plots must know: rows above the roof, and
    machine figures that disagreed before and after the bench run."""
    out = []
    if is_serve(bench):
        return out
    above = above_roof(bench)
    if above:
        out.append("%d of %d points lie above the measured roof: the peak or bandwidth was "
                   "measured low (a busy machine) or the data came from cache; the roof is "
                   "not a bound for them" % (len(above), len(bench["rows"])))
    # The bench's own lines, without its "warning: " (the callers add theirs)
    # and without its count of rows above the roof, which the line above
    # replaces.
    for w in bench.get("warnings", []):
        if "above this machine's measured roof" not in w:
            out.append(w[len("warning: "):] if w.startswith("warning: ") else w)
    return out


def roofline(bench, path):
    """Roofline of this machine (measured fp32 FMA peak and read bandwidth,
    and dashed the bf16 dot-product peak where it is higher) with every
    measured row at (FLOPs / bytes, achieved GFLOP/s): circles decode,
    squares prefill; filled f32 KV, hollow bf16 or 8-bit. Points above their roof
    (see above_roof) are ringed in red and counted on the plot. Writes
    `path`."""
    plt = _plt()
    m = bench["machine"]
    peak, bw = float(m["fp32_peak_gflops"]), float(m["dram_read_gbps"])
    rows = [r for r in bench["rows"] if r.get("gflops") is not None]
    above = above_roof(bench)
    variants = _variants(bench)
    colors = _colors(variants)
    xs = [r["arithmetic_intensity"] for r in rows] or [1.0]
    lo = min(min(xs) / 2, peak / bw / 20)
    hi = max(max(xs) * 2, peak / bw * 20)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(grid, [min(peak, bw * x) for x in grid], "k-", linewidth=1.5,
            label="roof: %.0f GFLOP/s, %.1f GB/s" % (peak, bw))
    ax.axvline(peak / bw, color="k", alpha=0.2, linewidth=1)
    # bf16 K/V rows can use the bf16 dot product (vdpbf16ps), whose peak
    # bench measures too: their roof is this one.
    bf16_peak = float(m.get("bf16_dot_peak_gflops") or 0)
    if bf16_peak > peak:
        ax.plot(grid, [min(bf16_peak, bw * x) for x in grid], "k--", linewidth=1, alpha=0.6,
                label="bf16-dot roof: %.0f GFLOP/s" % bf16_peak)
    seen = set()
    for r in rows:
        v = r["variant"]
        hollow = r["kv_dtype"] != "f32"
        label = None
        key = (v, r["mode"])
        if key not in seen:
            seen.add(key)
            label = "%s %s" % (v, r["mode"])
        ax.plot(r["arithmetic_intensity"], r["gflops"], "o" if r["mode"] == "decode" else "s",
                markersize=5, color=colors[v], markerfacecolor="none" if hollow else colors[v],
                label=label, linestyle="none")
    if above:
        ax.plot([r["arithmetic_intensity"] for r in above], [r["gflops"] for r in above], "o",
                markersize=11, markerfacecolor="none", markeredgecolor="red", linestyle="none",
                label="above the measured roof")
        ax.text(0.02, 0.98, "%d point(s) above the measured roof:\nthe machine was measured "
                "low (busy?) or the data came from cache" % len(above),
                transform=ax.transAxes, fontsize=7, color="red", va="top")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title("roofline (measured here): %s, %s threads\nfilled = f32 KV, hollow = bf16 / 8-bit KV"
                 % (m.get("simd", "?"), m.get("threads", "?")), fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    top = max([peak, bf16_peak] + [r["gflops"] for r in rows])
    bottom = min([bw * lo] + [r["gflops"] for r in rows])
    ax.set_ylim(bottom / 2, top * 2)
    fig.tight_layout()
    return _save(fig, path)


def _serve_lines(result):
    """The rows of a serve-bench result grouped into lines across budgets:
    {(variant, kv_dtype, cache): [rows by increasing memory]}, in variant
    order."""
    lines = {}
    for r in result["rows"]:
        lines.setdefault((r["variant"], r["kv_dtype"], r["cache"]), []).append(r)
    rank = {v: i for i, v in enumerate(_VARIANT_ORDER)}
    ordered = sorted(lines, key=lambda k: (rank.get(k[0], len(rank)), k))
    return {k: sorted(lines[k], key=lambda r: r["memory_bytes"]) for k in ordered}


def _serve_plot(result, path, ylabel, title, values):
    """One line per (variant, KV dtype, cache) of values(rows) -> [(ys,
    styles)] against the memory budget, where styles maps the cache mode to
    its line style: the first series paged solid and static dashed, later
    ones (the concurrency plot's peaks) thin, in styles of their own."""
    from matplotlib.ticker import FuncFormatter

    plt = _plt()
    lines = _serve_lines(result)
    colors = _colors(list(dict.fromkeys(k[0] for k in lines)))
    kv_dtypes = sorted({k[1] for k in lines})
    markers = dict(zip(kv_dtypes, "o^sD"))
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    for (variant, kv, cache), rows in lines.items():
        xs = [r["memory_bytes"] for r in rows]
        label = variant + ("" if len(kv_dtypes) == 1 else " " + kv) + ("" if cache == "paged" else " static")
        for i, (ys, styles) in enumerate(values(rows)):
            extra = {} if i == 0 else {"linewidth": 0.8, "alpha": 0.6}
            ax.plot(xs, ys, linestyle=styles[cache], color=colors[variant], marker=markers[kv],
                    markersize=4 if i == 0 else 2, label=label if i == 0 else None, **extra)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_bytes_label))
    ax.set_xlabel("KV memory budget (all layers)")
    ax.set_ylabel(ylabel)
    c = result.get("config", {})
    # Three lines: a trace's description is wider than the axes.
    ax.set_title("%s\n%s, %s layer(s)\n%s" % (title, c.get("model", "?"), c.get("layers", "?"),
                                                result.get("trace", {}).get("source", "")),
                 fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return _save(fig, path)


_MEAN_STYLES = {"paged": "-", "static": "--"}
_PEAK_STYLES = {"paged": ":", "static": "-."}


def serve_throughput_vs_memory(result, path):
    """Measured output tokens/s against the KV memory budget, per variant
    (paged solid, static dashed). Writes `path` and returns it."""
    return _serve_plot(result, path, "output tokens/s (measured)",
                       "serving throughput against the KV budget",
                       lambda rows: [([r["output_tokens_per_s"] for r in rows], _MEAN_STYLES)])


def serve_concurrency_vs_memory(result, path):
    """Sequences per step (mean; peak thin, dotted paged and dash-dotted
    static) against the KV memory budget, per variant. Writes `path` and
    returns it."""
    return _serve_plot(result, path, "sequences per step (mean; peak thin)",
                       "concurrency the KV budget allows",
                       lambda rows: [([r["mean_running"] for r in rows], _MEAN_STYLES),
                                     ([r["peak_running"] for r in rows], _PEAK_STYLES)])


def plot_all(bench, out_dir, formats=("png",), layers=1):
    """All three plots of a bench result (two of a serve-bench result) in
    every format; returns [{"plot": name, "path": p}]."""
    files = []
    if is_serve(bench):
        plots = (("serve_throughput_vs_memory", serve_throughput_vs_memory, {}),
                 ("serve_concurrency_vs_memory", serve_concurrency_vs_memory, {}))
    else:
        plots = (("kv_memory_vs_context", kv_memory_vs_context, {"layers": layers}),
                 ("decode_latency_vs_context", decode_latency_vs_context, {}),
                 ("roofline", roofline, {}))
    for fmt in formats:
        if fmt not in ("png", "svg"):
            raise ValueError("format must be png or svg, got %r" % fmt)
        for name, fn, kwargs in plots:
            path = os.path.join(out_dir, "%s.%s" % (name, fmt))
            files.append({"plot": name, "path": fn(bench, path, **kwargs)})
    return files


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m attnkit.plot",
                                description="Plots of an `attnkit bench --json` or "
                                            "`attnkit serve-bench --json` result.")
    p.add_argument("--input", required=True,
                   help="bench or serve-bench JSON (attnkit bench --json > bench.json)")
    p.add_argument("--out", default=".", help="output directory (default .)")
    p.add_argument("--format", default="png", help="png, svg or png,svg (default png)")
    p.add_argument("--layers", type=int, default=1, help="layers for the KV-memory plot (default 1)")
    p.add_argument("--json", action="store_true", help="print the files written as JSON")
    a = p.parse_args(argv)
    try:
        bench = load(a.input)
        files = plot_all(bench, a.out, [f for f in a.format.split(",") if f], a.layers)
    except (OSError, ValueError, KeyError) as e:
        print("attnkit.plot: %s" % e, file=sys.stderr)
        return 2
    notes = plot_warnings(bench)
    if a.json:
        print(json.dumps({"files": files, "input": a.input, "warnings": notes}))
    else:
        for f in files:
            print("%-26s %s" % (f["plot"], f["path"]))
        for w in notes:
            print("warning: %s" % w, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
