#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan, whole library
# instrumented) in a separate build directory and runs each for the given
# number of seconds on one core:
#
#   fuzz/run.sh [seconds]          # default 60; CI passes a short time
#
# Each target starts from the seeds in fuzz/corpus/<target>/ and keeps what
# it finds in <build>/corpus/<target>/ (the source tree is never written).
# A crash leaves its input in <build>/artifacts/<target>/ and makes the
# script exit 1 after all targets ran. Environment: ATTNKIT_FUZZ_BUILD_DIR
# (default build-fuzz), ATTNKIT_FUZZ_BUILD_JOBS (default 2).
set -euo pipefail

seconds=${1:-60}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${ATTNKIT_FUZZ_BUILD_DIR:-$root/build-fuzz}

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++ -DATTNKIT_BUILD_FUZZERS=ON \
  -DATTNKIT_BUILD_TESTS=OFF -DATTNKIT_BUILD_PYTHON=OFF -DATTNKIT_BUILD_TOOLS=OFF >/dev/null

targets=(safetensors_fuzz attention_fuzz paged_fuzz)
# The config fuzzer needs attention_config_from_json (src/io/hf_config.cc).
if [[ -f $root/src/io/hf_config.cc ]]; then targets+=(config_fuzz); fi
cmake --build "$build" -j "${ATTNKIT_FUZZ_BUILD_JOBS:-2}" --target "${targets[@]}"

status=0
for t in "${targets[@]}"; do
  mkdir -p "$build/corpus/$t" "$build/artifacts/$t" "$build/logs"
  log=$build/logs/$t.log
  echo "== $t: ${seconds}s"
  # One process (no -jobs/-workers): the machines are shared. -max_len
  # leaves room for headers of a few dozen tensors; -timeout catches hangs.
  dict=()
  if [[ -f $root/fuzz/$t.dict ]]; then dict=(-dict="$root/fuzz/$t.dict"); fi
  if "$build/fuzz/$t" "$build/corpus/$t" "$root/fuzz/corpus/$t" \
      "${dict[@]}" -max_total_time="$seconds" -max_len=16384 -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$build/artifacts/$t/" \
      >"$log" 2>&1; then
    echo "   ok: $(grep -m1 '^stat::number_of_executed_units' "$log" | awk '{print $2}') executions"
  else
    status=1
    echo "   FAILED (log: $log, reproducer in $build/artifacts/$t/):"
    grep -E 'ERROR|runtime error|fuzz: |Test unit written' "$log" | head -20 || true
  fi
done
exit $status
