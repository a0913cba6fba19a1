// Stream-K's division of a GEMM among CTAs (the own FP8 GEMM, fp8_gemm_sm90.cu, Fp8GemmArgs::stream_k).
// Plain integer arithmetic, compiled for the host too: the CPU tests check the partition.
//
// The work is `units` = tiles x kblocks units, tile t's K block kb being unit t * kblocks + kb.
// CTA i of `ctas` takes units [begin(i), begin(i + 1)) with begin(i) = floor(i * units / ctas):
// every CTA gets floor or ceil(units / ctas) units, so a product whose tiles are not a multiple
// of the CTAs (decode M: 192 tiles of 128 x 128 on 132 SMs take two full waves as plain tiles)
// has no idle last wave. A CTA's range crosses tiles: a tile whose K blocks fall to several CTAs
// (its "pieces") is summed from their FP32 partials. Each CTA holds at most two pieces of cut
// tiles: its first (a range starting inside a tile) and its last (a range ending inside one); a
// range inside a single tile is one piece, its first. Piece slots: 2 i for CTA i's first, 2 i + 1
// for its last, so the partial workspace is 2 x ctas tiles whatever the shape.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FP8RL_SK_HD __host__ __device__ __forceinline__
#else
#define FP8RL_SK_HD inline
#endif

namespace fp8rl::cuda::stream_k {

// The first unit of CTA i (i == ctas: the end of the last range). units * ctas < 2^63.
FP8RL_SK_HD int64_t begin(int64_t units, int ctas, int i) { return units * i / ctas; }

// The CTA whose range holds unit u (0 <= u < units, ctas <= units): the largest i with
// begin(i) <= u, i.e. i * units / ctas < u + 1.
FP8RL_SK_HD int owner(int64_t units, int ctas, int64_t u) {
  return static_cast<int>(((u + 1) * ctas + units - 1) / units - 1);
}

// The pieces of tile t: CTAs first_cta .. last_cta (one CTA: the tile is not cut).
FP8RL_SK_HD int first_cta(int64_t units, int ctas, int kblocks, int64_t t) { return owner(units, ctas, t * kblocks); }
FP8RL_SK_HD int last_cta(int64_t units, int ctas, int kblocks, int64_t t) {
  return owner(units, ctas, (t + 1) * kblocks - 1);
}

// The workspace slot of CTA i's piece of tile t: 2 i when the piece is the first of CTA i's range
// (the range starts inside tile t), else 2 i + 1 (the range's last piece).
FP8RL_SK_HD int slot(int64_t units, int ctas, int kblocks, int i, int64_t t) {
  return begin(units, ctas, i) / kblocks == t ? 2 * i : 2 * i + 1;
}

// CTA i's tiles [tile_begin, tile_end) and, for tile t among them, its K blocks [kb0, kb0 + nk).
struct Range {
  int64_t u0, u1;  // the CTA's units
  int kblocks;
  FP8RL_SK_HD int64_t tile_begin() const { return u0 / kblocks; }
  FP8RL_SK_HD int64_t tile_end() const { return (u1 + kblocks - 1) / kblocks; }
  FP8RL_SK_HD int kb0(int64_t t) const { return static_cast<int>((u0 > t * kblocks ? u0 : t * kblocks) - t * kblocks); }
  FP8RL_SK_HD int nk(int64_t t) const {
    const int64_t lo = u0 > t * kblocks ? u0 : t * kblocks, hi = u1 < (t + 1) * kblocks ? u1 : (t + 1) * kblocks;
    return static_cast<int>(hi - lo);
  }
};
FP8RL_SK_HD Range range(int64_t units, int ctas, int kblocks, int i) {
  return Range{begin(units, ctas, i), begin(units, ctas, i + 1), kblocks};
}

}  // namespace fp8rl::cuda::stream_k
