// Backend::record on the GPU: a recorded op sequence replays with the contents its input
// buffers hold at replay time, bit for bit like running the ops directly, and a replay's data
// errors surface at the next synchronizing call.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"

namespace fp8rl {
namespace {

Tensor random_host(const Shape& shape, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(shape_numel(shape));
  for (float& x : v) x = nd(gen);
  return from_float_vector(v, shape, DType::F32);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

TEST(CudaGraph, ReplayEqualsDirectRunOnNewInputs) {
  auto be = make_cuda_backend(0);
  const int64_t M = 40, K = 256, N = 384;
  for (LinearMode mode : {LinearMode::BF16, LinearMode::FP8_BLOCK}) {
    LinearWeight Wg, Wu;
    Wg.w = be->to_device(random_host({N, K}, 1));
    Wu.w = be->to_device(random_host({N, K}, 2));
    const LinearSpec spec{mode, false};
    Tensor x = be->alloc({M, K}, DType::F32);    // the graph's input buffer
    Tensor out = be->alloc({M, N}, DType::F32);  // its output buffer
    auto ops = [&] {
      Tensor gate = be->alloc({M, N}, DType::F32), up = be->alloc({M, N}, DType::F32);  // released inside
      be->linear(x, Wg, spec, gate);
      be->linear(x, Wu, spec, up);
      be->swiglu(gate, up, out);
    };
    Tensor x0 = random_host({M, K}, 7);
    be->copy(x0, x);
    ops();  // the unrecorded warm-up the contract asks for
    auto graph = be->record(ops);
    if (!graph) GTEST_SKIP() << "this build records no graphs (FP8RL_CUDA_GRAPHS=0 or plain allocation)";
    for (uint32_t seed : {11u, 12u, 13u}) {
      Tensor xi = random_host({M, K}, seed);
      be->copy(xi, x);
      graph->replay();
      Tensor replayed = be->to_host(out);
      ops();
      Tensor direct = be->to_host(out);
      EXPECT_TRUE(same_bits(replayed, direct)) << "mode " << static_cast<int>(mode) << " seed " << seed;
      bool nonzero = false;
      for (int64_t i = 0; i < replayed.numel(); ++i) nonzero |= replayed.data<float>()[i] != 0.0f;
      EXPECT_TRUE(nonzero);
    }
  }
}

TEST(CudaGraph, ReplayDataErrorSurfacesAtNextSync) {
  auto be = make_cuda_backend(0);
  const int64_t M = 8, K = 128, N = 128;
  LinearWeight W;
  W.w = be->to_device(random_host({N, K}, 3));
  const LinearSpec spec{LinearMode::FP8_BLOCK, false};
  Tensor x = be->alloc({M, K}, DType::F32), out = be->alloc({M, N}, DType::F32);
  auto ops = [&] { be->linear(x, W, spec, out); };
  Tensor xh = random_host({M, K}, 4);
  be->copy(xh, x);
  ops();
  auto graph = be->record(ops);
  if (!graph) GTEST_SKIP() << "this build records no graphs";
  graph->replay();
  EXPECT_NO_THROW(be->synchronize());
  xh.data<float>()[5] = NAN;
  be->copy(xh, x);
  graph->replay();
  try {
    be->synchronize();
    ADD_FAILURE() << "a NaN fed to an FP8 linear inside a replay was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA-graph replay"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(be->synchronize());  // reported once
}

TEST(CudaGraph, SynchronizingCallInsideRecordingFails) {
  auto be = make_cuda_backend(0);
  Tensor x = be->to_device(random_host({16}, 5));
  auto graph_or_throw = [&] { return be->record([&] { (void)be->sum_squares(x); }); };
  std::unique_ptr<OpGraph> probe = be->record([] {});
  if (!probe) GTEST_SKIP() << "this build records no graphs";
  EXPECT_THROW(graph_or_throw(), Error);
  EXPECT_GT(be->sum_squares(x), 0.0);  // the backend still works afterwards
}

}  // namespace
}  // namespace fp8rl
