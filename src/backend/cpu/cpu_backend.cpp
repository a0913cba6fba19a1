// Placeholder: the CPU reference backend lands with issue 2.
#include "backend/backend.h"
#include "core/error.h"

namespace fp8rl {
std::unique_ptr<Backend> make_cpu_backend() { FP8RL_FAIL("CPU backend not implemented yet"); }
}  // namespace fp8rl
