// PNG files of 8-bit RGB images. With libpng (CMake option FP8RL_LIBPNG, found by default)
// png_encode_rgb compresses through libpng/zlib (adaptive filters, deflate level 9); without it,
// and always through png_encode_rgb_stored, a minimal writer: no interlace, filter 0 (None) on
// every row, a zlib stream of stored (uncompressed) deflate blocks — larger files that every
// PNG reader decodes, with nothing outside the standard library.
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
// The same through the built-in stored-deflate writer (no libpng).
std::string png_encode_rgb_stored(const uint8_t* rgb, int width, int height);
// True when png_encode_rgb uses libpng.
bool png_have_libpng();
// Decodes an 8-bit RGB PNG (libpng; throws without it): the pixels [height, width, 3].
std::string png_decode_rgb(const std::string& png, int& width, int& height);
// Encodes and writes `path` atomically (core/fs.h write_file_atomic).
void png_write_rgb(const std::string& path, const uint8_t* rgb, int width, int height);

}  // namespace fp8rl
