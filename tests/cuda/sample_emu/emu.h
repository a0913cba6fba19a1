// Host emulation shim for the sampling kernel (see run.sh): 512 std::threads per block,
// std::barrier for __syncthreads and the warp exchanges, shared memory as host buffers.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__
#define INFINITY_F INFINITY
namespace emu {
using std::ceil;
using std::exp;
using std::floor;
using std::fmax;
using std::isnan;
using std::log;
struct EmuDim3 { int x = 0, y = 0, z = 0; };
inline thread_local EmuDim3 threadIdx, blockIdx;
inline EmuDim3 blockDim{512, 1, 1}, gridDim;
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
struct EmuWarp {
  std::barrier<> bar{32};
  uint64_t v[32];
};
inline thread_local EmuWarp* tw;
inline thread_local int tlane;
inline std::barrier<>* g_block_bar;
inline unsigned char* g_smem;         // dynamic shared memory
inline unsigned char* g_static_smem;  // the kernel's static __shared__ struct
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
template <class T>
T __shfl_xor_sync(unsigned, T v, int o) {
  static_assert(sizeof(T) <= 8);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  tw->v[tlane] = bits;
  tw->bar.arrive_and_wait();
  bits = tw->v[tlane ^ o];
  tw->bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}
inline int __any_sync(unsigned, int pred) {
  tw->v[tlane] = pred ? 1 : 0;
  tw->bar.arrive_and_wait();
  int any = 0;
  for (int i = 0; i < 32; ++i) any |= static_cast<int>(tw->v[i]);
  tw->bar.arrive_and_wait();
  return any;
}
inline int atomicExch(int* p, int v) {
  static std::mutex m;
  std::lock_guard<std::mutex> g(m);
  const int o = *p;
  *p = v;
  return o;
}
inline double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// Runs body() for every block of a 1-D grid of gx blocks with 512 threads (kSampleThreads).
inline void emu_launch(int gx, size_t static_bytes, size_t smem_bytes, const std::function<void()>& body) {
  std::vector<double> st(static_bytes / 8 + 2), dyn(smem_bytes / 8 + 2);
  g_static_smem = reinterpret_cast<unsigned char*>(st.data());
  g_smem = reinterpret_cast<unsigned char*>(dyn.data());
  std::barrier<> bb(512);
  g_block_bar = &bb;
  std::vector<EmuWarp> warps(16);
  std::vector<std::thread> th;
  gridDim = {gx, 1, 1};
  for (int t = 0; t < 512; ++t)
    th.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      tw = &warps[t / 32];
      tlane = t % 32;
      for (int x = 0; x < gx; ++x) {
        blockIdx = {x, 0, 0};
        body();
        bb.arrive_and_wait();
      }
    });
  for (auto& t : th) t.join();
}
}  // namespace emu
