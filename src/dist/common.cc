// The agreement protocol of src/dist/agree.h.
#include "dist/common.h"

#include <memory>
#include <new>
#include <string>
#include <vector>

#include "attnkit/dist.h"

namespace attnkit::dist::internal {

Status mpi_status(const char* fn, const char* call, int rc) {
  if (rc == MPI_SUCCESS) return Status::Ok();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  return internal_error(
      std::string(fn) + ": " + call + " failed: " +
      (len > 0 ? std::string(text, static_cast<size_t>(len)) : "MPI error " + std::to_string(rc)));
}

Status check_comm(const char* fn, MPI_Comm comm, int* rank, int* ranks) {
  const std::string f = fn;
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    return invalid_argument(f + ": MPI is " + (finalized ? "finalized" : "not initialized") +
                            "; call it between MPI_Init and MPI_Finalize");
  if (comm == MPI_COMM_NULL) return invalid_argument(f + ": comm is MPI_COMM_NULL");
  int inter = 0;
  ATTNKIT_RETURN_IF_ERROR(mpi_status(fn, "MPI_Comm_test_inter", MPI_Comm_test_inter(comm, &inter)));
  if (inter)
    return invalid_argument(f + ": comm is an intercommunicator; pass an intracommunicator");
  ATTNKIT_RETURN_IF_ERROR(mpi_status(fn, "MPI_Comm_rank", MPI_Comm_rank(comm, rank)));
  return mpi_status(fn, "MPI_Comm_size", MPI_Comm_size(comm, ranks));
}

Result<Agreement> Agreement::reach(MPI_Comm comm, const char* fn, const Status& local,
                                   std::span<const int64_t> facts) {
  int rank = 0, ranks = 0;
  ATTNKIT_RETURN_IF_ERROR(mpi_status(fn, "MPI_Comm_rank", MPI_Comm_rank(comm, &rank)));
  ATTNKIT_RETURN_IF_ERROR(mpi_status(fn, "MPI_Comm_size", MPI_Comm_size(comm, &ranks)));
  Agreement a;
  a.fn_ = fn;
  a.ranks_ = ranks;
  a.per_rank_ = facts.size();
  // Slot 0 of each rank's row: 1 if its local checks failed.
  const size_t row = facts.size() + 1;
  std::vector<int64_t> mine(row);
  mine[0] = local.ok() ? 0 : 1;
  for (size_t i = 0; i < facts.size(); ++i) mine[i + 1] = facts[i];
  std::vector<int64_t> all(row * static_cast<size_t>(ranks));
  ATTNKIT_RETURN_IF_ERROR(
      mpi_status(fn, "MPI_Allgather",
                 MPI_Allgather(mine.data(), static_cast<int>(row), MPI_INT64_T, all.data(),
                               static_cast<int>(row), MPI_INT64_T, comm)));
  int failed = -1;
  for (int r = 0; r < ranks && failed < 0; ++r)
    if (all[static_cast<size_t>(r) * row] != 0) failed = r;
  if (failed >= 0) {
    // The failing rank tells the others what went wrong.
    int64_t head[2] = {static_cast<int64_t>(local.code()),
                       static_cast<int64_t>(local.message().size())};
    ATTNKIT_RETURN_IF_ERROR(
        mpi_status(fn, "MPI_Bcast", MPI_Bcast(head, 2, MPI_INT64_T, failed, comm)));
    std::string message = rank == failed ? local.message() : std::string(head[1], ' ');
    ATTNKIT_RETURN_IF_ERROR(
        mpi_status(fn, "MPI_Bcast",
                   MPI_Bcast(message.data(), static_cast<int>(head[1]), MPI_CHAR, failed, comm)));
    return Status(
        static_cast<StatusCode>(head[0]),
        message + " (on rank " + std::to_string(failed) + " of " + std::to_string(ranks) + ")");
  }
  a.facts_.resize(facts.size() * static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    for (size_t i = 0; i < facts.size(); ++i)
      a.facts_[static_cast<size_t>(r) * facts.size() + i] =
          all[static_cast<size_t>(r) * row + i + 1];
  return a;
}

Status Agreement::same(size_t i, const char* what) const {
  for (int r = 1; r < ranks_; ++r)
    if (fact(r, i) != fact(0, i))
      return invalid_argument(fn_ + ": " + what + " = " + std::to_string(fact(0, i)) +
                              " on rank 0 but " + std::to_string(fact(r, i)) + " on rank " +
                              std::to_string(r) + "; every rank must pass the same");
  return Status::Ok();
}

Status agree(MPI_Comm comm, const char* fn, const Status& local) {
  Result<Agreement> a = Agreement::reach(comm, fn, local, {});
  return a.ok() ? Status::Ok() : a.status();
}

Status check_output(const char* fn, const char* name, const TensorView& v,
                    std::span<const int64_t> shape, const char* shape_text, bool optional) {
  const std::string f = std::string(fn) + ": " + name;
  if (!v.present()) {
    if (optional) return Status::Ok();
    return invalid_argument(f + " is absent (data is null)");
  }
  if (v.dtype != DType::kF32)
    return invalid_argument(f + ".dtype = " + dtype_name(v.dtype) + " must be f32");
  const int rank = static_cast<int>(shape.size());
  if (v.rank != rank)
    return invalid_argument(f + ".rank = " + std::to_string(v.rank) + " must be " +
                            std::to_string(rank) + " (" + shape_text + ")");
  for (int i = 0; i < rank; ++i)
    if (v.shape[i] != shape[size_t(i)])
      return invalid_argument(f + ".shape[" + std::to_string(i) +
                              "] = " + std::to_string(v.shape[i]) + " must be " +
                              std::to_string(shape[size_t(i)]) + " (" + shape_text + ")");
  if (!v.is_contiguous())
    return invalid_argument(f + " " + v.describe() + " must be contiguous (row-major)");
  return Status::Ok();
}

Result<char*> thread_scratch(const char* fn, size_t bytes) {
  constexpr size_t kAlign = 64;
  thread_local std::unique_ptr<char[]> buffer;
  thread_local size_t size = 0;
  if (bytes + kAlign > size) {
    buffer.reset();
    size = 0;
    try {
      buffer = std::make_unique_for_overwrite<char[]>(bytes + kAlign);
    } catch (const std::bad_alloc&) {
      return resource_exhausted(std::string(fn) + ": cannot allocate " + std::to_string(bytes) +
                                " bytes of scratch");
    }
    size = bytes + kAlign;
  }
  const uintptr_t p = reinterpret_cast<uintptr_t>(buffer.get());
  return buffer.get() + (kAlign - p % kAlign) % kAlign;
}

TensorView with_placeholder_if_empty(TensorView v) {
  alignas(64) static const unsigned char placeholder[64] = {};
  bool empty = false;
  for (int i = 0; i < v.rank; ++i) empty = empty || v.shape[i] == 0;
  if (empty && v.data == nullptr) v.data = const_cast<unsigned char*>(placeholder);
  return v;
}

uint64_t hash_values(std::span<const int64_t> values) {
  uint64_t h = 14695981039346656037ull;
  for (int64_t v : values)
    for (int byte = 0; byte < 8; ++byte) {
      h ^= (static_cast<uint64_t>(v) >> (8 * byte)) & 0xffu;
      h *= 1099511628211ull;
    }
  return h;
}

}  // namespace attnkit::dist::internal

namespace attnkit::dist {

Status agree(MPI_Comm comm, const Status& local) {
  int rank = 0, ranks = 0;
  ATTNKIT_RETURN_IF_ERROR(internal::check_comm("agree", comm, &rank, &ranks));
  return internal::agree(comm, "agree", local);
}

}  // namespace attnkit::dist
