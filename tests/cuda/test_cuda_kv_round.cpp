// Backend::kv_round on CUDA equals the CPU reference bit for bit (F32 activations), and with BF16
// activations is the E4M3 round trip of each BF16 value, rounded to BF16.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "quant/quant.h"

namespace fp8rl {
namespace {

Tensor random_heads(int64_t T, int64_t H, int64_t hd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::vector<float> v(static_cast<size_t>(T * H * hd));
  for (size_t i = 0; i < v.size(); ++i) v[i] = nd(rng) * (i % 11 == 0 ? 30.0f : 1.0f);
  return from_float_vector(v, {T, H, hd}, DType::F32);
}

TEST(CudaKvRound, MatchesCpuBitwise) {
  std::unique_ptr<Backend> gpu = make_cuda_backend(0, DType::F32), cpu = make_cpu_backend();
  const std::vector<float> scales = {0.02f, 0.7f, 1.0f / 3.0f, 0.0045f, 1.0f, 3.5f, 0.11f, 0.013f};
  // hd 128: 8 elements per thread; hd 20: the scalar path.
  for (const auto& [hd, T] : std::vector<std::pair<int64_t, int64_t>>{{128, 1}, {128, 17}, {128, 1000}, {20, 33}}) {
    SCOPED_TRACE(T);
    SCOPED_TRACE(hd);
    const Tensor host = random_heads(T, 8, hd, static_cast<uint32_t>(T + hd));
    Tensor c = cpu->to_device(host), g = gpu->to_device(host);
    cpu->kv_round(c, scales);
    gpu->kv_round(g, scales);
    const Tensor hc = cpu->to_host(c), hg = gpu->to_host(g);
    ASSERT_EQ(std::memcmp(hc.raw(), hg.raw(), hc.nbytes()), 0) << "F32 kv_round differs from the CPU";
    // BF16 activations: the round trip of the BF16 value, rounded to BF16.
    Tensor gb = gpu->alloc({T, 8, hd}, DType::BF16);
    gpu->convert(gpu->to_device(host), gb);
    gpu->kv_round(gb, scales);
    const Tensor hb = gpu->to_host(gb);
    for (int64_t i = 0; i < host.numel(); ++i) {
      const float x = bf16_to_float(bf16_from_float(host.data<float>()[i]));
      const float s = scales[static_cast<size_t>((i / hd) % 8)];
      ASSERT_EQ(hb.data<uint16_t>()[i], bf16_from_float(e4m3_to_float(e4m3_from_float(x / s)) * s))
          << "BF16 element " << i;
    }
  }
}

}  // namespace
}  // namespace fp8rl
