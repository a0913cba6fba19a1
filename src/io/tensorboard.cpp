#include "io/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "core/error.h"
#include "core/fs.h"

namespace fp8rl {

namespace {

const std::array<uint32_t, 256>& crc32c_table() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> r{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      r[i] = c;
    }
    return r;
  }();
  return t;
}

// Protocol-buffer wire format: varints, tags (field << 3 | wire type), little-endian fixed.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_tag(std::string& out, int field, int wire) { put_varint(out, static_cast<uint64_t>(field << 3 | wire)); }
template <class T>
void put_fixed(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out.append(b, sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

double unix_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const uint8_t* data, size_t n, uint32_t crc) {
  const auto& t = crc32c_table();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ data[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t crc32c_masked(const uint8_t* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord_frame(const std::string& data) {
  std::string out;
  const uint64_t len = data.size();
  put_fixed(out, len);
  put_fixed(out, crc32c_masked(reinterpret_cast<const uint8_t*>(out.data()), 8));
  out += data;
  put_fixed(out, crc32c_masked(reinterpret_cast<const uint8_t*>(data.data()), data.size()));
  return out;
}

std::string tb_event_file_version(double wall_time) {
  std::string e;
  put_tag(e, 1, 1);
  put_fixed(e, wall_time);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string tb_event_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, v] : scalars) {
    std::string value;
    put_bytes(value, 1, tag);
    put_tag(value, 2, 5);
    put_fixed(value, v);
    put_bytes(summary, 1, value);
  }
  std::string e;
  put_tag(e, 1, 1);
  put_fixed(e, wall_time);
  put_tag(e, 2, 0);
  put_varint(e, static_cast<uint64_t>(step));
  put_bytes(e, 5, summary);
  return e;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  make_dirs(dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const double now = unix_now();
  // A new file per writer (a resumed run adds one; TensorBoard reads every file in the folder).
  path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<long long>(now)) + "." + host + "." +
          std::to_string(::getpid());
  file_ = std::fopen(path_.c_str(), "ab");
  if (!file_) FP8RL_FAIL("cannot create TensorBoard event file '", path_, "': ", std::strerror(errno));
  append(tb_event_file_version(now));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::write_scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars) {
  append(tb_event_scalars(unix_now(), step, scalars));
}

void TensorBoardWriter::append(const std::string& event) {
  const std::string rec = tfrecord_frame(event);
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size() || std::fflush(file_) != 0)
    FP8RL_FAIL("cannot write '", path_, "': ", std::strerror(errno), " (disk full?)");
}

}  // namespace fp8rl
