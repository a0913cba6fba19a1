// CheckpointReader: one view over the safetensors files of an HF checkpoint. See safetensors.h.
#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_input.h"
#include "io/safetensors.h"

namespace fp8rl {

namespace {

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// A shard name from an index must be a plain file name in the checkpoint directory.
bool plain_file_name(const std::string& s) {
  return !s.empty() && s.find('/') == std::string::npos && s != "." && s != "..";
}

}  // namespace

CheckpointReader CheckpointReader::open(const std::string& path) {
  CheckpointReader r;
  r.path_ = path;
  if (!is_dir(path)) {
    FP8RL_CHECK(is_file(path), "checkpoint ", path, " is neither a directory nor a file");
    r.files_.push_back(SafetensorsFile::open(path));
  } else {
    const std::string index_path = path + "/model.safetensors.index.json";
    const std::string single_path = path + "/model.safetensors";
    if (is_file(index_path)) {
      nlohmann::json idx;
      try {
        idx = json_parse_limited(read_file_limited(index_path, size_t(256) << 20, "safetensors index"), index_path,
                                 {size_t(256) << 20, 16});
      } catch (const nlohmann::json::exception& ex) {
        FP8RL_FAIL(index_path, ": not valid JSON: ", ex.what());
      }
      FP8RL_CHECK(idx.is_object() && idx.contains("weight_map") && idx["weight_map"].is_object(),
                  index_path, ": must be an object with a 'weight_map' object");
      std::map<std::string, size_t> shard_index;  // shard file -> files_ index
      std::map<std::string, std::string> expected;  // tensor -> shard file
      for (const auto& [tensor, shard] : idx["weight_map"].items()) {
        FP8RL_CHECK(shard.is_string() && plain_file_name(shard.get<std::string>()), index_path,
                    ": weight_map['", tensor, "'] must be a file name in the checkpoint directory");
        const std::string s = shard.get<std::string>();
        expected[tensor] = s;
        if (!shard_index.count(s)) {
          shard_index[s] = r.files_.size();
          r.files_.push_back(SafetensorsFile::open(path + "/" + s));
        }
      }
      for (const auto& [tensor, shard] : expected) {
        FP8RL_CHECK(r.files_[shard_index[shard]].contains(tensor), index_path, ": weight_map puts '", tensor,
                    "' in ", shard, ", which does not contain it (stale index?)");
      }
      if (idx.contains("metadata") && idx["metadata"].is_object()) {
        for (const auto& [k, v] : idx["metadata"].items())
          r.metadata_[k] = v.is_string() ? v.get<std::string>() : json_brief(v, 1024);
      }
    } else {
      FP8RL_CHECK(is_file(single_path), "checkpoint directory ", path,
                  " has neither model.safetensors nor model.safetensors.index.json");
      r.files_.push_back(SafetensorsFile::open(single_path));
    }
  }
  for (size_t i = 0; i < r.files_.size(); ++i) {
    for (const std::string& name : r.files_[i].tensor_names()) {
      auto [it, fresh] = r.where_.emplace(name, i);
      FP8RL_CHECK(fresh, "checkpoint ", path, ": tensor '", name, "' is in both ", r.files_[it->second].path(),
                  " and ", r.files_[i].path());
    }
    for (const auto& [k, v] : r.files_[i].metadata()) r.metadata_.emplace(k, v);
  }
  return r;
}

std::vector<std::string> CheckpointReader::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(where_.size());
  for (const auto& [name, _] : where_) names.push_back(name);
  return names;
}

const SafetensorsEntry& CheckpointReader::entry(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) FP8RL_FAIL("checkpoint ", path_, " has no tensor named '", name, "'");
  return files_[it->second].entry(name);
}

Tensor CheckpointReader::get(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) FP8RL_FAIL("checkpoint ", path_, " has no tensor named '", name, "'");
  return files_[it->second].get(name);
}

bool CheckpointReader::is_quantized(const std::string& name) const {
  return contains(name) && entry(name).dtype == DType::E4M3 && contains(name + "_scale_inv");
}

QuantTensor CheckpointReader::get_quant(const std::string& name) const {
  const std::string sname = name + "_scale_inv";
  const SafetensorsEntry& e = entry(name);
  FP8RL_CHECK(e.dtype == DType::E4M3, path_, ": '", name, "' is ", dtype_name(e.dtype),
              ", not F8_E4M3; load it with get() instead");
  FP8RL_CHECK(e.shape.size() == 2, path_, ": FP8 weight '", name, "' must be 2-D [N, K], got ",
              shape_str(e.shape));
  FP8RL_CHECK(contains(sname), path_, ": FP8 weight '", name, "' has no '", sname, "' (block scales)");
  const Shape grid = {ceil_div(e.shape[0], kQuantBlock), ceil_div(e.shape[1], kQuantBlock)};
  const SafetensorsEntry& se = entry(sname);
  FP8RL_CHECK(se.shape == grid, path_, ": '", sname, "' must be [", grid[0], ", ", grid[1],
              "] (one scale per 128x128 block of ", shape_str(e.shape), "), got ", shape_str(se.shape));
  FP8RL_CHECK(se.dtype == DType::F32 || se.dtype == DType::BF16, path_, ": '", sname,
              "' must be F32 or BF16, got ", dtype_name(se.dtype));
  QuantTensor q;
  q.data = get(name);
  q.scales = from_float_vector(to_float_vector(get(sname)), grid, DType::F32);  // own F32 copy
  q.block_rows = kQuantBlock;
  q.block_cols = kQuantBlock;
  bool pow2 = true;
  const float* s = q.scales.data<float>();
  for (int64_t i = 0; i < q.scales.numel(); ++i) {
    FP8RL_CHECK(std::isfinite(s[i]) && s[i] > 0.0f, path_, ": '", sname, "' has a non-finite or non-positive scale ",
                s[i], " at index ", i);
    int exp = 0;
    pow2 = pow2 && std::frexp(s[i], &exp) == 0.5f;
  }
  q.pow2 = pow2;
  return q;
}

}  // namespace fp8rl
