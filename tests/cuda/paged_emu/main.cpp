// Driver of the paged attention host emulation (run.sh): random caches on scattered pages, the
// kernels run through emu.h, compared with a double-precision reference of backend.h's contract.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <type_traits>

#include "emu.h"
#include "quant/fp8_rule.h"  // fp8_scale_from_amax (plain C++); the codec shims are below
#define __align__(n) alignas(n)
// uint2, float2, fp8_e4m3x2_to_float2 and __syncwarp: emu.h's (the flash emulation's too)
#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif
inline uint4 paged_ld16(const void* p) { uint4 u; std::memcpy(&u, p, 16); return u; }
inline uint2 paged_ld8(const void* p) { uint2 u; std::memcpy(&u, p, 8); return u; }
inline float fp8_e4m3_round(float x) { return e4m3_dec(e4m3_enc(x)); }
inline uint8_t paged_e4m3_code(float x) { return e4m3_enc(x); }  // the fused output quantizer
using ::fabsf;
using std::isfinite;
using fp8rl::fp8_scale_from_amax;

// ---- shims of the tensor-core kernel's primitives (paged_mma_kernel) ----
// cp.async: emu.h's.
inline void paged_cp_async16(void* dst, const void* src, int nbytes) { emu_cp_async16(dst, src, nbytes != 0); }
inline void paged_cp_async_commit() { emu_cp_async_commit(); }
template <int N>
inline void paged_cp_async_wait() {
  emu_cp_async_wait<N>();
}
inline uint16_t paged_f16_bits(float x) { const _Float16 h = static_cast<_Float16>(x); uint16_t b; std::memcpy(&b, &h, 2); return b; }
inline uint32_t paged_pack_f16x2(float lo, float hi) { return uint32_t(paged_f16_bits(lo)) | (uint32_t(paged_f16_bits(hi)) << 16); }
inline uint32_t paged_pack_bf16x2(float lo, float hi) { return uint32_t(bf16_bits_from_float(lo)) | (uint32_t(bf16_bits_from_float(hi)) << 16); }
inline uint4 paged_lds16(const unsigned char* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16) std::abort();
  uint4 u; std::memcpy(&u, p, 16); return u;
}
inline uint2 paged_lds8(const unsigned char* p) {
  if (reinterpret_cast<uintptr_t>(p) % 8) std::abort();
  uint2 u; std::memcpy(&u, p, 8); return u;
}
inline int paged_shfl(int v, int src) {
  tw->a[tlane][0] = uint32_t(v);
  tw->bar.arrive_and_wait();
  const int r = int(tw->a[src & 31][0]);
  tw->bar.arrive_and_wait();
  return r;
}
inline int paged_shfl_xor(int v, int m) { return paged_shfl(v, (tlane ^ m) & 31); }
inline unsigned char* paged_dyn_smem() { return g_smem; }
// mma.sync m16n8k16 (A rows 8..15 zero), from the PTX fragment layouts; F16 or BF16 inputs.
template <bool F16>
inline void paged_mma(float& d0, float& d1, uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  float d[4] = {d0, d1, 0.0f, 0.0f};
  emu_mma16<F16>(d, {a0, 0u, a2, 0u}, b0, b1);
  d0 = d[0], d1 = d[1];
}
// The transposed kernel's (paged_mmat_kernel): the full m16n8k16, movmatrix, ex2, a vote, shared
// addresses as plain addresses.
template <bool F16>
inline void paged_mma4(float (&d)[4], const uint32_t (&x)[4], uint32_t b0, uint32_t b1) {
  emu_mma16<F16>(d, x, b0, b1);
}
// Thread (g, c) of the result holds row g, columns 2c, 2c + 1 of the transpose: elements
// (2c, g) and (2c + 1, g) of the input, held by lanes 8c + g / 2 and 8c + 4 + g / 2.
inline uint32_t paged_movm_t(uint32_t x) {
  tw->a[tlane][0] = x;
  tw->bar.arrive_and_wait();
  const int g = tlane >> 2, c = tlane & 3, h = g & 1;
  const uint32_t lo = (tw->a[4 * (2 * c) + g / 2][0] >> (16 * h)) & 0xffffu;
  const uint32_t hi = (tw->a[4 * (2 * c + 1) + g / 2][0] >> (16 * h)) & 0xffffu;
  tw->bar.arrive_and_wait();
  return lo | (hi << 16);
}
inline float paged_ex2(float x) {
  const float r = std::exp2(x);
  return r < 1.17549435e-38f ? 0.0f : r;  // ftz
}
inline bool paged_any(bool p) {
  tw->a[tlane][0] = p;
  tw->bar.arrive_and_wait();
  bool r = false;
  for (int i = 0; i < 32; ++i) r = r || tw->a[i][0];
  tw->bar.arrive_and_wait();
  return r;
}
template <class T>
inline T paged_keep(T x) { return x; }
using paged_saddr_t = uintptr_t;
inline paged_saddr_t paged_saddr(const void* p) { return reinterpret_cast<uintptr_t>(p); }
inline void paged_cp_async16z(paged_saddr_t dst, const void* src, bool zero) {
  paged_cp_async16(reinterpret_cast<void*>(dst), src, zero ? 0 : 16);
}
// The TMA copies (paged_mmat_kernel, COPY 2): a tensor map is the pool's bytes with its strides
// (the emulated launcher's encoding); a box of 16 slots x 128 bytes is read at issue and lands
// when a lane waits on its mbarrier, every 16-byte chunk q of row r at q ^ (address bits 7..9)
// (the 128-byte swizzle); the bytes armed on a barrier must equal those that landed on it.
#define __grid_constant__
struct CUtensorMap {
  const unsigned char* base = nullptr;
  int64_t row_bytes = 0, slot_bytes = 0;
};
struct EmuTma {
  paged_saddr_t bar;
  unsigned char* dst;
  std::vector<unsigned char> data;
};
inline std::mutex g_tma_mu;
inline std::vector<EmuTma> g_tma_pending;
inline std::map<paged_saddr_t, int64_t> g_tma_armed;
inline void paged_mbar_init(paged_saddr_t bar) {
  std::lock_guard<std::mutex> l(g_tma_mu);
  g_tma_armed[bar] = 0;
}
inline void paged_fence_proxy_async() {}
inline void paged_mbar_expect_tx(paged_saddr_t bar, uint32_t bytes) {
  std::lock_guard<std::mutex> l(g_tma_mu);
  if (!g_tma_armed.count(bar)) std::abort();  // not initialized
  g_tma_armed[bar] += bytes;
}
inline void paged_mbar_wait(paged_saddr_t bar, uint32_t) {
  std::lock_guard<std::mutex> l(g_tma_mu);
  for (size_t i = 0; i < g_tma_pending.size();) {
    EmuTma& e = g_tma_pending[i];
    if (e.bar != bar) {
      ++i;
      continue;
    }
    std::memcpy(e.dst, e.data.data(), e.data.size());
    g_tma_armed[bar] -= int64_t(e.data.size());
    g_tma_pending.erase(g_tma_pending.begin() + long(i));
  }
  if (g_tma_armed[bar] != 0) std::abort();  // armed bytes that never came (or more than armed)
}
inline void paged_tma_rows(paged_saddr_t dst, const CUtensorMap* map, paged_saddr_t bar, int c0, int c1, int c2) {
  if (dst % 1024 || c0 % 16 || c0 + 128 > map->row_bytes) std::abort();
  std::lock_guard<std::mutex> l(g_tma_mu);
  for (int r = 0; r < 16; ++r) {
    const unsigned char* src = map->base + int64_t(c2 + r) * map->slot_bytes + int64_t(c1) * map->row_bytes + c0;
    for (int q = 0; q < 8; ++q) {
      const paged_saddr_t row = dst + paged_saddr_t(128 * r);
      EmuTma e{bar, reinterpret_cast<unsigned char*>(row + ((q ^ ((row >> 7) & 7)) << 4)), {}};
      e.data.assign(src + 16 * q, src + 16 * q + 16);
      g_tma_pending.push_back(std::move(e));
    }
  }
}
inline bool emu_tma_idle() {
  std::lock_guard<std::mutex> l(g_tma_mu);
  for (const auto& [bar, n] : g_tma_armed)
    if (n) return false;
  return g_tma_pending.empty();
}
#include "kern.inc"

using namespace emu;
enum class Pool { F32, BF16, E4M3 };
struct Case {
  const char* name;
  int hd, Hq, Hkv, ps;
  Pool pool;
  bool q_bf16, fp8q;
  std::vector<int> lens;                      // sequence lengths (cache filled up to them)
  std::vector<std::pair<int, int>> tokens;    // (sequence, position) of each query token
  int forced;                                 // splits forced (0: the plan for 132 SMs)
  float kramp = 0.0f;                         // K at position j scaled by 1 + kramp j / 100 (rising maxima)
  // The consistent mode: the position-fixed plan (paged_invariant_split) with partials and the
  // lse; each token's output must then be the same bits as the token run alone (T = 1, its own
  // max_pos), and the lse attention()'s.
  bool invariant = false;
};

enum class Kern { Tiled, Grouped, Mma };
inline Kern g_kern = Kern::Tiled;  // which kernel runs
inline int g_variant = 0;          // of the tensor-core kernel (kMmaVariants)
inline const char* kern_name() {
  static const char* const mma[] = {"mma", "mma-v1", "mma-v2", "mma-v3", "mma-v4", "mma-v5", "mma-v6"};
  static_assert(sizeof(mma) / sizeof(mma[0]) == kMmaVariants, "a name per variant");
  return g_kern == Kern::Tiled ? "tiled" : g_kern == Kern::Grouped ? "grouped" : mma[g_variant];
}
template <int HD, class TP, int V>
void launch_mma_v(const PagedArgs& a0, int64_t T) {
  constexpr int S = paged_t_stages<HD, TP>(V), COPY = paged_t_copy<HD>(V);
  constexpr int smem = V == 0 ? PagedMmaCfg<HD, TP>::kSmemBytes : PagedTCfg<HD, TP, S, COPY>::kSmemBytes;
  PagedArgs a = a0;
  if constexpr (COPY == 2) {  // the launcher's tensor maps: the pools as {row bytes, Hkv, slots}
    const int64_t rb = HD * int64_t(sizeof(TP));
    a.kmap = {static_cast<const unsigned char*>(a.kpool), rb, rb * a.Hkv};
    a.vmap = {static_cast<const unsigned char*>(a.vpool), rb, rb * a.Hkv};
  }
  emu_launch(int(T * a.Hkv), a.splits, smem, [&] {
    if (threadIdx.x == 0) std::memset(g_smem, 0xff, smem);  // poison: NaN in every format
    __syncthreads();
    if constexpr (V == 0) paged_mma_kernel<HD, TP>(a);
    else paged_mmat_kernel<HD, TP, S, paged_t_lazy(V), COPY>(a);
    if (!emu_cp_async_idle() || !emu_tma_idle()) std::abort();  // every copy retired
  });
}
// The multi-query form of the default variant (NB blocks of 8 MMA columns) over `runs` query
// runs (a.qruns).
template <int HD, class TP, int NB>
void launch_mma_runs(const PagedArgs& a, int64_t runs) {
  constexpr int V = kMmaDefaultVariant, S = paged_t_stages<HD, TP>(V);
  constexpr int smem = PagedTCfg<HD, TP, S>::kSmemBytes;
  emu_launch(int(runs * a.Hkv), a.splits, smem, [&] {
    if (threadIdx.x == 0) std::memset(g_smem, 0xff, smem);
    __syncthreads();
    paged_mmat_kernel<HD, TP, S, paged_t_lazy(V), paged_t_copy<HD>(V), NB>(a);
    if (!emu_cp_async_idle()) std::abort();
  });
}
// The wide query runs (paged_wide_kernel: a block of 8 MMA columns per warp, kWideWarps warps).
template <int HD, class TP, int W>
void launch_wide_runs_w(const PagedArgs& a, int64_t runs) {
  constexpr int smem = PagedWideCfg<HD, TP>::kSmemBytes;
  emu_launch(
      int(runs * (kWideWarps / W) * a.Hkv), a.splits, smem,
      [&] {
        if (threadIdx.x == 0) std::memset(g_smem, 0xff, smem);
        __syncthreads();
        paged_wide_kernel<HD, TP, paged_t_lazy(kMmaDefaultVariant), W>(a);
        if (!emu_cp_async_idle()) std::abort();
      },
      32 * W);
}
inline int g_wide_warps = kWideWarps;  // CTAs of 8 warps, or 4 (two per run)
template <int HD, class TP>
void launch_wide_runs(const PagedArgs& a, int64_t runs) {
  if (g_wide_warps == 4) launch_wide_runs_w<HD, TP, 4>(a, runs);
  else launch_wide_runs_w<HD, TP, kWideWarps>(a, runs);
}
template <int HD, class TP>
void launch_mma(const PagedArgs& a, int64_t T) {
  static_assert(kMmaVariants == 7, "a case per variant");
  switch (g_variant) {
    case 0: return launch_mma_v<HD, TP, 0>(a, T);
    case 1: return launch_mma_v<HD, TP, 1>(a, T);
    case 2: return launch_mma_v<HD, TP, 2>(a, T);
    case 3: return launch_mma_v<HD, TP, 3>(a, T);
    case 4: return launch_mma_v<HD, TP, 4>(a, T);
    case 5: return launch_mma_v<HD, TP, 5>(a, T);
    default:  // TMA: tiles of 16 consecutive slots (the launcher runs the default elsewhere)
      if (a.page_size % kMmaTile) return launch_mma_v<HD, TP, kMmaDefaultVariant>(a, T);
      return launch_mma_v<HD, TP, kMmaTmaVariant>(a, T);
  }
}
template <int HD, class TP, int GM>
void launch_main(const PagedArgs& a, int64_t T) {
  if constexpr (!std::is_same_v<TP, float>) {
    if (g_kern == Kern::Mma) return launch_mma<HD, TP>(a, T);
  }
  if (g_kern == Kern::Grouped) emu_launch(int(T * a.Hkv), a.splits, 0, [&] { paged_attention_kernel<HD, TP, GM>(a); });
  else emu_launch(int(T * a.Hkv), a.splits, 0, [&] { paged_tiled_kernel<HD, TP, GM>(a); });
}
template <int HD, class TP>
void launch_g(const PagedArgs& a, int64_t T) {
  if (a.group == 1) launch_main<HD, TP, 1>(a, T);
  else if (a.group == 2) launch_main<HD, TP, 2>(a, T);
  else if (a.group <= 4) launch_main<HD, TP, 4>(a, T);
  else launch_main<HD, TP, 8>(a, T);
}
template <int HD>
void launch_p(const PagedArgs& a, Pool p, int64_t T) {
  if (p == Pool::E4M3) launch_g<HD, uint8_t>(a, T);
  else if (p == Pool::BF16) launch_g<HD, bf16>(a, T);
  else launch_g<HD, float>(a, T);
}

int run(const Case& c) {
  std::mt19937 gen(17 + c.hd + c.Hq);
  std::normal_distribution<float> nd(0, 1);
  const int B = int(c.lens.size()), hd = c.hd, Hkv = c.Hkv, Hq = c.Hq, G = Hq / Hkv;
  int max_pages = 0, num_pages = 0;
  for (int L : c.lens) max_pages = std::max(max_pages, (L + c.ps - 1) / c.ps), num_pages += (L + c.ps - 1) / c.ps;
  num_pages += 3;  // unused pages
  std::vector<int> perm(num_pages);
  for (int i = 0; i < num_pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), gen);
  std::vector<int32_t> table(size_t(B) * max_pages, -1);
  for (int b = 0, k = 0; b < B; ++b)
    for (int p = 0; p < (c.lens[b] + c.ps - 1) / c.ps; ++p) table[b * max_pages + p] = perm[k++];
  const int64_t pool_n = int64_t(num_pages) * c.ps * Hkv * hd;
  std::vector<int> slot_pos(size_t(num_pages) * c.ps, -1);  // a position the slot holds
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < c.lens[b]; ++j) slot_pos[size_t(table[b * max_pages + j / c.ps]) * c.ps + j % c.ps] = j;
  const size_t esz = c.pool == Pool::F32 ? 4 : c.pool == Pool::BF16 ? 2 : 1;
  std::vector<float> ks(Hkv, 1.0f), vs(Hkv, 1.0f);
  if (c.pool == Pool::E4M3)
    for (int h = 0; h < Hkv; ++h) ks[h] = 0.1f + 0.05f * h, vs[h] = 0.2f - 0.03f * h;
  // pools as raw bytes (16-byte aligned) and their decoded values (scale applied, as the CPU does)
  std::vector<uint4> kraw((pool_n * esz + 15) / 16), vraw((pool_n * esz + 15) / 16);
  std::vector<float> kval(pool_n), vval(pool_n);
  for (int which = 0; which < 2; ++which) {
    unsigned char* raw = reinterpret_cast<unsigned char*>(which ? vraw.data() : kraw.data());
    std::vector<float>& val = which ? vval : kval;
    for (int64_t i = 0; i < pool_n; ++i) {
      const int h = int((i / hd) % Hkv);
      float x = nd(gen) * (which ? 1.0f : 1.5f);
      if (!which && c.kramp > 0.0f && slot_pos[i / (int64_t(Hkv) * hd)] >= 0)
        x *= 1.0f + c.kramp * float(slot_pos[i / (int64_t(Hkv) * hd)]) / 100.0f;
      // Slots no sequence holds are NaN: a kernel that reads one (the TMA copies bring whole tiles
      // of a page) must mask it.
      if (slot_pos[i / (int64_t(Hkv) * hd)] < 0) x = NAN;
      if (c.pool == Pool::F32) {
        std::memcpy(raw + 4 * i, &x, 4);
        val[i] = x;
      } else if (c.pool == Pool::BF16) {
        const uint16_t b = bf16_bits_from_float(x);
        std::memcpy(raw + 2 * i, &b, 2);
        val[i] = bf16_bits_to_float(b);
      } else {
        const float s = which ? vs[h] : ks[h];
        raw[i] = e4m3_enc(x / s);
        val[i] = e4m3_dec(raw[i]) * s;
      }
    }
  }
  const int64_t T = int64_t(c.tokens.size());
  std::vector<int32_t> seq(T), pos(T);
  int max_pos = 0;
  for (int64_t t = 0; t < T; ++t) seq[t] = c.tokens[t].first, pos[t] = c.tokens[t].second, max_pos = std::max(max_pos, pos[t] + 1);
  std::vector<float> qf(T * Hq * hd);
  std::vector<uint16_t> qb(T * Hq * hd);
  for (size_t i = 0; i < qf.size(); ++i) {
    qf[i] = nd(gen);
    qb[i] = bf16_bits_from_float(qf[i]);
    if (c.q_bf16) qf[i] = bf16_bits_to_float(qb[i]);
  }
  const float scale = 1.0f / std::sqrt(float(hd));
  // reference
  std::vector<double> ref(T * Hq * hd, 0.0), ref_lse(size_t(T) * Hq, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / G;
      std::vector<float> qr(qf.begin() + (t * Hq + h) * hd, qf.begin() + (t * Hq + h + 1) * hd);
      if (c.fp8q) {
        float amax = 0;
        for (float x : qr) amax = std::max(amax, std::fabs(x));
        const float s = amax == 0 ? 1.0f : amax / 448.0f;
        for (float& x : qr) x = fp8_e4m3_round(x / s) * s;
      }
      const int n = pos[t] + 1;
      std::vector<double> p(n);
      double m = -1e300;
      auto row = [&](int j) { return ((int64_t(table[seq[t] * max_pages + j / c.ps]) * c.ps + j % c.ps) * Hkv + hk) * hd; };
      for (int j = 0; j < n; ++j) {
        double s = 0;
        for (int d = 0; d < hd; ++d) s += double(qr[d]) * kval[row(j) + d];
        p[j] = s * scale;
        m = std::max(m, p[j]);
      }
      double l = 0;
      for (double& x : p) l += (x = std::exp(x - m));
      for (int j = 0; j < n; ++j)
        for (int d = 0; d < hd; ++d) ref[(t * Hq + h) * hd + d] += p[j] / l * vval[row(j) + d];
      ref_lse[size_t(h) * T + t] = m + std::log(l);
    }
  // kernels
  const PagedSplit plan = c.invariant        ? paged_invariant_split(max_pos)
                          : g_kern == Kern::Mma ? paged_mma_split(T, Hkv, max_pos, 132 * 2, c.forced)
                                                : paged_attention_split(T, Hkv, max_pos, 132, c.forced);
  std::vector<float> lse_out(size_t(T) * Hq, NAN);
  std::vector<float> out_f(T * Hq * hd, NAN), part_o(size_t(T) * Hq * plan.splits * hd, NAN), part_l(size_t(T) * Hq * plan.splits, NAN);
  std::vector<uint16_t> out_b(T * Hq * hd, 0x7fc0);
  PagedArgs a;
  a.q = c.q_bf16 ? static_cast<const void*>(qb.data()) : static_cast<const void*>(qf.data());
  a.token_seq = seq.data();
  a.token_pos = pos.data();
  a.page_table = table.data();
  a.kpool = kraw.data();
  a.vpool = vraw.data();
  a.k_scale = c.pool == Pool::E4M3 ? ks.data() : nullptr;
  a.v_scale = c.pool == Pool::E4M3 ? vs.data() : nullptr;
  a.out = c.q_bf16 ? static_cast<void*>(out_b.data()) : static_cast<void*>(out_f.data());
  a.part_o = part_o.data();
  a.part_lse = part_l.data();
  a.max_pages = max_pages;
  a.Hq = Hq;
  a.Hkv = Hkv;
  a.group = G;
  a.page_size = c.ps;
  a.splits = plan.splits;
  a.chunk = plan.chunk;
  a.scale_log2 = scale * 1.4426950408889634f;
  a.q_bf16 = c.q_bf16;
  a.fp8_q = c.fp8q;
  a.ps_shift = (c.ps & (c.ps - 1)) == 0 ? __builtin_ctz(unsigned(c.ps)) : -1;
  a.partials = c.invariant;
  // The output's fused E4M3 copy (PagedArgs::out_q: the tensor-core kernels at hd 128, written by
  // the one-split epilogue or the combine); the scale layout alternates with T's parity.
  const bool fq = g_kern == Kern::Mma && hd == 128 && c.q_bf16 && !c.invariant;
  std::vector<uint8_t> oq(size_t(T) * Hq * hd, 0);
  std::vector<float> oqs(size_t(T) * Hq, NAN);
  int obad = 0;
  if (fq) {
    a.out_q = oq.data();
    a.out_qs = oqs.data();
    a.out_q_rows = T;
    a.out_q_gemm = T % 2 == 0;
    a.out_q_bad = &obad;
  }
  if (hd == 64) launch_p<64>(a, c.pool, T);
  else launch_p<128>(a, c.pool, T);
  // The split combine of a launch over all T tokens (partials po / pl, arguments r).
  auto combine = [&](std::vector<float>& po, std::vector<float>& pl, bool out_bf16, float* lse, const PagedArgs& r) {
    const int64_t rows = T * Hq;
    emu_launch(int((rows + 3) / 4), 1, 0, [&] {
      paged_combine_kernel(po.data(), pl.data(), pos.data(), rows, Hq, hd, plan.splits, plan.chunk, out_bf16, r.out, lse,
                           r);
    });
  };
  // BF16 token outputs differing from out_b, plus lse entries differing from lse_out (when given).
  auto differing = [&](const std::vector<uint16_t>& o, const std::vector<float>* lse) {
    int n = 0;
    for (int64_t t = 0; t < T; ++t)
      if (std::memcmp(o.data() + t * Hq * hd, out_b.data() + t * Hq * hd, size_t(Hq) * hd * 2) != 0) ++n;
    if (lse)
      for (size_t i = 0; i < lse->size(); ++i)
        if (std::memcmp(&(*lse)[i], &lse_out[i], 4) != 0) ++n;
    return n;
  };
  if (plan.splits > 1 || c.invariant) combine(part_o, part_l, c.q_bf16, c.invariant ? lse_out.data() : nullptr, a);
  int fq_bad = 0;
  if (fq) {  // bitwise the 1x128 quantizer of the stored BF16 output (quant.cuh's rule)
    for (int64_t r = 0; r < T * Hq; ++r) {
      float amax = 0.0f;
      for (int d = 0; d < hd; ++d) amax = std::max(amax, std::fabs(bf16_bits_to_float(out_b[r * hd + d])));
      const float s = fp8_scale_from_amax(amax, false);
      const float got = oqs[a.out_q_gemm ? (r % Hq) * T + r / Hq : r];
      if (std::memcmp(&got, &s, 4) != 0) ++fq_bad;
      for (int d = 0; d < hd; ++d)
        if (oq[r * hd + d] != e4m3_enc(bf16_bits_to_float(out_b[r * hd + d]) / s)) ++fq_bad;
    }
    if (obad != 0) ++fq_bad;
    std::printf("  fused E4M3 output (%s scales): %d mismatching codes / scales\n", a.out_q_gemm ? "VEC128" : "row-major",
                fq_bad);
  }
  int invariant_bad = 0;
  if (c.invariant) {
    // The lse, and every token alone (T = 1, max_pos its own, no partials when one split).
    double lerr = 0;
    for (size_t i = 0; i < ref_lse.size(); ++i)
      lerr = std::max(lerr, std::isfinite(lse_out[i]) ? std::fabs(lse_out[i] - ref_lse[i]) : INFINITY);
    if (!(lerr < 2e-5 * 16)) ++invariant_bad;
    for (int64_t t = 0; t < T; ++t) {
      const PagedSplit p1 = paged_invariant_split(pos[t] + 1);
      std::vector<float> o1f(size_t(Hq) * hd, NAN), po(size_t(Hq) * p1.splits * hd, NAN), pl(size_t(Hq) * p1.splits, NAN);
      std::vector<uint16_t> o1b(size_t(Hq) * hd, 0x7fc0);
      PagedArgs b = a;
      b.token_seq = seq.data() + t;
      b.token_pos = pos.data() + t;
      b.q = c.q_bf16 ? static_cast<const void*>(qb.data() + t * Hq * hd) : static_cast<const void*>(qf.data() + t * Hq * hd);
      b.out = c.q_bf16 ? static_cast<void*>(o1b.data()) : static_cast<void*>(o1f.data());
      b.part_o = po.data();
      b.part_lse = pl.data();
      b.splits = p1.splits;
      b.chunk = p1.chunk;
      b.partials = false;
      if (hd == 64) launch_p<64>(b, c.pool, 1);
      else launch_p<128>(b, c.pool, 1);
      if (p1.splits > 1)
        emu_launch(int((Hq + 3) / 4), 1, 0, [&] {
          paged_combine_kernel(po.data(), pl.data(), pos.data() + t, Hq, Hq, hd, p1.splits, p1.chunk, c.q_bf16, b.out);
        });
      const void* full = c.q_bf16 ? static_cast<const void*>(out_b.data() + t * Hq * hd)
                                  : static_cast<const void*>(out_f.data() + t * Hq * hd);
      const void* alone = c.q_bf16 ? static_cast<const void*>(o1b.data()) : static_cast<const void*>(o1f.data());
      if (std::memcmp(full, alone, size_t(Hq) * hd * (c.q_bf16 ? 2 : 4)) != 0) {
        std::printf("  token %ld (position %d): alone differs from its batch\n", long(t), pos[t]);
        ++invariant_bad;
      }
    }
    std::printf("  invariant plan: lse max |err| %.2e, %d token(s) differing alone\n", lerr, invariant_bad);
    // Query runs (the multi-query kernel of the default variant, one and two blocks of 8 MMA
    // columns, and the wide CTAs' kWideWarps blocks): consecutive tokens of one sequence, up to
    // 8 nb / G per run; out and lse bitwise the one-token CTAs'.
    for (int nb : {1, kMmaRunBlocks, kWideWarps, -kWideWarps}) {  // -: the wide runs on CTAs of 4 warps
      g_wide_warps = nb < 0 ? 4 : kWideWarps;
      nb = nb < 0 ? -nb : nb;
      if (!(g_kern == Kern::Mma && g_variant == kMmaDefaultVariant && (G == 1 || G == 2 || G == 4 || G == 8))) break;
      std::vector<int32_t> runs;
      for (int64_t t = 0; t < T;) {
        int64_t n = 1;
        while (t + n < T && n < 8 * nb / G && seq[t + n] == seq[t] && pos[t + n] == pos[t + n - 1] + 1) ++n;
        runs.push_back(int32_t(t));
        runs.push_back(int32_t(n));
        t += n;
      }
      const int64_t R = int64_t(runs.size() / 2);
      std::vector<float> lse_r(size_t(T) * Hq, NAN), po(part_o.size(), NAN), pl(part_l.size(), NAN);
      std::vector<uint16_t> out_r(T * Hq * hd, 0x7fc0);
      PagedArgs r = a;
      r.qruns = runs.data();
      r.out = out_r.data();
      r.part_o = po.data();
      r.part_lse = pl.data();
      r.out_q = nullptr;
      auto launch = [&](auto nbc) {
        constexpr int NB = decltype(nbc)::value;
        if (hd == 64)
          (c.pool == Pool::E4M3 ? launch_mma_runs<64, uint8_t, NB>(r, R) : launch_mma_runs<64, bf16, NB>(r, R));
        else
          (c.pool == Pool::E4M3 ? launch_mma_runs<128, uint8_t, NB>(r, R) : launch_mma_runs<128, bf16, NB>(r, R));
      };
      if (nb == 1) launch(std::integral_constant<int, 1>());
      else if (nb == kMmaRunBlocks) launch(std::integral_constant<int, kMmaRunBlocks>());
      else if (hd == 64) (c.pool == Pool::E4M3 ? launch_wide_runs<64, uint8_t>(r, R) : launch_wide_runs<64, bf16>(r, R));
      else (c.pool == Pool::E4M3 ? launch_wide_runs<128, uint8_t>(r, R) : launch_wide_runs<128, bf16>(r, R));
      combine(po, pl, true, lse_r.data(), r);
      const int run_bad = differing(out_r, &lse_r);
      std::printf("  query runs (%d column block(s)%s, %ld runs of up to %d tokens): %d token outputs / lse differing "
                  "from one-token CTAs\n",
                  nb, nb == kWideWarps && g_wide_warps == 4 ? " on CTAs of 4 warps" : "", long(R), 8 * nb / G, run_bad);
      invariant_bad += run_bad;
    }
  }
  double dmax = 0, rmax = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double x = c.q_bf16 ? bf16_bits_to_float(out_b[i]) : out_f[i];
    dmax = std::max(dmax, std::isfinite(x) ? std::fabs(x - ref[i]) : INFINITY);
    rmax = std::max(rmax, std::fabs(ref[i]));
  }
  const double err = dmax / rmax, tol = c.q_bf16 ? 8e-3 : 2e-6;
  std::printf("%-8s %-34s hd %3d Hq %2d Hkv %d ps %2d T %3ld splits %2d x %4d: rel err %.2e (tol %.0e) %s\n", kern_name(), c.name, hd,
              Hq, Hkv, c.ps, long(T), plan.splits, plan.chunk, err, tol, err < tol ? "ok" : "FAIL");
  return err < tol && invariant_bad == 0 && fq_bad == 0 ? 0 : 1;
}

// Usage: emu [name-substring [tiled|grouped|mma|mma-vN|mma-all]]  (runs only the cases whose name
// contains it ("" for all), on one kernel: mma is variant 0 of the tensor-core kernel, mma-vN
// variant N, mma-all every variant)
int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  std::vector<Case> cases;
  {  // Llama-8B-like group 4, BF16 pool, decode of 3 sequences + a prefill chunk of one: auto splits
    Case c{"mixed decode+prefill G4 bf16", 128, 8, 2, 16, Pool::BF16, false, false, {37, 300, 1500}, {}, 0};
    c.tokens = {{0, 36}, {1, 299}, {2, 1499}};
    for (int p = 290; p < 300; ++p) c.tokens.push_back({1, p});
    cases.push_back(c);
  }
  {  // group 8, E4M3, BF16 q, fp8 q, page size 2: the staged page list loops (600 > 255 * 2)
    Case c{"G8 e4m3 fp8q staged pages", 64, 16, 2, 2, Pool::E4M3, true, true, {1, 70, 600}, {}, 1};
    c.tokens = {{0, 0}, {1, 69}, {2, 100}, {2, 350}, {2, 598}, {2, 599}};
    cases.push_back(c);
  }
  {  // MHA (group 1), F32 pool, fp8 q, odd page size, 5 forced splits (tokens shorter than some)
    Case c{"G1 f32 fp8q forced splits", 128, 2, 2, 7, Pool::F32, false, true, {200, 45}, {}, 5};
    c.tokens = {{0, 199}, {1, 44}, {1, 3}, {0, 0}};
    cases.push_back(c);
  }
  {  // group 5 (padded to 8: masked heads), BF16 everywhere, auto splits
    Case c{"G5 padded bf16", 64, 10, 2, 16, Pool::BF16, true, false, {129}, {}, 0};
    c.tokens = {{0, 128}, {0, 0}, {0, 64}};
    cases.push_back(c);
  }
  {  // one long decode, group 8, E4M3: many splits
    Case c{"long decode G8 e4m3", 128, 16, 2, 16, Pool::E4M3, false, false, {1500}, {}, 0};
    c.tokens = {{0, 1499}};
    cases.push_back(c);
  }
  {  // group 2, F32 pool, BF16 q, page size 1 (staged list loops), one split
    Case c{"G2 f32 ps1 staged", 64, 4, 2, 1, Pool::F32, true, false, {300}, {}, 1};
    c.tokens = {{0, 299}, {0, 255}, {0, 254}};
    cases.push_back(c);
  }
  {  // group 4, E4M3, hd 128, fp8 q, prefill + decode with forced 3 splits
    Case c{"G4 e4m3 fp8q hd128 3 splits", 128, 8, 2, 16, Pool::E4M3, false, true, {90, 33}, {}, 3};
    c.tokens = {{1, 32}, {0, 10}, {0, 89}, {0, 88}, {1, 0}};
    cases.push_back(c);
  }
  {  // the decode benchmark's shape (Llama-3.2-1B: group 4, hd 64), BF16 pool, contexts 512..640
    Case c{"decode G4 bf16 hd64 bench shape", 64, 8, 2, 16, Pool::BF16, true, false, {512, 577, 640, 530}, {}, 0};
    c.tokens = {{0, 511}, {1, 576}, {2, 639}, {3, 529}};
    cases.push_back(c);
  }
  {  // the same with an E4M3 pool and fp8 q, one split (every warp walks several tiles)
    Case c{"decode G4 e4m3 hd64 fp8q", 64, 8, 2, 16, Pool::E4M3, true, true, {600, 140}, {}, 1};
    c.tokens = {{0, 599}, {1, 139}, {0, 31}, {0, 32}};
    cases.push_back(c);
  }
  // Cases for the tensor-core kernel only (BF16 q; the tiled kernel's cases above run on it too,
  // with q rounded to BF16, where the pool is BF16 or E4M3).
  std::vector<Case> mma_cases;
  {  // Qwen3-1.7B heads (16 / 8, group 2, hd 128): decode of 6 sequences with contexts 80..700
    for (Pool pool : {Pool::BF16, Pool::E4M3}) {
      Case c{pool == Pool::BF16 ? "qwen decode G2 hd128 bf16" : "qwen decode G2 hd128 e4m3", 128, 16, 8, 16, pool, true,
             false, {80, 700, 333, 97, 512, 129}, {}, 0};
      for (int b = 0; b < 6; ++b) c.tokens.push_back({b, c.lens[b] - 1});
      mma_cases.push_back(c);
      // The same at one split (the one-split epilogue, and its fused E4M3 output), 4 tokens.
      Case one{pool == Pool::BF16 ? "qwen one-split G2 hd128 bf16" : "qwen one-split G2 hd128 e4m3", 128, 16, 8, 16,
               pool, true, false, {80, 333, 97, 129}, {}, 1};
      for (int b = 0; b < 4; ++b) one.tokens.push_back({b, one.lens[b] - 1});
      mma_cases.push_back(one);
    }
  }
  {  // Llama-3.1-8B heads (32 / 8, group 4): one long decode (plan splits) plus a 20-token prefill chunk
    Case c{"llama G4 e4m3 long + prefill", 128, 32, 8, 16, Pool::E4M3, true, false, {2100, 50}, {}, 0};
    c.tokens.push_back({0, 2099});
    for (int p = 30; p < 50; ++p) c.tokens.push_back({1, p});
    mma_cases.push_back(c);
  }
  {  // group 3 (rows padded), fp8 q, page size 5 (division path), forced 4 splits, BF16 pool
    Case c{"G3 bf16 fp8q ps5 4 splits", 128, 6, 2, 5, Pool::BF16, true, true, {203, 17}, {}, 4};
    c.tokens = {{0, 202}, {1, 16}, {0, 15}, {0, 16}, {1, 0}};
    mma_cases.push_back(c);
  }
  {  // group 8, hd 64 E4M3 (LDS.64 V path), fp8 q, page size 1, contexts not multiples of 16
    Case c{"G8 e4m3 hd64 fp8q ps1", 64, 16, 2, 1, Pool::E4M3, true, true, {77, 301}, {}, 0};
    c.tokens = {{0, 76}, {1, 300}, {1, 33}};
    mma_cases.push_back(c);
  }
  {  // group 1 (MHA), hd 64 BF16, page size 32, one split: every warp walks several tiles
    Case c{"G1 bf16 hd64 ps32 1 split", 64, 4, 4, 32, Pool::BF16, true, false, {260, 1}, {}, 1};
    c.tokens = {{0, 259}, {1, 0}, {0, 64}};
    mma_cases.push_back(c);
  }
  {  // the consistent mode's plan: a prefill-sized batch of three sequences, one past two chunks
    for (Pool pool : {Pool::BF16, Pool::E4M3, Pool::F32}) {
      Case c{pool == Pool::BF16 ? "invariant G2 hd128 bf16" : pool == Pool::E4M3 ? "invariant G2 hd128 e4m3"
                                                                                   : "invariant G2 hd128 f32",
             128, 4, 2, 16, pool, pool != Pool::F32, false, {1100, 40, 513}, {}, 0};
      for (int p : {0, 1, 15, 16, 511, 512, 513, 1023, 1024, 1099}) c.tokens.push_back({0, p});
      for (int p : {0, 39}) c.tokens.push_back({1, p});
      for (int p : {500, 511, 512}) c.tokens.push_back({2, p});
      c.invariant = true;
      cases.push_back(c);
    }
  }
  {  // query runs: whole stretches of a sequence as queries (the consistent scoring), G 4 and 1,
     // scores rising with the position (the lazy rescale's per-token vote), across a chunk end
    const int C = kPagedInvariantChunk;
    Case c{"invariant runs G4 hd128 e4m3", 128, 8, 2, 16, Pool::E4M3, true, false, {C + 18, 12}, {}, 0};
    for (int p = C - 7; p < C + 9; ++p) c.tokens.push_back({0, p});
    for (int p = 0; p < 7; ++p) c.tokens.push_back({1, p});
    c.kramp = 1.5f;
    c.invariant = true;
    mma_cases.push_back(c);
    Case d{"invariant runs G1 hd64 bf16", 64, 2, 2, 16, Pool::BF16, true, false, {20, C + 8}, {}, 0};
    for (int p = 0; p < 20; ++p) d.tokens.push_back({0, p});
    for (int p = C - 4; p < C + 4; ++p) d.tokens.push_back({1, p});
    d.kramp = 1.5f;
    d.invariant = true;
    mma_cases.push_back(d);
  }
  {  // wide query runs at the 1.7B group: runs of 32 tokens whose warps end at different tiles and
     // passes, across a chunk end, and a short sequence; group 8 (one token per warp) on BF16 hd 64
    const int C = kPagedInvariantChunk;
    Case c{"invariant runs G2 hd128 e4m3 wide", 128, 4, 2, 16, Pool::E4M3, true, false, {C + 88, 45}, {}, 0};
    for (int p = C - 42; p < C + 34; ++p) c.tokens.push_back({0, p});
    for (int p = 0; p < 45; ++p) c.tokens.push_back({1, p});
    c.kramp = 1.5f;
    c.invariant = true;
    mma_cases.push_back(c);
    Case d{"invariant runs G8 hd64 bf16 wide", 64, 16, 2, 16, Pool::BF16, true, false, {C + 18, 3}, {}, 0};
    for (int p = C - 12; p < C + 3; ++p) d.tokens.push_back({0, p});
    for (int p = 0; p < 3; ++p) d.tokens.push_back({1, p});
    d.kramp = 1.5f;
    d.invariant = true;
    mma_cases.push_back(d);
  }
  {  // one split over 4,200 positions, pages of 32: every warp walks ~66 tiles, so the page-table
     // entries it holds a window of 32 tiles at a time (pages of a multiple of 16) turn over twice
    Case c{"long one-split G2 hd128 e4m3 ps32", 128, 4, 2, 32, Pool::E4M3, true, false, {4200, 70}, {}, 1};
    c.tokens = {{0, 4199}, {1, 69}, {0, 2100}};
    mma_cases.push_back(c);
  }
  for (Pool pool : {Pool::BF16, Pool::E4M3}) {  // scores rising with the position: the running max moves
    Case c{pool == Pool::BF16 ? "rising maxima G2 hd128 bf16" : "rising maxima G2 hd128 e4m3", 128, 4, 2, 16, pool, true,
           false, {700, 300}, {}, 1};
    c.tokens = {{0, 699}, {1, 299}, {0, 350}};
    c.kramp = 1.5f;
    mma_cases.push_back(c);
  }
  int bad = 0;
  for (const Kern k : {Kern::Tiled, Kern::Grouped, Kern::Mma})
    for (int v = 0; v < (k == Kern::Mma ? kMmaVariants : 1); ++v) {
      g_kern = k;
      g_variant = v;
      if (argc >= 3 && std::string(argv[2]) != kern_name() && !(k == Kern::Mma && std::string(argv[2]) == "mma-all"))
        continue;
      for (Case c : cases) {
        if (k == Kern::Mma) {
          if (c.pool == Pool::F32) continue;
          c.q_bf16 = true;
        }
        if (argc < 2 || std::strstr(c.name, argv[1])) bad += run(c);
      }
      if (k == Kern::Mma)
        for (const Case& c : mma_cases)
          if (argc < 2 || std::strstr(c.name, argv[1])) bad += run(c);
    }
  std::printf(bad ? "FAIL\n" : "PASS\n");
  return bad;
}
