// fp8rl plot RUN_DIR... [--out FILE.png] [--metrics a,b+c] [--width W] [--height H]
//   Draws the metric curves of one or several run directories (their metrics.jsonl) as a PNG grid
//   of panels, one colored line per run. Prints the path of the image written.
#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "core/error.h"
#include "io/png.h"
#include "plot/plot.h"

namespace fp8rl::cli {
namespace {

int parse_size(const std::string& text, const char* flag) {
  size_t used = 0;
  long v = 0;
  try {
    v = std::stol(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || v < 200 || v > 8000)
    FP8RL_FAIL("--", flag, " ", text, " is not a size in pixels: give an integer in 200..8000");
  return int(v);
}

int run(const std::vector<std::string>& argv) {
  Args args(argv, {"out", "metrics", "width", "height"}, {"help"});
  if (args.has("help") || args.positional().empty()) {
    std::fprintf(stderr,
                 "usage: fp8rl plot RUN_DIR... [--out FILE.png] [--metrics a,b+c] [--width W] [--height H]\n"
                 "  RUN_DIR: a run directory holding metrics.jsonl (fp8rl train / sft --out)\n"
                 "  --out: the image (default RUN_DIR/plots.png for one run, ./compare.png for several)\n"
                 "  --metrics: metric keys of metrics.jsonl, one panel each; key+key draws both in one panel\n"
                 "             (default: val_accuracy, reward_mean, token_mult_prob_error, gen_kl_error,\n"
                 "              response_length_mean, time_step_s+time_generation_s+time_train_s)\n"
                 "  --width, --height: image size in pixels (default 1600x960)\n");
    return args.has("help") ? 0 : 2;
  }
  const std::vector<std::string>& dirs = args.positional();
  PlotOptions options;
  options.width = parse_size(args.get("width", "1600"), "width");
  options.height = parse_size(args.get("height", "960"), "height");
  const std::vector<RunMetrics> runs = plot_load_runs(dirs);
  if (args.has("metrics")) {
    options.panels = plot_parse_panels(args.get("metrics"));
    // a name that no run logged is a typo far more often than a metric that never ran
    for (const PlotPanel& p : options.panels)
      for (const std::string& key : p.keys) {
        bool found = false;
        for (const RunMetrics& r : runs) found = found || r.series.count(key) > 0;
        if (found) continue;
        std::string known;
        for (const auto& [k, v] : runs[0].series) known += (known.empty() ? "" : ", ") + k;
        FP8RL_FAIL("no run has a value for metric '", key, "'; ", runs[0].dir, " has: ", known);
      }
  }
  const std::string out = args.has("out") ? args.get("out")
                          : dirs.size() == 1 ? dirs[0] + "/plots.png"
                                             : std::string("compare.png");
  const Canvas canvas = plot_render_runs(runs, options);
  png_write_rgb(out, canvas.rgb.data(), canvas.width, canvas.height);
  std::printf("%s\n", out.c_str());
  FP8RL_CHECK(std::fflush(stdout) == 0, "failed to write stdout");
  return 0;
}

Register reg{"plot", "PNG charts of the metric curves of one or several run directories", run};

}  // namespace
}  // namespace fp8rl::cli
