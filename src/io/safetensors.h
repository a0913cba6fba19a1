// safetensors: reading (memory-mapped, validated), writing (atomic), and sharded HF checkpoints.
//
// File layout: u64 little-endian N | N bytes of JSON header | data section. The header maps
// each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to
// the data section) and may hold "__metadata__": {string: string}. Nothing in a file is
// trusted before safetensors_parse_header has validated it: every malformed file becomes an
// fp8rl::Error that names the file and the problem.
//
// Sharded checkpoints (HF layout): a directory with model.safetensors, or with
// model.safetensors.index.json {"metadata": {...}, "weight_map": {tensor name: shard file}}.
// FP8 checkpoints (DeepSeek-V3 style): a weight `W` stored F8_E4M3 [N, K] comes with
// `W_scale_inv` F32 [ceil(N/128), ceil(K/128)]; CheckpointReader::get_quant returns both as
// one QuantTensor.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "quant/quant.h"

namespace fp8rl {

constexpr uint64_t kSafetensorsMaxHeaderBytes = 100ull << 20;  // 100 MB

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in data-offset order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // file offset of the data section (8 + header length)
};

// Parses and validates a whole safetensors file held in memory ([data, data + size)).
// `origin` names the file in error messages. Throws fp8rl::Error on anything malformed.
SafetensorsHeader safetensors_parse_header(const uint8_t* data, size_t size,
                                           const std::string& origin = "<memory>");

// Safetensors dtype name ("F32", "BF16", "F8_E4M3", ...) <-> DType; throws on unsupported.
const char* safetensors_dtype_name(DType t);
DType safetensors_dtype_from_name(const std::string& name, const std::string& origin);

class SafetensorsFile {
 public:
  // Memory-maps `path` (private copy-on-write: writing to a returned tensor never touches
  // the file) and validates its header.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> tensor_names() const;  // in data-offset order
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const;  // throws if absent
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  // The tensor in its stored dtype, on the CPU. Shares the mapping when the data is aligned
  // for its dtype, else is an aligned copy. The mapping lives as long as any such tensor.
  Tensor get(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<Storage> map_;  // the whole file
  SafetensorsHeader header_;
  std::map<std::string, size_t> index_;  // name -> header_.entries index
};

// Writes `tensors` (CPU, any supported dtype, names unique) and `metadata` to `path`
// atomically: written to `path.tmp.<pid>`, fsync'ed, then renamed over `path`. On any error
// the temporary file is removed and `path` is untouched.
void safetensors_write(const std::string& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// A checkpoint directory (one file or index-sharded), or a single .safetensors file.
class CheckpointReader {
 public:
  static CheckpointReader open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> tensor_names() const;  // sorted
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const;  // throws if absent
  Tensor get(const std::string& name) const;                     // stored dtype, CPU
  // True when `name` is F8_E4M3 and `name + "_scale_inv"` exists.
  bool is_quantized(const std::string& name) const;
  // `name` (E4M3 [N, K]) with `name_scale_inv` (F32 or BF16 [ceil(N/128), ceil(K/128)],
  // finite, > 0) as a 128x128-block QuantTensor. pow2 is set when every scale is a power of 2.
  QuantTensor get_quant(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor name -> files_ index
  std::map<std::string, std::string> metadata_;
};

}  // namespace fp8rl
