#!/usr/bin/python3
"""Static throughput of a compiled kernel's loops, from llvm-mca.

This VM exposes no hardware counters (perf stat: cycles and instructions
"not supported"), so instruction counts and execution-unit use come from
the compiled code itself: each loop of the named function (a backward
branch and the instructions it closes over) is fed to llvm-mca for the
chosen core model, which assumes every load hits L1 and reports cycles per
iteration and how busy each pipe is. Set against the measured time of the
same kernel on cache-resident data (bench/decode_tile_bench), it says
whether the instruction mix or something else (latency, the memory) is
what holds the kernel back.

  scripts/kernel_mca.py build/CMakeFiles/attnkit.dir/src/kernels/cpu/kernels_avx2.cc.o \\
      'rows4_block<3, true, unsigned short>' [--mcpu znver3]

Needs binutils (objdump, nm) and llvm-mca 16 (Debian: binutils, llvm-16).
"""
import argparse
import re
import shutil
import subprocess
import sys

INSN = re.compile(r"^\s*([0-9a-f]+):\s+(.*?)\s*$")
JUMP = re.compile(r"^(j[a-z]+)\s+([0-9a-f]+)(\s+<.*>)?$")


def find_symbol(obj, pattern):
    """Mangled name of the one symbol whose demangled name contains pattern."""
    mangled = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in mangled.splitlines() if len(line.split()) == 3]
    plain = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                           check=True).stdout.splitlines()
    hits = sorted({m for m, d in zip(names, plain) if pattern in d})
    if len(hits) != 1:
        demangled = dict(zip(names, plain))
        sys.exit(f"pattern {pattern!r} matches {len(hits)} symbols (need exactly 1):\n  " +
                 "\n  ".join(demangled[h] for h in hits))
    return hits[0]


def instructions(obj, symbol):
    """(address, text) of each instruction of symbol, AT&T syntax."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--disassemble={symbol}", obj],
                         capture_output=True, text=True, check=True).stdout
    body = []
    for line in out.splitlines():
        m = INSN.match(line)
        if m:
            body.append((int(m.group(1), 16), m.group(2).split("#")[0].strip()))
    return body


def loops(body):
    """Each innermost loop (a backward branch whose range holds no other
    loop; outer loops are not straight-line code, which llvm-mca assumes)
    as (start address, instruction texts)."""
    spans = []
    for i, (addr, text) in enumerate(body):
        m = JUMP.match(text)
        if not m:
            continue
        target = int(m.group(2), 16)
        if target > addr or target < body[0][0]:
            continue
        spans.append((next(j for j, (a, _) in enumerate(body) if a >= target), i))
    inner = [(s, e) for s, e in spans
             if not any((s, e) != (s2, e2) and s <= s2 and e2 <= e for s2, e2 in spans)]
    return [(body[s][0], [t for _, t in body[s:e + 1]]) for s, e in inner]


def for_mca(texts):
    # llvm-mca does not follow branches; every jump just needs a label.
    lines = [".Lloop:"]
    for t in texts:
        m = JUMP.match(t)
        lines.append(f"{m.group(1)} .Lloop" if m else t)
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("object")
    ap.add_argument("symbol", help="part of the demangled function name, matching one symbol")
    ap.add_argument("--mcpu", default="znver3")
    ap.add_argument("--iterations", type=int, default=500)
    ap.add_argument("--all", action="store_true", help="also loops without multiply-adds")
    args = ap.parse_args()
    # LLVM 14's znver3 model issues one 256-bit FMA per cycle; Zen 3 does
    # two (the measured peak, 100 GFLOP/s a core, needs them), and LLVM 16's
    # model agrees.
    mca = shutil.which("llvm-mca-16") or shutil.which("/usr/lib/llvm-16/bin/llvm-mca")
    if not mca:
        sys.exit("llvm-mca 16 not found (Debian: apt-get install llvm-16)")

    symbol = find_symbol(args.object, args.symbol)
    for start, texts in loops(instructions(args.object, symbol)):
        fmas = sum(1 for t in texts if t.startswith("vfmadd") or t.startswith("vfnmadd"))
        if fmas == 0 and not args.all:
            continue
        report = subprocess.run([mca, f"-mcpu={args.mcpu}", f"-iterations={args.iterations}"],
                                input=for_mca(texts), capture_output=True, text=True)
        if report.returncode != 0:
            print(f"loop at {start:#x}: llvm-mca failed:\n{report.stderr}")
            continue
        cycles = int(re.search(r"Total Cycles:\s+(\d+)", report.stdout).group(1))
        per_iter = cycles / args.iterations
        counts = {
            "loads": sum(1 for t in texts if "(" in t and not t.startswith(("lea", "prefetch", "nop"))
                         and not re.match(r"^v?mov[a-z]*\s+%\w+,", t)),
            "prefetches": sum(1 for t in texts if t.startswith("prefetch")),
            "widen": sum(1 for t in texts if t.startswith(("vpmovzxwd", "vpslld", "vpand",
                                                            "vpunpck", "vpshufb"))),
        }
        print(f"loop at {start:#x}: {len(texts)} instructions, {fmas} multiply-adds, " +
              ", ".join(f"{v} {k}" for k, v in counts.items()))
        print(f"  {per_iter:.2f} cycles per iteration ({args.mcpu}, all loads in L1): "
              f"{fmas / (2 * per_iter):.2f} of the 2-FMA-per-cycle peak")
        pressure = report.stdout.split("Resource pressure per iteration:")[1].split("\n\n")[0]
        print("  resource pressure per iteration:")
        for line in pressure.strip().splitlines():
            print("   ", line)
        print()


if __name__ == "__main__":
    main()
