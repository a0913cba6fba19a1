// Host emulation shim for the flash attention kernels (see run.sh): 128 std::threads per block,
// barriers for __syncthreads and warp exchanges, mma.sync m16n8k16 from the PTX fragment layouts.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>
#include <vector>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
struct EmuDim3 { int x = 0, y = 0, z = 0; };
inline thread_local EmuDim3 threadIdx, blockIdx;
inline EmuDim3 blockDim{128, 1, 1}, gridDim;
struct bf16 { uint16_t x; };
struct uint4 { uint32_t x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline uint16_t bf16_bits_from_float(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_bits_to_float(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }
inline void emu_check_align(const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16) { std::fprintf(stderr, "misaligned 16-byte access %p\n", p); std::abort(); }
}
// cp.async (16 bytes): read at issue, landing in shared memory only when a wait retires their
// group, so a read of a buffer before its wait sees the stale (poisoned) bytes. Per emulated
// thread; emu_cp_async_idle() says that every copy was retired.
struct EmuCopy {
  unsigned char* dst;
  unsigned char data[16];
};
inline thread_local std::vector<EmuCopy> t_emu_open;
inline thread_local std::deque<std::vector<EmuCopy>> t_emu_groups;
inline void emu_cp_async16(void* dst, const void* src, bool valid) {  // !valid: zero fill
  EmuCopy e;
  e.dst = static_cast<unsigned char*>(dst);
  std::memset(e.data, 0, 16);
  if (valid) std::memcpy(e.data, src, 16);
  t_emu_open.push_back(e);
}
inline void emu_cp_async_commit() {
  t_emu_groups.push_back(std::move(t_emu_open));
  t_emu_open.clear();
}
template <int N>  // until at most N groups are pending
inline void emu_cp_async_wait() {
  while (t_emu_groups.size() > size_t(N)) {
    for (const EmuCopy& e : t_emu_groups.front()) std::memcpy(e.dst, e.data, 16);
    t_emu_groups.pop_front();
  }
}
inline bool emu_cp_async_idle() { return t_emu_open.empty() && t_emu_groups.empty(); }
struct EmuWarp {
  std::barrier<> bar{32};
  float f[32];
  uint32_t a[32][4], b[32][2];
  const bf16* p[32];
};
inline thread_local EmuWarp* tw;
inline thread_local int tlane;
inline std::barrier<>* g_block_bar;
inline unsigned char* g_smem;
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
  tw->f[tlane] = v;
  tw->bar.arrive_and_wait();
  float r = tw->f[tlane ^ o];
  tw->bar.arrive_and_wait();
  return r;
}
inline void __syncwarp() { tw->bar.arrive_and_wait(); }
inline int __ffs(int x) { return x ? __builtin_ctz(static_cast<unsigned>(x)) + 1 : 0; }
// Pinned FP32 operations (no contraction on the host: x86-64 without -mfma has none).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
// The E4M3 pair decode (fp8_rule.h) and the 8-element BF16 row moves (common.cuh), for the decode
// kernel: E4M3 by its definition (bias 7, subnormals at 2^-9, 0x7f / 0xff NaN), BF16 by nearest even.
inline float emu_e4m3(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  float v = (c & 0x7f) == 0x7f ? NAN : e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (c & 0x80) ? -v : v;
}
inline float2 fp8_e4m3x2_to_float2(uint32_t two) { return {emu_e4m3(two & 0xff), emu_e4m3((two >> 8) & 0xff)}; }
// The E4M3 codec for the emulations' pools and references: decode as above; encode saturating,
// round to nearest even (the __NV_SATFINITE conversion), NaN to 0x7f, by search over the codes.
inline float e4m3_dec(uint8_t b) { return emu_e4m3(b); }
inline uint8_t e4m3_enc(float x) {
  if (std::isnan(x)) return 0x7f;
  const float a = std::min(std::fabs(x), 448.0f);
  int best = 0;
  for (int c = 1; c < 127; ++c) {
    const float d = std::fabs(e4m3_dec(uint8_t(c)) - a), db = std::fabs(e4m3_dec(uint8_t(best)) - a);
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return uint8_t(best | (x < 0 ? 0x80 : 0));
}
struct uint2 { uint32_t x, y; };
inline void load8(const bf16* p, float v[8]) {
  emu_check_align(p);
  for (int i = 0; i < 8; ++i) v[i] = bf16_bits_to_float(p[i].x);
}
inline void store8(bf16* p, const float v[8]) {
  emu_check_align(p);
  for (int i = 0; i < 8; ++i) p[i].x = bf16_bits_from_float(v[i]);
}
// cvt.rn.bf16x2.f32 (flash_attention.cu's PTX helpers): round to nearest even, as
// bf16_bits_from_float for every non-NaN value.
inline uint32_t pack_bf16(float lo, float hi) {
  return static_cast<uint32_t>(bf16_bits_from_float(lo)) | (static_cast<uint32_t>(bf16_bits_from_float(hi)) << 16);
}
inline void store8_finite(bf16* p, const float v[8]) {
  for (int i = 0; i < 8; ++i)
    if (std::isnan(v[i])) std::abort();  // the kernel's callers store finite values only
  store8(p, v);
}
inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
inline float half_of(uint32_t r, int h) { return bf16_bits_to_float(static_cast<uint16_t>(h ? r >> 16 : r & 0xffff)); }
inline float f16_to_float(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return float(x);
}
// The shims of common.cuh's E4M3 pair conversion and byte permutation (the paged and MLA decode
// kernels'): E4M3 codes to exact FP16 bits; byte i of the result = byte (sel >> 4 i) & 7 of b:a.
inline uint32_t e4m3x2_lo_f16x2(uint32_t w) {
  auto bits = [](float x) {
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return uint32_t(b);
  };
  return bits(e4m3_dec(uint8_t(w))) | (bits(e4m3_dec(uint8_t(w >> 8))) << 16);
}
inline uint32_t e4m3x2_hi_f16x2(uint32_t w) { return e4m3x2_lo_f16x2(w >> 16); }
inline uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t v = uint64_t(a) | (uint64_t(b) << 32);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
// mma.sync m16n8k16 from the PTX fragment layouts, FP16 (F16) or BF16 inputs, FP32 accumulator:
// the warp's fragments exchanged through tw, each output's 16 products summed in double and
// rounded once (the emulation checks layouts and indexing, not the tensor cores' order). The
// shims of every emulated kernel (flash, paged, MLA) call it.
template <bool F16>
inline void emu_mma16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto dec = [](uint32_t r, int h) {
    const uint16_t x = uint16_t(h ? r >> 16 : r & 0xffff);
    return F16 ? f16_to_float(x) : bf16_bits_to_float(x);
  };
  for (int i = 0; i < 4; ++i) tw->a[tlane][i] = a[i];
  tw->b[tlane][0] = b0, tw->b[tlane][1] = b1;
  tw->bar.arrive_and_wait();
  const int g = tlane >> 2, c = tlane & 3;
  float r[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * c + (i & 1);
    double s = d[i];
    for (int k = 0; k < 16; ++k) {
      const int al = (row % 8) * 4 + (k % 8) / 2, ar = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      const int bl = col * 4 + (k % 8) / 2, br = k >= 8 ? 1 : 0;
      s += double(dec(tw->a[al][ar], k & 1)) * dec(tw->b[bl][br], k & 1);
    }
    r[i] = static_cast<float>(s);
  }
  tw->bar.arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = r[i];
}
inline void emu_mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) { emu_mma16<false>(d, a, b[0], b[1]); }
inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) { emu_mma(d, a, b); }
// ldmatrix.x4 (.trans): lane l addresses row l % 8 of matrix l / 8; r[j] = (row g, columns 2c, 2c+1)
// of matrix j, or with trans (rows 2c, 2c+1, column g).
inline void emu_ldsm(uint32_t (&r)[4], const bf16* p, bool trans) {
  emu_check_align(p);
  tw->p[tlane] = p;
  tw->bar.arrive_and_wait();
  const int g = tlane >> 2, c = tlane & 3;
  for (int j = 0; j < 4; ++j) {
    uint16_t lo, hi;
    if (!trans) lo = tw->p[8 * j + g][2 * c].x, hi = tw->p[8 * j + g][2 * c + 1].x;
    else lo = tw->p[8 * j + 2 * c][g].x, hi = tw->p[8 * j + 2 * c + 1][g].x;
    r[j] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  tw->bar.arrive_and_wait();
}
inline void ldsm_x4(uint32_t (&r)[4], const bf16* p) { emu_ldsm(r, p, false); }
inline void ldsm_x4_t(uint32_t (&r)[4], const bf16* p) { emu_ldsm(r, p, true); }
inline void cp_async16(void* dst, const void* src, bool valid) {
  emu_check_align(dst);
  if (valid) emu_check_align(src);
  if (valid) std::memcpy(dst, src, 16); else std::memset(dst, 0, 16);
}
inline void cp_async4(void* dst, const void* src, bool valid) {
  if (valid) std::memcpy(dst, src, 4); else std::memset(dst, 0, 4);
}
inline void cp_async_commit() {}
inline void cp_async_wait_all_but_newest() {}
inline void cp_async_wait_all() {}
// Runs body() for every block of grid (gx, gy) with `threads` threads (a multiple of 32).
inline void emu_launch(int gx, int gy, size_t smem_bytes, const std::function<void()>& body, int threads = 128) {
  std::vector<unsigned char> smem(smem_bytes + 16);
  unsigned char* base = smem.data();
  while (reinterpret_cast<uintptr_t>(base) % 16) ++base;
  g_smem = base;
  std::barrier<> bb(threads);
  g_block_bar = &bb;
  std::vector<EmuWarp> warps(threads / 32);
  std::vector<std::thread> th;
  gridDim = {gx, gy, 1};
  blockDim = {threads, 1, 1};
  for (int t = 0; t < threads; ++t)
    th.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      tw = &warps[t / 32];
      tlane = t % 32;
      for (int y = 0; y < gy; ++y)
        for (int x = 0; x < gx; ++x) {
          blockIdx = {x, y, 0};
          body();
          bb.arrive_and_wait();
        }
    });
  for (auto& t : th) t.join();
}
