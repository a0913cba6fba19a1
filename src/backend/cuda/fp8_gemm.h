// The own block-scaled FP8 GEMM for Hopper (fp8_gemm_sm90.cu): C[M, N] = alpha * A B^T + beta * C
// with A E4M3 [M, K] (1x128 scales along K) and B E4M3 [N, K] (128x128 scales, or 1x128 ones per
// row: b_scales_rows, the FP8 wgrad), FP32 accumulation promoted every 128 K, BF16 or F32 output.
// Any M; N and K multiples of 16.
// Deterministic, and row-invariant at a fixed split count (see the .cu file).
//
// The BF16 mode of the same kernel (ab = BF16 in the arguments): C[M, N] = alpha * A B^T + beta * C
// with A BF16 [M, K] and B BF16 [N, K], both K-major (row-major), no scales (they must be null),
// one FP32 accumulation over all of K (per split), BF16 or F32 output. Any M; N a multiple of 16,
// K of 8. Tiles of 64 or 128 rows (block_m; 0: 64 for M <= 256, else 128) by 128 columns (block_n
// 0 or 128); the same splits, grids, epilogues and grouped form, with the same determinism and
// row invariance.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace fp8rl::cuda {

class PinnedUploads;

struct Fp8GemmArgs {
  DType ab = DType::E4M3;  // the operands: E4M3 (block-scaled) or BF16 (a, b hold BF16; no scales)
  int64_t M = 0, N = 0, K = 0;
  const uint8_t* a = nullptr;       // [M, K]
  const float* a_scales = nullptr;  // [M][ceil(K/128)], or [ceil(K/128)][M] when a_scales_kb_major
  bool a_scales_kb_major = false;
  const uint8_t* b = nullptr;       // [N, K]
  const float* b_scales = nullptr;  // [ceil(N/128)][ceil(K/128)], or [ceil(K/128)][N] when b_scales_rows
  // Per-row B scales (E4M3, "1x128 B": the FP8 wgrad's X^T, quantized 1x128 along tokens): one
  // scale per row n of B and K block kb at b_scales[kb * N + n], K-block-major, so that a tile's 128
  // column scales at one K block are 512 contiguous bytes (b_scales 16-byte aligned). Promoted as
  // total += acc * (sa[row] * sb[col]) per 128-K block. Taken by the dense product's 128-row tiles
  // (two consumer warpgroups, the overlapped K loop, no cluster, direct stores) at any split count;
  // block_m and block_n must be 0 or 128 and stream_k false (the launcher refuses the others). The
  // environment's variant switches (FP8RL_FP8_GEMM_BM, _CLUSTER, _SCALES, _OCCUPANCY, _PIPE, _STORE,
  // _BN) do not apply to it; _GRID and _BAND do. Unmeasured on a GPU.
  bool b_scales_rows = false;
  void* c = nullptr;  // [M, N]
  DType c_dtype = DType::BF16;
  float alpha = 1.0f, beta = 0.0f;
  int splits = 1;              // K splits (fp8_gemm_sm90_config); > 1 needs the workspace
  int block_m = 0;             // rows per CTA: 64, 128 or 192 (0: 64 for M <= 256, else fp8_gemm_large_block_m())
  int block_n = 0;             // columns per 64-row tile: 64 or 128 (0: fp8_gemm_block_n()); same bits
  float* workspace = nullptr;  // fp8_gemm_sm90_workspace_floats(M, N, splits) floats
  // Stream-K (E4M3; block_m 0 (128, or 64 where M <= 64), 64 or 128; splits and block_n
  // ignored): the tiles' K blocks shared out evenly among the CTAs that fit at once, so that a
  // product of few tiles (decode M) has no idle last wave; a tile cut between CTAs is summed by
  // the last of them to finish, from the others' FP32 partials in K order. Deterministic at a
  // given CTA count (the SM count), but the cuts follow M: not row-invariant. Needs sk_partials
  // (fp8_gemm_sm90_stream_k_floats() floats) and sk_counters (fp8_gemm_sm90_stream_k_tiles(M, N)
  // ints, zero before the first call; every call leaves them zero, so a graph may replay it).
  bool stream_k = false;
  float* sk_partials = nullptr;
  int* sk_counters = nullptr;
};

bool fp8_gemm_sm90_supported(int64_t M, int64_t N, int64_t K, DType ab = DType::E4M3);
// The configuration for a shape: decode-sized products (M <= 256) take 64-row tiles and enough
// K splits for about two CTAs per SM; larger M, 128-row tiles (192: FP8RL_FP8_GEMM_BM) and splits
// only where the tiles leave most SMs idle. Measured on the H200 (docs/benchmarks.md, session 5:
// bench-gemm's sweep).
// BF16: the same rules over its K blocks of 64 elements and 128-column tiles (not tuned for it).
struct Fp8GemmConfig {
  int block_m = 128, splits = 1;
};
Fp8GemmConfig fp8_gemm_sm90_config(int64_t M, int64_t N, int64_t K, int sm_count, DType ab = DType::E4M3);
// The configuration of a product with per-row B scales (Fp8GemmArgs::b_scales_rows): 128-row
// tiles at any M, and splits by the rule of fp8_gemm_sm90_config's 128-row tiles.
Fp8GemmConfig fp8_gemm_sm90_b_rows_config(int64_t M, int64_t N, int64_t K, int sm_count);
// FP8RL_FP8_GEMM_BN (read at each call): the dense product's columns per tile beside 64-row tiles,
// 128 (the default) or 64 ("narrow tiles": twice the CTAs for the decode products whose 128-column
// tiles leave most SMs idle; without clusters, scales read from global memory). Each output
// element's arithmetic is the same in both (the m64n64 wgmma in place of the m64n128 one).
int fp8_gemm_block_n();
// FP8RL_FP8_GEMM_BM (read at each call): 128 (the default) or 192 rows per tile where 64-row tiles
// are not taken (192: three consumer warpgroups; the arithmetic of every element is the same).
int fp8_gemm_large_block_m();
// Whether this kernel beats cuBLASLt's block-scaled one at the shape (graph-timed decode
// products on the H200: the small-N ones, M <= 256 with few 64-row tiles; cuBLASLt above).
bool fp8_gemm_sm90_preferred(int64_t M, int64_t N, int64_t K);
int64_t fp8_gemm_sm90_workspace_floats(int64_t M, int64_t N, int splits);
// FP8RL_FP8_GEMM_STREAMK=1 (read at each call): the decode-sized products (M <= 256) that take
// this kernel run as stream-K (Fp8GemmArgs::stream_k). Off by default: measured slower than cuBLASLt (session 37).
bool fp8_gemm_sm90_stream_k();
// Stream-K's partial workspace (two 128 x 128 FP32 tiles per CTA that can run at once) and its
// tile counters for an M x N product.
int64_t fp8_gemm_sm90_stream_k_floats();
int64_t fp8_gemm_sm90_stream_k_tiles(int64_t M, int64_t N);
void fp8_gemm_sm90(const Fp8GemmArgs& args, cudaStream_t stream);

// The grouped product (mixture-of-experts layers): rows [offsets[g], offsets[g + 1]) of A and C
// belong to group g, whose B is b[g] [N, K] with scales b_scales[g]; one launch for all groups.
// Each row's result is bitwise that of fp8_gemm_sm90 at one split with its group's B (and the
// same block_m). BF16 mode (ab = BF16): a and b[g] hold BF16, a_scales null, b_scales empty,
// block_m 64 or 128 (0: 64 or 128).
//
// The tile table: the kernel's unit of work along M is a tile of block_m rows of one group, an
// int4 {group g, first row, end row of group g (offsets[g + 1]), 0}: it computes and stores rows
// [first, min(first + block_m, end)) with group g's B. The host form builds it from offsets
// (every group's rows from offsets[g] in steps of block_m, groups in order) and uploads it per
// call. The device form (device_tiles, device_tile_count, max_tiles; offsets empty) takes the
// caller's table on the device instead, so that an MoE block runs without the host knowing its
// groups' row counts (no device-to-host copy; CUDA-graph capturable). Its contract:
//  - device_tiles: max_tiles int4 entries, 16-byte aligned; the first *device_tile_count are
//    valid tiles as above (0 <= group < groups, 0 <= first < end <= rows), their row ranges
//    disjoint (each row stored by at most one tile); rows no tile covers are left as they were.
//    Entries past the count are never read, whatever they hold.
//  - device_tile_count: one int on the device, 0 <= count <= max_tiles (the kernel reads it at
//    its start and clamps it to [0, max_tiles]); written before the launch in stream order.
//  - max_tiles: the table's capacity, an upper bound of the count (ceil(R / block_m) + G bounds
//    the tiles of any split of R rows among G groups): the persistent grid is sized for it (at
//    most as many CTAs as fit); FP8RL_FP8_GEMM_GRID=tile launches max_tiles x column tiles CTAs,
//    those past the count's tiles doing nothing.
//  - rows: R, the rows of A (and of a_scales) and C; groups: G, the maps' count.
//  - block_m: the block_m the table was built for (64, 128 or 192; BF16 64 or 128), not 0.
//  - maps: required (the groups' B maps on the device, fp8_gemm_sm90_grouped_maps' bytes for
//    this ab, N and K); b, b_scales, device_meta and uploads are not used. Nothing is uploaded.
// The same table gives the host form's bits (the kernel's arithmetic does not depend on where
// the table came from, nor on the tiles' order). E4M3 runs the default variant's instances here
// (no cluster, global scales): FP8RL_FP8_GEMM_CLUSTER, _SCALES, _OCCUPANCY, _PIPE and _BAND do not
// apply to the device form (every variant gives the same bits); _STORE and _GRID do.
struct Fp8GroupedArgs {
  DType ab = DType::E4M3;  // E4M3 or BF16 (see above)
  int64_t N = 0, K = 0;
  std::vector<int64_t> offsets;     // G + 1 row offsets, from 0 (empty: the device tile table)
  const uint8_t* a = nullptr;       // [R, K], R = offsets.back()
  const float* a_scales = nullptr;  // [R][ceil(K/128)], or [ceil(K/128)][R] when a_scales_kb_major
  bool a_scales_kb_major = false;
  std::vector<const uint8_t*> b;       // G x [N, K]
  std::vector<const float*> b_scales;  // G x [ceil(N/128)][ceil(K/128)]
  void* c = nullptr;                   // [R, N]
  DType c_dtype = DType::BF16;
  float alpha = 1.0f, beta = 0.0f;
  int block_m = 0;              // 64, 128 or 192 (0: 64 or fp8_gemm_large_block_m(), from the mean rows per group)
  void* device_meta = nullptr;  // device scratch of fp8_gemm_sm90_grouped_meta_bytes bytes
  size_t device_meta_bytes = 0;
  // A device copy (64-byte aligned) of fp8_gemm_sm90_grouped_maps' bytes for these b and
  // b_scales, kept by the caller across calls: then only the tile table is uploaded (null: the
  // maps are encoded and uploaded with it, into device_meta).
  const void* maps = nullptr;
  PinnedUploads* uploads = nullptr;  // the table's upload (null: a pageable copy)
  // The device tile table (see above), in place of offsets.
  const int4* device_tiles = nullptr;      // [max_tiles] {group, first row, group's end row, 0}
  const int* device_tile_count = nullptr;  // device: the valid entries of device_tiles
  int64_t max_tiles = 0;                   // device_tiles' capacity
  int64_t rows = 0;                        // R
  int groups = 0;                          // G
};
size_t fp8_gemm_sm90_grouped_meta_bytes(int groups, int64_t rows, int block_m);
// The groups' B tensor maps and scale pointers as the kernel reads them: G CUtensorMaps, then G
// scale pointers (the bytes depend only on the pointers, N, K and ab, so a copy stays valid as
// long as the weights stay where they are). BF16: b_scales empty (null pointers are written).
std::vector<unsigned char> fp8_gemm_sm90_grouped_maps(const std::vector<const uint8_t*>& b,
                                                      const std::vector<const float*>& b_scales, int64_t N, int64_t K,
                                                      DType ab = DType::E4M3);
// The host form uploads its tile table (and the maps when args.maps is null): not for use inside
// a CUDA graph capture. The device form uploads nothing and reads nothing back: it may be
// captured.
void fp8_gemm_sm90_grouped(const Fp8GroupedArgs& args, cudaStream_t stream);

// The K-grouped product (the experts' weight gradients dW_g = dY_g^T X_g), BF16 mode only: A
// BF16 [M, K] and B BF16 [N, K], both K-major (the caller's transposes of dY and X, each group's
// run of tokens padded with zeros to a multiple of 64), group g's K range [k_offsets[g],
// k_offsets[g + 1]) (multiples of 64 elements). For every group with a non-empty range and a
// non-null c[g]: C_g [M, N] = alpha * A[:, range] B[:, range]^T + beta * C_g, C_g = c[g] (BF16 or
// F32, its own tensor). The other groups' outputs are left as they are, which is the product only
// where beta is 1 (checked). One launch: tiles of block_m rows by 128 columns, the groups' tiles
// in turn (n fastest), each tile over its group's K blocks alone, one FP32 accumulation per
// element (the BF16 mode's), direct stores (beta applied in FP32, then rounded once). M any, N a
// multiple of 16, K of 64.
// It uploads its group table into device_meta (through uploads where given): not for use inside
// a CUDA graph capture.
struct Fp8KGroupedArgs {
  int64_t M = 0, N = 0, K = 0;
  const void* a = nullptr;         // BF16 [M, K]
  const void* b = nullptr;         // BF16 [N, K]
  std::vector<int64_t> k_offsets;  // G + 1 element offsets into K, multiples of 64, from 0
  std::vector<void*> c;            // G outputs [M, N] (null: the group is skipped)
  DType c_dtype = DType::F32;
  float alpha = 1.0f, beta = 1.0f;
  int block_m = 128;            // rows per tile: 128 (one CTA per SM) or 64 (two); the same bits
  void* device_meta = nullptr;  // device scratch of fp8_gemm_sm90_kgrouped_meta_bytes(G) bytes
  size_t device_meta_bytes = 0;
  PinnedUploads* uploads = nullptr;
};
size_t fp8_gemm_sm90_kgrouped_meta_bytes(int groups);
void fp8_gemm_sm90_kgrouped(const Fp8KGroupedArgs& args, cudaStream_t stream);

}  // namespace fp8rl::cuda
