#include "cli.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

namespace attnkit::cli {

namespace {

int64_t to_int(const std::string& name, const std::string& v) {
  int64_t x = 0;
  const char* first = v.data();
  const char* last = v.data() + v.size();
  if (first != last && *first == '+') ++first;  // from_chars takes no '+'
  const auto [end, ec] = std::from_chars(first, last, x);
  if (ec == std::errc::result_out_of_range && end == last)
    throw UsageError{name + " " + v + " is out of range (at most " +
                     std::to_string(std::numeric_limits<int64_t>::max()) + ")"};
  if (ec != std::errc() || end != last || first == last)
    throw UsageError{name + " expects an integer, got '" + v + "'"};
  return x;
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

// Adds a flag that takes one value and hands it, unconverted, to `set`.
// The hint is the value's name in --help ("N", "SIZE", ...).
void add_valued(CLI::App& app, const std::string& name, const std::string& help, const char* hint,
                std::function<void(const std::string&)> set) {
  app.add_option_function<std::string>(name, std::move(set), help)
      ->type_name(hint)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

}  // namespace

Flags::Flags(std::string command, std::string summary, std::vector<std::string> examples)
    : command_(std::move(command)),
      examples_(std::move(examples)),
      app_(std::make_unique<CLI::App>(std::move(summary), "attnkit " + command_)) {
  app_->set_help_flag("-h,--help", "show this help");
  // Unknown arguments are collected, not thrown, so that the message can
  // name the first one in the tool's words.
  app_->allow_extras();
}

Flags::~Flags() = default;

void Flags::add_string(const std::string& name, std::string* dst, const std::string& help) {
  add_valued(*app_, name, help, "TEXT", [dst](const std::string& v) { *dst = v; });
}

void Flags::add_int(const std::string& name, int64_t* dst, const std::string& help,
                    int64_t min_value) {
  add_valued(*app_, name, help, "N", [=](const std::string& v) {
    const int64_t x = to_int(name, v);
    if (x < min_value)
      throw UsageError{name + " must be >= " + std::to_string(min_value) + ", got " + v};
    *dst = x;
  });
}

void Flags::add_double(const std::string& name, double* dst, const std::string& help) {
  add_valued(*app_, name, help, "X", [=](const std::string& v) {
    double x = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (ec == std::errc::result_out_of_range && end == v.data() + v.size())
      throw UsageError{name + " " + v + " is out of range"};
    if (ec != std::errc() || end != v.data() + v.size() || !std::isfinite(x))
      throw UsageError{name + " expects a number, got '" + v + "'"};
    *dst = x;
  });
}

void Flags::add_bytes(const std::string& name, int64_t* dst, const std::string& help) {
  add_valued(*app_, name, help, "SIZE", [=](const std::string& v) {
    try {
      *dst = parse_bytes(v);
    } catch (const UsageError& e) {
      throw UsageError{name + ": " + e.message};
    }
  });
}

void Flags::add_int_list(const std::string& name, std::vector<int64_t>* dst,
                         const std::string& help) {
  add_valued(*app_, name, help, "N,N,..", [=](const std::string& v) {
    dst->clear();
    for (const std::string& p : split(v)) {
      const int64_t x = to_int(name, p);
      if (x < 1) throw UsageError{name + " values must be >= 1, got " + p};
      dst->push_back(x);
    }
  });
}

void Flags::add_string_list(const std::string& name, std::vector<std::string>* dst,
                            const std::string& help) {
  add_valued(*app_, name, help, "A,B,..", [=](const std::string& v) {
    *dst = split(v);
    for (const std::string& p : *dst)
      if (p.empty()) throw UsageError{name + " has an empty entry in '" + v + "'"};
  });
}

void Flags::add_bool(const std::string& name, bool* dst, const std::string& help) {
  app_->add_flag_callback(
          name, [dst] { *dst = true; }, help)
      ->disable_flag_override();
}

bool Flags::parse(int argc, char** argv, int first) {
  // CLI11 takes the arguments last first. A bool flag is a switch: CLI11
  // would read "--json=true" or "--json=" as on, which the tool refuses.
  std::vector<std::string> args;
  for (int i = first; i < argc; ++i) {
    const std::string arg = argv[i];
    if (const size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      const CLI::Option* f = app_->get_option_no_throw(arg.substr(0, eq));
      if (f != nullptr && f->get_expected_max() == 0)
        throw UsageError{arg.substr(0, eq) + " takes no value"};
    }
    args.insert(args.begin(), arg);
  }
  try {
    app_->parse(args);
  } catch (const CLI::CallForHelp&) {
    std::fputs(help().c_str(), stdout);
    return false;
  } catch (const CLI::ArgumentMismatch& e) {
    // CLI11 starts these messages with the flag's name: a flag given no
    // value, or a bool flag given one ("--json=1").
    const std::string what = e.what();
    std::string name = what.substr(0, what.find_first_of(": "));
    if (name.rfind("--", 0) != 0) name = "--" + name;  // flag messages drop the dashes
    throw UsageError{name + (what.find("flag override") != std::string::npos ? " takes no value"
                                                                             : " needs a value")};
  } catch (const CLI::ParseError& e) {
    throw UsageError{e.what()};
  }
  const std::vector<std::string> extra = app_->remaining();
  if (!extra.empty())
    throw UsageError{"unknown argument '" + extra.front() + "' (see attnkit " + command_ +
                     " --help)"};
  return true;
}

bool Flags::given(const std::string& name) const { return app_->count(name) > 0; }

std::string Flags::help() const {
  std::ostringstream o;
  o << "usage: attnkit " << command_ << " [flags]\n\n" << app_->get_description() << "\n\nflags:\n";
  const CLI::Option* help_flag = app_->get_help_ptr();
  auto line = [&o](const std::string& left, const std::string& text) {
    o << left << std::string(left.size() < 28 ? 28 - left.size() : 1, ' ') << text << "\n";
  };
  for (const CLI::Option* f : app_->get_options()) {
    if (f == help_flag) continue;
    const std::string hint = f->get_expected_max() == 0 ? "" : " " + f->get_type_name();
    line("  " + f->get_name() + hint, f->get_description());
  }
  line("  --help", help_flag->get_description());
  if (!examples_.empty()) {
    o << "\nexamples:\n";
    for (const std::string& e : examples_) o << "  " << e << "\n";
  }
  return o.str();
}

const char* version() { return ATTNKIT_VERSION; }

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
  constexpr double kKi = 1024.0;
  double mult = 1;
  if (unit.empty() || unit == "b")
    mult = 1;
  else if (unit == "k" || unit == "kib")
    mult = kKi;
  else if (unit == "m" || unit == "mib")
    mult = kKi * kKi;
  else if (unit == "g" || unit == "gib")
    mult = kKi * kKi * kKi;
  else if (unit == "t" || unit == "tib")
    mult = kKi * kKi * kKi * kKi;
  else if (unit == "p" || unit == "pib")
    mult = kKi * kKi * kKi * kKi * kKi;
  else if (unit == "kb")
    mult = 1e3;
  else if (unit == "mb")
    mult = 1e6;
  else if (unit == "gb")
    mult = 1e9;
  else if (unit == "tb")
    mult = 1e12;
  else if (unit == "pb")
    mult = 1e15;
  else
    throw UsageError{"unknown size unit '" + text.substr(i) + "' in '" + text +
                     "' (B, KiB, MiB, GiB, TiB, PiB, or kB, MB, GB, TB, PB)"};
  const double bytes = v * mult;
  if (!(bytes >= 0) || bytes > 9.0e18) throw UsageError{"size '" + text + "' is out of range"};
  return static_cast<int64_t>(bytes);
}

DType kv_dtype_of(const std::string& name, const std::string& flag) {
  for (DType kv : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3})
    if (name == kv_dtype_label(kv)) return kv;
  throw UsageError{flag + " must be f32, bf16, int8 or fp8_e4m3, got '" + name + "'"};
}

const char* kv_dtype_label(DType kv) {
  switch (kv) {
    case DType::kBF16:
      return "bf16";
    case DType::kI8:
      return "int8";
    case DType::kFp8E4M3:
      return "fp8_e4m3";
    default:
      return "f32";
  }
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

// v in the largest of `units` (each `base` times the one before) that keeps
// it below `base`; past the last unit, scientific notation (1.23e+04 YiB)
// rather than a long run of digits.
std::string scaled(double v, double base, std::initializer_list<const char*> units) {
  const char* const* u = units.begin();
  while (v >= base && u + 1 != units.end()) {
    v /= base;
    ++u;
  }
  if (v < base) return fmt(v, *u);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2e %s", v, *u);
  return buf;
}

}  // namespace

std::string format_bytes(double b) {
  return scaled(b, 1024, {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"});
}

std::string format_count(double n) { return scaled(n, 1e3, {"", "k", "M", "G", "T"}); }

std::string format_flops(double f) {
  if (f < 1e6) return fmt(f / 1e3, "kFLOP");
  return scaled(f / 1e6, 1e3, {"MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP", "ZFLOP", "YFLOP"});
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
    std::string text;
    for (size_t c = 0; c < width.size(); ++c) {
      const std::string cell = c < r.size() ? r[c] : "";
      const std::string pad(width[c] - cell.size(), ' ');
      text +=
          (c ? "  " : "") + (c > 0 && numbers_right_ && numeric(cell) ? pad + cell : cell + pad);
    }
    // Padding is for the columns to the right; a line ends at its last character.
    text.erase(text.find_last_not_of(' ') + 1);
    o << text << "\n";
  };
  line(header_);
  size_t total = 0;
  for (size_t w : width) total += w + 2;
  o << std::string(total > 2 ? total - 2 : 0, '-') << "\n";
  for (const auto& r : rows_) line(r);
  return o.str();
}

}  // namespace attnkit::cli
