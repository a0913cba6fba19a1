// The Gumbel-max sampler of Backend::sample_rows on the GPU: one read of the logits per row.
//
// Row b is cut into `splits` chunks of 4-id groups; a block of kThreads reads its chunk once
// (16-byte F32 or 8-byte BF16 loads when the row stride allows: BF16 logits, the lm_head GEMM's
// output, are read as they are, half the bytes, with no conversion pass) and keeps, per thread, (1) the best score
// fl(logit * inv_t) + g over the drawable ids (sampling.h: Philox and the logarithms the CPU
// reference runs, so the argmax is the CPU's bit for bit), (2) an online max / sum of
// exp((logit - max) / T) over all ld ids for logp, and (3) the NaN / +inf check. A group
// whose largest logit cannot reach the block's best score even with the largest Gumbel noise
// (fl(l * inv_t) + kGumbelMax < best: rounding is monotone, so the skipped tokens' scores are
// below a score some token has) skips its Philox call and logarithms, and an id whose random bits
// already bound its noise below what it needs (sampling::gumbel_skippable: at a flat distribution
// nearly every id once the block has a best) skips the logarithms: the result is the same. Blocks write one partial per (row, split);
// a second kernel (a warp per row) merges them in a fixed order (ties: the lowest id) and
// writes the token and logp. Greedy rows (temperature 0) take the raw-logit argmax in the same
// pass. Truncating rows (top-k / top-p) are left to the radix kernel (sample_kernels.cu).
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/sampling.h"

namespace fp8rl::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;      // 16-byte loads in flight per thread
constexpr int kMaxSplits = 32;  // the merge kernel's warp holds one split per lane

struct GumbelPartial {
  float best;  // best score (greedy: best logit) over the chunk's drawable ids; -inf if none
  int32_t id;  // its id (the lowest among equal scores), -1 if none
  float m;     // max logit over the chunk's ids (all ld)
  float s;     // sum of exp2((logit - m) * log2e / T) over them
  int32_t bad; // a NaN / +inf logit in the chunk
  int32_t pad[3];
};

// Order-preserving map of a float to an unsigned (for atomicMax on scores).
__device__ __forceinline__ uint32_t order_key_f(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float order_key_inv(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// (best, id) merge: the larger score, the lower id on ties; an id of -1 loses to any.
__device__ __forceinline__ void merge_best(float& best, int32_t& id, float ob, int32_t oid) {
  if (oid < 0) return;
  if (id < 0 || ob > best || (ob == best && oid < id)) best = ob, id = oid;
}
// (m, s) merge of two online sums at scale c (log2e / T).
__device__ __forceinline__ void merge_lse(float& m, float& s, float om, float os, float c) {
  if (om == -INFINITY) return;
  if (m == -INFINITY) {
    m = om, s = os;
    return;
  }
  const float mn = fmaxf(m, om);
  s = s * exp2f((m - mn) * c) + os * exp2f((om - mn) * c);
  m = mn;
}

// Four consecutive logits of group g of a row as F32: one 16-byte (F32) or 8-byte (BF16) load
// when `vec`, else element by element, -inf past ld. BF16 -> F32 is exact: the draw and logp are
// those of the F32 copy of the same logits, bit for bit.
__device__ __forceinline__ float4 load_group(const float* row, int64_t g, int64_t ld, bool vec) {
  if (vec) return __ldcs(reinterpret_cast<const float4*>(row) + g);
  const int64_t j = 4 * g;
  return make_float4(row[j], j + 1 < ld ? row[j + 1] : -INFINITY, j + 2 < ld ? row[j + 2] : -INFINITY,
                     j + 3 < ld ? row[j + 3] : -INFINITY);
}
__device__ __forceinline__ float4 load_group(const bf16* row, int64_t g, int64_t ld, bool vec) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
  if (vec) {
    const uint2 u = __ldcs(reinterpret_cast<const uint2*>(h) + g);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
  }
  const int64_t j = 4 * g;
  return make_float4(bf16_bits_to_float(h[j]), j + 1 < ld ? bf16_bits_to_float(h[j + 1]) : -INFINITY,
                     j + 2 < ld ? bf16_bits_to_float(h[j + 2]) : -INFINITY,
                     j + 3 < ld ? bf16_bits_to_float(h[j + 3]) : -INFINITY);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    sample_gumbel_partial_kernel(const T* __restrict__ logits, int64_t ld, int64_t V, const SampleRow* rows,
                                 int64_t groups_per_split, bool vec, GumbelPartial* partial) {
  const int64_t b = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const SampleRow p = rows[b];
  const bool temp_ok = isfinite(p.temperature) && p.temperature >= 0.0f;
  if (!temp_ok || sample_row_truncates(p)) return;  // the merge kernel reports / the radix kernel draws
  const bool greedy = p.temperature == 0.0f;
  const float inv_t = greedy ? 1.0f : sampling::div_rn(1.0f, p.temperature);
  const float c = greedy ? 0.0f : 1.4426950408889634f * inv_t;  // log2(e) / T
  const T* row = logits + b * ld;
  const int64_t G = (ld + 3) / 4;
  const int64_t g0 = split * groups_per_split, g1 = min(G, g0 + groups_per_split);

  __shared__ uint32_t sh_best;  // order key of the best score any thread of the block has
  if (threadIdx.x == 0) sh_best = order_key_f(-INFINITY);
  __syncthreads();

  float best = -INFINITY, m = -INFINITY, s = 0.0f;
  int32_t id = -1;
  bool bad = false;
  for (int64_t gb = g0 + threadIdx.x; gb < g1; gb += static_cast<int64_t>(kUnroll) * kThreads) {
    float4 q[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t g = gb + static_cast<int64_t>(u) * kThreads;
      q[u] = g >= g1 ? make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY) : load_group(row, g, ld, vec);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t g = gb + static_cast<int64_t>(u) * kThreads;
      if (g >= g1) break;
      const float l[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
      const int64_t j0 = 4 * g;
      float lmax = -INFINITY, dmax = -INFINITY;  // all ids / drawable ids
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        bad |= isnan(l[k]) || l[k] == INFINITY;
        lmax = fmaxf(lmax, l[k]);
        if (j0 + k < V) dmax = fmaxf(dmax, l[k]);
      }
      if (!greedy && lmax > -INFINITY) {  // online sum of exp over all ids
        const float mn = fmaxf(m, lmax);
        float add = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) add += exp2f((l[k] - mn) * c);
        s = (m == -INFINITY ? 0.0f : s * exp2f((m - mn) * c)) + add;
        m = mn;
      }
      if (dmax == -INFINITY) continue;  // nothing drawable in the group
      if (greedy) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (j0 + k < V && l[k] > best) best = l[k], id = static_cast<int32_t>(j0 + k);
        continue;
      }
      const float bound = fmaxf(best, order_key_inv(*reinterpret_cast<volatile uint32_t*>(&sh_best)));
      if (sampling::add_rn(sampling::mul_rn(dmax, inv_t), sampling::kGumbelMax) < bound) continue;
      const sampling::Philox4 r = sampling::philox4x32_10(static_cast<uint32_t>(g), p.counter,
                                                          sampling::kGumbelDomain, 0u, p.key_lo, p.key_hi);
      const float before = best;
      // Ids whose bits already say they score below the bound skip the logarithms.
      const float thr = sampling::gumbel_skip_threshold(bound, sampling::mul_rn(dmax, inv_t));
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (j0 + k >= V || l[k] == -INFINITY || sampling::gumbel_skippable(r.v[k], thr)) continue;
        const float sc = sampling::gumbel_score(l[k], inv_t, sampling::gumbel_from_bits(r.v[k]));
        if (sc > best) best = sc, id = static_cast<int32_t>(j0 + k);
      }
      if (best > before) atomicMax(&sh_best, order_key_f(best));
    }
  }

  // Block reduction: warps by shuffles, then warp 0 over the warps' results (a fixed order).
  __shared__ GumbelPartial sh_part[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int bad_i = bad;
  for (int o = 16; o > 0; o >>= 1) {
    merge_best(best, id, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, id, o));
    const float om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
    if (!greedy) merge_lse(m, s, om, os, c);
    bad_i |= __shfl_xor_sync(0xffffffffu, bad_i, o);
  }
  if (lane == 0) sh_part[warp] = GumbelPartial{best, id, m, s, bad_i, {0, 0, 0}};
  __syncthreads();
  if (threadIdx.x == 0) {
    GumbelPartial r = sh_part[0];
    for (int w = 1; w < kThreads / 32; ++w) {
      merge_best(r.best, r.id, sh_part[w].best, sh_part[w].id);
      if (!greedy) merge_lse(r.m, r.s, sh_part[w].m, sh_part[w].s, c);
      r.bad |= sh_part[w].bad;
    }
    partial[b * splits + split] = r;
  }
}

// One warp per row: merges the row's partials (lane i: split i) and writes token and logp.
template <typename T>
__global__ void sample_gumbel_merge_kernel(const T* __restrict__ logits, int64_t B, int64_t ld,
                                           const SampleRow* rows, int splits, bool truncation,
                                           const GumbelPartial* partial, int32_t* tokens, float* logp, int* bad) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (b >= B) return;
  const SampleRow p = rows[b];
  const bool temp_ok = isfinite(p.temperature) && p.temperature >= 0.0f;
  if (temp_ok && sample_row_truncates(p) && truncation) return;  // the radix kernel's row
  bool ok = temp_ok && !sample_row_truncates(p);
  const bool greedy = p.temperature == 0.0f;
  const float c = ok && !greedy ? 1.4426950408889634f * sampling::div_rn(1.0f, p.temperature) : 0.0f;
  float best = -INFINITY, m = -INFINITY, s = 0.0f;
  int32_t id = -1;
  int bad_i = 0;
  if (ok && lane < splits) {
    const GumbelPartial q = partial[b * splits + lane];
    best = q.best, id = q.id, m = q.m, s = q.s, bad_i = q.bad;
  }
  for (int o = 16; o > 0; o >>= 1) {
    merge_best(best, id, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, id, o));
    const float om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
    if (!greedy) merge_lse(m, s, om, os, c);
    bad_i |= __shfl_xor_sync(0xffffffffu, bad_i, o);
  }
  if (lane != 0) return;
  ok = ok && !bad_i && id >= 0;
  if (!ok) {  // bad parameters, a NaN / +inf logit, or only -inf among the drawable ids
    atomicExch(bad, 1);
    tokens[b] = 0;
    logp[b] = NAN;
    return;
  }
  tokens[b] = id;
  if (greedy) {
    logp[b] = 0.0f;
    return;
  }
  // logp = (l - m) / T - log(s): the log-prob under softmax(logits / T) over all ld ids.
  const double l = load_f(logits, b * ld + id);
  logp[b] = static_cast<float>((l - static_cast<double>(m)) / static_cast<double>(p.temperature) -
                               log(static_cast<double>(s)));
}

}  // namespace

int sample_gumbel_splits(int64_t B, int64_t ld, int sm_count) {
  const int64_t G = (ld + 3) / 4;
  int64_t splits = B > 0 ? (2 * static_cast<int64_t>(sm_count) + B - 1) / B : 1;
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, G / kThreads));  // >= one group per thread
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(splits, kMaxSplits)));
}

size_t sample_gumbel_scratch_bytes(int64_t B, int splits) {
  return static_cast<size_t>(B) * splits * sizeof(GumbelPartial);
}

namespace {
template <typename T>
void launch_gumbel(const T* logits, int64_t B, int64_t ld, int64_t V, const SampleRow* rows, bool truncation,
                   int splits, void* scratch, int32_t* tokens, float* logp, int* bad_flag, cudaStream_t stream) {
  if (B == 0) return;
  FP8RL_CHECK(B <= 65535, "sample_rows: ", B, " rows exceed the grid's 65535 (sample in parts)");
  const int64_t G = (ld + 3) / 4;
  const int64_t gps = (G + splits - 1) / splits;
  const bool vec = ld % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % (4 * sizeof(T)) == 0;
  auto* part = static_cast<GumbelPartial*>(scratch);
  sample_gumbel_partial_kernel<T><<<dim3(static_cast<unsigned>(splits), static_cast<unsigned>(B)), kThreads, 0,
                                    stream>>>(logits, ld, V, rows, gps, vec, part);
  CUDA_CHECK_LAUNCH("sample_gumbel_partial_kernel");
  constexpr int kRowsPerBlock = 8;
  sample_gumbel_merge_kernel<T><<<static_cast<unsigned>((B + kRowsPerBlock - 1) / kRowsPerBlock), 32 * kRowsPerBlock,
                                  0, stream>>>(logits, B, ld, rows, splits, truncation, part, tokens, logp, bad_flag);
  CUDA_CHECK_LAUNCH("sample_gumbel_merge_kernel");
}
}  // namespace

void launch_sample_gumbel(const void* logits, DType dtype, int64_t B, int64_t ld, int64_t V, const SampleRow* rows,
                          bool truncation, int splits, void* scratch, int32_t* tokens, float* logp, int* bad_flag,
                          cudaStream_t stream) {
  FP8RL_CHECK(dtype == DType::F32 || dtype == DType::BF16, "sample_rows: logits must be F32 or BF16, got ",
              dtype_name(dtype));
  if (dtype == DType::F32)
    launch_gumbel(static_cast<const float*>(logits), B, ld, V, rows, truncation, splits, scratch, tokens, logp,
                  bad_flag, stream);
  else
    launch_gumbel(static_cast<const bf16*>(logits), B, ld, V, rows, truncation, splits, scratch, tokens, logp,
                  bad_flag, stream);
}

}  // namespace fp8rl::cuda
