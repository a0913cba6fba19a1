// plot/plot.h: reading run directories, and laying out the grid of metric panels.
#include "plot/plot.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/fs.h"
#include "io/json_input.h"

namespace fp8rl {

namespace {

// ---- loading --------------------------------------------------------------------------------

std::string dir_name(const std::string& dir) {
  std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  if (p.has_filename()) return p.filename().string();
  return p.parent_path().filename().string();  // "runs/a/" normalizes to "runs/a/" with empty filename
}

// precision.recipe from DIR/config.yaml; "" when the file or the key is absent or unreadable (the
// recipe only decorates the legend).
std::string read_recipe(const std::string& dir) {
  const std::string path = dir + "/config.yaml";
  if (!std::filesystem::is_regular_file(path)) return "";
  try {
    const YAML::Node root = YAML::LoadFile(path);
    const YAML::Node recipe = root["precision"]["recipe"];
    return recipe && recipe.IsScalar() ? recipe.as<std::string>() : "";
  } catch (const YAML::Exception&) {
    return "";
  }
}

int64_t step_of(const nlohmann::json& j, const std::string& where) {
  const auto it = j.find("step");
  if (it == j.end()) FP8RL_FAIL(where, ": the object has no \"step\" key (every metrics line needs one)");
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_number_float()) {
    const double v = it->get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9e15) return int64_t(v);
  }
  FP8RL_FAIL(where, ": \"step\" is ", json_brief(*it), ", expected an integer");
}

// ---- axes -----------------------------------------------------------------------------------

struct Axis {
  double lo = 0, hi = 1;  // in axis units (log10 of the value on a log axis)
  bool log = false;
  std::vector<std::pair<double, std::string>> ticks;  // position in axis units, label
};

// 1, 2 or 5 times a power of ten, near range / target.
double nice_step(double range, int target) {
  const double raw = range / std::max(target, 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
}

std::string format_number(double v, double step) {
  char buf[48];
  if (std::fabs(v) < step * 1e-6) return "0";
  const int decimals = step >= 1 ? 0 : int(std::ceil(-std::log10(step) - 1e-9));
  if (decimals <= 4 && std::fabs(v) < 1e6) {
    std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
    return buf;
  }
  const int e = int(std::floor(std::log10(std::fabs(v))));
  const double unit = std::pow(10.0, e);
  const double rel = step / unit;
  const int mdec = rel >= 1 ? 0 : std::min(3, int(std::ceil(-std::log10(rel) - 1e-9)));
  std::snprintf(buf, sizeof buf, "%.*fe%d", mdec, v / unit, e);
  return buf;
}

Axis linear_axis(double lo, double hi, int target, bool integer) {
  if (!(hi > lo)) {
    const double pad = lo != 0 ? std::fabs(lo) * 0.1 : 1.0;
    lo -= pad;
    hi += pad;
  }
  double step = nice_step(hi - lo, target);
  if (integer) step = std::max(step, 1.0);
  Axis a;
  a.lo = std::floor(lo / step + 1e-9) * step;
  a.hi = std::ceil(hi / step - 1e-9) * step;
  for (double t = a.lo; t <= a.hi + step * 1e-6; t += step) a.ticks.push_back({t, format_number(t, step)});
  return a;
}

// Ticks at 1, 2, 5 x 10^k over a short range, at powers of ten over a long one.
Axis log_axis(double min_v, double max_v, int target) {
  Axis a;
  a.log = true;
  const double lo = std::log10(min_v), hi = std::log10(max_v), pad = 0.04 * (hi - lo);
  a.lo = lo - pad;
  a.hi = hi + pad;
  const int decades = int(std::ceil(a.hi) - std::floor(a.lo));
  const int every = std::max(1, (decades + std::max(target, 1) - 1) / std::max(target, 1));
  const std::vector<int> mantissas = a.hi - a.lo <= 2.5 ? std::vector<int>{1, 2, 5} : std::vector<int>{1};
  for (int k = int(std::floor(a.lo)); k <= int(std::ceil(a.hi)); ++k) {
    if (k % every != 0) continue;
    for (const int m : mantissas) {
      const double pos = std::log10(double(m)) + k;
      if (pos < a.lo || pos > a.hi) continue;
      char buf[32];
      if (k >= -3 && k <= 4) std::snprintf(buf, sizeof buf, "%.*f", std::max(0, -k), m * std::pow(10.0, k));
      else std::snprintf(buf, sizeof buf, "%de%d", m, k);
      a.ticks.push_back({pos, buf});
    }
  }
  return a;
}

// ---- drawing --------------------------------------------------------------------------------

constexpr Rgb kWhite{255, 255, 255}, kPanelBg{246, 247, 249}, kFrame{170, 174, 182}, kGrid{228, 230, 234};
constexpr Rgb kText{40, 44, 52}, kMuted{110, 116, 128};
constexpr Rgb kPalette[] = {{37, 99, 235}, {220, 38, 38}, {22, 163, 74},  {234, 88, 12}, {147, 51, 234},
                            {8, 145, 178}, {202, 138, 4}, {219, 39, 119}, {71, 85, 105}, {101, 163, 13}};
constexpr int kPaletteSize = int(sizeof kPalette / sizeof kPalette[0]);

Rgb run_color(size_t i) { return kPalette[i % kPaletteSize]; }

// Solid for a panel's first key, then dashed, dotted, long-dashed (lengths in font pixels).
std::pair<double, double> key_dash(size_t key_index, int scale) {
  static constexpr std::pair<double, double> kDash[] = {{0, 0}, {5, 3}, {1.2, 2.4}, {10, 3}};
  const auto [on, off] = kDash[key_index % 4];
  return {on * scale, off * scale};
}

// Names of a panel's keys without their shared prefix and suffix ("time_train_s" -> "train").
std::vector<std::string> short_names(const std::vector<std::string>& keys) {
  if (keys.size() < 2) return keys;
  size_t pre = keys[0].size(), suf = keys[0].size();
  for (const std::string& k : keys) {
    size_t p = 0;
    while (p < pre && p < k.size() && k[p] == keys[0][p]) ++p;
    pre = p;
    size_t s = 0;
    while (s < suf && s < k.size() && k[k.size() - 1 - s] == keys[0][keys[0].size() - 1 - s]) ++s;
    suf = s;
  }
  // cut only at '_' so that names stay words
  while (pre > 0 && keys[0][pre - 1] != '_') --pre;
  while (suf > 0 && keys[0][keys[0].size() - suf] != '_') --suf;
  std::vector<std::string> out;
  for (const std::string& k : keys) out.push_back(k.size() > pre + suf ? k.substr(pre, k.size() - pre - suf) : k);
  return out;
}

// `text` cut to `max_w` pixels, ".." marking the cut.
std::string fit_text(const std::string& text, int max_w, int scale) {
  if (canvas_text_width(text, scale) <= max_w) return text;
  std::string t = text;
  while (!t.empty() && canvas_text_width(t + "..", scale) > max_w) t.pop_back();
  return t.empty() ? "" : t + "..";
}

bool is_log_key(const std::string& key) { return key.find("kl_error") != std::string::npos; }

struct Layout {
  int scale = 1;
  double thickness = 2;
};

// One panel in `cell`: title, key legend, axes with ticks and grid, one line per run and key.
void draw_panel(Canvas& c, Rect cell, const PlotPanel& panel, const std::vector<RunMetrics>& runs, const Axis& x_axis,
                const Layout& L) {
  const int s = L.scale, pad = 6 * s, line_h = kLineHeight * s;
  canvas_fill_rect(c, cell, kPanelBg);

  // the values this panel shows
  double vmin = INFINITY, vmax = -INFINITY;
  bool all_positive = true;
  size_t npoints = 0;
  for (const RunMetrics& run : runs)
    for (const std::string& key : panel.keys) {
      const auto it = run.series.find(key);
      if (it == run.series.end()) continue;
      for (const auto& [step, v] : it->second) {
        vmin = std::min(vmin, v);
        vmax = std::max(vmax, v);
        all_positive = all_positive && v > 0;
        ++npoints;
      }
    }
  const bool use_log = npoints > 0 && all_positive && is_log_key(panel.keys[0]) && vmax / vmin >= 10;

  // title row, then the key legend (same row when it fits, else the next)
  const std::string title = fit_text(panel.title + (use_log ? " (log)" : ""), cell.x1 - cell.x0 - 2 * pad, s);
  canvas_draw_text(c, cell.x0 + pad, cell.y0 + pad, title, kText, s);
  int top = cell.y0 + pad + line_h + 4 * s + line_h / 2;  // room for the top tick label
  if (panel.keys.size() > 1) {
    const std::vector<std::string> names = short_names(panel.keys);
    const int sample = 16 * s;
    int legend_w = 0;
    for (const std::string& n : names) legend_w += sample + 4 * s + canvas_text_width(n, s) + 12 * s;
    int x = cell.x1 - pad - legend_w, y = cell.y0 + pad;
    if (x < cell.x0 + pad + canvas_text_width(title, s) + 12 * s) {
      x = cell.x0 + pad;
      y = top - line_h / 2 - 2 * s;
      top += line_h;
    }
    for (size_t k = 0; k < names.size(); ++k) {
      const double ly = y + 3.5 * s;
      canvas_draw_polyline(c, {{x, ly}, {x + sample, ly}}, kMuted, L.thickness, key_dash(k, s),
                           {0, 0, c.width, c.height});
      x += sample + 4 * s;
      canvas_draw_text(c, x, y, names[k], kMuted, s);
      x += canvas_text_width(names[k], s) + 12 * s;
    }
  }

  const int bottom = cell.y1 - pad - line_h - 3 * s;  // x tick labels below
  const int target_y = std::max(2, (bottom - top) / (24 + 14 * s));
  Axis y_axis = npoints == 0 ? linear_axis(0, 1, target_y, false)
                : use_log    ? log_axis(vmin, vmax, target_y)
                             : linear_axis(vmin, vmax, target_y, false);
  int label_w = 0;
  for (const auto& t : y_axis.ticks) label_w = std::max(label_w, canvas_text_width(t.second, s));
  const Rect plot{cell.x0 + pad + label_w + 5 * s, top, cell.x1 - pad - 4 * s, bottom};
  if (plot.x1 - plot.x0 < 10 || plot.y1 - plot.y0 < 10) return;  // too small to draw in

  const auto px = [&](double step) {
    return plot.x0 + (step - x_axis.lo) / (x_axis.hi - x_axis.lo) * (plot.x1 - plot.x0);
  };
  const auto py = [&](double v) {
    const double a = y_axis.log ? std::log10(v) : v;
    return plot.y1 - (a - y_axis.lo) / (y_axis.hi - y_axis.lo) * (plot.y1 - plot.y0);
  };

  canvas_fill_rect(c, plot, kWhite);
  const int half = line_h / 2 - s;
  for (const auto& [pos, label] : y_axis.ticks) {
    const int y = int(std::lround(plot.y1 - (pos - y_axis.lo) / (y_axis.hi - y_axis.lo) * (plot.y1 - plot.y0)));
    canvas_fill_rect(c, {plot.x0, y, plot.x1, y + 1}, kGrid);
    canvas_fill_rect(c, {plot.x0 - 3 * s, y, plot.x0, y + 1}, kFrame);
    canvas_draw_text(c, plot.x0 - 5 * s - canvas_text_width(label, s), y - half + s, label, kMuted, s);
  }
  int last_label_end = -1 << 30;
  for (const auto& [pos, label] : x_axis.ticks) {
    const int x = int(std::lround(px(pos)));
    canvas_fill_rect(c, {x, plot.y0, x + 1, plot.y1}, kGrid);
    canvas_fill_rect(c, {x, plot.y1, x + 1, plot.y1 + 3 * s}, kFrame);
    const int w = canvas_text_width(label, s);
    const int lx = std::clamp(x - w / 2, cell.x0, cell.x1 - w);
    if (lx <= last_label_end + 4 * s) continue;  // would overlap its left neighbour
    canvas_draw_text(c, lx, plot.y1 + 5 * s, label, kMuted, s);
    last_label_end = lx + w;
  }
  // frame
  canvas_fill_rect(c, {plot.x0, plot.y0, plot.x1, plot.y0 + 1}, kFrame);
  canvas_fill_rect(c, {plot.x0, plot.y1 - 1, plot.x1, plot.y1}, kFrame);
  canvas_fill_rect(c, {plot.x0, plot.y0, plot.x0 + 1, plot.y1}, kFrame);
  canvas_fill_rect(c, {plot.x1 - 1, plot.y0, plot.x1, plot.y1}, kFrame);

  if (npoints == 0) {
    const std::string msg = "no data";
    canvas_draw_text(c, (plot.x0 + plot.x1 - canvas_text_width(msg, s)) / 2, (plot.y0 + plot.y1 - line_h) / 2, msg,
                     kMuted, s);
    return;
  }
  const Rect clip{plot.x0 + 1, plot.y0 + 1, plot.x1 - 1, plot.y1 - 1};
  for (size_t r = 0; r < runs.size(); ++r)
    for (size_t k = 0; k < panel.keys.size(); ++k) {
      const auto it = runs[r].series.find(panel.keys[k]);
      if (it == runs[r].series.end()) continue;
      std::vector<std::pair<double, double>> pts;
      for (const auto& [step, v] : it->second) pts.push_back({px(double(step)), py(v)});
      canvas_draw_polyline(c, pts, run_color(r), L.thickness, key_dash(k, s), clip);
      // markers where points are sparse enough to tell apart (and always for a lone point)
      if (pts.size() == 1 || double(pts.size()) * 12 * s < plot.x1 - plot.x0)
        for (const auto& [x, y] : pts) canvas_fill_circle(c, x, y, 1.6 * s + 0.5, run_color(r), clip);
    }
}

}  // namespace

RunMetrics plot_load_run(const std::string& dir) {
  if (!std::filesystem::is_directory(dir))
    FP8RL_FAIL("'", dir, "' is not a directory: pass run directories (the --out of fp8rl train / fp8rl sft)");
  RunMetrics run;
  run.dir = dir;
  const std::string path = dir + "/metrics.jsonl";
  if (!std::filesystem::is_regular_file(path))
    FP8RL_FAIL("'", path, "' does not exist: '", dir, "' is not a run directory, or its run has not logged a step yet");
  const std::string text = read_file(path);
  size_t at = 0, records = 0;
  for (int64_t line_no = 1; at < text.size(); ++line_no) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(at, end - at);
    at = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank line
    const std::string where = path + ":" + std::to_string(line_no);
    nlohmann::json j;
    try {
      j = json_parse_limited(line, where, {size_t(1) << 20, 16});
    } catch (const Error& e) {
      FP8RL_FAIL(e.what(), "; a run killed mid-write can leave a torn last line: delete that line and plot again");
    }
    if (!j.is_object()) FP8RL_FAIL(where, ": expected a JSON object per line, got ", j.type_name());
    const int64_t step = step_of(j, where);
    for (const auto& [key, value] : j.items()) {
      if (key == "step" || !value.is_number()) continue;  // null = not measured; other types aren't metrics
      const double v = value.get<double>();
      if (std::isfinite(v)) run.series[key][step] = v;
    }
    ++records;
  }
  if (records == 0) FP8RL_FAIL("'", path, "' holds no steps yet: nothing to plot");
  run.label = dir_name(dir);
  if (const std::string recipe = read_recipe(dir); !recipe.empty()) run.label += " (" + recipe + ")";
  return run;
}

std::vector<RunMetrics> plot_load_runs(const std::vector<std::string>& dirs) {
  FP8RL_CHECK(!dirs.empty(), "no run directory given");
  std::vector<RunMetrics> runs;
  std::map<std::string, int> name_count;
  for (const std::string& d : dirs) {
    runs.push_back(plot_load_run(d));
    ++name_count[dir_name(d)];
  }
  for (RunMetrics& r : runs) {
    const std::string name = dir_name(r.dir);
    if (name_count[name] < 2) continue;
    const std::filesystem::path abs = std::filesystem::absolute(r.dir).lexically_normal();
    const std::filesystem::path p = abs.has_filename() ? abs : abs.parent_path();
    const std::string parent = p.parent_path().filename().string();
    r.label = (parent.empty() ? "" : parent + "/") + r.label;
  }
  return runs;
}

std::vector<PlotPanel> plot_default_panels() {
  return {{"val_accuracy", {"val_accuracy"}},
          {"reward_mean", {"reward_mean"}},
          {"token_mult_prob_error", {"token_mult_prob_error"}},
          {"gen_kl_error", {"gen_kl_error"}},
          {"response_length_mean", {"response_length_mean"}},
          {"time per step (s)", {"time_step_s", "time_generation_s", "time_train_s"}}};
}

std::vector<PlotPanel> plot_parse_panels(const std::string& spec) {
  std::vector<PlotPanel> panels;
  size_t at = 0;
  while (at <= spec.size()) {
    size_t end = spec.find(',', at);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(at, end - at);
    PlotPanel p;
    size_t k = 0;
    while (k <= item.size()) {
      size_t e = item.find('+', k);
      if (e == std::string::npos) e = item.size();
      const std::string key = item.substr(k, e - k);
      FP8RL_CHECK(!key.empty() && key.find_first_of(" \t") == std::string::npos, "metric list '", spec,
                  "' has an empty or spaced name: write key,key or key+key (lines in one panel)");
      p.keys.push_back(key);
      k = e + 1;
    }
    for (const std::string& key : p.keys) p.title += (p.title.empty() ? "" : " + ") + key;
    panels.push_back(std::move(p));
    at = end + 1;
  }
  return panels;
}

Canvas plot_render_runs(const std::vector<RunMetrics>& runs, const PlotOptions& options) {
  FP8RL_CHECK(!runs.empty(), "no run to plot");
  const std::vector<PlotPanel> panels = options.panels.empty() ? plot_default_panels() : options.panels;
  const int n = int(panels.size());
  const int cols = n <= 3 ? n : n == 4 ? 2 : n <= 9 ? 3 : int(std::ceil(std::sqrt(double(n))));
  const int rows = (n + cols - 1) / cols;
  const int W = options.width, H = options.height;
  Canvas c = canvas_create(W, H, kWhite);

  Layout L;
  L.scale = (W / cols >= 380 && H / rows >= 300) ? 2 : 1;
  L.thickness = 1.0 + 0.75 * L.scale;
  const int s = L.scale, margin = 8 * s, line_h = kLineHeight * s, gap = 6 * s;

  // legend: a colored line and the label of each run, wrapped to the width; the x axis named last
  int x = margin, y = margin;
  const int sample = 22 * s;
  auto place = [&](int w) {
    if (x > margin && x + w > W - margin) {
      x = margin;
      y += line_h + 4 * s;
    }
  };
  for (size_t r = 0; r < runs.size(); ++r) {
    const int w = sample + 5 * s + canvas_text_width(runs[r].label, s);
    place(w);
    const double ly = y + 3.5 * s;
    canvas_draw_line(c, x, ly, x + sample, ly, run_color(r), L.thickness + s, {0, 0, W, H});
    canvas_draw_text(c, x + sample + 5 * s, y, runs[r].label, kText, s);
    x += w + 16 * s;
  }
  const std::string x_name = "x: step";
  place(canvas_text_width(x_name, s));
  canvas_draw_text(c, std::max(x, W - margin - canvas_text_width(x_name, s)), y, x_name, kMuted, s);
  const int grid_top = y + line_h + 6 * s;

  // one step axis shared by every panel, over every plotted key of every run
  double xmin = INFINITY, xmax = -INFINITY;
  for (const PlotPanel& p : panels)
    for (const RunMetrics& run : runs)
      for (const std::string& key : p.keys)
        if (const auto it = run.series.find(key); it != run.series.end() && !it->second.empty()) {
          xmin = std::min(xmin, double(it->second.begin()->first));
          xmax = std::max(xmax, double(it->second.rbegin()->first));
        }
  if (!std::isfinite(xmin)) xmin = 0, xmax = 1;
  const int cell_w = (W - 2 * margin - (cols - 1) * gap) / cols;
  const int cell_h = (H - grid_top - margin - (rows - 1) * gap) / rows;
  FP8RL_CHECK(cell_w >= 60 && cell_h >= 60, "image ", W, "x", H, " is too small for ", n,
              " panels: raise --width/--height or plot fewer --metrics");
  const Axis x_axis = linear_axis(xmin, xmax, std::max(2, cell_w / (60 * s)), true);

  for (int i = 0; i < n; ++i) {
    const int cx = margin + (i % cols) * (cell_w + gap), cy = grid_top + (i / cols) * (cell_h + gap);
    draw_panel(c, {cx, cy, cx + cell_w, cy + cell_h}, panels[i], runs, x_axis, L);
  }
  return c;
}

}  // namespace fp8rl
