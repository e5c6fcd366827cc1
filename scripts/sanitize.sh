#!/usr/bin/env bash
# Builds the C++ test suite with sanitizers, each in its own build directory,
# runs it, and prints a summary:
#
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer (-fno-sanitize-recover:
#         the first finding aborts), the whole suite
#   tsan  ThreadSanitizer, the tests that run threads (the thread pool, the
#         fast kernels at several thread counts, layers called from several
#         threads, MoE shards); halt_on_error, so a race fails the run
#
#   scripts/sanitize.sh [asan] [tsan]      # default: both
#
# Compiler: GCC (Debian's libgtest is built with it; GCC's libasan/libtsan
# come with build-essential). Environment: ATTNKIT_SANITIZE_JOBS (build jobs,
# default nproc), ATTNKIT_ASAN_BUILD_DIR (default build-asan),
# ATTNKIT_TSAN_BUILD_DIR (default build-tsan), ATTNKIT_TSAN_FILTER (a gtest
# filter replacing the default one below).
#
# Uninstrumented libraries: libgtest, libstdc++, libdnnl and libgomp are
# Debian's plain builds. ASan/UBSan need nothing for them. TSan cannot see
# memory accesses inside them, which can only hide races, not invent them;
# the suppressions file scripts/tsan.supp exists for third-party frames
# only and never names attnkit code.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
jobs=${ATTNKIT_SANITIZE_JOBS:-$(nproc)}
modes=("$@")
((${#modes[@]})) || modes=(asan tsan)

# The threaded tests (gtest filter): the pool itself, the fast kernel's
# thread-count sweeps and determinism checks, layers from several threads,
# MoE shards, and the reliability suite's concurrency/determinism tests.
tsan_filter=${ATTNKIT_TSAN_FILTER:-'Threads.*:ReliabilityConcurrency.*:ReliabilityDeterminism.*:AttentionFast.DecodeIsBitIdenticalAcrossThreadCounts:AttentionFast.RandomCasesEveryTargetTilingAndThreadCount:MoeLayer.ThreadsAndStridesDoNotChangeTheResult:PagedKVCache.OutputsAreTheSameBitsForAnyThreadCount:SdpaVarlen.BitIdenticalForAnyThreadCount'}

declare -a summary=()
status=0

configure_and_build() {  # dir sanitizers
  local t0=$SECONDS
  cmake -S "$root" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=g++ \
    -DATTNKIT_SANITIZE="$2" -DATTNKIT_BUILD_PYTHON=OFF -DATTNKIT_BUILD_TOOLS=OFF \
    -DATTNKIT_BUILD_BENCH=OFF >/dev/null
  cmake --build "$1" -j "$jobs" --target attnkit_tests
  echo "   build: $((SECONDS - t0)) s"
}

run_suite() {  # name dir log [gtest args...]
  local name=$1 dir=$2 log=$3
  shift 3
  local t0=$SECONDS
  if "$dir/tests/attnkit_tests" --gtest_brief=1 "$@" >"$log" 2>&1; then
    local passed
    passed=$(grep -Eo '\[  PASSED  \] [0-9]+ tests?' "$log" | grep -Eo '[0-9]+' || echo "?")
    summary+=("$name: ok, $passed tests in $((SECONDS - t0)) s")
  else
    status=1
    summary+=("$name: FAILED after $((SECONDS - t0)) s (log: $log)")
    grep -E 'ERROR: (Address|Thread|Leak)Sanitizer|runtime error|WARNING: ThreadSanitizer|SUMMARY|\[  FAILED  \]' \
      "$log" | head -30 || true
  fi
}

for mode in "${modes[@]}"; do
  case $mode in
    asan)
      dir=${ATTNKIT_ASAN_BUILD_DIR:-$root/build-asan}
      echo "== ASan + UBSan ($dir)"
      configure_and_build "$dir" address,undefined
      ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1:abort_on_error=1} \
      UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
        run_suite "asan+ubsan" "$dir" "$dir/sanitize.log"
      ;;
    tsan)
      dir=${ATTNKIT_TSAN_BUILD_DIR:-$root/build-tsan}
      echo "== TSan ($dir)"
      configure_and_build "$dir" thread
      TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:allocator_may_return_null=1:suppressions=$root/scripts/tsan.supp} \
        run_suite "tsan" "$dir" "$dir/sanitize.log" --gtest_filter="$tsan_filter"
      ;;
    *)
      echo "sanitize.sh: unknown mode '$mode' (asan or tsan)" >&2
      exit 2
      ;;
  esac
done

echo "== sanitizer summary"
for line in "${summary[@]}"; do echo "   $line"; done
exit $status
