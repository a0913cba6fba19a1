// Placeholder until the CUDA backend lands (issue 5): keeps the build graph complete.
#include "backend/backend.h"
#include "core/error.h"

namespace fp8rl {
std::unique_ptr<Backend> make_cuda_backend(int) {
  FP8RL_FAIL("the CUDA backend is not implemented yet; use --device cpu");
}
}  // namespace fp8rl
