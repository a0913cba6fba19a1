// Step metrics: one JSON object per step appended to DIR/metrics.jsonl (flushed line by line,
// non-finite numbers written as null), a readable console line per step, and a progress bar
// for long phases.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/tensorboard.h"
#include "rl/metrics.h"
#include "train/grpo.h"

namespace fp8rl {

// NaN = not measured this step (JSON null). Names follow the reference system (recipe.md 5).
struct StepMetrics {
  static constexpr double kNone = std::numeric_limits<double>::quiet_NaN();
  int64_t step = 0;
  // outcome
  double reward_mean = kNone, accuracy = kNone;
  // generator/trainer mismatch (rl/metrics.h) and its correction (train/grpo.h GrpoStats)
  double token_mult_prob_error = kNone, gen_kl_error = kNone, policy_kl_error = kNone;
  double is_weight_mean = kNone, is_weight_min = kNone, is_weight_max = kNone;
  double is_truncated_fraction = kNone, is_masked_fraction = kNone;
  // optimization
  double loss = kNone, clip_fraction = kNone, kl_mean = kNone, entropy_mean = kNone;
  double grad_norm = kNone, lr = kNone;
  // responses
  double response_length_mean = kNone, response_length_max = kNone, response_capped_fraction = kNone;
  // time per phase (seconds) and throughput
  double time_generation_s = kNone, time_logprob_s = kNone, time_train_s = kNone;
  double time_refit_s = kNone, time_calibration_s = kNone, time_step_s = kNone;
  double generation_tokens_per_s = kNone;
  // validation: only on steps where it ran (step 0 included, before the first update)
  std::optional<double> val_accuracy;
  // mixture-of-experts models: the trainer's routing against the generator's (only then present;
  // the split of the mismatch by it goes into `extra`: step_metrics_set_routing)
  std::optional<double> routing_agreement;
  // anything else, in this order after the fixed keys (names must not repeat a fixed key)
  std::vector<std::pair<std::string, double>> extra;
};

// Copy the loss statistics (clip fraction, IS weights, truncated/masked fractions, KL mean),
// the mismatch metrics, and the response-length statistics into a step record.
void step_metrics_set_loss_stats(StepMetrics& m, const GrpoStats& s);
void step_metrics_set_mismatch(StepMetrics& m, const MismatchMetrics& mm);
void step_metrics_set_lengths(StepMetrics& m, const LengthStats& l);
// routing_agreement, and into `extra`: router_topk_agreement, routing_agreed_token_fraction,
// token_mult_prob_error_routing_{agreed,differs}, gen_kl_error_routing_{agreed,differs}.
void step_metrics_set_routing(StepMetrics& m, const RoutingMetrics& r);

// The JSON object of one step (one line, no newline). Every fixed key is present (null when
// unmeasured) except val_accuracy, present only when set. Throws on a duplicate extra key.
std::string metrics_to_json_line(const StepMetrics& m);
// A readable line: "step 12/40 | reward 0.531 acc 0.500 | ... | gen 1.2s train 0.4s refit 0.01s".
std::string metrics_console_line(const StepMetrics& m, int64_t total_steps);
// One line naming what the console line's abbreviations are (printed once before the first).
std::string metrics_console_legend();
// "1h02m", "3m07s", "12.3s".
std::string format_duration(double seconds);

class MetricsLog {
 public:
  // Opens DIR/metrics.jsonl for appending (DIR must exist); each write() also prints the
  // readable line to `console_out` (nullptr = no console line).
  explicit MetricsLog(const std::string& dir, std::FILE* console_out = stdout);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const StepMetrics& m, int64_t total_steps);
  // logger.tensorboard: every finite metric of every later write() also goes to a TensorBoard
  // event file under `dir` (io/tensorboard.h), tagged with its metrics.jsonl name.
  void enable_tensorboard(const std::string& dir);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  std::FILE* console_ = nullptr;
  std::unique_ptr<TensorBoardWriter> tb_;
  bool legend_printed_ = false;
};

// A progress indicator for a long phase (generation, training, validation, SFT, the whole run).
// On a terminal it redraws one line ("\rlabel [#####-----] 12/64 3.1s ETA 9.4s") at most ~10
// times a second; otherwise (a log file, CI) it prints a plain line at most every
// `line_interval_s` seconds and at the end. Only the newest live bar draws on a terminal; lines
// printed through console_line() (or after progress_clear_line()) erase it first, so that bars
// and log lines do not collide.
class Progress {
 public:
  // tty: 1 / 0 force the mode; -1 = isatty(out).
  Progress(std::string label, int64_t total, std::FILE* out = stderr, int tty = -1, double line_interval_s = 10.0);
  ~Progress();
  void update(int64_t done);
  void set_label(std::string label) { label_ = std::move(label); }
  void finish();  // prints the final state once (also called by the destructor)
  // quiet: no final line (a sub-phase bar that the next log line replaces).
  void finish_quietly();
  // "12/64 3.1s ETA 9.4s" (the ETA from the mean pace so far; absent before the first unit).
  static std::string format_tail(int64_t done, int64_t total, double elapsed_s);

 private:
  void draw(bool final_line);
  std::string label_;
  int64_t total_, done_ = 0;
  std::FILE* out_;
  bool tty_, finished_ = false;
  double interval_s_, start_s_, last_s_ = -1e300;
  Progress* below_ = nullptr;  // the bar that was live when this one started
};

// Erases the live terminal progress bar, if one is drawn (before printing a log line).
void progress_clear_line();
// printf to `out` (a line, newline added) after erasing the live bar; flushed.
void console_line(std::FILE* out, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace fp8rl
