#include "rl/metrics_log.h"

#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace fp8rl {

namespace {

nlohmann::ordered_json number(double v) { return std::isfinite(v) ? nlohmann::ordered_json(v) : nullptr; }

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// "%.3g" that prints "-" for NaN.
std::string fmt(const char* f, double v) {
  if (!std::isfinite(v)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

void step_metrics_set_loss_stats(StepMetrics& m, const GrpoStats& s) {
  m.clip_fraction = s.clip_fraction();
  m.is_weight_mean = s.is_weight_mean();
  m.is_weight_min = s.is_tokens ? s.is_weight_min : StepMetrics::kNone;
  m.is_weight_max = s.is_tokens ? s.is_weight_max : StepMetrics::kNone;
  m.is_truncated_fraction = s.truncated_fraction();
  m.is_masked_fraction = s.masked_fraction();
  m.kl_mean = s.kl_mean();
}

void step_metrics_set_mismatch(StepMetrics& m, const MismatchMetrics& mm) {
  m.token_mult_prob_error = mm.token_mult_prob_error;
  m.gen_kl_error = mm.gen_kl_error;
  m.policy_kl_error = mm.policy_kl_error;
}

void step_metrics_set_lengths(StepMetrics& m, const LengthStats& l) {
  m.response_length_mean = l.mean;
  m.response_length_max = l.count ? static_cast<double>(l.max) : StepMetrics::kNone;
  m.response_capped_fraction = l.capped_fraction;
}

void step_metrics_set_routing(StepMetrics& m, const RoutingMetrics& r) {
  m.routing_agreement = r.agreement;
  m.extra.push_back({"router_topk_agreement", r.router_agreement});
  m.extra.push_back({"routing_agreed_token_fraction", r.agreed_token_fraction});
  m.extra.push_back({"token_mult_prob_error_routing_agreed", r.agreed.token_mult_prob_error});
  m.extra.push_back({"token_mult_prob_error_routing_differs", r.differs.token_mult_prob_error});
  m.extra.push_back({"gen_kl_error_routing_agreed", r.agreed.gen_kl_error});
  m.extra.push_back({"gen_kl_error_routing_differs", r.differs.gen_kl_error});
}

std::string metrics_to_json_line(const StepMetrics& m) {
  nlohmann::ordered_json j;
  j["step"] = m.step;
  const std::pair<const char*, double> fixed[] = {
      {"reward_mean", m.reward_mean},
      {"accuracy", m.accuracy},
      {"token_mult_prob_error", m.token_mult_prob_error},
      {"gen_kl_error", m.gen_kl_error},
      {"policy_kl_error", m.policy_kl_error},
      {"is_weight_mean", m.is_weight_mean},
      {"is_weight_min", m.is_weight_min},
      {"is_weight_max", m.is_weight_max},
      {"is_truncated_fraction", m.is_truncated_fraction},
      {"is_masked_fraction", m.is_masked_fraction},
      {"loss", m.loss},
      {"clip_fraction", m.clip_fraction},
      {"kl_mean", m.kl_mean},
      {"entropy_mean", m.entropy_mean},
      {"grad_norm", m.grad_norm},
      {"lr", m.lr},
      {"response_length_mean", m.response_length_mean},
      {"response_length_max", m.response_length_max},
      {"response_capped_fraction", m.response_capped_fraction},
      {"time_generation_s", m.time_generation_s},
      {"time_logprob_s", m.time_logprob_s},
      {"time_train_s", m.time_train_s},
      {"time_refit_s", m.time_refit_s},
      {"time_calibration_s", m.time_calibration_s},
      {"time_step_s", m.time_step_s},
      {"generation_tokens_per_s", m.generation_tokens_per_s},
  };
  for (const auto& [k, v] : fixed) j[k] = number(v);
  if (m.val_accuracy) j["val_accuracy"] = number(*m.val_accuracy);
  if (m.routing_agreement) j["routing_agreement"] = number(*m.routing_agreement);
  for (const auto& [k, v] : m.extra) {
    FP8RL_CHECK(!k.empty() && !j.contains(k), "metric '", k, "' is empty or logged twice in step ", m.step);
    j[k] = number(v);
  }
  return j.dump();
}

std::string metrics_console_line(const StepMetrics& m, int64_t total_steps) {
  std::string s = "step " + std::to_string(m.step) + "/" + std::to_string(total_steps);
  s += " | reward " + fmt("%.3f", m.reward_mean) + " acc " + fmt("%.3f", m.accuracy);
  s += " | len " + fmt("%.1f", m.response_length_mean);
  s += " | mult_err " + fmt("%.4f", m.token_mult_prob_error) + " gen_kl " + fmt("%.2e", m.gen_kl_error);
  if (m.routing_agreement) {
    double agreed = StepMetrics::kNone, differs = StepMetrics::kNone;
    for (const auto& [k, v] : m.extra) {
      if (k == "token_mult_prob_error_routing_agreed") agreed = v;
      if (k == "token_mult_prob_error_routing_differs") differs = v;
    }
    s += " route " + fmt("%.4f", *m.routing_agreement) + " (mult_err " + fmt("%.4f", agreed) + "/" +
         fmt("%.4f", differs) + ")";
  }
  s += " | loss " + fmt("%.4f", m.loss) + " clip " + fmt("%.3f", m.clip_fraction) + " gnorm " + fmt("%.3g", m.grad_norm);
  s += " | gen " + fmt("%.2fs", m.time_generation_s) + " train " + fmt("%.2fs", m.time_train_s) + " refit " +
       fmt("%.3fs", m.time_refit_s) + " tok/s " + fmt("%.0f", m.generation_tokens_per_s);
  if (m.val_accuracy) s += " | val_acc " + fmt("%.3f", *m.val_accuracy);
  return s;
}

std::string metrics_console_legend() {
  return "legend: reward/acc = mean reward / fraction correct; len = mean response tokens; mult_err = "
         "token_mult_prob_error (1 = engines agree); gen_kl = KL(generator||trainer); route (MoE) = fraction "
         "of (token, MoE layer) pairs the trainer routed to the generator's experts (mult_err over the tokens "
         "routed alike in every layer / the others); clip = clipped-ratio "
         "fraction; gnorm = gradient norm; gen/train/refit = phase seconds; tok/s = generated tokens per second "
         "(metrics.jsonl has every metric)";
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "-";
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%.1fs", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%dm%02ds", int(s) / 60, int(s) % 60);
  else std::snprintf(buf, sizeof buf, "%dh%02dm", int(s) / 3600, int(s) % 3600 / 60);
  return buf;
}

MetricsLog::MetricsLog(const std::string& dir, std::FILE* console_out)
    : path_(dir + "/metrics.jsonl"), console_(console_out) {
  file_ = std::fopen(path_.c_str(), "a");
  if (!file_) FP8RL_FAIL("cannot open '", path_, "' for appending: ", std::strerror(errno),
                         " (create the run directory first)");
}

MetricsLog::~MetricsLog() {
  if (file_) std::fclose(file_);
}

void MetricsLog::enable_tensorboard(const std::string& dir) { tb_ = std::make_unique<TensorBoardWriter>(dir); }

void MetricsLog::write(const StepMetrics& m, int64_t total_steps) {
  const std::string line = metrics_to_json_line(m) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    FP8RL_FAIL("cannot write '", path_, "': ", std::strerror(errno), " (disk full?)");
  if (tb_) {
    std::vector<std::pair<std::string, float>> scalars;
    const nlohmann::ordered_json j = nlohmann::ordered_json::parse(line);
    for (const auto& [k, v] : j.items())
      if (k != "step" && v.is_number()) scalars.push_back({k, v.get<float>()});
    tb_->write_scalars(m.step, scalars);
  }
  if (console_) {
    if (!legend_printed_) console_line(console_, "%s", metrics_console_legend().c_str());
    legend_printed_ = true;
    console_line(console_, "%s", metrics_console_line(m, total_steps).c_str());
  }
}

// ---- progress ------------------------------------------------------------------------------
namespace {
Progress* g_live = nullptr;        // the newest unfinished terminal bar
std::FILE* g_drawn_on = nullptr;   // where a bar line is on screen now (nullptr: none)
}  // namespace

void progress_clear_line() {
  if (!g_drawn_on) return;
  std::fputs("\r\033[K", g_drawn_on);
  std::fflush(g_drawn_on);
  g_drawn_on = nullptr;
}

void console_line(std::FILE* out, const char* fmt, ...) {
  progress_clear_line();
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(out, fmt, ap);
  va_end(ap);
  std::fputc('\n', out);
  std::fflush(out);
}

std::string Progress::format_tail(int64_t done, int64_t total, double elapsed) {
  std::string s = std::to_string(done) + "/" + std::to_string(total) + " " + format_duration(elapsed);
  if (done > 0 && total > done) s += " ETA " + format_duration(elapsed * double(total - done) / double(done));
  return s;
}

Progress::Progress(std::string label, int64_t total, std::FILE* out, int tty, double line_interval_s)
    : label_(std::move(label)), total_(total), out_(out), interval_s_(line_interval_s), start_s_(now_s()) {
  tty_ = tty < 0 ? (out_ && ::isatty(::fileno(out_)) == 1) : tty == 1;
  if (!tty_) last_s_ = start_s_;  // plain lines: the first after one interval, not at once
  if (tty_ && out_) {
    below_ = g_live;
    g_live = this;
  }
}

Progress::~Progress() { finish(); }

void Progress::update(int64_t done) {
  if (!out_ || finished_) return;
  done_ = done;
  if (tty_ && g_live != this) return;  // a newer bar is live: it owns the line
  const double t = now_s();
  const double min_gap = tty_ ? 0.1 : interval_s_;
  if (t - last_s_ < min_gap) return;
  last_s_ = t;
  draw(false);
}

void Progress::finish() {
  if (!out_ || finished_) return;
  finished_ = true;
  if (!tty_ || g_live == this) draw(true);
  if (g_live == this) g_live = below_;
}

void Progress::finish_quietly() {
  if (!out_ || finished_) return;
  finished_ = true;
  if (tty_ && g_drawn_on == out_ && g_live == this) progress_clear_line();
  if (g_live == this) g_live = below_;
}

void Progress::draw(bool final_line) {
  const std::string tail = format_tail(done_, total_, now_s() - start_s_);
  if (tty_) {
    constexpr int kWidth = 30;
    const double frac = total_ > 0 ? std::min(1.0, std::max(0.0, double(done_) / double(total_))) : 0.0;
    const int filled = static_cast<int>(frac * kWidth);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(kWidth - filled), '-');
    std::fprintf(out_, "\r%s [%s] %s\033[K%s", label_.c_str(), bar.c_str(), tail.c_str(), final_line ? "\n" : "");
    g_drawn_on = final_line ? nullptr : out_;
  } else {
    std::fprintf(out_, "%s: %s%s\n", label_.c_str(), tail.c_str(), final_line ? " done" : "");
  }
  std::fflush(out_);
}

}  // namespace fp8rl
