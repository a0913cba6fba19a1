// Mixture-of-experts kernels: softmax top-k routing and its backward, the permute (row gather,
// optionally weighted), the weighted un-permute (a fixed-order sum of each token's k rows: no
// atomics, deterministic) and the routing weights' gradient. Simple and correct first: one
// thread per token for the routing (E and k are small), grid-stride loops elsewhere; FP32 math.
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace fp8rl::cuda {

namespace {

// Row z [E] of the logits: its max m and sum_e exp(z_e - m) s (the softmax's normalizer).
__device__ void softmax_max_sum(const float* z, int E, float& m, float& s) {
  m = -INFINITY;
  for (int e = 0; e < E; ++e) m = fmaxf(m, z[e]);
  s = 0.0f;
  for (int e = 0; e < E; ++e) s += expf(z[e] - m);
}

// The weights of the k experts ex of one token: softmax probabilities p = exp(z - m) / s,
// divided by their sum (slot order) when renormalized. The one formula of the routing kernel
// and the replay kernel (bitwise equal weights for the same experts).
__device__ void softmax_weights_of(const float* z, float m, float s, const int32_t* ex, int k, bool renorm, float* w) {
  float sel = 0.0f;
  for (int j = 0; j < k; ++j) {
    const float p = expf(z[ex[j]] - m) / s;
    w[j] = p;
    sel += p;
  }
  if (renorm)
    for (int j = 0; j < k; ++j) w[j] /= sel;
}

// Token t: the k largest logits in descending order (ties: the lower expert id), their
// softmax probabilities (optionally renormalized). Ordering by logit = ordering by probability.
__global__ void moe_route_softmax_kernel(const float* logits, int64_t T, int E, int k, bool renorm,
                                         int32_t* experts, float* weights) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= T) return;
  const float* z = logits + t * E;
  float m, s;
  softmax_max_sum(z, E, m, s);
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= experts[t * k + i] == e;
      if (!taken && (best < 0 || z[e] > z[best])) best = e;
    }
    experts[t * k + j] = best;
  }
  softmax_weights_of(z, m, s, experts + t * k, k, renorm, weights + t * k);
}

// Routing replay: the weights of given experts (each in [0, E), else *bad = 1 and the token's
// weights 0).
__global__ void moe_route_softmax_weights_kernel(const float* logits, const int32_t* experts, int64_t T, int E, int k,
                                                 bool renorm, float* weights, int* bad) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= T) return;
  const int32_t* ex = experts + t * k;
  for (int j = 0; j < k; ++j)
    if (ex[j] < 0 || ex[j] >= E) {
      *bad = 1;
      for (int i = 0; i < k; ++i) weights[t * k + i] = 0.0f;
      return;
    }
  const float* z = logits + t * E;
  float m, s;
  softmax_max_sum(z, E, m, s);
  softmax_weights_of(z, m, s, ex, k, renorm, weights + t * k);
}

// dz_e = p_e (g_e - sum_j ds_j s_j) with s_j = p[e_j], ds_j = dw_j or (dw_j - sum_i dw_i w_i) / S.
__global__ void moe_route_softmax_backward_kernel(const float* logits, const int32_t* experts, const float* dw,
                                                  int64_t T, int E, int k, bool renorm, float* dlogits) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= T) return;
  const float* z = logits + t * E;
  float* dz = dlogits + t * E;
  float m = -INFINITY;
  for (int e = 0; e < E; ++e) m = fmaxf(m, z[e]);
  float s = 0.0f;
  for (int e = 0; e < E; ++e) s += expf(z[e] - m);
  float S = 0.0f, dot = 0.0f;
  for (int j = 0; j < k; ++j) S += expf(z[experts[t * k + j]] - m) / s;
  for (int j = 0; j < k; ++j) dot += dw[t * k + j] * (expf(z[experts[t * k + j]] - m) / s) / S;
  float c = 0.0f;
  for (int j = 0; j < k; ++j) {
    const float sj = expf(z[experts[t * k + j]] - m) / s;
    const float dsj = renorm ? (dw[t * k + j] - dot) / S : dw[t * k + j];
    c += dsj * sj;
  }
  for (int e = 0; e < E; ++e) dz[e] = -(expf(z[e] - m) / s) * c;
  for (int j = 0; j < k; ++j) {
    const int e = experts[t * k + j];
    const float sj = expf(z[e] - m) / s;
    dz[e] += sj * (renorm ? (dw[t * k + j] - dot) / S : dw[t * k + j]);
  }
}

// The weights of the k experts ex of one token under sigmoid scoring: s = sigmoid(z) of each,
// divided by (their sum (slot order) + 1e-20) when renormalized, times scaling. Shared by the
// routing and the replay kernels (bitwise equal weights for the same experts).
__device__ void sigmoid_weights_of(const float* z, const int32_t* ex, int k, bool renorm, float scaling, float* w) {
  float sel = 0.0f;
  for (int j = 0; j < k; ++j) {
    const float s = 1.0f / (1.0f + expf(-z[ex[j]]));
    w[j] = s;
    sel += s;
  }
  for (int j = 0; j < k; ++j) w[j] = (renorm ? w[j] / (sel + 1e-20f) : w[j]) * scaling;
}

// DeepSeek-V3 routing for token t (see backend.h moe_route_sigmoid). Groups are at most
// kMaxGroups; a group is kept when fewer than topk_group groups beat it (ties: the lower group).
constexpr int kMaxGroups = 64;
__global__ void moe_route_sigmoid_kernel(const float* logits, const float* bias, int64_t T, int E, int k, int n_group,
                                         int topk_group, bool renorm, float scaling, int32_t* experts, float* weights) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= T) return;
  const float* z = logits + t * E;
  const int G = E / n_group;
  auto sig = [&](int e) { return 1.0f / (1.0f + expf(-z[e])); };
  auto choice = [&](int e) { return sig(e) + (bias ? bias[e] : 0.0f); };
  float gs[kMaxGroups];
  for (int g = 0; g < n_group; ++g) {
    float m1 = -INFINITY, m2 = -INFINITY;
    for (int e = g * G; e < (g + 1) * G; ++e) {
      const float c = choice(e);
      if (c > m1) m2 = m1, m1 = c;
      else if (c > m2) m2 = c;
    }
    gs[g] = G == 1 ? m1 : m1 + m2;
  }
  auto kept = [&](int g) {
    int better = 0;
    for (int h = 0; h < n_group; ++h) better += gs[h] > gs[g] || (gs[h] == gs[g] && h < g);
    return better < topk_group;
  };
  auto masked = [&](int e) { return kept(e / G) ? choice(e) : 0.0f; };
  for (int j = 0; j < k; ++j) {
    int best = -1;
    float bv = 0.0f;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= experts[t * k + i] == e;
      if (taken) continue;
      const float v = masked(e);
      if (best < 0 || v > bv) best = e, bv = v;
    }
    experts[t * k + j] = best;
  }
  sigmoid_weights_of(z, experts + t * k, k, renorm, scaling, weights + t * k);
}

// Routing replay: the weights of given experts (each in [0, E), else *bad = 1 and the token's
// weights 0).
__global__ void moe_route_sigmoid_weights_kernel(const float* logits, const int32_t* experts, int64_t T, int E, int k,
                                                 bool renorm, float scaling, float* weights, int* bad) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= T) return;
  const int32_t* ex = experts + t * k;
  for (int j = 0; j < k; ++j)
    if (ex[j] < 0 || ex[j] >= E) {
      *bad = 1;
      for (int i = 0; i < k; ++i) weights[t * k + i] = 0.0f;
      return;
    }
  sigmoid_weights_of(logits + t * E, ex, k, renorm, scaling, weights + t * k);
}

__global__ void moe_route_sigmoid_backward_kernel(const float* logits, const int32_t* experts, const float* dw,
                                                  int64_t T, int E, int k, bool renorm, float scaling, float* dlogits) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= T) return;
  const float* z = logits + t * E;
  float* dz = dlogits + t * E;
  for (int e = 0; e < E; ++e) dz[e] = 0.0f;
  float S = 1e-20f, dot = 0.0f;
  for (int j = 0; j < k; ++j) {
    const float s = 1.0f / (1.0f + expf(-z[experts[t * k + j]]));
    S += s;
    dot += dw[t * k + j] * s;
  }
  for (int j = 0; j < k; ++j) {
    const int e = experts[t * k + j];
    const float s = 1.0f / (1.0f + expf(-z[e]));
    const float ds = renorm ? scaling / S * (dw[t * k + j] - dot / S) : scaling * dw[t * k + j];
    dz[e] += ds * s * (1.0f - s);
  }
}

template <class T>
__global__ void moe_permute_kernel(const T* x, const int32_t* row_slot, const float* w, int64_t R, int64_t D, int k,
                                   int64_t slots, T* out, int* bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < R * D;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / D, d = i % D;
    const int32_t s = row_slot[r];
    if (s < 0 || s >= slots) {
      *bad = 1;
      continue;
    }
    const float v = load_f(x, (s / k) * D + d);
    store_f(out, i, w ? v * w[s] : v);
  }
}

// The same, 8 columns per thread in 16-byte accesses (D % 8 == 0, aligned rows): each element's
// arithmetic is the scalar kernel's (bitwise the same). The scalar one's per-element divisions
// and 2-byte accesses left it at ~1/5 of HBM bandwidth on the MoE train step.
template <class T>
__global__ void moe_permute_vec_kernel(const T* x, const int32_t* row_slot, const float* w, int64_t R, int64_t D8,
                                       int k, int64_t slots, T* out, int* bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < R * D8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / D8, d = (i % D8) * 8;
    const int32_t s = row_slot[r];
    if (s < 0 || s >= slots) {
      *bad = 1;
      continue;
    }
    float v[8];
    load8(x + (s / k) * D8 * 8 + d, v);
    if (w) {
      const float ws = w[s];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = v[e] * ws;
    }
    store8(out + r * D8 * 8 + d, v);
  }
}

template <class T>
__global__ void moe_unpermute_kernel(const T* y, const int32_t* slot_row, const float* w, int64_t T_, int64_t D,
                                     int k, int64_t R, T* out, int* bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T_ * D;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / D, d = i % D;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int32_t r = slot_row[t * k + j];
      if (r < 0 || r >= R) {
        *bad = 1;
        continue;
      }
      const float v = load_f(y, r * D + d);
      acc += w ? w[t * k + j] * v : v;
    }
    store_f(out, i, acc);
  }
}

// One warp per slot: dw[s] = dot(dout[s / k], y[slot_row[s]]).
template <class T>
__global__ void moe_weight_grad_kernel(const T* dout, const T* y, const int32_t* slot_row, int64_t S, int64_t D,
                                       int k, int64_t R, float* dw, int* bad) {
  const int64_t s = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (s >= S) return;
  const int32_t r = slot_row[s];
  if (r < 0 || r >= R) {
    if (lane == 0) *bad = 1;
    return;
  }
  float acc = 0.0f;
  for (int64_t d = lane; d < D; d += 32) acc += load_f(dout, (s / k) * D + d) * load_f(y, r * D + d);
  acc = warp_sum(acc);
  if (lane == 0) dw[s] = acc;
}

}  // namespace

void launch_moe_route_softmax(const float* logits, int64_t T, int E, int k, bool renorm, int32_t* experts,
                              float* weights, cudaStream_t stream) {
  if (T == 0) return;
  moe_route_softmax_kernel<<<grid_for(T, 128), 128, 0, stream>>>(logits, T, E, k, renorm, experts, weights);
  CUDA_CHECK_LAUNCH("moe_route_softmax_kernel");
}

void launch_moe_route_softmax_backward(const float* logits, const int32_t* experts, const float* dweights, int64_t T,
                                       int E, int k, bool renorm, float* dlogits, cudaStream_t stream) {
  if (T == 0) return;
  moe_route_softmax_backward_kernel<<<grid_for(T, 128), 128, 0, stream>>>(logits, experts, dweights, T, E, k, renorm,
                                                                          dlogits);
  CUDA_CHECK_LAUNCH("moe_route_softmax_backward_kernel");
}

void launch_moe_route_sigmoid(const float* logits, const float* bias, int64_t T, int E, int k, int n_group,
                              int topk_group, bool renorm, float scaling, int32_t* experts, float* weights,
                              cudaStream_t stream) {
  if (T == 0) return;
  FP8RL_CHECK(n_group <= kMaxGroups, "moe_route_sigmoid: at most ", kMaxGroups, " groups on the GPU, got ", n_group);
  moe_route_sigmoid_kernel<<<grid_for(T, 128), 128, 0, stream>>>(logits, bias, T, E, k, n_group, topk_group, renorm,
                                                                 scaling, experts, weights);
  CUDA_CHECK_LAUNCH("moe_route_sigmoid_kernel");
}

void launch_moe_route_sigmoid_backward(const float* logits, const int32_t* experts, const float* dweights, int64_t T,
                                       int E, int k, bool renorm, float scaling, float* dlogits, cudaStream_t stream) {
  if (T == 0) return;
  moe_route_sigmoid_backward_kernel<<<grid_for(T, 128), 128, 0, stream>>>(logits, experts, dweights, T, E, k, renorm,
                                                                          scaling, dlogits);
  CUDA_CHECK_LAUNCH("moe_route_sigmoid_backward_kernel");
}

void launch_moe_route_softmax_weights(const float* logits, const int32_t* experts, int64_t T, int E, int k,
                                      bool renorm, float* weights, int* bad_flag, cudaStream_t stream) {
  if (T == 0) return;
  moe_route_softmax_weights_kernel<<<grid_for(T, 128), 128, 0, stream>>>(logits, experts, T, E, k, renorm, weights,
                                                                         bad_flag);
  CUDA_CHECK_LAUNCH("moe_route_softmax_weights_kernel");
}

void launch_moe_route_sigmoid_weights(const float* logits, const int32_t* experts, int64_t T, int E, int k,
                                      bool renorm, float scaling, float* weights, int* bad_flag, cudaStream_t stream) {
  if (T == 0) return;
  moe_route_sigmoid_weights_kernel<<<grid_for(T, 128), 128, 0, stream>>>(logits, experts, T, E, k, renorm, scaling,
                                                                         weights, bad_flag);
  CUDA_CHECK_LAUNCH("moe_route_sigmoid_weights_kernel");
}

void launch_moe_permute(const void* x, DType dt, const int32_t* row_slot, const float* weights, int64_t R, int64_t D,
                        int k, int64_t slots, void* out, int* bad_flag, cudaStream_t stream) {
  if (R * D == 0) return;
  if (vec8_ok(D, {x, out})) {
    FP8RL_DISPATCH_FLOAT(dt, "moe_permute", {
      moe_permute_vec_kernel<T><<<grid_for(R * D / 8, 256), 256, 0, stream>>>(
          static_cast<const T*>(x), row_slot, weights, R, D / 8, k, slots, static_cast<T*>(out), bad_flag);
    });
    CUDA_CHECK_LAUNCH("moe_permute_vec_kernel");
    return;
  }
  FP8RL_DISPATCH_FLOAT(dt, "moe_permute", {
    moe_permute_kernel<T><<<grid_for(R * D, 256), 256, 0, stream>>>(static_cast<const T*>(x), row_slot, weights, R, D,
                                                                    k, slots, static_cast<T*>(out), bad_flag);
  });
  CUDA_CHECK_LAUNCH("moe_permute_kernel");
}

void launch_moe_unpermute(const void* y, DType dt, const int32_t* slot_row, const float* weights, int64_t T_,
                          int64_t D, int k, int64_t R, void* out, int* bad_flag, cudaStream_t stream) {
  if (T_ * D == 0) return;
  FP8RL_DISPATCH_FLOAT(dt, "moe_unpermute", {
    moe_unpermute_kernel<T><<<grid_for(T_ * D, 256), 256, 0, stream>>>(static_cast<const T*>(y), slot_row, weights, T_,
                                                                       D, k, R, static_cast<T*>(out), bad_flag);
  });
  CUDA_CHECK_LAUNCH("moe_unpermute_kernel");
}

void launch_moe_weight_grad(const void* dout, const void* y, DType dt, const int32_t* slot_row, int64_t S, int64_t D,
                            int k, int64_t R, float* dweights, int* bad_flag, cudaStream_t stream) {
  if (S == 0) return;
  FP8RL_DISPATCH_FLOAT(dt, "moe_unpermute_backward_weights", {
    moe_weight_grad_kernel<T><<<grid_for(S * 32, 256), 256, 0, stream>>>(
        static_cast<const T*>(dout), static_cast<const T*>(y), slot_row, S, D, k, R, dweights, bad_flag);
  });
  CUDA_CHECK_LAUNCH("moe_weight_grad_kernel");
}

}  // namespace fp8rl::cuda
