#include "cli.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace attnkit::cli {

Flags::Flags(std::string command, std::string summary, std::vector<std::string> examples)
    : command_(std::move(command)), summary_(std::move(summary)), examples_(std::move(examples)) {}

namespace {

int64_t to_int(const std::string& name, const std::string& v) {
  try {
    size_t pos = 0;
    const long long x = std::stoll(v, &pos);
    if (pos != v.size()) throw UsageError{""};
    return x;
  } catch (...) {
    throw UsageError{name + " expects an integer, got '" + v + "'"};
  }
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ',') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

}  // namespace

void Flags::add_string(const std::string& name, std::string* dst, const std::string& help) {
  flags_.push_back({name, help, "TEXT", true, [dst](const std::string& v) { *dst = v; }});
}

void Flags::add_int(const std::string& name, int64_t* dst, const std::string& help,
                    int64_t min_value) {
  flags_.push_back({name, help, "N", true, [=](const std::string& v) {
                      const int64_t x = to_int(name, v);
                      if (x < min_value)
                        throw UsageError{name + " must be >= " + std::to_string(min_value) +
                                         ", got " + v};
                      *dst = x;
                    }});
}

void Flags::add_double(const std::string& name, double* dst, const std::string& help) {
  flags_.push_back({name, help, "X", true, [=](const std::string& v) {
                      try {
                        size_t pos = 0;
                        *dst = std::stod(v, &pos);
                        if (pos != v.size() || !std::isfinite(*dst)) throw 0;
                      } catch (...) {
                        throw UsageError{name + " expects a number, got '" + v + "'"};
                      }
                    }});
}

void Flags::add_bytes(const std::string& name, int64_t* dst, const std::string& help) {
  flags_.push_back({name, help, "SIZE", true, [=](const std::string& v) {
                      try {
                        *dst = parse_bytes(v);
                      } catch (const UsageError& e) {
                        throw UsageError{name + ": " + e.message};
                      }
                    }});
}

void Flags::add_int_list(const std::string& name, std::vector<int64_t>* dst,
                         const std::string& help) {
  flags_.push_back({name, help, "N,N,..", true, [=](const std::string& v) {
                      dst->clear();
                      for (const std::string& p : split(v)) {
                        const int64_t x = to_int(name, p);
                        if (x < 1) throw UsageError{name + " values must be >= 1, got " + p};
                        dst->push_back(x);
                      }
                    }});
}

void Flags::add_string_list(const std::string& name, std::vector<std::string>* dst,
                            const std::string& help) {
  flags_.push_back({name, help, "A,B,..", true, [=](const std::string& v) {
                      *dst = split(v);
                      for (const std::string& p : *dst)
                        if (p.empty())
                          throw UsageError{name + " has an empty entry in '" + v + "'"};
                    }});
}

void Flags::add_bool(const std::string& name, bool* dst, const std::string& help) {
  flags_.push_back({name, help, "", false, [dst](const std::string&) { *dst = true; }});
}

const Flags::Flag* Flags::find(const std::string& name) const {
  for (const Flag& f : flags_)
    if (f.name == name) return &f;
  return nullptr;
}

bool Flags::parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    std::string value;
    bool has_value = false;
    if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    const Flag* f = find(arg);
    if (f == nullptr)
      throw UsageError{"unknown argument '" + arg + "' (see attnkit " + command_ + " --help)"};
    if (f->takes_value) {
      if (!has_value) {
        if (i + 1 >= argc) throw UsageError{arg + " needs a value"};
        value = argv[++i];
      }
      f->set(value);
    } else {
      if (has_value) throw UsageError{arg + " takes no value"};
      f->set("");
    }
  }
  return true;
}

std::string Flags::help() const {
  std::ostringstream o;
  o << "usage: attnkit " << command_ << " [flags]\n\n" << summary_ << "\n\nflags:\n";
  for (const Flag& f : flags_) {
    std::string left = "  " + f.name + (f.value_hint.empty() ? "" : " " + f.value_hint);
    o << left << std::string(left.size() < 28 ? 28 - left.size() : 1, ' ') << f.help << "\n";
  }
  o << "  --help                    show this help\n";
  if (!examples_.empty()) {
    o << "\nexamples:\n";
    for (const std::string& e : examples_) o << "  " << e << "\n";
  }
  return o.str();
}

int64_t parse_bytes(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    ++i;
  if (i == 0) throw UsageError{"'" + text + "' is not a size (try 24GiB, 512MiB, 4096)"};
  double v;
  try {
    v = std::stod(text.substr(0, i));
  } catch (...) {
    throw UsageError{"'" + text + "' is not a size"};
  }
  std::string unit = text.substr(i);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double mult = 1;
  if (unit.empty() || unit == "b")
    mult = 1;
  else if (unit == "k" || unit == "kib")
    mult = 1024.0;
  else if (unit == "m" || unit == "mib")
    mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb")
    mult = 1e3;
  else if (unit == "mb")
    mult = 1e6;
  else if (unit == "gb")
    mult = 1e9;
  else if (unit == "tb")
    mult = 1e12;
  else
    throw UsageError{"unknown size unit '" + text.substr(i) + "' in '" + text + "'"};
  const double bytes = v * mult;
  if (!(bytes >= 0) || bytes > 9.0e18) throw UsageError{"size '" + text + "' is out of range"};
  return static_cast<int64_t>(bytes);
}

std::string format_sig3(double v, const char* suffix) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f%s", v >= 100 ? 0 : v >= 10 ? 1 : 2, v, suffix);
  return buf;
}

namespace {
std::string fmt(double v, const char* unit) {
  return format_sig3(v, (std::string(" ") + unit).c_str());
}
}  // namespace

std::string format_bytes(double b) {
  if (b < 1024) return fmt(b, "B");
  if (b < 1024.0 * 1024) return fmt(b / 1024, "KiB");
  if (b < 1024.0 * 1024 * 1024) return fmt(b / (1024.0 * 1024), "MiB");
  if (b < 1024.0 * 1024 * 1024 * 1024) return fmt(b / (1024.0 * 1024 * 1024), "GiB");
  return fmt(b / (1024.0 * 1024 * 1024 * 1024), "TiB");
}

std::string format_count(double n) {
  if (n < 1e3) return fmt(n, "");
  if (n < 1e6) return fmt(n / 1e3, "k");
  if (n < 1e9) return fmt(n / 1e6, "M");
  return fmt(n / 1e9, "G");
}

std::string format_flops(double f) {
  if (f < 1e6) return fmt(f / 1e3, "kFLOP");
  if (f < 1e9) return fmt(f / 1e6, "MFLOP");
  if (f < 1e12) return fmt(f / 1e9, "GFLOP");
  return fmt(f / 1e12, "TFLOP");
}

std::string format_rate(double r) { return fmt(r / 1e9, "GFLOP/s"); }

std::string format_seconds(double s) {
  if (s < 1e-3) return fmt(s * 1e6, "us");
  if (s < 1) return fmt(s * 1e3, "ms");
  return fmt(s, "s");
}

Table::Table(std::vector<std::string> header, bool numbers_right)
    : header_(std::move(header)), numbers_right_(numbers_right) {}

void Table::add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }

std::string Table::str() const {
  std::vector<size_t> width(header_.size(), 0);
  auto measure = [&](const std::vector<std::string>& r) {
    for (size_t c = 0; c < r.size() && c < width.size(); ++c)
      width[c] = std::max(width[c], r[c].size());
  };
  measure(header_);
  for (const auto& r : rows_) measure(r);
  auto numeric = [](const std::string& s) {
    return !s.empty() &&
           (std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '-' || s[0] == '+');
  };
  std::ostringstream o;
  auto line = [&](const std::vector<std::string>& r) {
    for (size_t c = 0; c < width.size(); ++c) {
      const std::string cell = c < r.size() ? r[c] : "";
      const std::string pad(width[c] - cell.size(), ' ');
      o << (c ? "  " : "") << (c > 0 && numbers_right_ && numeric(cell) ? pad + cell : cell + pad);
    }
    o << "\n";
  };
  line(header_);
  size_t total = 0;
  for (size_t w : width) total += w + 2;
  o << std::string(total > 2 ? total - 2 : 0, '-') << "\n";
  for (const auto& r : rows_) line(r);
  return o.str();
}

}  // namespace attnkit::cli
