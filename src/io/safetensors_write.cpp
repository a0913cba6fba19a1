// Atomic safetensors writer. See safetensors.h.
//
// Layout written: tensors are laid out back to back (no gaps, as the reference Rust reader
// requires), ordered by element size, largest first, so that with the header padded to a
// multiple of 8 bytes every tensor starts aligned for its dtype.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"

namespace fp8rl {

namespace {

// Writes all of [p, p + n) to fd; returns false (errno set) on failure.
bool write_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

void safetensors_write(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // Validate everything before touching the disk.
  std::set<std::string> names;
  for (const auto& [name, t] : tensors) {
    FP8RL_CHECK(!name.empty() && name != "__metadata__", path, ": invalid tensor name '", name, "'");
    FP8RL_CHECK(names.insert(name).second, path, ": tensor name '", name, "' given twice");
    FP8RL_CHECK(t.defined(), path, ": tensor '", name, "' is undefined");
    FP8RL_CHECK(t.device() == DeviceKind::CPU, path, ": tensor '", name, "' is ", t.str(),
                "; copy it to the CPU before writing");
    safetensors_dtype_name(t.dtype());
  }
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dtype_size(tensors[a].second.dtype()) > dtype_size(tensors[b].second.dtype());
  });

  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // pad with spaces so the data starts 8-aligned
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) FP8RL_FAIL("cannot create ", tmp, ": ", std::strerror(errno), " (is the directory writable?)");
  bool ok = write_all(fd, len, 8) && write_all(fd, text.data(), text.size());
  for (size_t k = 0; ok && k < order.size(); ++k) {
    const Tensor& t = tensors[order[k]].second;
    if (t.nbytes()) ok = write_all(fd, t.raw(), t.nbytes());
  }
  ok = ok && ::fsync(fd) == 0;
  const int err = errno;
  ok = (::close(fd) == 0) && ok;
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = ok ? errno : err;
    ::unlink(tmp.c_str());
    FP8RL_FAIL("writing ", path, " failed: ", std::strerror(e), " (disk full or not writable?)");
  }
  // Make the rename itself durable.
  const int dfd = ::open(dir_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace fp8rl
