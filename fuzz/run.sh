#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan, whole library
# instrumented) in a separate build directory and runs each for the given
# number of seconds on one core (gated_delta_fuzz two thirds of it), as many
# side by side as there are cores:
#
#   fuzz/run.sh [seconds]          # default 60; CI passes a short time
#
# Each target starts from the seeds in fuzz/corpus/<target>/ and keeps what
# it finds in <build>/corpus/<target>/ (the source tree is never written).
# A crash leaves its input in <build>/artifacts/<target>/ and makes the
# script exit 1 after all targets ran. Environment: ATTNKIT_FUZZ_BUILD_DIR
# (default build-fuzz; CI passes scripts/sanitize.sh's build-asan), ATTNKIT_FUZZ_BUILD_JOBS (default 2),
# ATTNKIT_FUZZ_PARALLEL (targets at a time, default nproc).
set -euo pipefail

seconds=${1:-60}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${ATTNKIT_FUZZ_BUILD_DIR:-$root/build-fuzz}

# A build directory already configured with the fuzzers (scripts/sanitize.sh's
# ASan + UBSan one, which CI passes here) is used as it is: its library is
# built already, so only the fuzzers are compiled. -O1, as libFuzzer
# recommends and as that build has it.
if ! grep -qs '^ATTNKIT_BUILD_FUZZERS:BOOL=ON$' "$build/CMakeCache.txt"; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g -DNDEBUG" \
    -DCMAKE_CXX_COMPILER=clang++ -DATTNKIT_BUILD_FUZZERS=ON \
    -DATTNKIT_BUILD_TESTS=OFF -DATTNKIT_BUILD_PYTHON=OFF -DATTNKIT_BUILD_TOOLS=OFF >/dev/null
fi

targets=(safetensors_fuzz attention_fuzz paged_fuzz sparse_fuzz linear_fuzz)
# The config fuzzer needs attention_config_from_json (src/io/hf_config.cc).
if [[ -f $root/src/io/hf_config.cc ]]; then targets+=(config_fuzz); fi
# Last, for two thirds of the time: in the last batch, beside the config
# fuzzer (six targets on two cores), or alone after the others when the
# count is odd, so that it does not lengthen the run.
targets+=(gated_delta_fuzz)
t0=$SECONDS
cmake --build "$build" -j "${ATTNKIT_FUZZ_BUILD_JOBS:-2}" --target "${targets[@]}"
echo "   build: $((SECONDS - t0)) s"

# Seconds for target $1.
seconds_of() {
  if [[ $1 == gated_delta_fuzz ]]; then echo $((seconds * 2 / 3)); else echo "$seconds"; fi
}

fuzz_one() {  # target
  local t=$1 dict=()
  mkdir -p "$build/corpus/$t" "$build/artifacts/$t" "$build/logs"
  # One process per target (no -jobs/-workers). -max_len leaves room for
  # headers of a few dozen tensors; -timeout catches hangs.
  if [[ -f $root/fuzz/$t.dict ]]; then dict=(-dict="$root/fuzz/$t.dict"); fi
  "$build/fuzz/$t" "$build/corpus/$t" "$root/fuzz/corpus/$t" \
    "${dict[@]}" -max_total_time="$(seconds_of "$t")" -max_len=16384 -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$build/artifacts/$t/" \
    >"$build/logs/$t.log" 2>&1
}

# Targets run side by side, ATTNKIT_FUZZ_PARALLEL at a time (default: one
# per core), so each still has a core for its full time.
parallel=${ATTNKIT_FUZZ_PARALLEL:-$(nproc)}
status=0
for ((first = 0; first < ${#targets[@]}; first += parallel)); do
  batch=("${targets[@]:first:parallel}")
  pids=()
  for t in "${batch[@]}"; do
    echo "== $t: $(seconds_of "$t")s"
    fuzz_one "$t" &
    pids+=($!)
  done
  for i in "${!batch[@]}"; do
    t=${batch[i]}
    log=$build/logs/$t.log
    if wait "${pids[i]}"; then
      echo "   $t ok: $(grep -m1 '^stat::number_of_executed_units' "$log" | awk '{print $2}') executions"
    else
      status=1
      echo "   $t FAILED (log: $log, reproducer in $build/artifacts/$t/):"
      grep -E 'ERROR|runtime error|fuzz: |Test unit written' "$log" | head -20 || true
    fi
  done
done
exit $status
