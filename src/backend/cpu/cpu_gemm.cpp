// CPU backend: the double GEMM C[M, N] = A[M, K] B[N, K]^T behind every linear layer.
//
// The math is the naive triple loop (c_ij = sum_k a_ik b_jk in double); only the order of the
// additions differs, so results agree with it to a few units of 2^-53 relative to sum |a b|,
// far below the one rounding into FP32/BF16 that follows. How it is made fast:
// - a register tile of kTileRows x kTileCols outputs, each accumulated in kLanes independent
//   partial sums along k (a 4-double vector), so the loop is throughput- not latency-bound and
//   each loaded row of A or B feeds several outputs;
// - cache blocks: kColBlock rows of B x kDepthBlock values of k stay in L2 while every row tile
//   of A passes over them (partial sums over depth blocks are added in a fixed order);
// - the rows of C split across the threads of cpu_parallel_for (each output computed by
//   one thread, in the same order for any thread count: results do not depend on it);
// - on x86-64 with AVX2 + FMA, the same kernel compiled for those instructions (chosen at
//   run time; multiply-adds may then be fused, which only makes each step more exact).
// The summation order is fixed by (kLanes, kDepthBlock): results are deterministic.
#include <algorithm>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_parallel.h"

namespace fp8rl::cpu {
namespace {

constexpr int kLanes = 4, kTileRows = 2, kTileCols = 4;
constexpr int64_t kColBlock = 64, kDepthBlock = 256;

using Vec = double __attribute__((vector_size(kLanes * sizeof(double))));
// The same vector at a double's alignment, for loads from any double in a row.
typedef Vec VecU __attribute__((aligned(alignof(double)), may_alias));

// (By reference: a 32-byte vector passed by value would change the ABI of non-AVX code.)
// A plain unaligned vector load (the same instruction a 32-byte memcpy compiles to): under
// AddressSanitizer a memcpy here stays a call to its checked memcpy, at every load of the GEMM's
// inner loop (half of a sanitized test's time in it); a load is checked inline, at its first and
// last byte.
[[gnu::always_inline]] inline void load_vec(Vec& v, const double* p) { v = *reinterpret_cast<const VecU*>(p); }

// c[r][j] += sum_{k < K} a[r][k] b[j][k] for R rows of A and C columns (rows of B).
template <int R, int C>
[[gnu::always_inline]] inline void tile_kernel(const double* const* a, const double* const* b, int64_t K,
                                               double* c, int64_t ldc) {
  Vec acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) acc[r][j] = Vec{};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    // Fully unrolled, so that the accumulators live in registers.
    Vec va[R], vb[C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) load_vec(va[r], a[r] + k);
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) load_vec(vb[j], b[j] + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[r][j] += va[r] * vb[j];
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) {
      double s = (acc[r][j][0] + acc[r][j][1]) + (acc[r][j][2] + acc[r][j][3]);
      for (int64_t kk = k; kk < K; ++kk) s += a[r][kk] * b[j][kk];
      c[r * ldc + j] += s;
    }
  }
}

// Rows [i0, i1) of C += A B^T over depth [k0, k0 + kd) and columns [j0, j1).
template <int R>
[[gnu::always_inline]] inline void row_tile(const double* A, const double* B, double* Cm, int64_t N, int64_t K,
                                            int64_t i, int64_t j0, int64_t j1, int64_t k0, int64_t kd) {
  const double* a[R];
  for (int r = 0; r < R; ++r) a[r] = A + (i + r) * K + k0;
  int64_t j = j0;
  for (; j + kTileCols <= j1; j += kTileCols) {
    const double* b[kTileCols];
    for (int q = 0; q < kTileCols; ++q) b[q] = B + (j + q) * K + k0;
    tile_kernel<R, kTileCols>(a, b, kd, Cm + i * N + j, N);
  }
  for (; j < j1; ++j) {
    const double* b[1] = {B + j * K + k0};
    tile_kernel<R, 1>(a, b, kd, Cm + i * N + j, N);
  }
}

[[gnu::always_inline]] inline void gemm_rows_body(const double* A, const double* B, double* Cm, int64_t i0,
                                                  int64_t i1, int64_t N, int64_t K) {
  for (int64_t j0 = 0; j0 < N; j0 += kColBlock) {
    const int64_t j1 = std::min(N, j0 + kColBlock);
    for (int64_t k0 = 0; k0 < K; k0 += kDepthBlock) {
      const int64_t kd = std::min(K - k0, kDepthBlock);
      int64_t i = i0;
      for (; i + kTileRows <= i1; i += kTileRows) row_tile<kTileRows>(A, B, Cm, N, K, i, j0, j1, k0, kd);
      for (; i < i1; ++i) row_tile<1>(A, B, Cm, N, K, i, j0, j1, k0, kd);
    }
  }
}

void gemm_rows_generic(const double* A, const double* B, double* Cm, int64_t i0, int64_t i1, int64_t N, int64_t K) {
  gemm_rows_body(A, B, Cm, i0, i1, N, K);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
[[gnu::target("avx2,fma")]] void gemm_rows_avx2(const double* A, const double* B, double* Cm, int64_t i0,
                                                 int64_t i1, int64_t N, int64_t K) {
  gemm_rows_body(A, B, Cm, i0, i1, N, K);
}
bool have_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

}  // namespace

std::vector<double> matmul_nt(const std::vector<double>& a, const std::vector<double>& b, int64_t M, int64_t N,
                              int64_t K) {
  std::vector<double> c(M * N, 0.0);
  if (M == 0 || N == 0 || K == 0) return c;
  auto rows = gemm_rows_generic;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (have_avx2_fma()) rows = gemm_rows_avx2;
#endif
  // Chunks of whole row tiles, so that the tiling (and the summation order) is the same for
  // any number of threads.
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  cpu_parallel_for(tiles, M * N * K, [&](int64_t t0, int64_t t1) {
    rows(a.data(), b.data(), c.data(), t0 * kTileRows, std::min(M, t1 * kTileRows), N, K);
  });
  return c;
}

}  // namespace fp8rl::cpu
