#!/usr/bin/python3
"""Runs a short fixed set of attnkit's benchmarks and writes the results for
the CPU it ran on into docs/perf/<cpu-slug>.md, as one dated section.

    scripts/perf_report.py [--build build] [--out docs/perf] [--reps 3] [--pairs 20]

Run it in a built tree (cmake --build build --target attnkit_bench
decode_tile_bench decode_read_bench linear_bf16_bench) on a machine as quiet
as you can get; it takes 4-10 minutes on 2 cores. Under ATTNKIT_SIMD (and
DNNL_MAX_CPU_ISA, to cap oneDNN alike) it reports the kernels of that
target, in a section of its own. Each row of the table is one case, its
figure, and the command that measures that case alone. A run on the same
date and commit replaces its own section; other sections (older runs,
other commits, rows copied from earlier reports) are kept as they are.
The figures are fractions of limits that the same run measured (the fp32
FMA peak, a read of the same bytes beside each decode call) or ratios of
calls alternated in one process, so they compare across runs better than
times do; on a shared machine, rerun and compare the spread.
"""

import argparse
import datetime
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The attnkit_bench cases, by benchmark name (the summary's names).
ATTNKIT_BENCH_FILTER = (
    "^(prefill/causal/(gqa32-8/s2048|mha32/s1024|mqa32-1/s1024)/(f32|bf16)/"
    "|prefill/causal/gqa32-8/s256/"
    "|decode/gqa32-8/k16384/(q1|q4|b8/q1)/"
    "|decode/gqa32-8/k(4096|65536)/q1/f32/"
    # Only the paired cases the report reads: with all of them, this step
    # alone ran past 8 minutes (a 16-vCPU Intel Xeon model 207, 2026-11-28).
    "|paired/(prefill/causal/s1024/(gqa32-8|mqa32-1)_over_mha32/f32/"
    "|decode/gqa32-8/k16384/(q4_over_q1/|q1/(int8|fp8_e4m3)_over_(bf16|f32)/))"
    "|mla/h128/k4096/q1/(f32|bf16)/"
    "|threads1/(prefill|mla|decode/gqa32-8/k16384/q1/f32))"
)


def run(cmd, env=None):
    """Runs cmd (a list), echoing it; returns its stdout."""
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    full_env = dict(os.environ)
    full_env.update(env or {})
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=full_env)
    return out.stdout


def cpu_info():
    """Model name, vendor, family, model, stepping, flag summary, CPUs."""
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if ":" not in line:
                if info:
                    break  # the first processor is enough
                continue
            key, value = (s.strip() for s in line.split(":", 1))
            info.setdefault(key, value)
    flags = set(info.get("flags", "").split())
    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16",
              "amx_bf16", "amx_int8"]
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(info.get("vendor_id", ""),
                                                                   "cpu")
    return {
        "name": info.get("model name", "unknown"),
        "vendor": vendor,
        "family": info.get("cpu family", "?"),
        "model": info.get("model", "?"),
        "stepping": info.get("stepping", "?"),
        "flags": " ".join(f for f in wanted if f in flags) or "none of " + " ".join(wanted),
        "cpus": os.cpu_count(),
    }


def slug(cpu):
    return "%s-family%s-model%s" % (cpu["vendor"], cpu["family"], cpu["model"])


def git_commit(path):
    try:
        commit = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"],
                                check=True, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               check=True, capture_output=True, text=True).stdout.strip()
        return commit + ("+changes" if dirty else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def parse_attnkit_bench(text):
    """The summary of attnkit_bench: per-benchmark rows, ratios, paired ratios."""
    rows, ratios, paired, limits = {}, {}, {}, []
    section = None
    for line in text.splitlines():
        if line.startswith("summary:"):
            section = "rows"
            continue
        if line.startswith("ratios of best time"):
            section = "ratios"
            continue
        if line.startswith("paired ratios"):
            section = "paired"
            continue
        if section is None:
            continue
        m = re.match(r"\s+(\d+) thread\(s\), (\d+)-bit: before ([\d.]+) GFLOP/s, ([\d.]+) GB/s; "
                     r"after ([\d.]+) GFLOP/s, ([\d.]+) GB/s", line)
        if m:
            limits.append(m.groups())
            continue
        if section == "rows":
            f = line.split()
            # name, threads, vector bits (the width of the peak), ms,
            # GFLOP/s, of peak[, GB/s, of DRAM, of read]
            if len(f) >= 6 and "/" in f[0]:
                rows[f[0]] = {"ms": float(f[3]), "of_peak": float(f[5]), "bits": int(f[2]),
                              "of_read": float(f[8]) if len(f) >= 9 else None}
        elif section == "ratios":
            m = re.match(r"\s+(.*\S)\s+([\d.]+)$", line)
            if m:
                ratios[m.group(1)] = float(m.group(2))
        elif section == "paired":
            m = re.match(r"\s+(\S+)\s+([\d.]+) \[([\d.]+), ([\d.]+)\]", line)
            if m:
                paired[m.group(1)] = tuple(float(x) for x in m.groups()[1:])
    return rows, ratios, paired, limits


def parse_tile_bench(text):
    """decode_tile_bench's summary: label -> (tile ns, read ns, of fp32 peak)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s+(\S+ rows\d+ keys\d+ \S+)\s+" + r"([\d.]+)\s+" * 6 + r"([\d.]+)$", line)
        if m:
            v = [float(x) for x in m.groups()[1:]]
            out[m.group(1)] = (v[4], v[5], v[6])
    return out


def parse_linear_bf16_bench(text, columns):
    """linear_bf16_bench's table (decode step or --kernel): M -> its numbers."""
    out = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) == columns and re.match(r"\d+$", f[0]):
            try:
                out[int(f[0])] = [float(x) for x in f[1:]]
            except ValueError:
                pass
    return out


def parse_read_bench(text):
    out = {}
    for line in text.splitlines():
        m = re.match(r"(.+?)\s+median .*, ([\d.]+) of the sequential read", line)
        if m:
            out[m.group(1).strip()] = float(m.group(2))
    return out


def measure(build, reps, pairs):
    """Runs the benchmarks; returns (target, limits line, [(case, figure, command)])."""
    bench = os.path.join(build, "bench")
    rel = "build/bench"  # as the commands are written in the docs, whatever --build is
    rep = "--benchmark_repetitions=%d" % reps
    rows = []

    text = run([os.path.join(bench, "attnkit_bench"), "--benchmark_filter=" + ATTNKIT_BENCH_FILTER,
                rep, "--benchmark_report_aggregates_only=true"])
    m = re.search(r"kernels (\S+);", text)
    target = m.group(1) if m else "?"
    b, ratios, paired, limits = parse_attnkit_bench(text)
    limit_text = "; ".join(
        "%s thread(s): %s-bit fp32 FMA peak %s / %s GFLOP/s, read %s / %s GB/s (before / after)" %
        (t, bits, pb, pa, rb, ra) for t, bits, pb, rb, pa, ra in limits)

    def cmd(flt):
        return "`%s/attnkit_bench --benchmark_filter='%s' %s`" % (rel, flt, rep)

    def frac(case, name, key):
        r = b.get(name)
        if r and r[key] is not None:
            # Each row is judged against the FMA peak of its kernels' vectors
            # (256-bit for AVX2 kernels, on any CPU), measured in the run.
            case = case.replace("of the fp32 FMA peak", "of the %d-bit fp32 FMA peak" % r["bits"])
            rows.append((case, "%.2f" % r[key], cmd("^" + name + "/")))

    def ratio(case, what, flt):
        if what in ratios:
            rows.append((case, "%.2f" % ratios[what], cmd(flt)))

    def pair(case, name):
        if name in paired:
            med, q1, q3 = paired[name]
            rows.append((case, "%.2f [%.2f, %.2f]" % (med, q1, q3), cmd("^" + name + "/")))

    for kv, label in (("f32", "fp32"), ("bf16", "bf16 K/V")):
        frac("prefill GQA 32/8, causal s2048, %s: of the fp32 FMA peak" % label,
             "prefill/causal/gqa32-8/s2048/" + kv, "of_peak")
    if target != "avx2":
        frac("prefill GQA 32/8, causal s2048, fp32, avx2 kernels: of the fp32 FMA peak",
             "prefill/causal/gqa32-8/s2048/f32/avx2", "of_peak")
    for kv, label in (("f32", "fp32"), ("bf16", "bf16 K/V")):
        frac("prefill MHA 32/32, causal s1024, %s: of the fp32 FMA peak" % label,
             "prefill/causal/mha32/s1024/" + kv, "of_peak")
        frac("prefill MQA 32/1, causal s1024, %s: of the fp32 FMA peak" % label,
             "prefill/causal/mqa32-1/s1024/" + kv, "of_peak")
    pair("prefill s1024 fp32, GQA 32/8 time over MHA's (paired)",
         "paired/prefill/causal/s1024/gqa32-8_over_mha32/f32")
    pair("prefill s1024 fp32, MQA 32/1 time over MHA's (paired)",
         "paired/prefill/causal/s1024/mqa32-1_over_mha32/f32")
    for kv in ("f32", "bf16", "int8", "fp8_e4m3"):
        frac("decode 1 token, GQA 32/8, 16K keys, %s: of a read of the same bytes (paired)" % kv,
             "decode/gqa32-8/k16384/q1/" + kv, "of_read")
    for kv in ("f32", "bf16"):
        frac("decode 1 token, batch 8, 16K keys, %s: of the paired read" % kv,
             "decode/gqa32-8/k16384/b8/q1/" + kv, "of_read")
    for kv in ("f32", "bf16", "int8", "fp8_e4m3"):
        pair("decode 4 tokens over 1 token, %s (paired)" % kv,
             "paired/decode/gqa32-8/k16384/q4_over_q1/" + kv)
    for kv in ("int8", "fp8_e4m3"):
        for wide in ("bf16", "f32"):
            pair("decode 1 token, %s time over %s's (paired)" % (kv, wide),
                 "paired/decode/gqa32-8/k16384/q1/%s_over_%s" % (kv, wide))
    for kv in ("f32", "bf16"):
        frac("absorbed MLA decode, 128 heads, 576/512, 4096 keys, %s: of the fp32 FMA peak" % kv,
             "mla/h128/k4096/q1/" + kv, "of_peak")
    ratio("decode per key at 4K keys, of 16K's (fp32)", "decode per key, 4K / 16K keys",
          "^decode/gqa32-8/k(4096|16384)/q1/f32/")
    ratio("decode per key at 64K keys, of 16K's (fp32)", "decode per key, 64K / 16K keys",
          "^decode/gqa32-8/k(65536|16384)/q1/f32/")
    ratio("1 -> 2 threads, prefill GQA s2048 fp32", "speedup 1 -> default threads, prefill GQA s2048",
          "^(threads1/)?prefill/causal/gqa32-8/s2048/f32/")
    ratio("1 -> 2 threads, decode 1 token fp32", "speedup 1 -> default threads, decode q1 f32",
          "^(threads1/)?decode/gqa32-8/k16384/q1/f32/")
    ratio("1 -> 2 threads, absorbed MLA fp32", "speedup 1 -> default threads, absorbed MLA f32",
          "^(threads1/)?mla/h128/k4096/q1/f32/")
    ratio("reference twin time over the fast kernel's, prefill GQA s256",
          "prefill reference / fast (s256)", "^prefill/causal/gqa32-8/s256/")

    tile_filter = "^tile/[^/]+/rows(4|16)/padded/"
    text = run([os.path.join(bench, "decode_tile_bench"), "--benchmark_filter=" + tile_filter, rep])
    tiles = parse_tile_bench(text)
    for label, (tile_ns, read_ns, _) in sorted(tiles.items()):
        kv, r, keys, _ = label.split()
        rows.append(("one kv head's %s-key decode tile, %s %s, 1 thread, resident: arithmetic "
                     "over the time to read it from DRAM (%.0f / %.0f ns)" %
                     (keys[4:], kv, r.replace("rows", "") + " rows", tile_ns, read_ns),
                     "%.2f" % (tile_ns / read_ns),
                     "`%s/decode_tile_bench --benchmark_filter='^tile/%s/rows%s/padded/' %s`" %
                     (rel, kv, r[4:], rep)))

    # The kernel's 1-token fp32 decode tile: 12 keys on avx2, 64 elsewhere.
    tile_keys = "12" if target == "avx2" else "64"
    text = run([os.path.join(bench, "decode_read_bench"), "2", str(pairs), tile_keys])
    walks = parse_read_bench(text)
    for walk, what in (("K, then V", "every head's K rows of a tile, then their V rows"),
                       ("by head", "head by head")):
        if walk in walks:
            rows.append(("1-token decode's reads without arithmetic, %s-key tiles, %s: of a "
                         "sequential read (2 threads)" % (tile_keys, what), "%.2f" % walks[walk],
                         "`%s/decode_read_bench 2 %d %s`" % (rel, pairs, tile_keys)))

    # Decode steps with bf16 weights (issue 33): the Llama-3-8B layer's seven
    # projections for M sequences, bf16 weights' time over f32 weights'
    # (alternated), and the stream GEMM's share of the FMA peak.
    step_reps = max(reps, 5)
    text = run([os.path.join(bench, "linear_bf16_bench"), "2", str(step_reps), "1,16,32"])
    steps = parse_linear_bf16_bench(text, 8)
    step_cmd = "`%s/linear_bf16_bench 2 %d 1,16,32`" % (rel, step_reps)
    for m in sorted(steps):
        plan_over_f32, of_read = steps[m][4], steps[m][5]
        rows.append(("decode step, Llama-3-8B layer projections, %d row(s), bf16 weights: time "
                     "over f32 weights' (alternated, 2 threads)" % m, "%.2f" % plan_over_f32,
                     step_cmd))
        rows.append(("the same, bf16 weights: of a read of their bytes at the run's bandwidth" +
                     (" (%d row(s))" % m), "%.2f" % of_read, step_cmd))
    text = run([os.path.join(bench, "linear_bf16_bench"), "--kernel", str(step_reps), "16,32"])
    kernel = parse_linear_bf16_bench(text, 8)
    kernel_cmd = "`%s/linear_bf16_bench --kernel %d 16,32`" % (rel, step_reps)
    # Which stream kernel ran: on AMX tiles its products are not FMAs, and
    # its rate passes the FMA peak.
    found = re.search(r"attnkit bf16 stream \((\w+)\)", text)
    name = found.group(1) if found else "?"
    for m in sorted(kernel):
        stream_peak, f32_peak = kernel[m][5], kernel[m][6]
        rows.append(("bf16 stream GEMM (%s), 1024 x 4096, %d rows, 1 thread: GFLOP/s over the "
                     "fp32 FMA peak%s (oneDNN's f32 GEMM: %.2f)"
                     % (name, m, ", which tiles are not bound by" if name == "amx" else "",
                        f32_peak), "%.2f" % stream_peak, kernel_cmd))
    return target, limit_text, rows


def header(cpu):
    return ("# %s (family %s, model %s)\n\n"
            "Results of `scripts/perf_report.py` on this CPU, newest first, and rows kept from\n"
            "earlier reports. Each section is one run: its date, the commit measured, the\n"
            "CPU and the limits the run measured; each row a case, its figure and the command\n"
            "that measures it alone. Fractions are of limits measured in the same run;\n"
            "`[a, b]` are the quartiles of calls alternated pair by pair. What each figure\n"
            "decided is in [docs/PERFORMANCE.md](../PERFORMANCE.md).\n"
            % (cpu["name"], cpu["family"], cpu["model"]))


def marker(date, commit, target):
    return "<!-- perf_report %s %s %s -->" % (date, commit, target)


def section(date, commit, cpu, target, limits, rows, load):
    simd = os.environ.get("ATTNKIT_SIMD")
    lines = [
        "## %s · %s · `%s` · scripts/perf_report.py" % (date, commit, target),
        marker(date, commit, target),
        "",
        "CPU: %s, family %s, model %s, stepping %s, %s CPUs; flags: %s; kernels `%s`%s." %
        (cpu["name"], cpu["family"], cpu["model"], cpu["stepping"], cpu["cpus"], cpu["flags"],
         target, "" if not simd else " (`ATTNKIT_SIMD=%s%s`)" % (
             simd, "" if "DNNL_MAX_CPU_ISA" not in os.environ else
             " DNNL_MAX_CPU_ISA=" + os.environ["DNNL_MAX_CPU_ISA"])),
        "Limits measured by attnkit_bench: %s." % limits,
        "Load average (1 minute) at the start / end of the run: %.1f / %.1f; on a busy machine "
        "the limits fall and single rows move: compare with a quiet run." % load,
        "",
        "| case | figure | command |",
        "|---|---|---|",
    ]
    lines += ["| %s | %s | %s |" % r for r in rows]
    return "\n".join(lines) + "\n"


def write(path, head, date, commit, target, body):
    """Puts body first under the header, replacing a section of the same date, commit and
    kernels (runs under two ATTNKIT_SIMD values keep a section each)."""
    mark = marker(date, commit, target)
    old = open(path).read() if os.path.exists(path) else head
    parts = re.split(r"(?=^## )", old, flags=re.M)
    kept = [p.strip("\n") + "\n" for p in parts[1:] if mark not in p]
    with open(path, "w") as f:
        f.write("\n".join([parts[0].rstrip("\n") + "\n", body] + kept))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="the build tree")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "perf"), help="output folder")
    ap.add_argument("--reps", type=int, default=3, help="benchmark repetitions (best is kept)")
    ap.add_argument("--pairs", type=int, default=20, help="decode_read_bench pairs")
    args = ap.parse_args()

    cpu = cpu_info()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    commit = git_commit(args.build)
    load_start = os.getloadavg()[0]
    target, limits, rows = measure(os.path.abspath(args.build), args.reps, args.pairs)
    load = (load_start, os.getloadavg()[0])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, slug(cpu) + ".md")
    write(path, header(cpu), date, commit, target,
          section(date, commit, cpu, target, limits, rows, load))
    print(path)


if __name__ == "__main__":
    main()
