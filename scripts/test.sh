#!/usr/bin/env bash
# Installs what is missing, builds attnkit, and runs every test: the C++
# suite, the Python suite against PyTorch, and the install-consumer check.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
build=${ATTNKIT_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j"$(nproc)"
ctest --test-dir "$build" --output-on-failure -j"$(nproc)"
