#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "core/error.h"
#include "train/lr_schedule.h"

using namespace fp8rl;

TEST(LrSchedule, WarmupThenConstant) {
  LrSchedule s;
  s.base_lr = 1e-3;
  s.warmup_steps = 4;
  lr_schedule_validate(s);
  // (step + 1) / 4 of the peak during warm-up, then the peak.
  EXPECT_DOUBLE_EQ(lr_schedule_at(s, 0), 0.25e-3);
  EXPECT_DOUBLE_EQ(lr_schedule_at(s, 1), 0.50e-3);
  EXPECT_DOUBLE_EQ(lr_schedule_at(s, 3), 1.00e-3);
  EXPECT_DOUBLE_EQ(lr_schedule_at(s, 4), 1.00e-3);
  EXPECT_DOUBLE_EQ(lr_schedule_at(s, 1000), 1.00e-3);
}

TEST(LrSchedule, NoWarmup) {
  LrSchedule s;
  s.base_lr = 2e-5;
  EXPECT_DOUBLE_EQ(lr_schedule_at(s, 0), 2e-5);
}

TEST(LrSchedule, Cosine) {
  LrSchedule s;
  s.base_lr = 1.0;
  s.warmup_steps = 2;
  s.kind = LrScheduleKind::Cosine;
  s.total_steps = 12;  // decay over steps 2..12 (10 steps)
  s.min_lr_ratio = 0.1;
  lr_schedule_validate(s);
  EXPECT_DOUBLE_EQ(lr_schedule_at(s, 0), 0.5);
  EXPECT_DOUBLE_EQ(lr_schedule_at(s, 1), 1.0);
  EXPECT_DOUBLE_EQ(lr_schedule_at(s, 2), 1.0);  // start of the decay: the peak
  // Halfway (step 7): cos(pi/2) = 0 -> 0.1 + 0.9 * 0.5 = 0.55.
  EXPECT_NEAR(lr_schedule_at(s, 7), 0.55, 1e-15);
  // Step 4: p = 0.2 -> 0.1 + 0.9 * (1 + cos(0.2 pi)) / 2, cos(0.2 pi) = 0.80901699437...
  EXPECT_NEAR(lr_schedule_at(s, 4), 0.1 + 0.9 * (1 + 0.8090169943749474) / 2, 1e-15);
  EXPECT_NEAR(lr_schedule_at(s, 12), 0.1, 1e-15);
  EXPECT_NEAR(lr_schedule_at(s, 500), 0.1, 1e-15);  // stays at the floor
  // Monotone non-increasing after warm-up.
  for (int i = 2; i < 14; ++i) EXPECT_LE(lr_schedule_at(s, i + 1), lr_schedule_at(s, i));
}

TEST(LrSchedule, RejectsBadInput) {
  LrSchedule s;
  s.base_lr = 1.0;
  s.kind = LrScheduleKind::Cosine;
  s.warmup_steps = 10;
  s.total_steps = 10;
  EXPECT_THROW(lr_schedule_validate(s), Error);  // no room for the decay
  s.total_steps = 20;
  s.min_lr_ratio = 1.5;
  EXPECT_THROW(lr_schedule_validate(s), Error);
  s.min_lr_ratio = 0;
  s.base_lr = -1;
  EXPECT_THROW(lr_schedule_validate(s), Error);
  EXPECT_THROW(lr_schedule_at(s, -1), Error);
  EXPECT_THROW(lr_schedule_kind_from_name("linear"), Error);
  EXPECT_EQ(lr_schedule_kind_from_name("cosine"), LrScheduleKind::Cosine);
}
