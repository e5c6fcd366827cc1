#!/usr/bin/env python3
"""Fails when a function in the command-line tool is longer than LIMIT lines.

The tool's commands are meant to translate: parse flags into an options
struct, make library calls that return result structs, render them. A
function that grows past LIMIT lines is usually computing or printing more
than one thing, and what it computes belongs in the library
(include/attnkit/report.h, analysis.h).

The scan is a brace matcher, not a parser: it skips comments, string and
character literals (raw strings included), treats namespace, class, struct,
union and enum bodies as transparent, and takes any other brace block at
that level whose header holds a parenthesis as a function, counted from the
first line of its signature to its closing brace. Lambdas and nested
blocks count toward the function around them.

Usage: scripts/check_function_length.py [--limit N] [FILE_OR_DIR ...]
       scripts/check_function_length.py --self-test
Default: tools/attnkit/*.cc of the checkout this script is in. Exit 1 and
one line per function over the limit ("path:line: name is N lines"); files
in ALLOWED are reported but do not fail (each names why it waits).
"""

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile

LIMIT = 80

# Files whose long functions are known and pending, with the reason. An
# entry here is a debt, not a licence: remove it with the change that pays it.
ALLOWED = {}

_TRANSPARENT = re.compile(r"\b(namespace|class|struct|union|enum)\b")
_NAME = re.compile(r"([A-Za-z_~][A-Za-z_0-9:<>~]*(?:operator\S*)?)\s*\($")


def _strip(text):
    """Text with comments and literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            k = text.find("(", i + 2)
            delim = ")" + text[i + 2:k] + '"'
            j = text.find(delim, k)
            j = n if j < 0 else j + len(delim)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # digit separator 1'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(text):
    """(name, first line, line count) of each function defined in `text`."""
    src = _strip(text)
    found = []
    stack = []  # per open brace: "transparent", "function" or "block"
    header_start = 0  # offset where the current header began
    in_function = 0
    func_open = None
    for i, c in enumerate(src):
        if c in ";}" and not in_function:
            header_start = i + 1
        if c == "{":
            header = src[header_start:i]
            if in_function:
                stack.append("block")
            elif _TRANSPARENT.search(header) and "(" not in header.split("{")[0].split("=")[0]:
                stack.append("transparent")
                header_start = i + 1
            elif "(" in header:
                stack.append("function")
                in_function = 1
                first = header_start + len(header) - len(header.lstrip())
                name_part = header[: header.find("(") + 1].strip()
                m = _NAME.search(name_part.replace("\n", " "))
                func_open = (m.group(1) if m else "?", src.count("\n", 0, first) + 1)
                continue
            else:
                stack.append("block")
        elif c == "}" and stack:
            kind = stack.pop()
            if kind == "function":
                in_function = 0
                end_line = src.count("\n", 0, i) + 1
                found.append((func_open[0], func_open[1], end_line - func_open[1] + 1))
                header_start = i + 1
            elif kind == "transparent":
                header_start = i + 1
    return found


def check(paths, limit):
    failures = 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        allowed = ALLOWED.get(os.path.basename(path))
        for name, line, count in functions(text):
            if count <= limit:
                continue
            tag = f" (allowed, {allowed})" if allowed else ""
            print(f"{path}:{line}: {name} is {count} lines (limit {limit}){tag}")
            failures += not allowed
    return failures


def self_test():
    long_body = "\n".join(f"  x += {i};" for i in range(85))
    text = (
        "// a comment with { a brace\n"
        "namespace a {\nnamespace {\n"
        "struct S {\n  int f() const { return 1; }\n};\n"
        'const char* kText = "}{";\n'
        "int short_one(int x) {\n  auto l = [](int y) { return y; };\n  return l(x);\n}\n"
        "}  // namespace\n"
        f"int long_one(int x)\n{{\n{long_body}\n  return x;\n}}\n"
        "}  // namespace a\n"
    )
    got = {name: count for name, _, count in functions(text)}
    assert got.get("f") == 1, got
    assert got.get("short_one") == 4, got
    assert got.get("long_one") == 89, got
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "cmd_x.cc")
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert check([p], LIMIT) == 1
            assert check([p], 100) == 0
        assert "long_one is 89 lines" in out.getvalue(), out.getvalue()
    print("check_function_length: self-test passed")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--limit", type=int, default=LIMIT)
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    targets = args.paths or [os.path.join(root, "tools", "attnkit")]
    files = []
    for t in targets:
        if os.path.isdir(t):
            files += sorted(os.path.join(t, f) for f in os.listdir(t) if f.endswith(".cc"))
        else:
            files.append(t)
    bad = check(files, args.limit)
    if bad:
        print(f"check_function_length: {bad} function(s) over {args.limit} lines", file=sys.stderr)
        return 1
    print(f"check_function_length: {len(files)} files, no function over {args.limit} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
