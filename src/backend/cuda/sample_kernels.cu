// Token sampling on the GPU, the semantics of backend.h / cpu_sample.cpp: per row b, z = logits
// / temperature, tokens ordered by z descending (ties: lower id first), top-k, then the smallest
// top-p prefix of the renormalized top-k mass, then an inverse-CDF draw with the given uniform.
//
// One block per row, no sort. Each token has an order key (the float bits of z mapped to an
// unsigned integer that orders like z) and a weight e = exp(z - zmax) rounded to FP32, both
// recomputed from the logits in every pass (no scratch traffic). "The first token in the order
// at which the cumulative weight passes Y" is found by a digit-wise radix search on the key:
// the largest key v with sum_{key >= v} weight > Y (or >= Y), 4 bits per pass (8 passes): each
// thread accumulates the FP64 weight of the tokens under the current prefix into its own 16
// bins in shared memory (no atomics: deterministic), the bins are reduced in a fixed order, and
// the largest digit whose cumulative mass (above the prefix + that digit and larger) crosses Y
// extends the prefix. Then one pass gathers the tokens of key v (equal z, equal weight) and
// they are split arithmetically; only when the i-th of them by id is not the first is it found
// with a block scan. Sums are FP64, weights FP32: results equal the CPU's (FP64 throughout)
// unless a uniform lands within rounding of a boundary between two tokens (logits that are
// well separated never do). Rows are ld apart; only their first V ids can be drawn (V < ld: a
// vocabulary padded past the tokenizer's), the rest enter only logp's normalization (backend.h).
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace fp8rl::cuda {

namespace {

constexpr int kSampleThreads = 512;  // one block (row) per SM: ~82 registers, no spills
constexpr int kDigitBits = 4;
constexpr int kBins = 1 << kDigitBits;
// Dynamic shared memory: per-thread bins [kBins][kSampleThreads] doubles (64 KiB).
constexpr size_t kBinBytes = sizeof(double) * kBins * kSampleThreads;

__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

__device__ __forceinline__ uint32_t order_key(float z) {
  const uint32_t u = __float_as_uint(z);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Calls f(logit, j) for j = threadIdx.x, + blockDim.x, ... < V, in that order, with kLoads
// loads in flight per thread (the passes are bound by the memory latency).
constexpr int kLoads = 8;
template <class F>
__device__ __forceinline__ void for_row(const float* row, int64_t V, F&& f) {
  const int64_t T = blockDim.x;
  for (int64_t j0 = threadIdx.x; j0 < V; j0 += kLoads * T) {
    float l[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) l[u] = j0 + u * T < V ? row[j0 + u * T] : 0.0f;
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      if (j0 + u * T < V) f(l[u], j0 + u * T);
  }
}

// The row's view: key and FP32-rounded weight of token j, recomputed from the logit.
struct RowView {
  const float* row;
  float tau;
  double zmax;
  __device__ __forceinline__ uint32_t key(int64_t j) const { return order_key(row[j] / tau); }
  __device__ __forceinline__ double weight_of(float l) const {
    return static_cast<double>(static_cast<float>(exp(static_cast<double>(l) / tau - zmax)));
  }
};

struct SampleShared {
  double red[32];
  float redf[32];
  int redi[32];
  int64_t counts[kSampleThreads];
  int64_t found;
  double bin_total[kBins];
  double w0[kBins];  // level-0 weight bins (the top digit), filled by the log-sum-exp pass
  double bin_part[kSampleThreads / 32];
  uint32_t prefix;
  double above;
  int ok;
};

__device__ double block_sum_d(double v, SampleShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum_d(v);
  __syncthreads();
  if (lane == 0) sh.red[warp] = v;
  __syncthreads();
  v = lane < nw ? sh.red[lane] : 0.0;
  return warp_sum_d(v);
}

// Block max of v, NaN counted as +inf (the caller flags +inf). Every thread gets the result.
__device__ float block_max_nan_inf(float v, SampleShared& sh) {
  if (isnan(v)) v = INFINITY;
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.redf[threadIdx.x >> 5] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) m = sh.redf[i] > m ? sh.redf[i] : m;
  return m;
}

// Sums the per-thread bins [kBins][kSampleThreads] into sh.bin_total in a fixed order: kPer
// threads per bin, each sums kBins columns, then warp sums. Call after a barrier; ends with one.
constexpr int kPer = kSampleThreads / kBins;
static_assert(kPer % 32 == 0, "each bin needs whole warps");
__device__ void reduce_bins(const double* bins, SampleShared& sh) {
  const int t = threadIdx.x, d = t / kPer, r = t % kPer;
  double s = 0.0;
  for (int i = 0; i < kBins; ++i) s += bins[d * kSampleThreads + r + kPer * i];
  s = warp_sum_d(s);
  if ((t & 31) == 0) sh.bin_part[t >> 5] = s;
  __syncthreads();
  if (t < kBins) {
    double tot = 0.0;
    for (int p = 0; p < kPer / 32; ++p) tot += sh.bin_part[t * (kPer / 32) + p];
    sh.bin_total[t] = tot;
  }
  __syncthreads();
}

// Largest key v such that W(v) = sum over tokens with key >= v of (count ? 1 : weight)
// satisfies W(v) > Y (strict) or W(v) >= Y. Returns false when even v = 0 fails. Digit-wise:
// after each pass the prefix p (the top bits fixed so far) satisfies W(p.000) > Y with
// `above` = the mass of keys above the prefix's range.
template <bool kCount>
__device__ bool search_key(const RowView& rv, int64_t V, double Y, bool strict, SampleShared& sh, double* bins,
                           uint32_t& out) {
  const int t = threadIdx.x;
  __syncthreads();  // every thread is done reading the state of the previous search
  if (t == 0) {
    sh.prefix = 0;
    sh.above = 0.0;
    sh.ok = 1;
  }
  for (int level = 0; level < 32 / kDigitBits; ++level) {
    const int shift = 32 - kDigitBits * (level + 1);
    __syncthreads();  // the prefix of the previous level is visible; the bins are free
    const uint32_t prefix = sh.prefix;
    const bool have_totals = !kCount && level == 0;  // the weight bins of the top digit: sh.w0
    if (!have_totals) {
#pragma unroll
      for (int d = 0; d < kBins; ++d) bins[d * kSampleThreads + t] = 0.0;
      // Thread t owns column t of the bins: no atomics, and its 32 lanes hit distinct banks.
      for_row(rv.row, V, [&](float l, int64_t) {
        const uint32_t k = order_key(l / rv.tau);
        if (level > 0 && (k >> (shift + kDigitBits)) != (prefix >> (shift + kDigitBits))) return;
        const int dg = static_cast<int>((k >> shift) & (kBins - 1));
        bins[dg * kSampleThreads + t] += kCount ? 1.0 : rv.weight_of(l);
      });
      __syncthreads();
      reduce_bins(bins, sh);
    } else if (t < kBins) {
      sh.bin_total[t] = sh.w0[t];  // (read by thread 0 after the barrier below)
    }
    __syncthreads();
    if (t == 0) {
      const double above = sh.above;
      double hi = above;  // mass of digits > d
      int chosen = -1;
      double chosen_above = above;
      for (int d = kBins - 1; d >= 0; --d) {
        const double w = hi + sh.bin_total[d];
        if (strict ? w > Y : w >= Y) {
          chosen = d;
          chosen_above = hi;
          break;
        }
        hi = w;
      }
      if (chosen < 0) {
        if (level == 0) {
          sh.ok = 0;
        } else {  // rounding between levels: the last occupied digit (the end of the prefix's range)
          hi = above;
          for (int d = kBins - 1; d >= 0; --d) {
            if (sh.bin_total[d] > 0.0 || (d == 0 && chosen < 0)) chosen = d, chosen_above = hi;
            hi += sh.bin_total[d];
          }
        }
      }
      if (chosen >= 0) {
        sh.prefix = prefix | (static_cast<uint32_t>(chosen) << shift);
        sh.above = chosen_above;
      }
    }
    __syncthreads();
    if (!sh.ok) return false;
  }
  out = sh.prefix;
  return true;
}

struct KeyStats {
  double above_w;     // weight of tokens with key > v
  int64_t above_n;    // their count
  int64_t tie_n;      // tokens with key == v
  double tie_w;       // the weight of one of them (all equal: equal z)
  int64_t tie_first;  // the lowest id among them (V if none)
};

__device__ KeyStats key_stats(const RowView& rv, int64_t V, uint32_t v, SampleShared& sh) {
  double aw = 0.0, an = 0.0, tn = 0.0, tw = 0.0;
  int64_t first = V;
  for_row(rv.row, V, [&](float l, int64_t j) {
    const uint32_t k = order_key(l / rv.tau);
    if (k > v) {
      aw += rv.weight_of(l);
      an += 1.0;
    } else if (k == v) {
      tn += 1.0;
      tw = fmax(tw, rv.weight_of(l));
      if (j < first) first = j;
    }
  });
  KeyStats s;
  s.above_w = block_sum_d(aw, sh);
  s.above_n = static_cast<int64_t>(block_sum_d(an, sh));
  s.tie_n = static_cast<int64_t>(block_sum_d(tn, sh));
  // The largest tie weight (they are all equal; max is robust to lanes without ties), lowest id.
  for (int o = 16; o > 0; o >>= 1) {
    tw = fmax(tw, __shfl_xor_sync(0xffffffffu, tw, o));
    const int64_t of = __shfl_xor_sync(0xffffffffu, first, o);
    if (of < first) first = of;
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    sh.red[threadIdx.x >> 5] = tw;
    sh.counts[threadIdx.x >> 5] = first;
  }
  __syncthreads();
  double m = 0.0;
  int64_t f = V;
  for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) {
    m = fmax(m, sh.red[i]);
    if (sh.counts[i] < f) f = sh.counts[i];
  }
  s.tie_w = m;
  s.tie_first = f;
  return s;
}

// The id of the i-th token (0-based, by id) whose key is v.
__device__ int64_t nth_with_key(const RowView& rv, int64_t V, uint32_t v, int64_t i, const KeyStats& st,
                                SampleShared& sh) {
  if (i == 0) return st.tie_first;  // block-uniform
  const int64_t chunk = (V + blockDim.x - 1) / blockDim.x;
  const int64_t b = threadIdx.x * chunk, e = clamp64(b + chunk, 0, V);
  int64_t n = 0;
  for (int64_t j = b; j < e; ++j) n += rv.key(j) == v;
  __syncthreads();
  sh.counts[threadIdx.x] = n;
  if (threadIdx.x == 0) sh.found = -1;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t acc = 0;
    for (int t = 0; t < static_cast<int>(blockDim.x); ++t) {
      const int64_t c = sh.counts[t];
      sh.counts[t] = acc;
      acc += c;
    }
  }
  __syncthreads();
  const int64_t start = sh.counts[threadIdx.x];
  if (i >= start && i < start + n) {
    int64_t k = start;
    for (int64_t j = b; j < e; ++j)
      if (rv.key(j) == v) {
        if (k == i) {
          sh.found = j;
          break;
        }
        ++k;
      }
  }
  __syncthreads();
  return sh.found;
}

// The token at position pos (0-based) of the order.
__device__ int64_t token_at(const RowView& rv, int64_t V, int64_t pos, SampleShared& sh, double* bins) {
  uint32_t v = 0;
  search_key<true>(rv, V, static_cast<double>(pos + 1), false, sh, bins, v);
  const KeyStats st = key_stats(rv, V, v, sh);
  int64_t i = pos - st.above_n;
  i = clamp64(i, 0, st.tie_n - 1);
  return nth_with_key(rv, V, v, i, st, sh);
}

// The first position whose cumulative weight passes Y (> when strict, else >=), as (position,
// token, cumulative weight through it); false if no position does (rounding at the very end).
struct Crossing {
  int64_t pos, token;
  double cum;
};
__device__ bool first_crossing(const RowView& rv, int64_t V, double Y, bool strict, SampleShared& sh, double* bins,
                               Crossing& out) {
  uint32_t v = 0;
  if (!search_key<false>(rv, V, Y, strict, sh, bins, v)) return false;
  const KeyStats st = key_stats(rv, V, v, sh);
  if (st.tie_n == 0 || st.tie_w <= 0.0) return false;
  const double need = (Y - st.above_w) / st.tie_w;
  int64_t i = strict ? static_cast<int64_t>(floor(need)) : static_cast<int64_t>(ceil(need)) - 1;
  i = clamp64(i, 0, st.tie_n - 1);
  out.pos = st.above_n + i;
  out.cum = st.above_w + static_cast<double>(i + 1) * st.tie_w;
  out.token = nth_with_key(rv, V, v, i, st, sh);
  return true;
}

__global__ void __launch_bounds__(kSampleThreads, 1)
    sample_kernel(const float* __restrict__ logits, int64_t ld, int64_t V, const float* __restrict__ temperature,
                  const float* __restrict__ top_p, const int32_t* __restrict__ top_k,
                  const float* __restrict__ uniforms, int64_t pstride, bool only_truncating,
                  int32_t* __restrict__ tokens, float* __restrict__ logp, int* bad) {
  __shared__ SampleShared sh;
  extern __shared__ double bins[];  // [kBins][kSampleThreads]
  const int64_t b = blockIdx.x;
  const float* row = logits + b * ld;  // ids [0, V) only: V < ld masks a padded vocabulary
  // Row b's parameters are element b * pstride of each array (1: separate arrays; 8: fields of
  // SampleRow). only_truncating: rows without top-k / top-p are another kernel's (skipped).
  const float tau = temperature[b * pstride], row_top_p = top_p[b * pstride], u = uniforms[b * pstride];
  const int32_t row_top_k = top_k[b * pstride];
  const bool truncates = tau != 0.0f && (row_top_k != 0 || row_top_p < 1.0f);
  if (only_truncating && !(truncates && tau > 0.0f && tau < INFINITY)) return;
  if (!(tau >= 0.0f && tau < INFINITY) || !(row_top_p > 0.0f && row_top_p <= 1.0f) || row_top_k < 0 ||
      !(u >= 0.0f && u < 1.0f)) {  // the parameters (checked on the host too, when they come from it)
    if (threadIdx.x == 0) {
      atomicExch(bad, 1);
      tokens[b] = 0;
      logp[b] = NAN;
    }
    return;
  }

  // Max logit (lowest id on ties), and the NaN / +inf check.
  float mx = -INFINITY;
  int64_t arg = V;
  bool invalid = false;
  for_row(row, V, [&](float l, int64_t j) {
    invalid |= isnan(l) || l == INFINITY;
    if (l > mx) mx = l, arg = j;  // j increases: the first max of this thread is its lowest id
  });
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, mx, o);
    const int64_t oa = __shfl_xor_sync(0xffffffffu, arg, o);
    if (om > mx || (om == mx && oa < arg)) mx = om, arg = oa;
  }
  const int warp_bad = __any_sync(0xffffffffu, invalid);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    sh.redf[threadIdx.x >> 5] = mx;
    sh.counts[threadIdx.x >> 5] = arg;
    sh.redi[threadIdx.x >> 5] = warp_bad;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    int64_t a = V;
    int any_bad = 0;
    for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) {
      if (sh.redf[i] > m || (sh.redf[i] == m && sh.counts[i] < a)) m = sh.redf[i], a = sh.counts[i];
      any_bad |= sh.redi[i];
    }
    sh.redf[0] = m;
    sh.found = a;
    sh.redi[0] = any_bad;
  }
  __syncthreads();
  mx = sh.redf[0];
  arg = sh.found;
  if (sh.redi[0] || mx == -INFINITY) {
    if (threadIdx.x == 0) {
      atomicExch(bad, 1);
      tokens[b] = 0;
      logp[b] = NAN;
    }
    return;
  }
  // A padded vocabulary (ld > V): the padding's max, and the NaN / +inf check there too.
  float pm = -INFINITY;
  if (ld > V) {
    for (int64_t j = V + threadIdx.x; j < ld; j += blockDim.x) {
      const float l = row[j];
      if (isnan(l) || l == INFINITY) pm = INFINITY;
      else if (l > pm) pm = l;
    }
    pm = block_max_nan_inf(pm, sh);
    if (pm == INFINITY) {
      if (threadIdx.x == 0) {
        atomicExch(bad, 1);
        tokens[b] = 0;
        logp[b] = NAN;
      }
      return;
    }
  }
  if (tau == 0.0f) {  // greedy
    if (threadIdx.x == 0) {
      tokens[b] = static_cast<int32_t>(arg);
      logp[b] = 0.0f;
    }
    return;
  }

  // lse in FP64 (the CPU's z is FP64: logit / tau, exp(z - zmax)).
  const double zmax = static_cast<double>(mx) / tau;
  const RowView rv{row, tau, zmax};
  // The same pass fills the level-0 weight bins (top digit of the key) of the weight searches.
  double se = 0.0;
#pragma unroll
  for (int d = 0; d < kBins; ++d) bins[d * kSampleThreads + threadIdx.x] = 0.0;
  for_row(row, V, [&](float l, int64_t) {
    const double e = exp(static_cast<double>(l) / tau - zmax);
    se += e;
    const uint32_t top = order_key(l / tau) >> (32 - kDigitBits);
    bins[top * kSampleThreads + threadIdx.x] += static_cast<double>(static_cast<float>(e));  // = rv.weight_of(l)
  });
  se = block_sum_d(se, sh);  // synchronizes: the bins are complete
  reduce_bins(bins, sh);
  if (threadIdx.x < kBins) sh.w0[threadIdx.x] = sh.bin_total[threadIdx.x];  // read after search_key's barriers
  const double lse = zmax + log(se);
  // A padded vocabulary: ids [V, ld) are never drawn, but logp is normalized over all ld ids
  // (backend.h): lse_all = log(e^lse + e^lse_pad), each with its own max.
  double lse_all = lse;
  if (ld > V) {
    if (pm > -INFINITY) {
      const double pmax = static_cast<double>(pm) / tau;
      double ps = 0.0;
      for (int64_t j = V + threadIdx.x; j < ld; j += blockDim.x) ps += exp(static_cast<double>(row[j]) / tau - pmax);
      ps = block_sum_d(ps, sh);
      const double lse_pad = pmax + log(ps);
      const double hi = lse > lse_pad ? lse : lse_pad, lo = lse > lse_pad ? lse_pad : lse;
      lse_all = hi + log(1.0 + exp(lo - hi));
    }
  }

  // top-k: the kept mass is the cumulative weight through position keep - 1.
  int64_t keep = row_top_k > 0 ? clamp64(row_top_k, 1, V) : V;
  double kept = se;
  if (keep < V) {
    uint32_t v = 0;
    search_key<true>(rv, V, static_cast<double>(keep), false, sh, bins, v);
    const KeyStats st = key_stats(rv, V, v, sh);
    kept = st.above_w + static_cast<double>(keep - st.above_n) * st.tie_w;
  }
  // top-p: the smallest prefix (within the top-k) whose weight reaches top_p * kept.
  if (row_top_p < 1.0f) {
    Crossing c;
    if (first_crossing(rv, V, static_cast<double>(row_top_p) * kept, false, sh, bins, c) && c.pos + 1 < keep) {
      keep = c.pos + 1;
      kept = c.cum;
    }
  }
  // The draw: the first kept token whose cumulative weight exceeds u * kept; else the last kept.
  Crossing c;
  int64_t tok;
  if (first_crossing(rv, V, static_cast<double>(u) * kept, true, sh, bins, c) && c.pos < keep) {
    tok = c.token;
  } else {
    tok = token_at(rv, V, keep - 1, sh, bins);
  }
  if (threadIdx.x == 0) {
    tokens[b] = static_cast<int32_t>(tok);
    logp[b] = static_cast<float>(static_cast<double>(row[tok]) / tau - lse_all);
  }
}

}  // namespace

void launch_sample(const float* logits, int64_t B, int64_t ld, int64_t V, const float* temperature, const float* top_p,
                   const int32_t* top_k, const float* uniforms, int64_t pstride, bool only_truncating, int32_t* tokens,
                   float* logp, int* bad_flag, cudaStream_t stream) {
  if (B == 0) return;
  // The bins exceed the default 48 KiB of dynamic shared memory (set per call: per device).
  // Not while a graph is being captured: the op ran once before (backend.h's rule for record).
  if (!stream_capturing(stream))
    CUDA_CHECK(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kBinBytes)),
               "raising sample_kernel's shared memory limit");
  sample_kernel<<<static_cast<unsigned>(B), kSampleThreads, kBinBytes, stream>>>(
      logits, ld, V, temperature, top_p, top_k, uniforms, pstride, only_truncating, tokens, logp, bad_flag);
  CUDA_CHECK_LAUNCH("sample_kernel");
}

}  // namespace fp8rl::cuda
