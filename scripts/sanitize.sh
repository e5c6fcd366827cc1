#!/usr/bin/env bash
# Builds the C++ test suite with sanitizers, each in its own build directory,
# runs it, and prints a summary:
#
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer (-fno-sanitize-recover:
#         the first finding aborts), the whole suite
#   tsan  ThreadSanitizer, the tests that run threads (the thread pool, the
#         fast kernels at several thread counts, layers called from several
#         threads, MoE shards); halt_on_error, so a race fails the run. Its
#         test binary is built from the test files that hold those tests
#         only (the library is whole).
#
# Both run as gtest shards, several per core, one per core at a time: a
# core that finishes its shard takes the next, so a few long tests landing
# in one shard cannot leave the other core idle (docs/RELIABILITY.md, CI).
#
#   scripts/sanitize.sh [asan] [tsan]      # default: both
#
# Compilers: the ASan + UBSan build is clang's, configured exactly as
# fuzz/run.sh configures the libFuzzer build (ATTNKIT_BUILD_FUZZERS: the
# library also carries coverage instrumentation, which costs the tests
# little), so that CI's fuzz step builds only the fuzzers in the same
# directory; clang compiles the sanitized code in half GCC's time
# (docs/RELIABILITY.md). TSan is GCC's (libtsan from build-essential).
# Debian's libgtest, built by GCC, links with either.
#
# Environment: ATTNKIT_SANITIZE_JOBS (build jobs, default nproc),
# ATTNKIT_SANITIZE_PARALLEL (test processes at a time, default nproc),
# ATTNKIT_SANITIZE_SHARDS (gtest shards in all, default 8 per process at a
# time),
# ATTNKIT_ASAN_BUILD_DIR (default build-asan), ATTNKIT_TSAN_BUILD_DIR
# (default build-tsan), ATTNKIT_ASAN_FILTER (a gtest filter replacing the
# default one below for ASan), ATTNKIT_TSAN_FILTER (a gtest filter replacing the
# default one below).
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

# Left out of the ASan + UBSan run (a negative gtest filter): bit-equality
# sweeps over long sequences whose code paths smaller tests reach under the
# sanitizers too, and which clang -O1 with instrumentation makes many
# minutes long (the engine's 4100-token prefix-caching test on the fast
# kernels: 47 s in the plain build, over 15 min here on 2 cores; the pool's
# chunking / batching sweep over f32, bf16, int8 and fp8 caches on every
# SIMD target: 58 s in the plain build). The plain build's ctest runs them.
asan_filter=${ATTNKIT_ASAN_FILTER:-'-ServeEngine.PrefixCachingAndChunkingChangeNoBitsWithTheFastKernels:PagedInvariance.RowsAreTheSameBitsHoweverTheSequenceIsChunkedOrBatched'}

parallel=${ATTNKIT_SANITIZE_PARALLEL:-$(nproc)}
shards=${ATTNKIT_SANITIZE_SHARDS:-$((8 * parallel))}

# The test files that hold the filter's suites, ';'-separated, for a TSan
# build of only those (tests/CMakeLists.txt, ATTNKIT_TEST_FILES); empty, so
# the whole suite, when the filter has wildcards in suite names or negative
# patterns, which cannot be mapped to files this way.
filter_files() {  # filter
  local suite files=()
  if [[ $1 == *-* ]]; then return; fi
  for suite in $(tr ':' '\n' <<<"$1" | sed 's/\..*//' | sort -u); do
    if [[ $suite == *[*?]* ]]; then return; fi
    local found
    found=$(cd "$root/tests" && grep -rlE "^(TEST|TEST_F|TEST_P)\($suite," --include='*_test.cc' . |
      grep -v '^./dist/' | sed 's#^\./##' || true)
    if [[ -z $found ]]; then
      echo "sanitize.sh: no test file defines suite '$suite' of the TSan filter" >&2
      exit 2
    fi
    files+=($found)
  done
  printf '%s\n' "${files[@]}" | sort -u | paste -sd';'
}

declare -a summary=()
status=0

# The optimisation level is the build's: the sanitizers' checks are the
# same at any level, the compile and run times are not (docs/RELIABILITY.md).
configure_and_build() {  # dir sanitizers compiler opt [cmake args...]
  local t0=$SECONDS dir=$1 san=$2 cxx=$3 opt=$4
  shift 4
  cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$cxx" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$opt -g -DNDEBUG" \
    -DATTNKIT_SANITIZE="$san" -DATTNKIT_BUILD_PYTHON=OFF -DATTNKIT_BUILD_TOOLS=OFF \
    -DATTNKIT_BUILD_BENCH=OFF -DATTNKIT_BUILD_DIST=OFF "$@" >/dev/null
  cmake --build "$dir" -j "$jobs" --target attnkit_tests
  echo "   build: $((SECONDS - t0)) s"
}

# Runs the suite as `shards` gtest shards (each test runs in exactly one),
# `parallel` processes at a time, one log per shard. gtest deals tests to
# shards by index, not by cost; with several small shards per process the
# cores stay busy to the end, where two shards of half the suite each
# differed by a factor of 2 to 9 in time.
run_suite() {  # name dir log [gtest args...]
  local name=$1 dir=$2 log=$3
  shift 3
  local t0=$SECONDS i failed=0 passed=0 n running=0
  local -a pids=()
  for ((i = 0; i < shards; ++i)); do
    if ((running == parallel)); then
      wait -n || true  # statuses are collected below, shard by shard
      running=$((running - 1))
    fi
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
      "$dir/tests/attnkit_tests" --gtest_brief=1 "$@" >"$log.$i" 2>&1 &
    pids+=($!)
    running=$((running + 1))
  done
  for ((i = 0; i < shards; ++i)); do
    if wait "${pids[i]}"; then
      n=$(grep -Eo '\[  PASSED  \] [0-9]+ tests?' "$log.$i" | grep -Eo '[0-9]+' || echo 0)
      passed=$((passed + n))
    else
      failed=1
      echo "   $name shard $i failed (log: $log.$i):"
      grep -E 'ERROR: (Address|Thread|Leak)Sanitizer|runtime error|WARNING: ThreadSanitizer|SUMMARY|\[  FAILED  \]' \
        "$log.$i" | head -30 || true
    fi
  done
  if ((failed)); then
    status=1
    summary+=("$name: FAILED after $((SECONDS - t0)) s (logs: $log.*)")
  else
    summary+=("$name: ok, $passed tests in $((SECONDS - t0)) s ($shards shards, $parallel at a time)")
  fi
}

for mode in "${modes[@]}"; do
  case $mode in
    asan)
      dir=${ATTNKIT_ASAN_BUILD_DIR:-$root/build-asan}
      echo "== ASan + UBSan ($dir)"
      # -O1: what libFuzzer recommends, and the fuzzers share this build.
      configure_and_build "$dir" address,undefined clang++ -O1 -DATTNKIT_BUILD_FUZZERS=ON \
        -DATTNKIT_TEST_FILES=
      ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1:abort_on_error=1} \
      UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
        run_suite "asan+ubsan" "$dir" "$dir/sanitize.log" --gtest_filter="$asan_filter"
      ;;
    tsan)
      dir=${ATTNKIT_TSAN_BUILD_DIR:-$root/build-tsan}
      echo "== TSan ($dir)"
      files=$(filter_files "$tsan_filter")
      # -O2: the threaded tests are most of this step's time, and TSan's
      # instrumentation of every call makes them sensitive to inlining;
      # the build is small once it holds only their files.
      configure_and_build "$dir" thread g++ -O2 -DATTNKIT_TEST_FILES="$files"
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
