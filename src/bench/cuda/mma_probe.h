// `fp8rl bench-gemm --mma-probe`: the wgmma throughput probe (src/bench/cuda/mma_probe.cu). Kernels
// that fill shared memory once and then only issue E4M3 wgmma (m64n128k32 / m64n256k32) in the
// patterns of our block-scaled FP8 GEMM (fp8_gemm_sm90.cu) and its alternatives: no TMA, no
// global loads, no epilogue in the timed loop. What each pattern reaches says how much of the
// tensor pipe the issue pattern itself leaves. The tma_* patterns feed the same MMAs through a
// TMA ring from L2-resident operands (still no epilogue): beside the shared-memory patterns they
// separate the operand delivery's ceiling from the issue pattern's. A plain C++ header: the CLI
// includes no CUDA header. Defined in the CUDA library, so only in builds with FP8RL_HAVE_CUDA.
#pragma once
#include <string>
#include <vector>

namespace fp8rl::cuda {

struct MmaProbeResult {
  std::string name;         // the pattern, e.g. ss_n128_wait0_promote
  double tflops = 0;        // dense FP8 TFLOP/s of the timed launch
  double ms = 0;            // the timed launch's milliseconds
  bool checked = false;     // whether the accumulators were compared with the host reference
  bool checked_ok = false;  // ... and matched it
  std::string note;         // occupancy, registers, spills, measured SM clock, % of peak, mismatches
};

struct MmaProbeReport {
  std::string device;  // the device's name
  int sms = 0;
  int clock_khz = 0;       // cudaDevAttrClockRate: the SM's peak (boost) clock
  double peak_tflops = 0;  // sms * clock * 8192 FLOP/clk/SM: sm_90's dense FP8 tensor rate
  int iters = 0;           // K blocks per warpgroup (CTA) per launch (rounded up to a multiple of 8)
  std::vector<MmaProbeResult> results;
};

// Runs every pattern once untimed and once timed, `iters` K blocks (128 K each) per warpgroup (per
// CTA in the tma_* patterns, whose warpgroups share each K block's tiles).
MmaProbeReport run_mma_probe(int device, int iters);

}  // namespace fp8rl::cuda
