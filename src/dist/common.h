// What src/dist/ shares (internal): how the ranks agree on a call's outcome
// before any rank enters a data collective, and argument checks.
//
//   Status local = ...;                             // this rank's own checks
//   const int64_t facts[] = {batch, seq};           // values that must match
//   Result<Agreement> a = Agreement::reach(comm, fn, local, facts);
//   if (!a.ok()) return a.status();                 // some rank failed: all return it
//   ATTNKIT_RETURN_IF_ERROR(a->same(0, "x.shape[0] (batch)"));
//
// reach() is one MPI_Allgather of (failed?, facts...) per rank; only when a
// rank failed does a second collective broadcast that rank's code and
// message. Every rank gets the same Status, so every rank takes the same
// branch afterwards.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit::dist::internal {

// Local checks every public function makes first: MPI initialised and not
// finalised, comm a valid intracommunicator. A failure here cannot be
// agreed on (there is no usable communicator), so it is only local.
Status check_comm(const char* fn, MPI_Comm comm, int* rank, int* ranks);

// An MPI return code as a Status naming the call.
Status mpi_status(const char* fn, const char* call, int rc);

class Agreement {
 public:
  // Collective over comm. `facts` must have the same length on every rank.
  // On any rank's failure returns, on every rank, the lowest failing rank's
  // code and message with " (on rank r of N)" appended.
  static Result<Agreement> reach(MPI_Comm comm, const char* fn, const Status& local,
                                 std::span<const int64_t> facts);

  int ranks() const { return ranks_; }
  int64_t fact(int rank, size_t i) const {
    return facts_[static_cast<size_t>(rank) * per_rank_ + i];
  }
  // Fails (identically on every rank) when fact i differs between ranks:
  // "<fn>: <what> = 3 on rank 0 but 5 on rank 2; every rank must pass the same".
  Status same(size_t i, const char* what) const;

 private:
  std::string fn_;
  int ranks_ = 0;
  size_t per_rank_ = 0;
  std::vector<int64_t> facts_;  // [rank][i]
};

// Collective: the agreement of a step that has no facts to compare, such as
// the end of a computation whose every rank must succeed.
Status agree(MPI_Comm comm, const char* fn, const Status& local);

// A caller's f32 output of exactly `shape`, contiguous (it receives a
// collective's or a copy's bytes); with `optional`, absent is fine too.
// Messages: "<fn>: <name>.shape[1] = 3 must be 4 (<shape_text>)".
Status check_output(const char* fn, const char* name, const TensorView& v,
                    std::span<const int64_t> shape, const char* shape_text, bool optional);

// This thread's scratch of at least `bytes` bytes, 64-byte aligned and
// uninitialised, kept for the thread's later calls and only grown (as the
// kernels keep theirs, src/kernels/dispatch.cc): ring attention needs about
// 100 MiB per call at 4096 tokens, which fresh allocations would map and
// fault in anew every call (2.8 us per 4 KiB page on this machine).
// kResourceExhausted "<fn>: cannot allocate <bytes> bytes of scratch".
Result<char*> thread_scratch(const char* fn, size_t bytes);

// An empty tensor (a dimension of 0) may arrive without storage (an empty
// std::vector, a zero-size numpy array); such a view gets a placeholder
// address, never read, so that "absent" keeps meaning "not passed" and a
// rank with no tokens can take part like any other.
TensorView with_placeholder_if_empty(TensorView v);

// A 64-bit FNV-1a hash of values, for facts that are sequences (positions).
uint64_t hash_values(std::span<const int64_t> values);

}  // namespace attnkit::dist::internal
