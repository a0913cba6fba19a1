#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace fp8rl {

const char* lr_schedule_kind_name(LrScheduleKind k) {
  return k == LrScheduleKind::Cosine ? "cosine" : "constant";
}

LrScheduleKind lr_schedule_kind_from_name(const std::string& s) {
  if (s == "constant") return LrScheduleKind::Constant;
  if (s == "cosine") return LrScheduleKind::Cosine;
  FP8RL_FAIL("unknown lr schedule '", s, "' (expected constant or cosine)");
}

void lr_schedule_validate(const LrSchedule& s) {
  FP8RL_CHECK(std::isfinite(s.base_lr) && s.base_lr >= 0, "learning rate must be finite and >= 0, got ", s.base_lr);
  FP8RL_CHECK(s.warmup_steps >= 0, "warmup_steps must be >= 0, got ", s.warmup_steps);
  if (s.kind == LrScheduleKind::Cosine) {
    FP8RL_CHECK(s.total_steps > s.warmup_steps, "cosine schedule needs total_steps (", s.total_steps,
                ") > warmup_steps (", s.warmup_steps, "): lower the warm-up or raise the step count");
    FP8RL_CHECK(s.min_lr_ratio >= 0 && s.min_lr_ratio <= 1, "min_lr_ratio must be in [0, 1], got ", s.min_lr_ratio);
  }
}

double lr_schedule_at(const LrSchedule& s, int64_t step) {
  FP8RL_CHECK(step >= 0, "lr_schedule_at: negative step ", step);
  if (step < s.warmup_steps)
    return s.base_lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  if (s.kind == LrScheduleKind::Constant) return s.base_lr;
  const double span = static_cast<double>(s.total_steps - s.warmup_steps);
  const double p = span > 0 ? std::min(1.0, static_cast<double>(step - s.warmup_steps) / span) : 1.0;
  const double m = s.min_lr_ratio;
  return s.base_lr * (m + (1.0 - m) * 0.5 * (1.0 + std::cos(std::numbers::pi * p)));
}

}  // namespace fp8rl
