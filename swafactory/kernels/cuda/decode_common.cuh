// Helpers shared by our decode kernels (decode_d64.cu, decode_fp8.cu): cp.async copies,
// ldmatrix / movmatrix, the m16n8k16 MMAs, 2^x, reductions over a lane % 4 class, the
// distributed-shared-memory loads of a cluster merge, the launch parameters and attributes, and
// the ring of a tile's pool rows and positions. launch.build_cubin hashes every .cuh
// beside a kernel's source, so a change here rebuilds the kernels that include it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  int n = valid ? 16 : 0;  // 0: zero-fill, no read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm4(uint32_t addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm4t(uint32_t addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ uint32_t movtrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// c += a . b over m16n8k16 tiles, fp32 accumulators; a, b: bf16 (mma_bf16) or fp16 (mma_f16)
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ float ex2(float x) {  // 2^x; -inf -> 0, NaN -> NaN (as Triton's exp)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float xmax(float x) {  // max over the 8 lanes of a lane % 4 class
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
__device__ __forceinline__ float xsum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

// thread-block clusters (Hopper): a barrier of the whole cluster, loads from a rank's smem
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n"
               ::: "memory");
}
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, int rank) {  // rank's smem address
  uint32_t ra;
  asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(addr), "r"(rank));
  return ra;
}
// no "memory" clobber: the loads follow a cluster barrier (asm volatile keeps them after it),
// and being free to issue them back to back lets their latencies overlap
__device__ __forceinline__ float ld_rank(uint32_t addr, int rank) {
  float x;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(map_rank(addr, rank)));
  return x;
}
__device__ __forceinline__ float4 ld_rank4(uint32_t addr, int rank) {  // 16-byte aligned
  float4 x;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(map_rank(addr, rank)));
  return x;
}

// The launch parameters both decode kernels take from -D flags (launch.py), with their defaults,
// and the launch attributes they imply: NT threads a CTA (the kernel defines NT), in clusters of
// CLUSTER CTAs along x (1: no cluster).
#ifndef GROUP
#define GROUP 8  // query heads per KV head (<= 8: the MMA's N)
#endif
#ifndef CLUSTER
#define CLUSTER 1  // splits of one (request, KV head); 1, 2, 4 or 8
#endif
#ifndef NS
#define NS 3  // shared-memory stages
#endif
#if CLUSTER > 1
#define KERNEL_ATTRS __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(NT)
#else
#define KERNEL_ATTRS __launch_bounds__(NT)
#endif

// The pool rows and positions of tile t, keys lo + t BN_ + [0, BN_) of a request's list (from
// kv0; keys past hi are zero-filled, not read), into the shared-memory ring slot at sb: [2][BN_]
// int32, rows then positions. NT_ threads share the copy, one 4-byte cp.async each per pass.
// UNROLLED: as a fixed count per thread, unrolled (2 BN_ a multiple of NT_); else a strided
// loop. Each kernel keeps the form it was measured with (the cubins are byte-identical to it).
template <int BN_, int NT_, bool UNROLLED>
__device__ __forceinline__ void load_tab(uint32_t sb, const int* kv_indices, const int* kv_pos,
                                         int kv0, int lo, int t, int hi, int tid) {
  if constexpr (UNROLLED) {
    static_assert((2 * BN_) % NT_ == 0, "an unrolled copy needs whole passes");
#pragma unroll
    for (int j = 0; j < (2 * BN_) / NT_; ++j) {
      const int x = tid + j * NT_, r = x % BN_;  // x < BN_: the row; else the position
      const int e = lo + t * BN_ + r;
      const int* src = (x < BN_ ? kv_indices : kv_pos) + kv0 + (e < hi ? e : 0);
      cp_async4(sb + x * 4, src, e < hi);
    }
  } else {
    for (int x = tid; x < 2 * BN_; x += NT_) {
      const int r = x % BN_, e = lo + t * BN_ + r;
      const int* src = (x < BN_ ? kv_indices : kv_pos) + kv0 + (e < hi ? e : 0);
      cp_async4(sb + x * 4, src, e < hi);
    }
  }
}

// The start of the cp.async ring both kernels pipeline their tiles through, NS_ stages deep:
// tab(t) brings tile t's pool rows and positions into the ring, issue(t) its K/V rows into stage
// t % NS_. Fills the first NS_ - 1 stages (group t: tile t's K/V and tile t + NS_ - 1's rows);
// each tile's turn then waits for it and issues tile t + NS_ - 1, in the kernel's own loop (as a
// helper here, nvcc scheduled decode_d64's loop differently).
template <int NS_, class Tab, class Issue>
__device__ __forceinline__ void ring_start(const Tab& tab, const Issue& issue, int ntiles) {
#pragma unroll
  for (int t = 0; t < NS_ - 1; ++t) tab(t);
  cp_commit();
  cp_wait<0>();
  __syncthreads();  // the first NS_ - 1 tiles' rows are in the ring
#pragma unroll
  for (int t = 0; t < NS_ - 1; ++t) {
    if (t < ntiles) issue(t);
    tab(t + NS_ - 1);
    cp_commit();
  }
}
