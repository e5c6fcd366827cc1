// attnkit/status.h — error reporting across the public API.
//
// No public function throws or aborts. Every call that can fail returns a
// Status (or a Result<T>, which is a value or a Status). A failed call leaves
// its outputs and any cache it was given untouched. Messages name the
// argument, its value and the rule it broke, e.g.
//   "sdpa: k.shape[2] (num_kv_heads) = 3 must divide q.shape[2] (num_heads) = 8"
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace attnkit {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // a caller-supplied value breaks a documented rule
  kOutOfRange,         // e.g. a cache would overflow its capacity
  kNotFound,           // e.g. a required weight name is missing
  kIoError,            // a file could not be opened, mapped or read
  kResourceExhausted,  // an allocation failed or a byte count overflows
  kInternal,           // a bug in attnkit; please report it
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: <message>", or "OK".
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

Status invalid_argument(std::string message);
Status out_of_range(std::string message);
Status not_found(std::string message);
Status io_error(std::string message);
Status resource_exhausted(std::string message);
Status internal_error(std::string message);

// A value of type T, or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) status_ = internal_error("Result constructed from OK status without a value");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace attnkit

// Propagate a failed Status from an expression (internal convenience, also
// usable by callers).
#define ATTNKIT_RETURN_IF_ERROR(expr)          \
  do {                                         \
    ::attnkit::Status _attnkit_st = (expr);    \
    if (!_attnkit_st.ok()) return _attnkit_st; \
  } while (0)

#define ATTNKIT_CONCAT_INNER_(a, b) a##b
#define ATTNKIT_CONCAT_(a, b) ATTNKIT_CONCAT_INNER_(a, b)
#define ATTNKIT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()
// ATTNKIT_ASSIGN_OR_RETURN(auto x, make_x()) — assigns or returns the error.
#define ATTNKIT_ASSIGN_OR_RETURN(lhs, expr) \
  ATTNKIT_ASSIGN_OR_RETURN_IMPL_(ATTNKIT_CONCAT_(_attnkit_r_, __LINE__), lhs, expr)
