// safetensors header validation and memory-mapped reading. See safetensors.h.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_input.h"

namespace fp8rl {

using nlohmann::json;

namespace {

// Every header error goes through here: "<file>: invalid safetensors header: <problem>".
template <class... Args>
[[noreturn]] void fail_header(const std::string& origin, Args&&... args) {
  FP8RL_FAIL(origin, ": invalid safetensors file: ", std::forward<Args>(args)...);
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A JSON number that is a non-negative integer fitting int64 (shape dims, offsets).
bool json_nonneg_int(const json& j, int64_t& out) {
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    out = static_cast<int64_t>(u);
    return true;
  }
  if (j.is_number_integer()) {
    const int64_t v = j.get<int64_t>();
    if (v < 0) return false;
    out = v;
    return true;
  }
  return false;
}

SafetensorsEntry parse_entry(const std::string& name, const json& v, uint64_t data_bytes,
                             const std::string& origin) {
  const std::string where = "tensor '" + name + "'";
  if (!v.is_object()) fail_header(origin, where, " must be a JSON object, got ", v.type_name());
  for (const auto& [key, _] : v.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      fail_header(origin, where, " has unknown key '", key, "'");
  }
  if (!v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
    fail_header(origin, where, " must have keys dtype, shape and data_offsets");
  SafetensorsEntry e;
  e.name = name;
  const json& dt = v.at("dtype");
  if (!dt.is_string()) fail_header(origin, where, ": dtype must be a string");
  e.dtype = safetensors_dtype_from_name(dt.get<std::string>(), origin + ": " + where);

  const json& sh = v.at("shape");
  if (!sh.is_array()) fail_header(origin, where, ": shape must be an array");
  if (sh.size() > 16) fail_header(origin, where, ": shape has ", sh.size(), " dimensions (max 16)");
  uint64_t numel = 1;
  for (const json& d : sh) {
    int64_t n = 0;
    if (!json_nonneg_int(d, n))
      fail_header(origin, where, ": shape entries must be non-negative integers, got ", json_brief(d));
    e.shape.push_back(n);
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(n), &numel) ||
        numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail_header(origin, where, ": shape ", json_brief(sh), " has too many elements");
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(e.dtype)), &nbytes))
    fail_header(origin, where, ": shape ", json_brief(sh), " is too large");

  const json& off = v.at("data_offsets");
  int64_t b = 0, en = 0;
  if (!off.is_array() || off.size() != 2 || !json_nonneg_int(off[0], b) || !json_nonneg_int(off[1], en))
    fail_header(origin, where, ": data_offsets must be [begin, end] (non-negative integers), got ",
                json_brief(off));
  e.begin = static_cast<uint64_t>(b);
  e.end = static_cast<uint64_t>(en);
  if (e.begin > e.end) fail_header(origin, where, ": data_offsets begin ", e.begin, " > end ", e.end);
  if (e.end > data_bytes)
    fail_header(origin, where, ": data_offsets end ", e.end, " is past the data section (",
                data_bytes, " bytes; file truncated?)");
  if (e.end - e.begin != nbytes)
    fail_header(origin, where, ": ", dtype_name(e.dtype), json_brief(sh), " needs ", nbytes,
                " bytes but data_offsets span ", e.end - e.begin);
  return e;
}

}  // namespace

// fp8rl's dtype names are the safetensors spellings (core/dtype.cpp dtype_name).
const char* safetensors_dtype_name(DType t) { return dtype_name(t); }

DType safetensors_dtype_from_name(const std::string& name, const std::string& origin) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F32", DType::F32}, {"BF16", DType::BF16}, {"F16", DType::F16}, {"F8_E4M3", DType::E4M3},
      {"I32", DType::I32}, {"I64", DType::I64},   {"U8", DType::U8},   {"F64", DType::F64}};
  for (const auto& [n, t] : kNames)
    if (name == n) return t;
  FP8RL_FAIL(origin, ": unsupported safetensors dtype '", name,
             "' (supported: F32, BF16, F16, F8_E4M3, I32, I64, U8, F64)");
}

SafetensorsHeader safetensors_parse_header(const uint8_t* data, size_t size, const std::string& origin) {
  if (size < 8) fail_header(origin, "file is ", size, " bytes, shorter than the 8-byte header length");
  const uint64_t n = read_u64_le(data);
  if (n < 2) fail_header(origin, "header length ", n, " is too small for a JSON object");
  if (n > kSafetensorsMaxHeaderBytes)
    fail_header(origin, "header length ", n, " exceeds the 100 MB limit (not a safetensors file?)");
  if (n > size - 8)
    fail_header(origin, "header length ", n, " runs past the end of the file (", size, " bytes)");
  const char* text = reinterpret_cast<const char*>(data + 8);
  if (text[0] != '{') fail_header(origin, "header does not start with '{'");
  // JSON has no raw NUL bytes, and the JSON lexer would take one for the end of the input.
  if (std::memchr(text, '\0', n) != nullptr) fail_header(origin, "header contains a NUL byte");

  // Parse, recording top-level keys to catch duplicates (nlohmann keeps only the last one).
  std::set<std::string> seen;
  std::string duplicate;
  // Depth: a header is {name: {dtype, shape: [..], data_offsets: [..]}}, 3 levels.
  const json h = json_parse_limited(std::string_view(text, n), origin + ": safetensors header",
                                    {kSafetensorsMaxHeaderBytes, 8}, [&](int depth, const std::string& k) {
                                      if (depth == 1 && !seen.insert(k).second && duplicate.empty()) duplicate = k;
                                    });
  if (!duplicate.empty()) fail_header(origin, "tensor name '", duplicate, "' appears twice");
  if (!h.is_object()) fail_header(origin, "header must be a JSON object");

  SafetensorsHeader out;
  out.data_start = 8 + n;
  const uint64_t data_bytes = size - out.data_start;
  for (const auto& [name, v] : h.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) fail_header(origin, "__metadata__ must be an object of strings");
      for (const auto& [mk, mv] : v.items()) {
        if (!mv.is_string()) fail_header(origin, "__metadata__['", mk, "'] must be a string, got ", mv.type_name());
        out.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    if (name.empty()) fail_header(origin, "empty tensor name");
    out.entries.push_back(parse_entry(name, v, data_bytes, origin));
  }
  // Overlaps: sorted by range, each non-empty range must start at or after the previous end.
  std::stable_sort(out.entries.begin(), out.entries.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : out.entries) {
    if (e.begin == e.end) continue;
    if (prev && e.begin < prev->end)
      fail_header(origin, "tensors '", prev->name, "' [", prev->begin, ", ", prev->end, ") and '", e.name,
                  "' [", e.begin, ", ", e.end, ") overlap");
    prev = &e;
  }
  return out;
}

// ---- SafetensorsFile ------------------------------------------------------

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) FP8RL_FAIL("cannot open safetensors file ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    FP8RL_FAIL(path, ": not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail_header(path, "file is ", size, " bytes, shorter than the 8-byte header length");
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (p == MAP_FAILED) FP8RL_FAIL("cannot mmap ", path, " (", size, " bytes): ", std::strerror(map_errno));

  SafetensorsFile f;
  f.path_ = path;
  f.map_ = std::make_shared<Storage>();
  f.map_->ptr = p;
  f.map_->bytes = size;
  f.map_->device = DeviceKind::CPU;
  f.map_->release = [size](void* q) { ::munmap(q, size); };
  f.header_ = safetensors_parse_header(static_cast<const uint8_t*>(p), size, path);
  for (size_t i = 0; i < f.header_.entries.size(); ++i) f.index_[f.header_.entries[i].name] = i;
  return f;
}

std::vector<std::string> SafetensorsFile::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(header_.entries.size());
  for (const auto& e : header_.entries) names.push_back(e.name);
  return names;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) FP8RL_FAIL(path_, ": no tensor named '", name, "'");
  return header_.entries[it->second];
}

Tensor SafetensorsFile::get(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  const size_t offset = static_cast<size_t>(header_.data_start + e.begin);
  if (offset % dtype_size(e.dtype) == 0) return Tensor(map_, offset, e.shape, e.dtype);
  // Misaligned for its element type: hand out an aligned copy.
  Tensor t = Tensor::empty(e.shape, e.dtype);
  if (t.nbytes()) std::memcpy(t.raw(), static_cast<const char*>(map_->ptr) + offset, t.nbytes());
  return t;
}

}  // namespace fp8rl
