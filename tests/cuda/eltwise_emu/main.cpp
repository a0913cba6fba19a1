// Host emulation of the GPU's row-block FP8 kernels (see run.sh): the extracted device code runs
// one std::thread per GPU thread (a warp's 32 at a time, their shuffles through a barrier) and
// its outputs are compared bit for bit with a reference written here without the kernels' code:
// BF16 by bit rounding, E4M3 codes by a nearest-value search over the code table with true
// divisions x / s, the scale by fp8_rule.h's rule (the one the CPU quantizer uses).
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "quant/fp8_rule.h"

#define __device__
#define __global__
#define __forceinline__ inline

namespace emu {

using std::fabs;
using std::isfinite;
using std::isnan;
using fp8rl::Fp8Divisor;
using fp8rl::fp8_scale_from_amax;

struct Dim {
  int x = 0;
};
inline thread_local Dim threadIdx, blockIdx;
inline Dim blockDim, gridDim;

struct bf16 {
  uint16_t x;
};
struct alignas(8) uint2 {
  uint32_t x, y;
};
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
struct float2 {
  float x, y;
};
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
inline float fabsf(float a) { return std::fabs(a); }
inline float expf(float a) { return std::exp(a); }

// ---- the E4M3 and BF16 codecs (reference and shims) ----
inline float e4m3_value(int c) {  // codes 0 .. 126 (0x7f is NaN)
  const int e = (c >> 3) & 15, m = c & 7;
  return e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
}
// Round to nearest, ties to the even code, saturating to 448; NaN -> 0x7f | sign.
inline uint8_t e4m3_nearest(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7f;
  const double a = std::fabs(static_cast<double>(x));
  int best = 0;
  double bd = a;
  for (int c = 1; c <= 126; ++c) {
    const double d = std::fabs(e4m3_value(c) - a);
    if (d < bd || (d == bd && (c & 1) == 0)) best = c, bd = d;
  }
  return sign | static_cast<uint8_t>(best);
}
enum { __NV_SATFINITE, __NV_E4M3 };
inline uint16_t __nv_cvt_float2_to_fp8x2(float2 v, int, int) {
  return static_cast<uint16_t>(e4m3_nearest(v.x) | (e4m3_nearest(v.y) << 8));
}
inline uint16_t bf16_bits(float x) {  // nearest even; NaN -> quiet NaN, sign and payload kept
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- device primitives ----
inline void check_align(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16) {
    std::fprintf(stderr, "misaligned 16-byte %s at %p\n", what, p);
    std::abort();
  }
}
inline void load8(const float* p, float v[8]) {
  check_align(p, "load");
  for (int i = 0; i < 8; ++i) v[i] = p[i];
}
inline void load8(const bf16* p, float v[8]) {
  check_align(p, "load");
  for (int i = 0; i < 8; ++i) v[i] = bf16_float(p[i].x);
}
inline void store8_rounded(float* p, float v[8]) {
  check_align(p, "store");
  for (int i = 0; i < 8; ++i) p[i] = v[i];
}
inline void store8_rounded(bf16* p, float v[8]) {
  check_align(p, "store");
  for (int i = 0; i < 8; ++i) {
    p[i].x = bf16_bits(v[i]);
    v[i] = bf16_float(p[i].x);
  }
}
inline void store8(float* p, const float v[8]) {
  check_align(p, "store");
  for (int i = 0; i < 8; ++i) p[i] = v[i];
}
inline void store8(bf16* p, const float v[8]) {
  check_align(p, "store");
  for (int i = 0; i < 8; ++i) p[i].x = bf16_bits(v[i]);
}
inline float2 fp8_e4m3x2_to_float2(uint32_t two) {
  const auto dec = [](uint8_t c) {
    const float m = e4m3_value(c & 0x7f);
    return (c & 0x80) ? -m : m;
  };
  return {dec(static_cast<uint8_t>(two & 0xff)), dec(static_cast<uint8_t>((two >> 8) & 0xff))};
}
struct KvRoundScales {
  float v[64];
};
inline void divmod_index(int64_t n, int64_t d, int64_t& q, int64_t& r) {
  q = n / d;
  r = n % d;
}
inline float swiglu_value(float g, float u) { return g * (1.0f / (1.0f + std::exp(-g))) * u; }
inline void swiglu_backward_value(float d, float g, float u, float& dg, float& du) {
  const float sg = 1.0f / (1.0f + std::exp(-g));
  du = d * g * sg;
  dg = d * u * sg * (1.0f + g * (1.0f - sg));
}
inline int atomicExch(int* p, int v) {
  return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}

struct Warp {
  explicit Warp() : bar(32) {}
  std::barrier<> bar;
  float f[32] = {};
  bool alive[32] = {};
};
inline thread_local Warp* tw;
inline thread_local int tlane;
inline float __shfl_xor_sync(unsigned mask, float v, int o) {
  const int p = tlane ^ o;
  if (!((mask >> tlane) & 1u) || !((mask >> p) & 1u)) {
    std::fprintf(stderr, "shuffle: lane %d or its partner %d is not in the mask %08x\n", tlane, p, mask);
    std::abort();
  }
  tw->f[tlane] = v;
  tw->bar.arrive_and_wait();
  if (!tw->alive[p]) {
    std::fprintf(stderr, "shuffle: lane %d reads lane %d, which has exited\n", tlane, p);
    std::abort();
  }
  const float r = tw->f[p];
  tw->bar.arrive_and_wait();
  return r;
}

#include "kern.inc"

// Runs body() as grid x block threads, one warp of std::threads at a time.
void launch(int64_t threads_total, int block, const std::function<void()>& body) {
  blockDim.x = block;
  gridDim.x = static_cast<int>((threads_total + block - 1) / block);
  for (int b = 0; b < gridDim.x; ++b)
    for (int w = 0; w < block / 32; ++w) {
      Warp warp;
      for (bool& a : warp.alive) a = true;
      std::vector<std::thread> lanes;
      for (int l = 0; l < 32; ++l)
        lanes.emplace_back([&, l] {
          tw = &warp;
          tlane = l;
          blockIdx.x = b;
          threadIdx.x = w * 32 + l;
          body();
          warp.alive[l] = false;
          warp.bar.arrive_and_drop();
        });
      for (auto& t : lanes) t.join();
    }
}

}  // namespace emu

using emu::bf16;

// ---- buffers and the reference ----
struct Buf {
  std::shared_ptr<uint8_t> p;
  size_t n;
  explicit Buf(size_t bytes) : p(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)), std::free), n(bytes) {
    std::memset(p.get(), 0xa5, (bytes + 63) / 64 * 64);
  }
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(p.get());
  }
};

int g_fail = 0, g_cases = 0;
bool same(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }
void expect(bool ok, const std::string& what) {
  if (!ok && g_fail++ < 20) std::fprintf(stderr, "FAIL %s\n", what.c_str());
}

template <class T>
float get(const Buf& b, int64_t i) {
  if constexpr (std::is_same_v<T, float>) return b.as<float>()[i];
  else return emu::bf16_float(b.as<bf16>()[i].x);
}
template <class T>
Buf make(const std::vector<float>& v) {  // values rounded to T
  Buf b(v.size() * sizeof(T));
  for (size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<T, float>) b.as<float>()[i] = v[i];
    else b.as<bf16>()[i].x = emu::bf16_bits(v[i]);
  }
  return b;
}
template <class T>
float round_t(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return emu::bf16_float(emu::bf16_bits(x));
}

std::vector<float> wide(int64_t n, int64_t C, std::mt19937& gen) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ue(-6.0f, 3.0f);
  std::vector<float> v(n);
  float s = 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (i % C == 0) s = std::pow(10.0f, ue(gen));
    v[i] = nd(gen) * s;
  }
  if (n >= 3 * C)
    for (int64_t j = 0; j < C; ++j) v[C + j] = 0.0f;  // an all-zero row: scale 1
  return v;
}

// The stored output y [R, C] (as T), its codes q and scales against the reference quantizer.
template <class T>
void check_quant(const std::string& name, const std::vector<float>& y, const Buf& q, const Buf& sc, int64_t R,
                 int64_t C, bool pow2, bool gemm_layout) {
  const int64_t nb = (C + 127) / 128;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.0f;
      for (int64_t c = b * 128; c < std::min(C, b * 128 + 128); ++c) amax = std::max(amax, std::fabs(y[r * C + c]));
      const float s = fp8rl::fp8_scale_from_amax(amax, pow2);
      const float got = sc.as<float>()[gemm_layout ? b * R + r : r * nb + b];
      expect(std::memcmp(&s, &got, 4) == 0, name + ": scale of row " + std::to_string(r) + " block " +
                                                std::to_string(b));
      for (int64_t c = b * 128; c < std::min(C, b * 128 + 128); ++c) {
        const uint8_t want = emu::e4m3_nearest(y[r * C + c] / s), have = q.as<uint8_t>()[r * C + c];
        expect(want == have, name + ": code of (" + std::to_string(r) + ", " + std::to_string(c) + ")");
      }
    }
}

struct Shape {
  int64_t R, C;
};
const Shape kShapes[] = {{1, 8}, {3, 128}, {2, 136}, {5, 264}, {4, 1000}, {17, 256}, {2, 2056}, {3, 392}};

template <class T>
void run_rows(std::mt19937& gen) {
  for (const Shape& sh : kShapes)
    for (bool pow2 : {false, true})
      for (bool gl : {false, true}) {
        const int64_t R = sh.R, C = sh.C;
        const std::vector<float> x = wide(R * C, C, gen);
        Buf xb = make<T>(x), q(R * C), sc(R * ((C + 127) / 128) * 4);
        int bad = 0;
        emu::launch(emu::row_block_threads(R, C), 256, [&] {
          emu::quant_rows_vec_kernel<T>(xb.as<T>(), R, C, pow2, q.as<uint8_t>(), sc.as<float>(), gl, &bad);
        });
        std::vector<float> y(R * C);
        for (int64_t i = 0; i < R * C; ++i) y[i] = round_t<T>(x[i]);
        const std::string name = "quant_rows " + std::to_string(R) + "x" + std::to_string(C);
        check_quant<T>(name, y, q, sc, R, C, pow2, gl);
        expect(bad == 0, name + ": flag");
        ++g_cases;
      }
}

template <class T>
void run_swiglu(std::mt19937& gen) {
  for (const Shape& sh : kShapes)
    for (bool cat : {false, true})  // gate | up in one [R, 2F] tensor (ld 2F), or two [R, F]
      for (bool pow2 : {false, true}) {
        const int64_t R = sh.R, F = sh.C, ld = cat ? 2 * F : F;
        const bool gl = !pow2;
        std::vector<float> gu = wide(R * 2 * F, F, gen);
        Buf gb = make<T>(std::vector<float>(gu.begin(), gu.begin() + R * ld));
        Buf ub = make<T>(std::vector<float>(gu.begin() + R * F, gu.end()));
        const T* g = gb.as<T>();
        const T* u = cat ? g + F : ub.as<T>();
        Buf out(R * F * sizeof(T)), q(R * F), sc(R * ((F + 127) / 128) * 4);
        int bad = 0;
        emu::launch(emu::row_block_threads(R, F), 256, [&] {
          emu::swiglu_fp8_kernel<T>(g, u, ld, out.as<T>(), R, F, pow2, q.as<uint8_t>(), sc.as<float>(), gl, &bad);
        });
        const Buf& gsrc = gb;
        const Buf& usrc = cat ? gb : ub;
        const int64_t uoff = cat ? F : 0;
        std::vector<float> y(R * F);
        const std::string name = std::string("swiglu_fp8 ") + std::to_string(R) + "x" + std::to_string(F);
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = 0; c < F; ++c) {
            y[r * F + c] = round_t<T>(emu::swiglu_value(get<T>(gsrc, r * ld + c), get<T>(usrc, r * ld + uoff + c)));
            expect(same(get<T>(out, r * F + c), y[r * F + c]), name + ": out");
          }
        check_quant<T>(name, y, q, sc, R, F, pow2, gl);
        expect(bad == 0, name + ": flag");
        ++g_cases;
      }
}

template <class T>
void run_add(std::mt19937& gen) {
  for (const Shape& sh : kShapes)
    for (bool alias : {false, true}) {
      const int64_t R = sh.R, D = sh.C;
      const bool pow2 = alias, gl = !alias;
      const std::vector<float> av = wide(R * D, D, gen), bv = wide(R * D, D, gen);
      Buf a = make<T>(av), b = make<T>(bv), out(R * D * sizeof(T)), q(R * D), sc(R * ((D + 127) / 128) * 4);
      std::vector<float> y(R * D);
      for (int64_t i = 0; i < R * D; ++i) y[i] = round_t<T>(get<T>(a, i) + get<T>(b, i));
      T* o = alias ? a.as<T>() : out.as<T>();
      int bad = 0;
      emu::launch(emu::row_block_threads(R, D), 256, [&] {
        emu::add_fp8_kernel<T>(a.as<T>(), b.as<T>(), o, R, D, pow2, q.as<uint8_t>(), sc.as<float>(), gl, &bad);
      });
      const std::string name = std::string("add_fp8 ") + (alias ? "in place " : "") + std::to_string(R) + "x" +
                               std::to_string(D);
      const Buf& ob = alias ? a : out;
      for (int64_t i = 0; i < R * D; ++i) expect(same(get<T>(ob, i), y[i]), name + ": out " + std::to_string(i));
      check_quant<T>(name, y, q, sc, R, D, pow2, gl);
      expect(bad == 0, name + ": flag");
      ++g_cases;
    }
}

template <class T>
void run_swiglu_backward(std::mt19937& gen) {
  for (const Shape& sh : kShapes)
    for (bool pow2 : {false, true}) {
      const int64_t R = sh.R, F = sh.C;
      const bool gl = pow2;
      Buf d = make<T>(wide(R * F, F, gen)), g = make<T>(wide(R * F, F, gen)), u = make<T>(wide(R * F, F, gen));
      Buf dg(R * F * sizeof(T)), du(R * F * sizeof(T)), qg(R * F), qu(R * F), sg(R * ((F + 127) / 128) * 4),
          su(R * ((F + 127) / 128) * 4);
      int bad = 0;
      emu::launch(emu::row_block_threads(R, F), 256, [&] {
        emu::swiglu_backward_fp8_kernel<T>(d.as<T>(), g.as<T>(), u.as<T>(), dg.as<T>(), du.as<T>(), R, F, pow2,
                                           qg.as<uint8_t>(), sg.as<float>(), qu.as<uint8_t>(), su.as<float>(), gl,
                                           &bad);
      });
      std::vector<float> yg(R * F), yu(R * F);
      const std::string name = std::string("swiglu_backward_fp8 ") + std::to_string(R) + "x" + std::to_string(F);
      for (int64_t i = 0; i < R * F; ++i) {
        float a, b;
        emu::swiglu_backward_value(get<T>(d, i), get<T>(g, i), get<T>(u, i), a, b);
        yg[i] = round_t<T>(a);
        yu[i] = round_t<T>(b);
        expect(same(get<T>(dg, i), yg[i]) && same(get<T>(du, i), yu[i]), name + ": out " + std::to_string(i));
      }
      check_quant<T>(name + " dgate", yg, qg, sg, R, F, pow2, gl);
      check_quant<T>(name + " dup", yu, qu, su, R, F, pow2, gl);
      expect(bad == 0, name + ": flag");
      ++g_cases;
    }
}

// A NaN or an infinity anywhere sets the flag (the op then refuses the output).
template <class T>
void run_non_finite() {
  for (float badv : {NAN, INFINITY})
    for (int64_t at : {int64_t{0}, int64_t{200}, int64_t{391}}) {
      const int64_t R = 3, C = 392;
      std::vector<float> x(R * C, 0.5f);
      x[at] = badv;
      Buf xb = make<T>(x), q(R * C), sc(R * 4 * 4);
      int bad = 0;
      emu::launch(emu::row_block_threads(R, C), 256, [&] {
        emu::quant_rows_vec_kernel<T>(xb.as<T>(), R, C, false, q.as<uint8_t>(), sc.as<float>(), false, &bad);
      });
      expect(bad == 1, "quant_rows: non-finite at " + std::to_string(at) + " not flagged");
      ++g_cases;
    }
}

// KV writes through a slot table into a pool of more slots than tokens (the rest must stay as
// they were), E4M3 codes e4m3(x / s[head]) or the values rounded to the pool's type.
template <class TS, class TP>
void run_kv_write(std::mt19937& gen) {
  for (int Hkv : {1, 8})
    for (int hd : {8, 64, 128})
      for (bool with_v : {true, false}) {
        const int64_t T = 13, P = 29, n = T * Hkv * hd, pn = P * Hkv * hd;
        std::vector<int32_t> perm(P);
        for (int i = 0; i < P; ++i) perm[i] = i;
        std::shuffle(perm.begin(), perm.end(), gen);
        std::vector<int32_t> slots(perm.begin(), perm.begin() + T);
        Buf k = make<TS>(wide(n, Hkv * hd, gen)), v = make<TS>(wide(n, Hkv * hd, gen));
        std::vector<float> ks(Hkv), vs(Hkv);
        std::uniform_real_distribution<float> ue(-8.0f, 2.0f);
        for (int h = 0; h < Hkv; ++h) ks[h] = std::pow(10.0f, ue(gen)), vs[h] = std::pow(10.0f, ue(gen));
        Buf kp(pn * sizeof(TP)), vp(pn * sizeof(TP));  // 0xa5 bytes: the untouched slots
        std::vector<uint8_t> untouched(kp.p.get(), kp.p.get() + pn * sizeof(TP));
        emu::launch(n / 8, 256, [&] {
          emu::kv_write8_kernel<TS, TP>(k.as<TS>(), v.as<TS>(), slots.data(), n / 8, Hkv, hd / 8, kp.as<TP>(),
                                        with_v ? vp.as<TP>() : nullptr, ks.data(), vs.data());
        });
        const std::string name = std::string("kv_write8 ") + (std::is_same_v<TP, uint8_t> ? "e4m3" : "") +
                                 " Hkv " + std::to_string(Hkv) + " hd " + std::to_string(hd) +
                                 (with_v ? "" : " k only");
        std::vector<char> written(P, 0);
        for (int64_t t = 0; t < T; ++t) written[slots[t]] = 1;
        for (int which = 0; which < (with_v ? 2 : 1); ++which) {
          const Buf& src = which ? v : k;
          const Buf& pool = which ? vp : kp;
          const std::vector<float>& sc = which ? vs : ks;
          for (int64_t t = 0; t < T; ++t)
            for (int64_t e = 0; e < Hkv * hd; ++e) {
              const int64_t i = t * Hkv * hd + e, dst = static_cast<int64_t>(slots[t]) * Hkv * hd + e;
              const float x = get<TS>(src, i);
              bool ok;
              if constexpr (std::is_same_v<TP, uint8_t>) ok = pool.as<uint8_t>()[dst] == emu::e4m3_nearest(x / sc[e / hd]);
              else ok = same(get<TP>(pool, dst), round_t<TP>(x));
              expect(ok, name + (which ? ": v" : ": k") + " element " + std::to_string(i));
            }
        }
        for (int s2 = 0; s2 < P; ++s2)
          if (!written[s2])
            expect(std::memcmp(kp.p.get() + s2 * Hkv * hd * sizeof(TP), untouched.data() + s2 * Hkv * hd * sizeof(TP),
                               Hkv * hd * sizeof(TP)) == 0,
                   name + ": slot " + std::to_string(s2) + " was not ours");
        ++g_cases;
      }
}

template <class T>
void run_kv_round(std::mt19937& gen) {
  for (int H : {1, 8})
    for (int hd : {8, 128}) {
      const int64_t Tk = 11, n = Tk * H * hd;
      const std::vector<float> x0 = wide(n, H * hd, gen);
      Buf x = make<T>(x0);
      std::vector<float> ref(n);
      emu::KvRoundScales s{};
      std::uniform_real_distribution<float> ue(-6.0f, 1.0f);
      for (int h = 0; h < H; ++h) s.v[h] = std::pow(10.0f, ue(gen));
      for (int64_t i = 0; i < n; ++i) {
        const float sc = s.v[(i / hd) % H], xi = get<T>(x, i);
        const uint8_t c = emu::e4m3_nearest(xi / sc);
        const float m = emu::e4m3_value(c & 0x7f);
        ref[i] = round_t<T>(((c & 0x80) ? -m : m) * sc);
      }
      emu::launch(n / 8, 256, [&] { emu::kv_round8_kernel<T>(x.as<T>(), n / 8, H, hd / 8, s); });
      for (int64_t i = 0; i < n; ++i)
        expect(same(get<T>(x, i), ref[i]), "kv_round8 H " + std::to_string(H) + " hd " + std::to_string(hd) +
                                               " element " + std::to_string(i));
      ++g_cases;
    }
}

int main() {
  std::mt19937 gen(2026);
  run_rows<float>(gen);
  run_rows<bf16>(gen);
  run_swiglu<float>(gen);
  run_swiglu<bf16>(gen);
  run_add<float>(gen);
  run_add<bf16>(gen);
  run_swiglu_backward<float>(gen);
  run_swiglu_backward<bf16>(gen);
  run_non_finite<float>();
  run_non_finite<bf16>();
  run_kv_write<float, uint8_t>(gen);
  run_kv_write<bf16, uint8_t>(gen);
  run_kv_write<bf16, bf16>(gen);
  run_kv_write<float, bf16>(gen);
  run_kv_write<bf16, float>(gen);
  run_kv_round<float>(gen);
  run_kv_round<bf16>(gen);
  std::printf("%s: %d cases, %d failures\n", g_fail ? "FAIL" : "PASS", g_cases, g_fail);
  return g_fail ? 1 : 0;
}
