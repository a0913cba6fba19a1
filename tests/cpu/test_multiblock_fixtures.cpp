// The FP8 exact path on multi-block shapes against an independent emulation
// (scripts/fixtures/fp8_emulation.py, written without fp8rl's code): tests/data/multiblock, made
// by scripts/fixtures/make_multiblock_fixtures.py --maker transformers (its docstring has the
// schema): Llama / Qwen2 / Qwen3 built and saved by transformers 5.24, "fp32" log-probs its own
// float32 forward, "fp8" / "fp8_pow2" the numpy emulation's. Hidden 256,
// q/k/v widths 144-160 and 40-48, MLP 192: every linear has K or N spanning 2-3 blocks of 128
// with a partial last block; BF16-stored weights, the case where x / s lands exactly on E4M3
// rounding midpoints and a one-ulp difference upstream of a quantizer shows.
//   - the quantizer, bit for bit: codes and scales of multi-block inputs (partial blocks, zero
//     blocks, ties, BF16-valued rows) for pow2 off and on;
//   - the CPU forward: mean |logprob diff| < 1e-3 for fp8 and fp8 with pow2 scales (measured
//     <= 1.5e-7), and FP32 < 1e-5 against transformers' float32 forward (measured <= 1.1e-6).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "quant/quant.h"
#include "test_model_util.h"

namespace fp8rl {
namespace {

// FP8RL_MULTIBLOCK_DIR points the tests at another set made by the script (e.g. --size full, by
// hand: too large to commit).
const std::string kDir = std::getenv("FP8RL_MULTIBLOCK_DIR") ? std::getenv("FP8RL_MULTIBLOCK_DIR")
                                                             : std::string(FP8RL_TEST_DATA) + "/multiblock";

nlohmann::json load_multiblock() {
  std::ifstream f(kDir + "/multiblock.json");
  if (!f) throw std::runtime_error(kDir + "/multiblock.json is missing");
  return nlohmann::json::parse(f);
}

std::vector<char> read_bytes(const std::string& rel) {
  std::ifstream f(kDir + "/" + rel, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + kDir + "/" + rel);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

TEST(MultiblockQuant, CodesAndScalesMatchEmulationBitForBit) {
  const nlohmann::json ref = load_multiblock();
  ASSERT_GE(ref["quant"].size(), 8u);
  for (const auto& [name, c] : ref["quant"].items()) {
    const int64_t R = c["rows"], C = c["cols"];
    const int br = c["block_rows"], bc = c["block_cols"];
    const bool pow2 = c["pow2"];
    const std::vector<char> xb = read_bytes(c["x"]), codes = read_bytes(c["codes"]),
                            scales = read_bytes(c["scales"]);
    ASSERT_EQ(xb.size(), size_t(R * C * 4)) << name;
    Tensor x = Tensor::empty({R, C}, DType::F32);
    std::memcpy(x.raw(), xb.data(), xb.size());
    QuantTensor q = quant_alloc(R, C, br, bc, pow2);
    quantize_blocks_into(x, false, q, name.c_str());
    ASSERT_EQ(codes.size(), size_t(q.data.numel())) << name;
    ASSERT_EQ(scales.size(), size_t(q.scales.numel() * 4)) << name;
    const uint8_t* got = q.data.data<uint8_t>();
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < R * C; ++i)
      if (got[i] != static_cast<uint8_t>(codes[i])) bad += 1, first = first < 0 ? i : first;
    EXPECT_EQ(bad, 0) << name << ": " << bad << " codes differ, first at [" << first / C << ", " << first % C
                      << "]: fp8rl 0x" << std::hex << int(first >= 0 ? got[first] : 0) << " emulation 0x"
                      << int(first >= 0 ? static_cast<uint8_t>(codes[first]) : 0);
    EXPECT_EQ(std::memcmp(q.scales.raw(), scales.data(), scales.size()), 0) << name << ": scales differ";
    if (br == 1) {  // the CPU backend's row-parallel activation quantizer gives the same bytes
      const QuantTensor q2 = quantize_1x128(x, pow2);
      EXPECT_EQ(std::memcmp(q2.data.raw(), q.data.raw(), codes.size()), 0) << name;
    } else {
      const QuantTensor q2 = quantize_128x128(x, pow2);
      EXPECT_EQ(std::memcmp(q2.data.raw(), q.data.raw(), codes.size()), 0) << name;
    }
  }
}

struct MbCase {
  const char* reference;  // "fp32" | "fp8" | "fp8_pow2"
  LinearMode mode;
  bool pow2;
  double max_mean_abs_diff;
};

class MultiblockLogprobs : public ::testing::TestWithParam<MbCase> {};

TEST_P(MultiblockLogprobs, CpuMatchesEmulation) {
  const MbCase& mc = GetParam();
  const nlohmann::json ref = load_multiblock();
  ASSERT_GE(ref["models"].size(), 3u);
  auto be = make_cpu_backend();
  for (const auto& [name, m] : ref["models"].items()) {
    const auto seqs = m["sequences"].get<std::vector<std::vector<int32_t>>>();
    const auto want = m["logprobs"][mc.reference].get<std::vector<std::vector<double>>>();
    ASSERT_EQ(want.size(), seqs.size());
    const ModelWeights host = model_weights_load(kDir + "/" + m["dir"].get<std::string>(), DType::F32);
    const ModelWeights w = model_weights_to_device(*be, host, DType::F32);
    EnginePrecision p;
    p.linear = mc.mode;
    p.pow2_scales = mc.pow2;
    double sum = 0.0, worst = 0.0;
    size_t n = 0;
    for (size_t s = 0; s < seqs.size(); ++s) {  // one sequence a forward, as `fp8rl logprobs`
      const ForwardBatch batch = forward_batch_from_sequences({seqs[s]});
      const std::vector<double> got = test::values_f64(*be, model_forward_logprobs(*be, w, p, batch, {}).logp);
      ASSERT_EQ(want[s].size() + 1, seqs[s].size());
      for (size_t t = 0; t + 1 < seqs[s].size(); ++t) {
        const double d = std::fabs(got[t] - want[s][t]);
        sum += d, worst = std::max(worst, d), ++n;
      }
    }
    const double mad = sum / n;
    EXPECT_LT(mad, mc.max_mean_abs_diff) << name << " " << mc.reference << ": worst " << worst;
    std::printf("  %-14s %-8s mean |diff| %.3e  worst %.3e  over %zu tokens\n", name.c_str(), mc.reference, mad,
                worst, n);
  }
}

INSTANTIATE_TEST_SUITE_P(Multiblock, MultiblockLogprobs,
                         ::testing::Values(MbCase{"fp32", LinearMode::FP32, false, 1e-5},
                                           MbCase{"fp8", LinearMode::FP8_BLOCK, false, 1e-3},
                                           MbCase{"fp8_pow2", LinearMode::FP8_BLOCK, true, 1e-3}),
                         [](const auto& info) { return std::string(info.param.reference); });

}  // namespace
}  // namespace fp8rl
