#!/usr/bin/env bash
# The bytes each rank really sends per distributed call, as Open MPI's PML
# monitoring counts them (every message: the calls' own and those inside
# collectives), for comparison with the cost model's formula that
# dist_bench prints. Each case runs its calls twice as many times in a
# second run; the difference divided by the extra calls cancels the setup
# traffic (communicator duplication, weight loading, a cache's prefill).
#
#   bench/dist_bytes.sh [build dir (build)] [ranks (2)]
#
# As root, export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
set -euo pipefail
build=${1:-build}
np=${2:-2}

sent() {  # case reps -> the most bytes any rank sent in the whole run
  mpirun --oversubscribe -np "$np" --mca pml_monitoring_enable 2 \
    --mca pml_monitoring_enable_output 1 \
    "$build/bench/dist_bench" --case "$1" --reps "$2" --calls-only 2>&1 |
    awk '$1 == "E" || $1 == "I" { sent[$2] += $4 }
         END { m = 0; for (r in sent) if (sent[r] > m) m = sent[r]; print m }'
}

echo "bytes sent per rank per call, $np ranks (Open MPI PML monitoring)"
# case:calls per repetition (the context-parallel cases time two contexts)
for c in hp-prefill:1 hp-decode:1 cp-allreduce:2 cp-allgather:2 ring:1; do
  name=${c%%:*}
  calls=${c##*:}
  a=$(sent "$name" 4)
  b=$(sent "$name" 8)
  printf '  %-14s %12d\n' "$name" $(((b - a) / (4 * calls)))
done
