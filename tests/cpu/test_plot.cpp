// io/png.h and plot/plot.h: the PNG writer's bytes decoded by an independent reader written here
// (chunk CRCs, zlib header, stored deflate blocks, Adler-32, filter bytes, pixels), the canvas,
// reading run directories, and the `fp8rl plot` command end to end.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "support/test_support.h"
#include "core/fs.h"
#include "io/png.h"
#include "plot/plot.h"

namespace fp8rl {
namespace {

namespace fs = std::filesystem;

// ---- an independent PNG reader ------------------------------------------------------------

// Bitwise CRC-32 (no table), straight from the definition.
uint32_t ref_crc32(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

uint32_t ref_adler32(const uint8_t* p, size_t n) {
  uint64_t a = 1, b = 0;
  for (size_t i = 0; i < n; ++i) {
    a = (a + p[i]) % 65521;
    b = (b + a) % 65521;
  }
  return uint32_t((b << 16) | a);
}

uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }

struct Decoded {
  uint32_t width = 0, height = 0;
  std::vector<uint8_t> rgb;  // [height, width, 3]
  int stored_blocks = 0;
};

// Checks every structural rule it meets with gtest assertions; returns the pixels.
Decoded decode_png(const std::string& file) {
  Decoded d;
  const auto* p = reinterpret_cast<const uint8_t*>(file.data());
  const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  EXPECT_GE(file.size(), 8u);
  EXPECT_EQ(0, std::memcmp(p, sig, 8)) << "signature";
  std::vector<std::string> types;
  std::string idat;
  size_t at = 8;
  while (at + 12 <= file.size()) {
    const uint32_t len = be32(p + at);
    EXPECT_LE(at + 12 + size_t(len), file.size()) << "chunk overruns the file";
    if (at + 12 + size_t(len) > file.size()) return d;
    const std::string type(file, at + 4, 4);
    EXPECT_EQ(be32(p + at + 8 + len), ref_crc32(p + at + 4, 4 + len)) << "CRC of chunk " << type;
    const std::string data(file, at + 8, len);
    if (type == "IHDR") {
      EXPECT_EQ(len, 13u);
      const auto* h = reinterpret_cast<const uint8_t*>(data.data());
      d.width = be32(h);
      d.height = be32(h + 4);
      EXPECT_EQ(h[8], 8) << "bit depth";
      EXPECT_EQ(h[9], 2) << "color type RGB";
      EXPECT_EQ(h[10], 0) << "compression";
      EXPECT_EQ(h[11], 0) << "filter method";
      EXPECT_EQ(h[12], 0) << "interlace";
    }
    if (type == "IDAT") idat += data;
    if (type == "IEND") {
      EXPECT_EQ(len, 0u);
    }
    types.push_back(type);
    at += 12 + len;
  }
  EXPECT_EQ(at, file.size()) << "bytes after the last chunk";
  EXPECT_GE(types.size(), 3u);
  if (types.size() < 3) return d;
  EXPECT_EQ(types.front(), "IHDR");
  EXPECT_EQ(types.back(), "IEND");

  // zlib: header, stored blocks, Adler-32
  const auto* z = reinterpret_cast<const uint8_t*>(idat.data());
  EXPECT_GE(idat.size(), 2u + 5u + 4u);
  EXPECT_EQ(z[0] & 0x0F, 8) << "deflate";
  EXPECT_LE(z[0] >> 4, 7) << "window size";
  EXPECT_EQ((z[0] * 256 + z[1]) % 31, 0) << "FCHECK";
  EXPECT_EQ(z[1] & 0x20, 0) << "no preset dictionary";
  std::string raw;
  size_t zi = 2;
  bool final_block = false;
  while (!final_block && zi + 5 <= idat.size()) {
    final_block = z[zi] & 1;
    EXPECT_EQ((z[zi] >> 1) & 3, 0) << "block type must be stored";
    EXPECT_EQ(z[zi] >> 3, 0) << "padding bits after a stored block header are zero";
    const uint32_t len = z[zi + 1] | uint32_t(z[zi + 2]) << 8;
    const uint32_t nlen = z[zi + 3] | uint32_t(z[zi + 4]) << 8;
    EXPECT_EQ(len ^ 0xFFFF, nlen);
    zi += 5;
    EXPECT_LE(zi + len, idat.size());
    if (zi + len > idat.size()) return d;
    raw.append(idat, zi, len);
    zi += len;
    ++d.stored_blocks;
  }
  EXPECT_TRUE(final_block);
  EXPECT_EQ(zi + 4, idat.size()) << "Adler-32 ends the stream";
  if (zi + 4 != idat.size()) return d;
  EXPECT_EQ(be32(z + zi), ref_adler32(reinterpret_cast<const uint8_t*>(raw.data()), raw.size()));

  const size_t row = size_t(d.width) * 3 + 1;
  EXPECT_EQ(raw.size(), row * d.height);
  if (raw.size() != row * d.height) return d;
  for (uint32_t y = 0; y < d.height; ++y) {
    EXPECT_EQ(raw[y * row], 0) << "filter type of row " << y;
    d.rgb.insert(d.rgb.end(), raw.begin() + y * row + 1, raw.begin() + (y + 1) * row);
  }
  return d;
}

std::vector<uint8_t> random_image(int w, int h, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(size_t(w) * h * 3);
  for (auto& b : v) b = uint8_t(rng());
  return v;
}

TEST(Png, ChecksumsMatchTheirDefinitions) {
  // the published check values of CRC-32 and Adler-32
  const std::string digits = "123456789";
  EXPECT_EQ(png_crc32(reinterpret_cast<const uint8_t*>(digits.data()), digits.size()), 0xCBF43926u);
  const std::string wiki = "Wikipedia";
  EXPECT_EQ(png_adler32(reinterpret_cast<const uint8_t*>(wiki.data()), wiki.size()), 0x11E60398u);
  // and the independent implementations above on long random data, also when continued
  const std::vector<uint8_t> data = random_image(300, 100, 7);  // 90000 bytes: several Adler reductions
  EXPECT_EQ(png_crc32(data.data(), data.size()), ref_crc32(data.data(), data.size()));
  EXPECT_EQ(png_adler32(data.data(), data.size()), ref_adler32(data.data(), data.size()));
  EXPECT_EQ(png_crc32(data.data() + 1000, data.size() - 1000, png_crc32(data.data(), 1000)),
            ref_crc32(data.data(), data.size()));
  EXPECT_EQ(png_adler32(data.data() + 7000, data.size() - 7000, png_adler32(data.data(), 7000)),
            ref_adler32(data.data(), data.size()));
}

TEST(Png, SmallImageDecodesToItsPixels) {
  const int w = 7, h = 5;
  const std::vector<uint8_t> img = random_image(w, h, 1);
  const Decoded d = decode_png(png_encode_rgb_stored(img.data(), w, h));
  EXPECT_EQ(d.width, uint32_t(w));
  EXPECT_EQ(d.height, uint32_t(h));
  EXPECT_EQ(d.stored_blocks, 1);
  EXPECT_EQ(d.rgb, img);
}

TEST(Png, LargeImageSpansSeveralStoredBlocks) {
  const int w = 301, h = 173;  // 156,746 bytes of scanlines: three blocks, the last one partial
  const std::vector<uint8_t> img = random_image(w, h, 2);
  const Decoded d = decode_png(png_encode_rgb_stored(img.data(), w, h));
  EXPECT_EQ(d.width, uint32_t(w));
  EXPECT_EQ(d.height, uint32_t(h));
  EXPECT_EQ(d.stored_blocks, 3);
  EXPECT_EQ(d.rgb, img);
}

TEST(Png, RejectsBadSizes) {
  const uint8_t px[3] = {1, 2, 3};
  EXPECT_THROW(png_encode_rgb(px, 0, 1), Error);
  EXPECT_THROW(png_encode_rgb(px, 1, -1), Error);
  EXPECT_THROW(png_encode_rgb(nullptr, 1, 1), Error);
}

// ---- canvas -------------------------------------------------------------------------------

int count_color(const Canvas& c, Rgb col, Rect r) {
  int n = 0;
  for (int y = std::max(0, r.y0); y < std::min(c.height, r.y1); ++y)
    for (int x = std::max(0, r.x0); x < std::min(c.width, r.x1); ++x) {
      const Rgb p = canvas_get_pixel(c, x, y);
      n += p.r == col.r && p.g == col.g && p.b == col.b;
    }
  return n;
}

TEST(Canvas, LineCoversItsPathAndStaysInsideTheClip) {
  const Rgb bg{255, 255, 255}, red{200, 0, 0};
  Canvas c = canvas_create(60, 40, bg);
  const Rect clip{0, 0, 30, 40};
  canvas_draw_line(c, 5.5, 20.3, 55.5, 20.3, red, 3, clip);  // covers y 18.8..21.8
  for (int x = 6; x < 29; ++x) EXPECT_EQ(canvas_get_pixel(c, x, 20).r, 200) << x;
  EXPECT_EQ(count_color(c, bg, {30, 0, 60, 40}), 30 * 40) << "nothing drawn right of the clip";
  EXPECT_EQ(count_color(c, bg, {0, 0, 60, 17}), 60 * 17) << "nothing drawn far above the line";
  // the edge pixels are blended by their coverage (row 18: 0.2), not full
  const Rgb edge = canvas_get_pixel(c, 10, 18);
  EXPECT_NEAR(edge.g, 255 * (1 - 0.2), 1.0);
  EXPECT_NEAR(edge.r, 255 + (200 - 255) * 0.2, 1.0);
}

TEST(Canvas, TextWidthMatchesTheInkDrawn) {
  const Rgb bg{0, 0, 0}, ink{255, 255, 0};
  Canvas c = canvas_create(200, 40, bg);
  const std::string text = "Wq_0.5e-3";
  canvas_draw_text(c, 10, 5, text, ink, 2);
  const int w = canvas_text_width(text, 2);
  EXPECT_EQ(w, (6 * int(text.size()) - 1) * 2);
  int min_x = 1 << 30, max_x = -1, max_y = -1;
  for (int y = 0; y < c.height; ++y)
    for (int x = 0; x < c.width; ++x)
      if (canvas_get_pixel(c, x, y).r == 255) min_x = std::min(min_x, x), max_x = std::max(max_x, x), max_y = y;
  EXPECT_EQ(min_x, 10);         // 'W' touches its left column
  EXPECT_LE(max_x, 10 + w - 1);  // nothing past the advertised width
  EXPECT_GE(max_x, 10 + w - 4);  // '3' reaches its right column
  EXPECT_EQ(max_y, 5 + 2 * kGlyphHeight - 1);  // 'q' descends to the last row
  // distinct glyphs differ
  Canvas a = canvas_create(20, 20, bg), b = canvas_create(20, 20, bg);
  canvas_draw_text(a, 0, 0, "O", ink, 1);
  canvas_draw_text(b, 0, 0, "0", ink, 1);
  EXPECT_NE(a.rgb, b.rgb);
}

// ---- run directories and charts -------------------------------------------------------------

struct TempDir {
  fs::path path;
  TempDir() {
    static int n = 0;
    path = fs::temp_directory_path() / ("fp8rl_test_plot_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string make_run(const std::string& name, const std::string& metrics, const std::string& recipe = "") {
    const fs::path d = path / name;
    fs::create_directories(d);
    std::ofstream(d / "metrics.jsonl") << metrics;
    if (!recipe.empty()) std::ofstream(d / "config.yaml") << "model:\n  path: x\nprecision:\n  recipe: " << recipe << "\n";
    return d.string();
  }
};

// A small synthetic run: reward rising (or falling), validation every 5 steps, nulls at step 0.
std::string synthetic_metrics(int steps, double slope) {
  std::string s;
  for (int i = 0; i <= steps; ++i) {
    const double r = 0.5 + slope * i;
    s += "{\"step\":" + std::to_string(i);
    if (i == 0) {
      s += ",\"reward_mean\":null,\"gen_kl_error\":null,\"time_step_s\":null";
    } else {
      s += ",\"reward_mean\":" + std::to_string(r) + ",\"token_mult_prob_error\":" + std::to_string(1.0 + 0.01 / i) +
           ",\"gen_kl_error\":" + std::to_string(1e-4 * i * i) + ",\"response_length_mean\":" + std::to_string(20 + i) +
           ",\"time_step_s\":" + std::to_string(3.0 + 0.1 * i) + ",\"time_generation_s\":1.5,\"time_train_s\":1.2";
    }
    if (i % 5 == 0) s += ",\"val_accuracy\":" + std::to_string(0.3 + 0.01 * i);
    s += "}\n";
  }
  return s;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(PlotLoad, SkipsNullsKeepsSparseKeysAndLabelsTheRecipe) {
  TempDir t;
  const std::string dir = t.make_run("run_a", synthetic_metrics(12, 0.01) + "{\"step\":12,\"reward_mean\":0.99}\n",
                                     "fp8_e2e");
  const RunMetrics r = plot_load_run(dir + "/");
  EXPECT_EQ(r.label, "run_a (fp8_e2e)");
  EXPECT_EQ(r.series.at("reward_mean").size(), 12u);  // step 0 was null
  EXPECT_EQ(r.series.at("reward_mean").begin()->first, 1);
  EXPECT_DOUBLE_EQ(r.series.at("reward_mean").at(12), 0.99);  // the later line of a repeated step wins
  EXPECT_EQ(r.series.at("val_accuracy").size(), 3u);          // steps 0, 5, 10
  EXPECT_EQ(r.series.count("step"), 0u);
}

TEST(PlotLoad, ErrorsNameTheFileAndLine) {
  TempDir t;
  const std::string bad = t.make_run("bad", "{\"step\":0,\"reward_mean\":0.5}\n\n{\"step\":1,\"reward_m");
  std::string msg = error_of([&] { plot_load_run(bad); });
  EXPECT_NE(msg.find("bad/metrics.jsonl:3"), std::string::npos) << msg;
  const std::string nostep = t.make_run("nostep", "{\"step\":0}\n{\"reward_mean\":0.5}\n");
  msg = error_of([&] { plot_load_run(nostep); });
  EXPECT_NE(msg.find("nostep/metrics.jsonl:2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("step"), std::string::npos) << msg;
  const std::string array = t.make_run("array", "[1,2]\n");
  msg = error_of([&] { plot_load_run(array); });
  EXPECT_NE(msg.find("array/metrics.jsonl:1"), std::string::npos) << msg;
  fs::create_directories(t.path / "empty_dir");
  msg = error_of([&] { plot_load_run((t.path / "empty_dir").string()); });
  EXPECT_NE(msg.find("empty_dir/metrics.jsonl"), std::string::npos) << msg;
  msg = error_of([&] { plot_load_run((t.path / "absent").string()); });
  EXPECT_NE(msg.find("absent"), std::string::npos) << msg;
}

TEST(PlotLoad, CollidingDirectoryNamesGetTheirParent) {
  TempDir t;
  const std::string a = t.make_run("bf16/out", synthetic_metrics(3, 0.1));
  const std::string b = t.make_run("fp8/out", synthetic_metrics(3, 0.1), "fp8_e2e");
  const std::vector<RunMetrics> runs = plot_load_runs({a, b});
  EXPECT_EQ(runs[0].label, "bf16/out");
  EXPECT_EQ(runs[1].label, "fp8/out (fp8_e2e)");
}

TEST(PlotPanels, ParsesCommasAndPluses) {
  const std::vector<PlotPanel> p = plot_parse_panels("loss,time_step_s+time_train_s");
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].keys, std::vector<std::string>{"loss"});
  EXPECT_EQ(p[1].keys, (std::vector<std::string>{"time_step_s", "time_train_s"}));
  EXPECT_THROW(plot_parse_panels("loss,,grad_norm"), Error);
  EXPECT_THROW(plot_parse_panels("loss+"), Error);
}

// Pixels of exactly `col` (line interiors) in the plot, below the legend and the title row.
std::pair<double, double> mean_y_left_right(const Canvas& c, Rgb col, int top) {
  double sum[2] = {0, 0}, n[2] = {0, 0};
  for (int y = top; y < c.height; ++y)
    for (int x = 0; x < c.width; ++x) {
      const Rgb p = canvas_get_pixel(c, x, y);
      if (p.r != col.r || p.g != col.g || p.b != col.b) continue;
      const int side = x < c.width / 3 ? 0 : x >= 2 * c.width / 3 ? 1 : -1;
      if (side < 0) continue;
      sum[side] += y;
      n[side] += 1;
    }
  EXPECT_GT(n[0], 0);
  EXPECT_GT(n[1], 0);
  return {sum[0] / std::max(n[0], 1.0), sum[1] / std::max(n[1], 1.0)};
}

TEST(PlotRender, RisingMetricIsDrawnRisingInEachRunsColor) {
  TempDir t;
  const std::vector<RunMetrics> runs = plot_load_runs(
      {t.make_run("up", synthetic_metrics(30, 0.01)), t.make_run("down", synthetic_metrics(30, -0.01))});
  PlotOptions opt;
  opt.panels = plot_parse_panels("reward_mean");
  opt.width = 800;
  opt.height = 600;
  const Canvas c = plot_render_runs(runs, opt);
  ASSERT_EQ(c.width, 800);
  ASSERT_EQ(c.height, 600);
  // the two runs' colors: the legend swatches' middle pixels, left of each label
  const auto saturated = [](Rgb p) { return std::max({p.r, p.g, p.b}) - std::min({p.r, p.g, p.b}) > 60; };
  const int swatch_y = 8 * 2 + 7;  // margin + half a text line at scale 2
  const Rgb up = canvas_get_pixel(c, 8 * 2 + 11 * 2, swatch_y);
  ASSERT_TRUE(saturated(up)) << "no legend swatch where expected";
  const Rgb down_color = [&] {
    for (int x = 80; x < 800; ++x) {
      const Rgb p = canvas_get_pixel(c, x, swatch_y);
      if ((p.r != up.r || p.g != up.g || p.b != up.b) && saturated(p)) return p;
    }
    return Rgb{};
  }();
  ASSERT_TRUE(saturated(down_color)) << "no second legend swatch";
  const int below_legend = 90;
  const auto [up_left, up_right] = mean_y_left_right(c, up, below_legend);
  EXPECT_GT(up_left, up_right + 50) << "a rising reward must end higher (smaller y)";
  const auto [down_left, down_right] = mean_y_left_right(c, down_color, below_legend);
  EXPECT_LT(down_left + 50, down_right) << "a falling reward must end lower";
}

TEST(PlotRender, DefaultPanelsDrawWithoutErrorsAndMissingKeysSayNoData) {
  TempDir t;
  // the second run logs no validation and no timing: its panels still draw
  const std::vector<RunMetrics> runs =
      plot_load_runs({t.make_run("a", synthetic_metrics(20, 0.01), "bf16"),
                      t.make_run("b", "{\"step\":1,\"reward_mean\":0.4}\n{\"step\":2,\"reward_mean\":null}\n")});
  const Canvas c = plot_render_runs(runs, PlotOptions{});
  EXPECT_EQ(c.width, 1600);
  EXPECT_EQ(c.height, 960);
  const Canvas lone = plot_render_runs({runs[1]}, PlotOptions{});  // one point, five empty panels
  EXPECT_NE(lone.rgb, c.rgb);
  PlotOptions tiny;
  tiny.width = 200;
  tiny.height = 200;
  tiny.panels = plot_parse_panels("a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p");
  EXPECT_THROW(plot_render_runs(runs, tiny), Error);
}

// ---- the command --------------------------------------------------------------------------

// `log` names the folder of the command's log.
int run_fp8rl(const std::vector<std::string>& args, const std::string& log, std::string& output) {
  return test::run_binary_in(fs::path(log).parent_path().string(), args, output);
}

// What `fp8rl plot` writes: libpng's compressed PNG when built with it, else the stored one.
Decoded decode_written(const std::string& bytes) {
  if (!png_have_libpng()) return decode_png(bytes);
  Decoded d;
  int w = 0, h = 0;
  const std::string px = png_decode_rgb(bytes, w, h);
  d.width = uint32_t(w);
  d.height = uint32_t(h);
  d.rgb.assign(px.begin(), px.end());
  return d;
}

// libpng writes the chart's exact pixels (the text stays as drawn), far smaller than stored.
TEST(Png, LibpngRoundTripsAChartExactly) {
  if (!png_have_libpng()) GTEST_SKIP() << "built without libpng (libpng-dev; FP8RL_LIBPNG): the stored encoder is used";
  TempDir t;
  const std::vector<RunMetrics> runs = plot_load_runs({t.make_run("a", synthetic_metrics(20, 0.01), "bf16")});
  const Canvas c = plot_render_runs(runs, PlotOptions{});
  const std::string png = png_encode_rgb(c.rgb.data(), c.width, c.height);
  int w = 0, h = 0;
  const std::string px = png_decode_rgb(png, w, h);
  EXPECT_EQ(w, c.width);
  EXPECT_EQ(h, c.height);
  ASSERT_EQ(px.size(), c.rgb.size());
  EXPECT_EQ(std::memcmp(px.data(), c.rgb.data(), px.size()), 0) << "pixels differ";
  const std::string stored = png_encode_rgb_stored(c.rgb.data(), c.width, c.height);
  EXPECT_LT(png.size() * 10, stored.size()) << png.size() << " vs stored " << stored.size();
  EXPECT_THROW(png_decode_rgb(png.substr(0, 100), w, h), Error);
}

TEST(PlotCli, WritesAPngThatDecodesAndPrintsItsPath) {
  TempDir t;
  const std::string a = t.make_run("bf16", synthetic_metrics(8, 0.02), "bf16");
  const std::string b = t.make_run("fp8", synthetic_metrics(8, 0.01), "fp8_e2e");
  std::string out;
  const std::string log = (t.path / "log.txt").string();
  ASSERT_EQ(run_fp8rl({"plot", a, "--width", "400", "--height", "300"}, log, out), 0) << out;
  EXPECT_EQ(out, a + "/plots.png\n");
  const Decoded d = decode_written(read_file(a + "/plots.png"));
  EXPECT_EQ(d.width, 400u);
  EXPECT_EQ(d.height, 300u);
  EXPECT_EQ(d.rgb.size(), 400u * 300u * 3u);

  const std::string png = (t.path / "cmp.png").string();
  ASSERT_EQ(run_fp8rl({"plot", a, b, "--out", png, "--metrics", "reward_mean,time_step_s+time_train_s"}, log, out), 0)
      << out;
  EXPECT_EQ(out, png + "\n");
  EXPECT_EQ(decode_written(read_file(png)).width, 1600u);

  EXPECT_NE(run_fp8rl({"plot", a, "--metrics", "reward_maen"}, log, out), 0);
  EXPECT_NE(out.find("reward_maen"), std::string::npos) << out;
  EXPECT_NE(run_fp8rl({"plot", (t.path / "nope").string()}, log, out), 0);
  EXPECT_NE(out.find("nope"), std::string::npos) << out;
}

}  // namespace
}  // namespace fp8rl
