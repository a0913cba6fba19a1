#include "io/png.h"

#ifdef FP8RL_HAVE_LIBPNG
#include <png.h>
#endif

#include <algorithm>
#include <array>
#include <cstring>

#include "core/error.h"
#include "core/fs.h"

namespace fp8rl {

namespace {

constexpr size_t kMaxStoredBlock = 65535;  // a stored deflate block's LEN is 16 bits

std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t n = 0; n < 256; ++n) {
    uint32_t c = n;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[n] = c;
  }
  return t;
}

void put_be32(std::string& out, uint32_t v) {
  out += char(v >> 24);
  out += char(v >> 16);
  out += char(v >> 8);
  out += char(v);
}

void put_le16(std::string& out, uint32_t v) {
  out += char(v & 0xFF);
  out += char((v >> 8) & 0xFF);
}

// length, type, data, CRC over type + data
void put_chunk(std::string& out, const char type[4], const std::string& data) {
  FP8RL_CHECK(data.size() <= 0x7FFFFFFFu, "PNG chunk of ", data.size(), " bytes exceeds 2^31-1");
  put_be32(out, uint32_t(data.size()));
  const size_t type_at = out.size();
  out.append(type, 4);
  out += data;
  const auto* p = reinterpret_cast<const uint8_t*>(out.data()) + type_at;
  put_be32(out, png_crc32(p, 4 + data.size()));
}

// zlib header (deflate, 32K window, no dictionary), stored blocks, Adler-32 of the raw bytes.
std::string zlib_store(const std::string& raw) {
  std::string z;
  z.reserve(raw.size() + raw.size() / kMaxStoredBlock * 5 + 16);
  z += char(0x78);  // CMF: method 8 (deflate), window 2^(7+8)
  z += char(0x01);  // FLG: no dictionary, level 0; (0x78 * 256 + 0x01) % 31 == 0
  size_t at = 0;
  do {
    const size_t len = std::min(kMaxStoredBlock, raw.size() - at);
    const bool final_block = at + len == raw.size();
    z += char(final_block ? 1 : 0);  // BFINAL bit, BTYPE 00 (stored), then pad to the byte
    put_le16(z, uint32_t(len));
    put_le16(z, uint32_t(~len & 0xFFFF));
    z.append(raw, at, len);
    at += len;
  } while (at < raw.size());
  put_be32(z, png_adler32(reinterpret_cast<const uint8_t*>(raw.data()), raw.size()));
  return z;
}

}  // namespace

uint32_t png_crc32(const uint8_t* data, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc_table();
  uint32_t c = crc ^ 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ data[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t png_adler32(const uint8_t* data, size_t n, uint32_t adler) {
  constexpr uint32_t kMod = 65521;
  uint32_t a = adler & 0xFFFF, b = adler >> 16;
  while (n > 0) {
    // 5552 bytes is the most that cannot overflow 32 bits before the reduction
    const size_t run = std::min<size_t>(n, 5552);
    for (size_t i = 0; i < run; ++i) {
      a += data[i];
      b += a;
    }
    a %= kMod;
    b %= kMod;
    data += run;
    n -= run;
  }
  return (b << 16) | a;
}

std::string png_encode_rgb_stored(const uint8_t* rgb, int width, int height) {
  FP8RL_CHECK(width > 0 && height > 0 && width <= 65535 && height <= 65535, "PNG image size ", width, "x",
              height, " is out of range: both sides must be 1..65535 pixels");
  FP8RL_CHECK(rgb != nullptr, "PNG pixel buffer is null");
  const size_t row_bytes = size_t(width) * 3;
  std::string raw;
  raw.reserve((row_bytes + 1) * size_t(height));
  for (int y = 0; y < height; ++y) {
    raw += char(0);  // filter type 0: the row's bytes as they are
    raw.append(reinterpret_cast<const char*>(rgb) + size_t(y) * row_bytes, row_bytes);
  }

  std::string ihdr;
  put_be32(ihdr, uint32_t(width));
  put_be32(ihdr, uint32_t(height));
  ihdr += char(8);  // bit depth
  ihdr += char(2);  // color type: truecolor (RGB)
  ihdr += char(0);  // compression: deflate
  ihdr += char(0);  // filter method 0
  ihdr += char(0);  // no interlace

  std::string png("\x89PNG\r\n\x1a\n", 8);
  put_chunk(png, "IHDR", ihdr);
  put_chunk(png, "IDAT", zlib_store(raw));
  put_chunk(png, "IEND", std::string());
  return png;
}

#ifdef FP8RL_HAVE_LIBPNG

namespace {

// libpng reports errors by longjmp to the setjmp in the caller (no C++ exception crosses C code).
thread_local std::string t_png_error;
void on_png_error(png_structp png, png_const_charp msg) {
  t_png_error = msg ? msg : "unknown error";
  png_longjmp(png, 1);
}
void on_png_warning(png_structp, png_const_charp) {}

void append_bytes(png_structp png, png_bytep data, png_size_t n) {
  static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), n);
}
void flush_none(png_structp) {}

struct Reader {
  const std::string* src;
  size_t at = 0;
};
void read_bytes(png_structp png, png_bytep out, png_size_t n) {
  Reader* r = static_cast<Reader*>(png_get_io_ptr(png));
  if (r->at + n > r->src->size()) png_error(png, "truncated PNG");
  std::memcpy(out, r->src->data() + r->at, n);
  r->at += n;
}

}  // namespace

bool png_have_libpng() { return true; }

std::string png_encode_rgb(const uint8_t* rgb, int width, int height) {
  FP8RL_CHECK(width > 0 && height > 0 && width <= 65535 && height <= 65535, "PNG image size ", width, "x",
              height, " is out of range: both sides must be 1..65535 pixels");
  FP8RL_CHECK(rgb != nullptr, "PNG pixel buffer is null");
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, on_png_error, on_png_warning);
  FP8RL_CHECK(png, "libpng: cannot create a write struct");
  png_infop info = png_create_info_struct(png);
  std::string out;
  if (!info) {
    png_destroy_write_struct(&png, nullptr);
    FP8RL_FAIL("libpng: cannot create an info struct");
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    FP8RL_FAIL("libpng: cannot encode the image: ", t_png_error);
  }
  {
    png_set_write_fn(png, &out, append_bytes, flush_none);
    png_set_IHDR(png, info, static_cast<png_uint_32>(width), static_cast<png_uint_32>(height), 8, PNG_COLOR_TYPE_RGB,
                 PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_set_compression_level(png, 9);
    png_write_info(png, info);
    const size_t row_bytes = size_t(width) * 3;
    for (int y = 0; y < height; ++y)
      png_write_row(png, const_cast<png_bytep>(rgb + size_t(y) * row_bytes));
    png_write_end(png, nullptr);
  }
  png_destroy_write_struct(&png, &info);
  return out;
}

std::string png_decode_rgb(const std::string& bytes, int& width, int& height) {
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, nullptr, on_png_error, on_png_warning);
  FP8RL_CHECK(png, "libpng: cannot create a read struct");
  png_infop info = png_create_info_struct(png);
  std::string pixels;
  Reader r{&bytes};
  bool rgb8 = true;
  if (!info) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    FP8RL_FAIL("libpng: cannot create an info struct");
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    FP8RL_FAIL("libpng: cannot decode the PNG: ", t_png_error);
  }
  {
    png_set_read_fn(png, &r, read_bytes);
    png_read_info(png, info);
    width = static_cast<int>(png_get_image_width(png, info));
    height = static_cast<int>(png_get_image_height(png, info));
    rgb8 = png_get_color_type(png, info) == PNG_COLOR_TYPE_RGB && png_get_bit_depth(png, info) == 8;
    if (!rgb8) png_error(png, "png_decode_rgb reads 8-bit RGB PNGs only");
    pixels.resize(size_t(width) * size_t(height) * 3);
    for (int y = 0; y < height; ++y)
      png_read_row(png, reinterpret_cast<png_bytep>(pixels.data()) + size_t(y) * size_t(width) * 3, nullptr);
    png_read_end(png, nullptr);
  }
  png_destroy_read_struct(&png, &info, nullptr);
  return pixels;
}

#else

bool png_have_libpng() { return false; }

std::string png_encode_rgb(const uint8_t* rgb, int width, int height) { return png_encode_rgb_stored(rgb, width, height); }

std::string png_decode_rgb(const std::string&, int&, int&) {
  FP8RL_FAIL("png_decode_rgb needs libpng (libpng-dev; CMake option FP8RL_LIBPNG)");
}

#endif

void png_write_rgb(const std::string& path, const uint8_t* rgb, int width, int height) {
  write_file_atomic(path, png_encode_rgb(rgb, width, height));
}

}  // namespace fp8rl
