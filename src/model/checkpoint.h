// The tensors of a Hugging Face checkpoint directory (internal to
// src/model/): model.safetensors, or the shards that
// model.safetensors.index.json names, memory-mapped and merged into one
// WeightMap whose views stay valid while the Checkpoint lives.
#pragma once

#include <string>
#include <vector>

#include "attnkit/status.h"
#include "attnkit/weights.h"

namespace attnkit::model {

struct Checkpoint {
  std::vector<SafetensorsFile> files;  // the mappings the views point into
  WeightMap tensors;                   // every tensor of every shard, by name
  std::string where;                   // "dir/model.safetensors" or the index, for messages
};

// Opens dir's weights. With an index, every shard it names must open (a
// missing or truncated shard is an error naming it), every tensor it maps
// must be in the shard it names, and a shard may hold no tensor the index
// does not map to it; a name in two shards is an error. `fn` names the
// caller in messages.
Result<Checkpoint> open_checkpoint(const std::string& dir, const char* fn);

// The file's text, or an error naming the path.
Result<std::string> read_text_file(const std::string& path, const char* fn);

}  // namespace attnkit::model
