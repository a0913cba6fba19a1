#include "core/fs.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace fp8rl {

namespace {

std::string os_error() { return std::strerror(errno); }

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // some filesystems refuse to open directories: the rename still happened
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

void write_file_atomic(const std::string& path, std::string_view bytes) {
  FP8RL_CHECK(!path.empty(), "write_file_atomic: empty path");
  const std::filesystem::path p(path);
  const std::string dir = p.has_parent_path() ? p.parent_path().string() : std::string(".");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) FP8RL_FAIL("cannot create '", tmp, "': ", os_error(), " (does the directory exist and is it writable?)");
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = os_error();
      ::close(fd);
      ::unlink(tmp.c_str());
      FP8RL_FAIL("cannot write '", tmp, "': ", why, " (disk full?)");
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string why = os_error();
    ::unlink(tmp.c_str());
    FP8RL_FAIL("cannot flush '", tmp, "' to disk: ", why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = os_error();
    ::unlink(tmp.c_str());
    FP8RL_FAIL("cannot rename '", tmp, "' to '", path, "': ", why);
  }
  fsync_dir(dir);
}

std::string read_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) FP8RL_FAIL("cannot open '", path, "': ", os_error());
  std::string out;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  const bool bad = std::ferror(f) != 0;
  std::fclose(f);
  FP8RL_CHECK(!bad, "read error on '", path, "'");
  return out;
}

void make_dirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) FP8RL_FAIL("cannot create directory '", path, "': ", ec.message());
  FP8RL_CHECK(std::filesystem::is_directory(path), "'", path, "' exists and is not a directory");
}

}  // namespace fp8rl
