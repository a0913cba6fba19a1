// Driver of the flash attention host emulation (run.sh): random BF16 q/k/v/dout on ragged packed
// sequences with GQA, the kernels run through emu.h, compared with a double-precision reference.
#include "kern.inc"
#include <cstdio>
#include <random>
using namespace emu;
static bf16 tob(float x) { return bf16{bf16_bits_from_float(x)}; }
static float tf(bf16 b) { return bf16_bits_to_float(b.x); }
template <int D, bool M = false, int DV = D>  // M: the tile-merge order (FP8RL_FLASH_ORDER=merge); DV: v's width
int run(const std::vector<int32_t>& cu, int Hq, int Hkv) {
  const int64_t T = cu.back();
  std::mt19937 gen(5 + D + DV);
  std::normal_distribution<float> nd(0, 1);
  auto mk = [&](int64_t n, float s) { std::vector<bf16> v(n); for (auto& x : v) x = tob(nd(gen) * s); return v; };
  auto q = mk(T * Hq * D, 2.0f), k = mk(T * Hkv * D, 1), v = mk(T * Hkv * DV, 1), g = mk(T * Hq * DV, 1);
  const float scale = 1.0f / std::sqrt(float(D));
  std::vector<int32_t> tl = flash_attention_tiles(cu);
  const int nt = tl.size() / 8;
  const TileDesc* tq = reinterpret_cast<const TileDesc*>(tl.data());
  const TileDesc* tk = tq + nt;
  std::vector<bf16> out(T * Hq * DV, tob(NAN)), dq(T * Hq * D, tob(NAN)), dk(T * Hkv * D, tob(NAN)), dv(T * Hkv * DV, tob(NAN));
  std::vector<float> lse(Hq * T, NAN), delta(T * Hq, NAN);
  emu_launch(nt, Hq, FwdSmem<D, DV>::kBytes, [&] { flash_fwd_kernel<D, M, DV>(q.data(), k.data(), v.data(), tq, Hq, Hkv, T, scale, out.data(), lse.data()); });
  const int64_t rows = T * Hq;
  emu_launch((rows + 3) / 4, 1, 0, [&] { flash_delta_kernel<DV>(g.data(), out.data(), T, Hq, delta.data()); });
  emu_launch(nt, Hq, DqSmem<D, DV>::kBytes, [&] { flash_dq_kernel<D, DV>(g.data(), q.data(), k.data(), v.data(), lse.data(), delta.data(), tq, Hq, Hkv, T, scale, dq.data()); });
  std::vector<float> pk(Hq != Hkv ? T * Hq * D : 0, NAN), pv(Hq != Hkv ? T * Hq * DV : 0, NAN);
  emu_launch(nt, Hq, DkvSmem<D, DV>::kBytes, [&] { flash_dkv_kernel<D, DV>(g.data(), q.data(), k.data(), v.data(), lse.data(), delta.data(), tk, Hq, Hkv, T, scale, dk.data(), dv.data(), pk.data(), pv.data()); });
  if (Hq != Hkv) emu_launch(3, 1, 0, [&] { flash_dkv_reduce_kernel(pk.data(), pv.data(), T, Hq, Hkv, D, DV, scale, dk.data(), dv.data()); });
  // reference in double (using the kernel's bf16 out for delta, as the backend does)
  std::vector<double> ro(T * Hq * DV, 0), rl(Hq * T), rdq(T * Hq * D, 0), rdk(T * Hkv * D, 0), rdv(T * Hkv * DV, 0);
  std::vector<int> ss(T), se(T);
  for (size_t b = 0; b + 1 < cu.size(); ++b) for (int t = cu[b]; t < cu[b + 1]; ++t) ss[t] = cu[b], se[t] = cu[b + 1];
  for (int64_t t = 0; t < T; ++t) for (int h = 0; h < Hq; ++h) {
    const int hk = h / (Hq / Hkv);
    std::vector<double> p(t + 1 - ss[t]);
    double m = -1e300;
    for (int64_t j = ss[t]; j <= t; ++j) { double s = 0; for (int d = 0; d < D; ++d) s += double(tf(q[(t*Hq+h)*D+d])) * tf(k[(j*Hkv+hk)*D+d]); p[j-ss[t]] = s * scale; m = std::max(m, p[j-ss[t]]); }
    double l = 0; for (auto& x : p) { x = std::exp(x - m); l += x; }
    rl[h * T + t] = m + std::log(l);
    for (auto& x : p) x /= l;
    for (int64_t j = ss[t]; j <= t; ++j) for (int d = 0; d < DV; ++d) ro[(t*Hq+h)*DV+d] += p[j-ss[t]] * tf(v[(j*Hkv+hk)*DV+d]);
    double Dl = 0; for (int d = 0; d < DV; ++d) Dl += double(tf(g[(t*Hq+h)*DV+d])) * tf(out[(t*Hq+h)*DV+d]);
    for (int64_t j = ss[t]; j <= t; ++j) {
      double dp = 0; for (int d = 0; d < DV; ++d) dp += double(tf(g[(t*Hq+h)*DV+d])) * tf(v[(j*Hkv+hk)*DV+d]);
      const double pp = p[j-ss[t]], ds = pp * (dp - Dl) * scale;
      for (int d = 0; d < D; ++d) {
        rdq[(t*Hq+h)*D+d] += ds * tf(k[(j*Hkv+hk)*D+d]);
        rdk[(j*Hkv+hk)*D+d] += ds * tf(q[(t*Hq+h)*D+d]);
      }
      for (int d = 0; d < DV; ++d) rdv[(j*Hkv+hk)*DV+d] += pp * tf(g[(t*Hq+h)*DV+d]);
    }
  }
  auto rel = [](auto& got, const std::vector<double>& ref, bool isbf) {
    double d = 0, m = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      double x; if constexpr (std::is_same_v<std::decay_t<decltype(got[0])>, bf16>) x = tf(got[i]); else x = got[i];
      if (!std::isfinite(x)) return INFINITY * 1.0;
      d = std::max(d, std::fabs(x - ref[i])); m = std::max(m, std::fabs(ref[i]));
    }
    (void)isbf; return d / m;
  };
  double eo = rel(out, ro, true), el = rel(lse, rl, false), eq = rel(dq, rdq, true), ek = rel(dk, rdk, true), ev = rel(dv, rdv, true);
  std::printf("%sD %d DV %d Hq %d Hkv %d T %ld: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", M ? "tile-merge order: " : "", D, DV, Hq, Hkv, (long)T, eo, el, eq, ek, ev);
  return (eo < 1e-2 && el < 1e-5 && eq < 3e-2 && ek < 3e-2 && ev < 3e-2) ? 0 : 1;
}
// The decode kernel in the forward's order (flash_decode_kernel): every token of the packed
// sequences served from a paged cache (pages in a scrambled order, page size 16) must give
// bitwise the forward kernel's row over the values the cache hands out (E4M3: code * scale
// rounded to BF16, as kv_round gives the trainer; BF16: as stored).
static uint8_t e4m3_nearest(float x) {  // round to nearest, ties to the even code, saturating
  uint8_t best = 0;
  double bd = INFINITY;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    const double d = std::fabs(double(emu_e4m3(uint8_t(c))) - double(x));
    if (d < bd || (d == bd && (c & 1) == 0 && std::signbit(emu_e4m3(uint8_t(c))) == std::signbit(x))) bd = d, best = uint8_t(c);
  }
  return best;
}
// M: both kernels in the tile-merge order; P (with M, E4M3): the tile-parallel decode
// (flash_decode_tiles_kernel) instead of the cooperative one.
template <int D, bool M = false, bool P = false>
int run_decode(const std::vector<int32_t>& cu, int Hq, int Hkv, bool e4m3, int ps = 16, int fold = 0) {
  const int64_t T = cu.back();
  const int B = int(cu.size()) - 1;
  std::mt19937 gen(11 + D + Hq);
  std::normal_distribution<float> nd(0, 1);
  std::vector<bf16> q(T * Hq * D), kr(T * Hkv * D), vr(T * Hkv * D);
  for (auto& x : q) x = tob(nd(gen) * 2.0f);
  std::vector<float> ks(Hkv), vs(Hkv);
  for (int h = 0; h < Hkv; ++h) ks[h] = 0.004f * (1 + h), vs[h] = 0.003f * (2 + h);
  if (fold)  // power-of-two scales, folded by the kernel
    for (int h = 0; h < Hkv; ++h) ks[h] = std::ldexp(1.0f, -7 - h), vs[h] = std::ldexp(1.0f, -8 + h);
  // pages: sequence b's page i at a scrambled pool page
  std::vector<int> npages(B);
  int total = 0, maxp = 1;
  for (int b = 0; b < B; ++b) npages[b] = (cu[b + 1] - cu[b] + ps - 1) / ps, total += npages[b], maxp = std::max(maxp, npages[b]);
  std::vector<int32_t> perm(total);
  for (int i = 0; i < total; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), gen);
  std::vector<int32_t> table(size_t(B) * maxp, 0), seq(T), pos(T);
  for (int b = 0, at = 0; b < B; ++b)
    for (int i = 0; i < npages[b]; ++i) table[size_t(b) * maxp + i] = perm[at++];
  const size_t pool_n = size_t(total) * ps * Hkv * D;
  std::vector<uint8_t> kc(pool_n, 0x7f), vc(pool_n, 0x7f);      // E4M3 pools; NaN where never written
  std::vector<bf16> kb(pool_n, tob(NAN)), vb(pool_n, tob(NAN));  // BF16 pools
  for (int b = 0; b < B; ++b)
    for (int t = cu[b]; t < cu[b + 1]; ++t) {
      seq[t] = b, pos[t] = t - cu[b];
      const int64_t slot = int64_t(table[size_t(b) * maxp + pos[t] / ps]) * ps + pos[t] % ps;
      for (int h = 0; h < Hkv; ++h)
        for (int d = 0; d < D; ++d) {
          const float x = nd(gen), y = nd(gen);
          const size_t i = (size_t(t) * Hkv + h) * D + d, c = (size_t(slot) * Hkv + h) * D + d;
          if (e4m3) {
            kc[c] = e4m3_nearest(x / ks[h]);
            vc[c] = e4m3_nearest(y / vs[h]);
            kr[i] = tob(emu_e4m3(kc[c]) * ks[h]);
            vr[i] = tob(emu_e4m3(vc[c]) * vs[h]);
          } else {
            kr[i] = kb[c] = tob(x);
            vr[i] = vb[c] = tob(y);
          }
        }
    }
  const float scale = 1.0f / std::sqrt(float(D));
  std::vector<int32_t> tl = flash_attention_tiles(cu);
  const int nt = tl.size() / 8;
  std::vector<bf16> of(T * Hq * D, tob(NAN)), od(T * Hq * D, tob(NAN));
  std::vector<float> lse(Hq * T, NAN);
  emu_launch(nt, Hq, FwdSmem<D>::kBytes, [&] {
    flash_fwd_kernel<D, M>(q.data(), kr.data(), vr.data(), reinterpret_cast<const TileDesc*>(tl.data()), Hq, Hkv, T,
                           scale, of.data(), lse.data());
  });
  const int gx = int(T * Hkv);  // one CTA of four warps per (token, KV head)
  if (P)
    emu_launch(gx, 1, DecTilesSmem<D>::bytes(Hq / Hkv), [&] {
      flash_decode_tiles_kernel<D>(q.data(), seq.data(), pos.data(), table.data(), maxp, T, Hq, Hkv, ps, kc.data(),
                                   vc.data(), ks.data(), vs.data(), scale, fold, od.data());
    });
  else if (e4m3)
    emu_launch(gx, 1, DecSmem<D, true>::kBytes, [&] {
      flash_decode_kernel<D, true, M>(q.data(), seq.data(), pos.data(), table.data(), maxp, T, Hq, Hkv, ps, kc.data(),
                                   vc.data(), ks.data(), vs.data(), scale, fold, od.data());
    });
  else
    emu_launch(gx, 1, DecSmem<D, false>::kBytes, [&] {
      flash_decode_kernel<D, false, M>(q.data(), seq.data(), pos.data(), table.data(), maxp, T, Hq, Hkv, ps, kb.data(),
                                    vb.data(), nullptr, nullptr, scale, fold, od.data());
    });
  int64_t rows_bad = 0;
  for (int64_t r = 0; r < T * Hq; ++r)
    if (std::memcmp(of.data() + r * D, od.data() + r * D, D * sizeof(bf16)) != 0) ++rows_bad;
  std::printf("%sdecode D %d Hq %d Hkv %d T %ld page %d %s pool%s: %ld of %ld rows differ from the forward's\n", P ? "tile-merge order, tiles in parallel: " : M ? "tile-merge order: " : "", D, Hq, Hkv, (long)T, ps,
              e4m3 ? "E4M3" : "BF16", fold ? " (pow2 scales folded)" : "", (long)rows_bad, (long)(T * Hq));
  return rows_bad == 0 ? 0 : 1;
}
int main() {
  int bad = 0;
  bad += run<64>({0, 1, 18, 82, 212, 300}, 4, 1);
  bad += run<64>({0, 70, 71, 200}, 2, 2);  // no GQA: dk/dv written by the dk/dv kernel itself
  bad += run<128>({0, 17, 18, 147}, 4, 2);
  // MLA's heads (DeepSeek-V3 / Moonlight): q/k 192 wide over v 128 wide; no GQA, and with GQA.
  bad += run<192, false, 128>({0, 1, 18, 82, 212}, 2, 2);
  bad += run<192, false, 128>({0, 17, 18, 147}, 4, 2);
  bad += run_decode<64>({0, 1, 18, 82, 212, 300}, 4, 1, true);
  bad += run_decode<128>({0, 17, 18, 147}, 4, 2, true);
  bad += run_decode<128>({0, 64, 65, 200}, 16, 1, false);
  bad += run_decode<64>({0, 70, 71, 200}, 2, 2, false);
  bad += run_decode<128>({0, 90, 91, 230}, 4, 2, true, 12);  // a page size that is no power of two
  bad += run_decode<128>({0, 17, 18, 147}, 4, 2, true, 16, 1);
  bad += run_decode<64>({0, 1, 18, 82, 212, 300}, 4, 1, true, 16, 1);
  // The tile-merge order: the forward against the double reference, the decode bitwise the forward.
  bad += run<64, true>({0, 1, 18, 82, 212, 300}, 4, 1);
  bad += run<128, true>({0, 17, 18, 147}, 4, 2);
  bad += run_decode<64, true>({0, 1, 18, 82, 212, 300}, 4, 1, true);
  bad += run_decode<128, true>({0, 17, 18, 147}, 4, 2, true);
  bad += run_decode<128, true>({0, 64, 65, 200}, 16, 1, false);
  bad += run_decode<128, true>({0, 90, 91, 230}, 4, 2, true, 12);
  bad += run_decode<128, true>({0, 17, 18, 147}, 4, 2, true, 16, 1);
  // ... with the tiles in parallel (E4M3 pools): sequences of 1 to 6 tiles (a partial second
  // round), groups 2 to 16, page sizes 16 and 12, folded pow2 scales.
  bad += run_decode<64, true, true>({0, 1, 18, 82, 212, 300}, 4, 1, true);
  bad += run_decode<128, true, true>({0, 17, 18, 147}, 4, 2, true);
  bad += run_decode<128, true, true>({0, 64, 65, 400}, 16, 1, true);
  bad += run_decode<128, true, true>({0, 90, 91, 230}, 4, 2, true, 12);
  bad += run_decode<128, true, true>({0, 17, 18, 147}, 4, 2, true, 16, 1);
  bad += run_decode<64, true, true>({0, 1, 18, 82, 212, 300}, 4, 1, true, 16, 1);
  bad += run_decode<64, true, true>({0, 590}, 2, 1, true);  // 10 tiles: three rounds, each prefetched
  std::printf(bad ? "FAIL\n" : "PASS\n");
  return bad;
}
