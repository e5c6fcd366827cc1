#include "model/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "io/json_util.h"

namespace attnkit::model {
namespace {

namespace fs = std::filesystem;

Status prefixed(const std::string& what, const Status& st) {
  return Status(st.code(), what + ": " + st.message());
}

// weight_map of the index: tensor name -> shard file name, each shard a
// plain file name in the index's directory.
Status read_weight_map(const std::string& index_path, const char* fn,
                       std::map<std::string, std::string>* weight_map) {
  ATTNKIT_ASSIGN_OR_RETURN(std::string text, read_text_file(index_path, fn));
  io::json index;
  ATTNKIT_RETURN_IF_ERROR(io::json_parse(fn, text, &index));
  const std::string where = std::string(fn) + ": " + index_path;
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    return invalid_argument(where + " has no \"weight_map\" object (tensor name -> shard file)");
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string())
      return invalid_argument(where + ": weight_map[\"" + name + "\"] = " + io::json_brief(file) +
                              " must be a shard file name");
    const std::string shard = file.get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
      return invalid_argument(where + ": weight_map[\"" + name + "\"] = \"" + shard +
                              "\" must name a file in the checkpoint's directory");
    (*weight_map)[name] = shard;
  }
  if (weight_map->empty()) return invalid_argument(where + ": weight_map is empty");
  return Status::Ok();
}

// Adds `file`'s tensors to `ckpt`; with `expected` (the index's names for
// this shard), each must be there and nothing else.
Status add_shard(const std::string& path, const char* fn, const std::vector<std::string>* expected,
                 Checkpoint* ckpt) {
  auto file = SafetensorsFile::open(path);
  if (!file.ok()) return prefixed(std::string(fn) + ": shard " + path, file.status());
  for (const auto& [name, view] : file->tensors()) {
    if (ckpt->tensors.count(name) != 0)
      return invalid_argument(std::string(fn) + ": tensor \"" + name + "\" is in two shards (" +
                              path + " and another)");
    if (expected != nullptr &&
        std::find(expected->begin(), expected->end(), name) == expected->end())
      return invalid_argument(std::string(fn) + ": shard " + path + " holds tensor \"" + name +
                              "\", which the index does not map to it");
    ckpt->tensors.emplace(name, view);
  }
  if (expected != nullptr)
    for (const std::string& name : *expected)
      if (file->tensors().count(name) == 0)
        return invalid_argument(std::string(fn) + ": the index maps tensor \"" + name +
                                "\" to shard " + path + ", which does not hold it");
  ckpt->files.push_back(std::move(file).value());
  return Status::Ok();
}

}  // namespace

Result<std::string> read_text_file(const std::string& path, const char* fn) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found(std::string(fn) + ": cannot open " + path);
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) return io_error(std::string(fn) + ": cannot read " + path);
  return s.str();
}

Result<Checkpoint> open_checkpoint(const std::string& dir, const char* fn) {
  Checkpoint ckpt;
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::error_code ec;
  if (fs::exists(single, ec)) {
    ckpt.where = single.string();
    ATTNKIT_RETURN_IF_ERROR(add_shard(single.string(), fn, nullptr, &ckpt));
    return ckpt;
  }
  if (!fs::exists(index, ec))
    return not_found(std::string(fn) + ": " + dir +
                     " has neither model.safetensors nor model.safetensors.index.json");
  ckpt.where = index.string();
  std::map<std::string, std::string> weight_map;
  ATTNKIT_RETURN_IF_ERROR(read_weight_map(index.string(), fn, &weight_map));
  std::map<std::string, std::vector<std::string>> by_shard;
  for (const auto& [name, shard] : weight_map) by_shard[shard].push_back(name);
  for (const auto& [shard, names] : by_shard) {
    const fs::path path = fs::path(dir) / shard;
    if (!fs::exists(path, ec))
      return not_found(std::string(fn) + ": the index " + index.string() + " names shard \"" +
                       shard + "\" (for tensor \"" + names.front() + "\"), which is missing");
    ATTNKIT_RETURN_IF_ERROR(add_shard(path.string(), fn, &names, &ckpt));
  }
  return ckpt;
}

}  // namespace attnkit::model
