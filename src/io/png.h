// A minimal PNG writer: 8-bit RGB, no interlace, filter 0 (None) on every row, and a zlib
// stream of stored (uncompressed) deflate blocks. Files are larger than a compressing
// encoder's but every PNG reader decodes them; nothing outside the standard library is used.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace fp8rl {

// CRC-32 as PNG and zlib define it (reflected polynomial 0xEDB88320). Pass a previous result
// as `crc` to continue over more bytes.
uint32_t png_crc32(const uint8_t* data, size_t n, uint32_t crc = 0);
// Adler-32 (RFC 1950), the zlib stream's trailer. Pass a previous result to continue.
uint32_t png_adler32(const uint8_t* data, size_t n, uint32_t adler = 1);

// The PNG file bytes of an RGB image. `rgb`: [height, width, 3], row-major, 8 bits per channel.
std::string png_encode_rgb(const uint8_t* rgb, int width, int height);
// Encodes and writes `path` atomically (core/fs.h write_file_atomic).
void png_write_rgb(const std::string& path, const uint8_t* rgb, int width, int height);

}  // namespace fp8rl
