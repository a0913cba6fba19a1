// Driver of the MLA latent decode host emulation (run.sh): random latent caches on scattered
// pages, mla_decode_kernel run through emu.h and the shims below, compared with a
// double-precision reference of launch_attention_paged's semantics (one 576-wide row per
// position shared by all heads, V its first 512 values, E4M3 value = code * k_scale).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "emu.h"
#define __align__(n) alignas(n)
#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif

// ---- shims of the kernel's device primitives ----
inline unsigned char* mla_dyn_smem() { return g_smem; }
// cp.async (emu.h's), with the kernel's 16-byte alignment checked.
inline void mla_cp_async16(void* dst, const void* src, bool valid) {
  emu_check_align(dst);
  if (valid) emu_check_align(src);
  emu_cp_async16(dst, src, valid);
}
inline void mla_cp_async_commit() { emu_cp_async_commit(); }
inline void mla_cp_async_wait_all() { emu_cp_async_wait<0>(); }
// ldmatrix must address shared memory (the dynamic buffer).
inline size_t g_smem_bytes = 0;
inline void check_smem(const void* p, size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  if (b < g_smem || b + n > g_smem + g_smem_bytes) {
    std::fprintf(stderr, "shared-memory access outside the dynamic buffer\n");
    std::abort();
  }
}
inline void mla_ldsm_x4(uint32_t (&r)[4], const void* p) {
  check_smem(p, 16);
  emu_ldsm(r, static_cast<const bf16*>(p), false);
}
inline void mla_ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  check_smem(p, 16);
  emu_ldsm(r, static_cast<const bf16*>(p), true);
}
inline uint4 mla_lds16(const void* p) {
  emu_check_align(p);
  check_smem(p, 16);
  uint4 u;
  std::memcpy(&u, p, 16);
  return u;
}
inline uint4 mla_ldg16(const void* p) {
  emu_check_align(p);
  uint4 u;
  std::memcpy(&u, p, 16);
  return u;
}
inline void mla_stg16(void* p, uint4 v) {
  emu_check_align(p);
  std::memcpy(p, &v, 16);
}
inline uint16_t f16_bits(float x) {
  const _Float16 h = static_cast<_Float16>(x);  // round to nearest even
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
// mma.sync m16n8k16: emu.h's.
template <bool F16>
inline void mla_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu_mma16<F16>(d, a, b0, b1);
}
template <bool F16>
inline uint32_t mla_pack2(float lo, float hi) {
  if constexpr (F16) return uint32_t(f16_bits(lo)) | (uint32_t(f16_bits(hi)) << 16);
  else return pack_bf16(lo, hi);
}
#include "kern.inc"

using namespace emu;

struct Case {
  const char* name;
  int H, ps;
  bool e4m3, lse;
  std::vector<int> lens;                    // sequence lengths (cache filled up to them)
  std::vector<std::pair<int, int>> tokens;  // (sequence, position) of each query token
  float kramp = 0.0f;  // row j scaled by 1 + kramp j / 100: scores rise with the position (the max moves)
};

int run(const Case& c, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int B = int(c.lens.size()), H = c.H, ps = c.ps;
  int max_pages = 0, npages = 0;
  for (int L : c.lens) max_pages = std::max(max_pages, (L + ps - 1) / ps), npages += (L + ps - 1) / ps;
  npages += 3;  // unused pages among them
  std::vector<int> perm(npages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), gen);
  std::vector<int32_t> table(size_t(B) * max_pages, -1);  // -1: never read
  for (int b = 0, n = 0; b < B; ++b)
    for (int p = 0; p < (c.lens[b] + ps - 1) / ps; ++p) table[size_t(b) * max_pages + p] = perm[n++];
  // The pool (every slot written; slots past a sequence's length hold values too, never read).
  const int64_t slots = int64_t(npages) * ps;
  std::vector<float> x(size_t(slots) * kMlaRow);
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < c.lens[b]; ++j) {
      const int64_t sl = int64_t(table[size_t(b) * max_pages + j / ps]) * ps + j % ps;
      for (int d = 0; d < kMlaRow; ++d) x[sl * kMlaRow + d] = nd(gen) * (1.0f + c.kramp * j / 100.0f);
    }
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  std::vector<float> ks(1, amax / 448.0f);
  std::vector<uint16_t> pool_b(c.e4m3 ? 0 : x.size());
  std::vector<uint8_t> pool_e(c.e4m3 ? x.size() : 0);
  std::vector<double> val(x.size());  // the values the cache hands out
  for (size_t i = 0; i < x.size(); ++i) {
    if (c.e4m3) {
      pool_e[i] = e4m3_enc(x[i] / ks[0]);
      val[i] = double(e4m3_dec(pool_e[i])) * ks[0];
    } else {
      pool_b[i] = bf16_bits_from_float(x[i]);
      val[i] = bf16_bits_to_float(pool_b[i]);
    }
  }
  // q: BF16, head h's row scaled by 2^(h % 5 - 2) (the per-head FP16 scaling of the E4M3 path).
  const int64_t T = int64_t(c.tokens.size());
  std::vector<int32_t> seq(T), pos(T);
  for (int64_t t = 0; t < T; ++t) seq[t] = c.tokens[t].first, pos[t] = c.tokens[t].second;
  std::vector<uint16_t> q(size_t(T) * H * kMlaRow);
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < kMlaRow; ++d)
        q[(size_t(t) * H + h) * kMlaRow + d] = bf16_bits_from_float(std::ldexp(nd(gen), h % 5 - 2));
  const float scale = 1.0f / std::sqrt(192.0f);  // DeepSeek-V3's 1 / sqrt(qk_nope + qk_rope)
  // Reference (double).
  std::vector<double> ref(size_t(T) * H * kMlaV, 0.0), ref_lse(size_t(T) * H, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      const uint16_t* qr = q.data() + (size_t(t) * H + h) * kMlaRow;
      const int n = pos[t] + 1;
      std::vector<double> p(n);
      double m = -1e300;
      auto row = [&](int j) { return (int64_t(table[size_t(seq[t]) * max_pages + j / ps]) * ps + j % ps) * kMlaRow; };
      for (int j = 0; j < n; ++j) {
        double s = 0;
        for (int d = 0; d < kMlaRow; ++d) s += double(bf16_bits_to_float(qr[d])) * val[row(j) + d];
        p[j] = s * scale;
        m = std::max(m, p[j]);
      }
      double l = 0;
      for (double& v : p) l += (v = std::exp(v - m));
      for (int j = 0; j < n; ++j)
        for (int d = 0; d < kMlaV; ++d) ref[(size_t(t) * H + h) * kMlaV + d] += p[j] / l * val[row(j) + d];
      ref_lse[size_t(h) * T + t] = m + std::log(l);
    }
  // Kernel.
  std::vector<uint16_t> out(size_t(T) * H * kMlaV, 0x7fc0);  // NaN: every element must be written
  std::vector<float> lse(size_t(T) * H, NAN);
  MlaArgs a;
  a.q = q.data();
  a.token_seq = seq.data();
  a.token_pos = pos.data();
  a.page_table = table.data();
  a.pool = c.e4m3 ? static_cast<const void*>(pool_e.data()) : static_cast<const void*>(pool_b.data());
  a.k_scale = c.e4m3 ? ks.data() : nullptr;
  a.out = out.data();
  a.lse = c.lse ? lse.data() : nullptr;
  a.T = T;
  a.H = H;
  a.max_pages = max_pages;
  a.page_size = ps;
  a.scale_log2 = scale * 1.4426950408889634f;
  const int smem = c.e4m3 ? MlaCfg<uint8_t>::kSmemBytes : MlaCfg<bf16>::kSmemBytes;
  g_smem_bytes = size_t(smem);
  const int blocks = int(T * ((H + kMlaHeads - 1) / kMlaHeads));
  emu_launch(
      blocks, 1, size_t(smem),
      [&] {
        if (threadIdx.x == 0) std::memset(g_smem, 0xff, size_t(smem));  // poison: NaN in BF16, FP16 and E4M3
        __syncthreads();
        if (c.e4m3) mla_decode_kernel<uint8_t>(a);
        else mla_decode_kernel<bf16>(a);
        if (!emu_cp_async_idle()) std::abort();  // every copy retired
        __syncthreads();
      },
      kMlaThreads);
  // Errors: out as max |out - ref| / max |ref| per case (and the largest per (token, head) row),
  // lse as max |lse - ref| / max(1, |ref|).
  double dmax = 0, rmax = 0, row_err = 0;
  for (size_t r = 0; r < size_t(T) * H; ++r) {
    double rd = 0, rr = 0;
    for (int d = 0; d < kMlaV; ++d) {
      const size_t i = r * kMlaV + d;
      const double o = bf16_bits_to_float(out[i]);
      rd = std::max(rd, std::isfinite(o) ? std::fabs(o - ref[i]) : INFINITY);
      rr = std::max(rr, std::fabs(ref[i]));
    }
    dmax = std::max(dmax, rd), rmax = std::max(rmax, rr), row_err = std::max(row_err, rd / rr);
  }
  double lerr = 0;
  if (c.lse)
    for (size_t i = 0; i < lse.size(); ++i)
      lerr = std::max(lerr, std::isfinite(lse[i]) ? std::fabs(lse[i] - ref_lse[i]) / std::max(1.0, std::fabs(ref_lse[i]))
                                                  : INFINITY);
  const double err = dmax / rmax, tol = 8e-3, ltol = 1e-5;
  int tiles = 0;
  for (int64_t t = 0; t < T; ++t) tiles += (pos[t] + kMlaTile) / kMlaTile;
  const bool ok = err < tol && row_err < 2 * tol && (!c.lse || lerr < ltol);
  std::printf("%-30s H %3d ps %2d %s T %3ld tiles %3d: out rel err %.2e (worst row %.2e, tol %.0e)", c.name, H, ps,
              c.e4m3 ? "e4m3" : "bf16", long(T), tiles, err, row_err, tol);
  if (c.lse) std::printf(", lse rel err %.2e (tol %.0e)", lerr, ltol);
  std::printf(" %s\n", ok ? "ok" : "FAIL");
  return ok ? 0 : 1;
}

// Usage: emu [name-substring]  (only the cases whose name contains it)
int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  std::vector<Case> cases;
  for (bool e4m3 : {false, true}) {
    // Moonlight (16 heads): decode of 6 sequences, 1 .. 700 positions (one tile, tile ends, a
    // partial last tile, 11 tiles), page size 16, with the lse.
    Case d{e4m3 ? "moonlight decode e4m3" : "moonlight decode bf16", 16, 16, e4m3, true, {1, 64, 65, 700, 130, 17}, {}};
    for (int b = 0; b < 6; ++b) d.tokens.push_back({b, d.lens[b] - 1});
    cases.push_back(d);
    // 8 heads (rows 8..15 of the MMAs padding), page size 1, no lse; one token mid-sequence.
    Case s{e4m3 ? "H8 ps1 e4m3" : "H8 ps1 bf16", 8, 1, e4m3, false, {300, 129, 2}, {}};
    s.tokens = {{0, 299}, {1, 128}, {2, 1}, {0, 63}};
    cases.push_back(s);
    // 32 heads (two head blocks per token), page size 64: a prefill chunk of one sequence across a
    // tile end, plus decodes of two others; the lse.
    Case p{e4m3 ? "H32 ps64 prefill+decode e4m3" : "H32 ps64 prefill+decode bf16", 32, 64, e4m3, true, {140, 5, 260}, {}};
    for (int j = 122; j < 132; ++j) p.tokens.push_back({0, j});
    p.tokens.push_back({1, 4});
    p.tokens.push_back({2, 259});
    p.tokens.push_back({0, 0});
    cases.push_back(p);
    // Scores rising with the position: the running max moves at every tile; 20 heads (a partial
    // second head block), page size 16.
    Case r{e4m3 ? "rising maxima H20 e4m3" : "rising maxima H20 bf16", 20, 16, e4m3, true, {450}, {}, 1.5f};
    r.tokens = {{0, 449}, {0, 200}};
    cases.push_back(r);
    // DeepSeek-V3 (128 heads: 8 head blocks per token), page size 5 (not a power of two).
    Case v{e4m3 ? "deepseek H128 ps5 e4m3" : "deepseek H128 ps5 bf16", 128, 5, e4m3, true, {100, 257}, {}};
    v.tokens = {{0, 99}, {1, 256}};
    cases.push_back(v);
  }
  int bad = 0;
  uint32_t seed = 1;
  for (const Case& c : cases) {
    ++seed;
    if (argc < 2 || std::strstr(c.name, argv[1])) bad += run(c, seed);
  }
  std::printf(bad ? "FAIL\n" : "PASS\n");
  return bad;
}
