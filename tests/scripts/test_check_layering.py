"""scripts/check_layering.py passes on the tree and fails, naming the file,
the line and the rule, on an include planted in a copy of it.

    /usr/bin/python3 tests/scripts/test_check_layering.py    (or pytest)
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "check_layering.py")
COPIED = ["src", "include", "tools", "python/src", "bench", "fuzz", "tests", "docs"]


def run_check(root):
    return subprocess.run([sys.executable, SCRIPT, "--root", root], capture_output=True,
                          text=True, check=False)


class CheckLayering(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="attnkit-layering-")
        for d in COPIED:
            shutil.copytree(os.path.join(ROOT, d), os.path.join(self.tmp, d),
                            ignore=shutil.ignore_patterns("*.py", "corpus", "img", "*.png"))

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def plant(self, relpath, line, include):
        """Inserts `#include "include"` as line `line` (1-based) of relpath."""
        path = os.path.join(self.tmp, relpath)
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
        lines.insert(line - 1, f'#include "{include}"\n')
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(lines)

    def test_the_tree_passes(self):
        result = run_check(ROOT)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_an_upward_include_fails_naming_file_line_and_rule(self):
        self.plant("src/kernels/linear.cc", 3, "layers/paged_positions.h")
        result = run_check(self.tmp)
        self.assertEqual(result.returncode, 1, result.stdout)
        self.assertIn('src/kernels/linear.cc:3: #include "layers/paged_positions.h" '
                      "(src/layers/paged_positions.h, floor layers) goes up or sideways: "
                      "kernels (src/kernels) may include itself, include, core", result.stdout)

    def test_a_sideways_include_fails(self):
        self.plant("src/ops/rope.cc", 2, "io/json_util.h")
        result = run_check(self.tmp)
        self.assertEqual(result.returncode, 1, result.stdout)
        self.assertIn('src/ops/rope.cc:2: #include "io/json_util.h"', result.stdout)
        self.assertIn("ops (src/ops) may include itself, include, core, kernels", result.stdout)

    def test_a_second_library_reading_private_headers_fails(self):
        self.plant("src/dist/common.cc", 2, "core/threads.h")
        self.plant("python/src/moe.cc", 2, "ops/kv_quant.h")
        result = run_check(self.tmp)
        self.assertEqual(result.returncode, 1, result.stdout)
        self.assertIn('src/dist/common.cc:2: #include "core/threads.h"', result.stdout)
        self.assertIn("and of other floors only src/core/check.h", result.stdout)
        self.assertIn('python/src/moe.cc:2: #include "ops/kv_quant.h"', result.stdout)
        self.assertIn("python (python/src) may include itself, include", result.stdout)

    def test_a_table_that_differs_from_the_doc_fails(self):
        doc = os.path.join(self.tmp, "docs", "ARCHITECTURE.md")
        with open(doc, encoding="utf-8") as f:
            text = f.read()
        with open(doc, "w", encoding="utf-8") as f:
            f.write(text.replace("| ops | `src/ops/` | core, kernels |",
                                 "| ops | `src/ops/` | core, kernels, io |"))
        result = run_check(self.tmp)
        self.assertEqual(result.returncode, 1, result.stdout)
        self.assertIn("docs/ARCHITECTURE.md: the layering table differs", result.stdout)

    def test_an_include_of_no_file_fails(self):
        self.plant("tools/attnkit/main.cc", 1, "no_such_header.h")
        result = run_check(self.tmp)
        self.assertEqual(result.returncode, 1, result.stdout)
        self.assertIn('tools/attnkit/main.cc:1: #include "no_such_header.h" resolves to no file',
                      result.stdout)


if __name__ == "__main__":
    unittest.main()
