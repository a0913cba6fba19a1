// TensorBoard event files written by hand: TFRecord framing around Event protocol buffers
// (tensorflow/core/util/event.proto, summary.proto), scalars only.
//   record  = uint64 length (LE) | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
//   masked  = ((crc >> 15) | (crc << 17)) + 0xa282ead8, crc = CRC-32C (Castagnoli)
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
// The first record of a file is an Event with file_version "brain.Event:2".
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace fp8rl {

// CRC-32C (reflected polynomial 0x82F63B78); pass a previous result to continue.
uint32_t crc32c(const uint8_t* data, size_t n, uint32_t crc = 0);
uint32_t crc32c_masked(const uint8_t* data, size_t n);

// One TFRecord (framing + checksums) around `data`.
std::string tfrecord_frame(const std::string& data);
// The serialized Event of `scalars` at `step`.
std::string tb_event_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& scalars);
std::string tb_event_file_version(double wall_time);

// DIR/events.out.tfevents.<unix seconds>.<host>: one Event per step with a scalar per metric;
// flushed after every step so that a running TensorBoard sees it.
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::string& dir);  // creates DIR
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  void write_scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars);
  const std::string& path() const { return path_; }

 private:
  void append(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace fp8rl
