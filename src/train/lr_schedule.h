// Learning-rate schedule: linear warm-up, then constant or cosine decay.
// Steps count OPTIMIZER steps (a GRPO step with optimizer_steps_per_rollout = 4 advances 4).
#pragma once
#include <cstdint>
#include <string>

namespace fp8rl {

enum class LrScheduleKind { Constant, Cosine };
const char* lr_schedule_kind_name(LrScheduleKind k);
LrScheduleKind lr_schedule_kind_from_name(const std::string& s);  // "constant" | "cosine"

struct LrSchedule {
  double base_lr = 0.0;
  int64_t warmup_steps = 0;  // linear ramp over the first warmup_steps steps (0 = none)
  LrScheduleKind kind = LrScheduleKind::Constant;
  int64_t total_steps = 0;   // cosine only: the step at which the decay reaches min_lr_ratio
  double min_lr_ratio = 0.0; // cosine only: final lr = base_lr * min_lr_ratio
};

// Throws on a negative lr/warm-up, a cosine without total_steps > warmup_steps, or a
// min_lr_ratio outside [0, 1].
void lr_schedule_validate(const LrSchedule& s);

// The lr of optimizer step `step` (0-based):
//   warm-up   (step < W):  base * (step + 1) / W           (the first step is not wasted at 0)
//   constant  (step >= W): base
//   cosine    (step >= W): base * (m + (1 - m) * (1 + cos(pi * p)) / 2),
//             p = min(1, (step - W) / (T - W)), m = min_lr_ratio; stays at base * m after T.
double lr_schedule_at(const LrSchedule& s, int64_t step);

}  // namespace fp8rl
