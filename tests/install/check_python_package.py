"""Run by run_consumer.cmake after `cmake --install --prefix PREFIX`.

Proves the installed Python package works on its own: it imports from
PREFIX/PACKAGE_DIR (not from the build tree), its extension computes
attention that agrees with a float64 loop, and attnkit.dist's native module
was installed where MPI was found. Also checks that PACKAGE_DIR under the
interpreter's default prefix is on its sys.path, which is what lets a
default `cmake --install` be imported with no PYTHONPATH.

usage: check_python_package.py PREFIX PACKAGE_DIR DEFAULT_PREFIX EXPECT_DIST(0|1)
"""
import os
import site
import sys

prefix, package_dir, default_prefix, expect_dist = sys.argv[1:5]
if "PYTHONPATH" in os.environ:
    sys.exit("run without PYTHONPATH: the check is that the install alone suffices")

default_dir = os.path.join(default_prefix, package_dir)
if default_dir not in sys.path:
    sys.exit(f"{default_dir} (the package's home under the default prefix) is not on "
             f"{sys.executable}'s sys.path {sys.path}")

# A fresh prefix is not on the interpreter's path; add it as the default
# prefix's directory is added at start-up (site.addsitedir runs .pth files too).
installed = os.path.join(prefix, package_dir)
site.addsitedir(installed)
import numpy as np  # noqa: E402

import attnkit  # noqa: E402

where = os.path.realpath(os.path.dirname(attnkit.__file__))
if not where.startswith(os.path.realpath(installed)):
    sys.exit(f"attnkit was imported from {where}, not from the install at {installed}")

rng = np.random.default_rng(7)
q = rng.standard_normal((1, 5, 4, 8)).astype(np.float32)
k = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
v = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
out = attnkit.sdpa(q, k, v, causal=True)
# float64 loop: query head h reads kv head h // 2; causal aligned bottom-right.
ref = np.zeros((1, 5, 4, 8))
for h in range(4):
    for i in range(5):
        visible = i + 1 + (6 - 5)
        s = k[0, :visible, h // 2].astype(np.float64) @ q[0, i, h].astype(np.float64) / np.sqrt(8)
        p = np.exp(s - s.max())
        ref[0, i, h] = (p / p.sum()) @ v[0, :visible, h // 2].astype(np.float64)
err = np.abs(np.asarray(out, dtype=np.float64) - ref).max()
if not err < 1e-5:
    sys.exit(f"installed attnkit.sdpa differs from the float64 loop by {err}")

has_dist = any(name.startswith("_attnkit_dist") for name in os.listdir(where))
if has_dist != (expect_dist == "1"):
    sys.exit(f"_attnkit_dist installed: {has_dist}, expected: {expect_dist == '1'}")
print(f"installed attnkit {attnkit.__version__} imports from {where}; sdpa max error {err:.1e}")
