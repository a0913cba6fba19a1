// `fp8rl plot`: metric curves of one or several runs as a PNG grid of panels, one colored line
// per run. Drawn on a small RGB raster canvas with a built-in 5x9 bitmap font (ASCII), written
// by io/png.h; nothing outside the standard library.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace fp8rl {

// ---- canvas ---------------------------------------------------------------------------------
struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};

// Pixels [x0, x1) x [y0, y1).
struct Rect {
  int x0 = 0, y0 = 0, x1 = 0, y1 = 0;
};

struct Canvas {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  // [height, width, 3], row-major
};

// Glyph cell of the built-in font at scale 1: 5x9 pixels (rows 0-6 above the baseline, 7-8
// descenders), advancing 6 pixels per character; lines are kLineHeight apart.
constexpr int kGlyphWidth = 5, kGlyphHeight = 9, kGlyphAdvance = 6, kLineHeight = 11;

Canvas canvas_create(int width, int height, Rgb background);
Rgb canvas_get_pixel(const Canvas& c, int x, int y);
// Mixes `color` over the pixel with weight alpha in [0, 1]; pixels off the canvas are ignored.
void canvas_blend_pixel(Canvas& c, int x, int y, Rgb color, double alpha);
void canvas_fill_rect(Canvas& c, Rect r, Rgb color);  // clipped to the canvas
// An anti-aliased segment `thickness` pixels wide with round ends, drawn only inside `clip`.
// Coordinates are continuous: pixel (x, y) covers [x, x+1) x [y, y+1).
void canvas_draw_line(Canvas& c, double x0, double y0, double x1, double y1, Rgb color, double thickness, Rect clip);
// A connected line through `points` ({x, y} pairs); dash = {on, off} lengths in pixels along the
// line, {0, 0} = solid.
void canvas_draw_polyline(Canvas& c, const std::vector<std::pair<double, double>>& points, Rgb color, double thickness,
                          std::pair<double, double> dash, Rect clip);
void canvas_fill_circle(Canvas& c, double cx, double cy, double radius, Rgb color, Rect clip);
// Text with its top-left corner at (x, y), each font pixel drawn as scale x scale; characters
// outside printable ASCII are drawn as '?'. canvas_text_width: the width the text takes.
void canvas_draw_text(Canvas& c, int x, int y, std::string_view text, Rgb color, int scale);
int canvas_text_width(std::string_view text, int scale);

// ---- run metrics ----------------------------------------------------------------------------
struct RunMetrics {
  std::string dir;
  std::string label;  // legend text: the directory's name, plus " (recipe)" from its config.yaml
  // metric key -> step -> value; only finite numbers (null and missing keys are skipped). A step
  // logged twice (a resumed run) keeps its last value.
  std::map<std::string, std::map<int64_t, double>> series;
};

// Reads DIR/metrics.jsonl (and DIR/config.yaml's precision.recipe when present). Throws naming the
// file and line on a missing file, a line that is not a JSON object, or a line without an integer
// "step".
RunMetrics plot_load_run(const std::string& dir);
// plot_load_run for each directory; runs whose directory names collide are labeled parent/name.
std::vector<RunMetrics> plot_load_runs(const std::vector<std::string>& dirs);

// ---- charts ---------------------------------------------------------------------------------
struct PlotPanel {
  std::string title;
  std::vector<std::string> keys;  // one line per run and key; keys after the first are dashed/dotted
};

struct PlotOptions {
  std::vector<PlotPanel> panels;  // empty = plot_default_panels()
  int width = 1600, height = 960;
};

// val_accuracy, reward_mean, token_mult_prob_error, gen_kl_error (log scale), response_length_mean,
// and the time per step with its generation and training phases.
std::vector<PlotPanel> plot_default_panels();
// "a,b+c" -> panel a, panel b with c; throws on an empty name.
std::vector<PlotPanel> plot_parse_panels(const std::string& spec);
Canvas plot_render_runs(const std::vector<RunMetrics>& runs, const PlotOptions& options);

}  // namespace fp8rl
