// Strict, non-throwing reads of Hugging Face config.json fields.
//
// Every helper returns a Status whose message names the calling function,
// the field's path ("rope_scaling.factor"), the offending value and the
// rule. A field that is absent or JSON null leaves the output untouched, so
// callers preset defaults. Nothing here throws: json_parse() catches the
// parser's exception (to report its position) and every accessor checks the
// type before it converts.
#pragma once

#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>

#include "attnkit/status.h"

namespace attnkit::io {

using json = nlohmann::json;

// A value shortened for messages.
inline std::string json_brief(const json& v) {
  std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

// Parses `text`; a syntax error reports the byte position and nlohmann's
// own description ("parse error at line 3, column 7: syntax error ...").
inline Status json_parse(const char* fn, std::string_view text, json* out) {
  try {
    *out = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    // what() is "[json.exception.parse_error.101] parse error at line ..."
    std::string what = e.what();
    if (const size_t tag = what.find("] "); what.starts_with("[json.") && tag != std::string::npos)
      what.erase(0, tag + 2);
    return invalid_argument(std::string(fn) + ": the text is not valid JSON (byte " +
                            std::to_string(e.byte) + "): " + what);
  } catch (const std::exception& e) {
    return resource_exhausted(std::string(fn) + ": cannot parse JSON: " + e.what());
  }
  return Status::Ok();
}

// The fields of one JSON object, read on behalf of function `fn`; `prefix`
// is the object's path with a trailing dot ("rope_scaling.") or empty.
class JsonFields {
 public:
  JsonFields(const char* fn, const json& obj, std::string prefix = "")
      : fn_(fn), obj_(obj), prefix_(std::move(prefix)) {}

  std::string path(std::string_view key) const { return prefix_ + std::string(key); }
  Status error(const std::string& what) const {
    return invalid_argument(std::string(fn_) + ": " + what);
  }

  // The value, or nullptr when absent or null.
  const json* get(const char* key) const {
    const auto it = obj_.find(key);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }
  bool has(const char* key) const { return get(key) != nullptr; }

  Status required(const char* key, const char* why) const {
    if (has(key)) return Status::Ok();
    const bool null = obj_.find(key) != obj_.end();
    return error("required field " + path(key) + (null ? " is null" : " is missing") + " (" + why +
                 ")");
  }

  // An integer; an integral float (4096.0) is accepted, 4096.5 and "4096"
  // are not.
  Status integer(const char* key, int64_t* out) const {
    const json* v = get(key);
    if (!v) return Status::Ok();
    if (v->is_number_unsigned()) {
      if (v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return error(path(key) + " = " + json_brief(*v) + " does not fit in 64 bits");
      *out = static_cast<int64_t>(v->get<uint64_t>());
      return Status::Ok();
    }
    if (v->is_number_integer()) {
      *out = v->get<int64_t>();
      return Status::Ok();
    }
    if (v->is_number_float()) {
      const double d = v->get<double>();
      // 2^63 is exact in double; the half-open range keeps the cast defined.
      if (std::isfinite(d) && d == std::floor(d) && d >= -0x1p63 && d < 0x1p63) {
        *out = static_cast<int64_t>(d);
        return Status::Ok();
      }
    }
    return error(path(key) + " = " + json_brief(*v) + " must be an integer");
  }

  Status number(const char* key, double* out) const {
    const json* v = get(key);
    if (!v) return Status::Ok();
    if (!v->is_number()) return error(path(key) + " = " + json_brief(*v) + " must be a number");
    *out = v->get<double>();
    if (!std::isfinite(*out)) return error(path(key) + " = " + json_brief(*v) + " must be finite");
    return Status::Ok();
  }

  Status boolean(const char* key, bool* out) const {
    const json* v = get(key);
    if (!v) return Status::Ok();
    if (!v->is_boolean())
      return error(path(key) + " = " + json_brief(*v) + " must be true or false");
    *out = v->get<bool>();
    return Status::Ok();
  }

  Status string(const char* key, std::string* out) const {
    const json* v = get(key);
    if (!v) return Status::Ok();
    if (!v->is_string()) return error(path(key) + " = " + json_brief(*v) + " must be a string");
    *out = v->get<std::string>();
    return Status::Ok();
  }

 private:
  const char* fn_;
  const json& obj_;
  std::string prefix_;
};

}  // namespace attnkit::io
