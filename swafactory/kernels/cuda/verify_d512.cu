// Dense-run verify tile at head_dim 512: 64 rows (8 queries x 8 GQA heads) of one KV head.
//
// Why a kernel of our own: at D = 512 the 64 x 512 fp32 output tile is 128 KB of registers, so
// one warp cannot own a row block's whole width (256 registers a thread for o alone). Triton's
// `tl` makes both warpgroups compute the whole score tile; FlashInfer's prefill spills. Here the
// eight warps are four row blocks x two D halves. Each warp computes its half of the dot
// products (q[:, half] . k[:, half]), the two halves of a row block add their 16 x BN partial
// scores through shared memory (a + b == b + a, so both hold the same scores bit for bit), both
// run the same online softmax, and each multiplies P by its own half of V. So every K/V byte is
// read once per KV head, and o is 128 fp32 registers a thread.
//
// Two forms of the same tile. WGMMA=1 (Hopper, the default there): each D half is one warpgroup;
// its scores are one m64n32k16 wgmma chain from Q and K in shared memory, and P.V is m64n64k16
// wgmmas with P from registers and V read MN-major. So a warpgroup reads each K/V element from
// shared memory once. WGMMA=0 (other GPUs): ldmatrix + mma.sync, where each of a D half's four
// row-block warps reads it. The register layouts are the same, so only the matrix products
// differ. On the H200 (bench/results/probe-verify-cuda-d79e545.md) wgmma reads the dense run at
// 85% of copy bandwidth and mma.sync at 72%. The other switches below were measured and gave
// nothing; they stay for the sweeps.
//
// Keys: only the request's dense run [lo, hi) (every query sees every key there: no mask, no
// window), clipped to this program's split. The keys outside it (the draft tokens, a window edge)
// are another pass's; the two partial states are merged by LSE (merge.combine_splits).
// Pages: pool rows, one per key (page size 1), gathered by kv_indices with cp.async.
//
// Grid (batch, Hkv, splits); 256 threads; dynamic shared memory SMEM_BYTES.
#include <cuda_bf16.h>
#include <stdint.h>

#ifndef BN
#define BN 32  // keys per tile
#endif
#ifndef NS
#define NS 2  // shared-memory stages of K and V
#endif
#ifndef SPLITKV
#define SPLITKV 0  // K and V in separate cp.async groups: the scores start before V lands
#endif
#ifndef LAZY
#define LAZY 0  // rescale o only when some row's running max moved
#endif
#ifndef PAIRBAR
#define PAIRBAR 0  // the score exchange syncs the two warps of a row block, not all eight
#endif
#ifndef FULLS
#define FULLS 0  // each warp computes the whole scores (twice the QK work, no exchange)
#endif
#ifndef WGMMA
#define WGMMA 0  // Hopper warpgroup MMA from shared memory (sm_90a) instead of ldmatrix + mma.sync
#endif
#define D 512
#define ROWS 64
#define GROUP 8
#define NT 256
#define ROWB (D * 2)                 // bytes of one 512-wide bf16 row
#define Q_BYTES (ROWS * ROWB)
#define KV_BYTES (BN * ROWB)
#define X_BYTES (8 * (BN / 8) * 32 * 16)  // partial scores: warp x n-tile x lane x float4
#define SMEM_BYTES (Q_BYTES + 2 * NS * KV_BYTES + X_BYTES + 1024)  // + alignment slack
#define CPR (ROWB / 16)              // 16-byte chunks per row: 64
#define LOADS ((BN * CPR) / NT)      // chunks per thread per K (or V) tile

#if WGMMA
// row r, 16-byte chunk c of a tile of R rows -> byte offset, in wgmma's canonical 128-byte
// swizzled layout: 64-column blocks of R rows x 128 bytes, chunks XOR-swizzled by r % 8
// (blocks 1024-byte aligned). K-major for Q and K, MN-major (transposed) for V.
template <int R>
__device__ __forceinline__ uint32_t lay(int r, int c) {
  return (c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}
#else
// row r, 16-byte chunk c -> byte offset; chunks XOR-swizzled by r % 8 so ldmatrix is conflict free
template <int R>
__device__ __forceinline__ uint32_t lay(int r, int c) { return r * ROWB + ((c ^ (r & 7)) << 4); }
#endif
#define swz(r, c) lay<BN>(r, c)

// a wgmma shared-memory descriptor: 128-byte swizzle, leading / stride byte offsets
__device__ __forceinline__ uint64_t gdesc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) |
         ((uint64_t)(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void reg_fence(float& x) { asm volatile("" : "+f"(x)::"memory"); }

#if WGMMA
// s[4][4] (+)= Q[64 x 16] . K[32 x 16]^T, both K-major in shared memory
__device__ __forceinline__ void wg_qk(float (*s)[4], uint64_t da, uint64_t db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(s[0][0]), "+f"(s[0][1]), "+f"(s[0][2]), "+f"(s[0][3]), "+f"(s[1][0]), "+f"(s[1][1]),
        "+f"(s[1][2]), "+f"(s[1][3]), "+f"(s[2][0]), "+f"(s[2][1]), "+f"(s[2][2]), "+f"(s[2][3]),
        "+f"(s[3][0]), "+f"(s[3][1]), "+f"(s[3][2]), "+f"(s[3][3])
      : "l"(da), "l"(db), "r"(acc));
}
// o[8][4] += P[64 x 16] (registers) . V[16 x 64] (MN-major in shared memory)
__device__ __forceinline__ void wg_pv(float (*o)[4], const uint32_t* pa, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
      "{%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(o[0][0]), "+f"(o[0][1]), "+f"(o[0][2]), "+f"(o[0][3]), "+f"(o[1][0]), "+f"(o[1][1]),
        "+f"(o[1][2]), "+f"(o[1][3]), "+f"(o[2][0]), "+f"(o[2][1]), "+f"(o[2][2]), "+f"(o[2][3]),
        "+f"(o[3][0]), "+f"(o[3][1]), "+f"(o[3][2]), "+f"(o[3][3]), "+f"(o[4][0]), "+f"(o[4][1]),
        "+f"(o[4][2]), "+f"(o[4][3]), "+f"(o[5][0]), "+f"(o[5][1]), "+f"(o[5][2]), "+f"(o[5][3]),
        "+f"(o[6][0]), "+f"(o[6][1]), "+f"(o[6][2]), "+f"(o[6][3]), "+f"(o[7][0]), "+f"(o[7][1]),
        "+f"(o[7][2]), "+f"(o[7][3])
      : "r"(pa[0]), "r"(pa[1]), "r"(pa[2]), "r"(pa[3]), "l"(db));
}
#endif

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  int n = valid ? 16 : 0;  // 0: zero-fill, no read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm4(uint32_t addr, uint32_t& a, uint32_t& b, uint32_t& c,
                                      uint32_t& d) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(addr));
}
__device__ __forceinline__ void ldsm4t(uint32_t addr, uint32_t& a, uint32_t& b, uint32_t& c,
                                       uint32_t& d) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(addr));
}
__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// q: [total_q, Hq, 512] bf16 (strides sqt, sqh elements; last dim contiguous)
// k, v: [pool rows, Hkv, 512] bf16 (strides skr, skh / svr, svh elements)
// qo_indptr, kv_indptr: [B+1] int32; kv_indices: [total_kv] int32 pool rows
// rng: [B, 2] int32, the dense run (lo, hi) of each request, in its key list
// po: [total_q, Hq, P, 512] fp32 and plse: [total_q, Hq, P] fp32 partial states; this kernel
//   writes partial index part_base + split. scale_log2: softmax scale x log2(e).
extern "C" __global__ void __launch_bounds__(NT, 1)
    verify_d512(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                const __nv_bfloat16* __restrict__ v, const int* __restrict__ qo_indptr,
                const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
                const int* __restrict__ rng, float* __restrict__ po, float* __restrict__ plse,
                long long sqt, long long sqh, long long skr, long long skh, long long svr,
                long long svh, int Hq, int n_splits, int P, int part_base, float scale_log2) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t s_raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t s_q = (s_raw + 1023u) & ~1023u;  // swizzle atoms need 1024-byte alignment
  unsigned char* smem = smem_raw + (s_q - s_raw);
  const uint32_t s_k = s_q + Q_BYTES;
  const uint32_t s_v = s_k + NS * KV_BYTES;
  float4* xs = reinterpret_cast<float4*>(smem + Q_BYTES + 2 * NS * KV_BYTES);

  const int b = blockIdx.x, kh = blockIdx.y, sp = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rg = warp & 3, dh = warp >> 2;  // row block (16 rows), D half (256 columns)

  const int q0 = qo_indptr[b], nq = qo_indptr[b + 1] - q0;
  const int kv0 = kv_indptr[b], n = kv_indptr[b + 1] - kv0;
  const int chunk = (((n + n_splits - 1) / n_splits + BN - 1) / BN) * BN;
  const int lo = min(sp * chunk, n), hi = min(lo + chunk, n);
  const int a = min(max(rng[2 * b], lo), hi);
  const int e = min(max(rng[2 * b + 1], a), hi);
  const int ntiles = (e - a + BN - 1) / BN;

  // Q: 64 rows x 64 chunks, 16 per thread; rows past the request's queries are zeros
#pragma unroll
  for (int i = 0; i < (ROWS * CPR) / NT; ++i) {
    int c = i * NT + tid, r = c / CPR, ch = c % CPR, t = r / GROUP;
    bool ok = t < nq;
    const __nv_bfloat16* src = q + (ok ? (long long)(q0 + t) * sqt + (long long)(kh * GROUP + r % GROUP) * sqh + ch * 8 : 0);
    cp_async16(s_q + lay<ROWS>(r, ch), src, ok);
  }
  // the K/V rows this thread copies: row lr0 + 4 i (i < LOADS) of a tile, chunk lc
  const int lc = tid % CPR, lr0 = tid / CPR;
  const long long koff = (long long)kh * skh + lc * 8, voff = (long long)kh * svh + lc * 8;
  int rows_next[LOADS];
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    int key = a + lr0 + 4 * i;
    rows_next[i] = key < e ? kv_indices[kv0 + key] : -1;
  }
  auto issue = [&](int t) {  // copies tile t into stage t % NS, loads tile t+1's pool rows
    const int st = t % NS;
    const int nxt = a + (t + 1) * BN;
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      int row = rows_next[i];
      bool ok = row >= 0;
      cp_async16(s_k + st * KV_BYTES + swz(lr0 + 4 * i, lc), k + (ok ? (long long)row * skr + koff : 0), ok);
    }
#if SPLITKV
    cp_commit();
#endif
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      int rr = lr0 + 4 * i, row = rows_next[i];
      bool ok = row >= 0;
      cp_async16(s_v + st * KV_BYTES + swz(rr, lc), v + (ok ? (long long)row * svr + voff : 0), ok);
      int key = nxt + rr;
      rows_next[i] = key < e ? kv_indices[kv0 + key] : -1;
    }
    cp_commit();
  };
  auto skip = [&]() {  // the same number of groups as issue(), empty
#if SPLITKV
    cp_commit();
#endif
    cp_commit();
  };
#pragma unroll
  for (int t = 0; t < NS - 1; ++t) {  // the first group also holds Q
    if (t < ntiles) issue(t); else skip();
  }

  float o[32][4];
#pragma unroll
  for (int j = 0; j < 32; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows lane/4 and lane/4 + 8

  // ldmatrix lane addressing
  const int arow = rg * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), achk = lane >> 4;  // A = Q
  const int krow = (lane & 7) + 8 * (lane >> 4), kchk = (lane >> 3) & 1;            // B = K
  const int vrow = (lane & 7) + 8 * ((lane >> 3) & 1), vchk = lane >> 4;             // B = V^T

  for (int t = 0; t < ntiles; ++t) {
    if (t + NS - 1 < ntiles) issue(t + NS - 1); else skip();
#if SPLITKV
    cp_wait<2 * NS - 1>();  // K of tile t has landed (V of t and tiles t+1.. may be in flight)
#else
    cp_wait<NS - 1>();
#endif
#if WGMMA
    proxy_fence();  // cp.async wrote through the generic proxy; wgmma reads through the async one
#endif
    __syncthreads();
    const int st = t % NS;
    const uint32_t kb = s_k + st * KV_BYTES, vb = s_v + st * KV_BYTES;

    // partial scores over this warp's D half: 16 rows x BN keys
    float s[BN / 8][4];
#if WGMMA
    static_assert(BN == 32 && !FULLS, "the wgmma path is written for 32-key tiles, split scores");
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {  // k-steps of 16 columns over this D half
      const int blk = dh * 4 + kk / 4, off = (kk % 4) * 32;
      wg_qk(s, gdesc(s_q + blk * (ROWS * 128) + off, 16, 1024),
            gdesc(kb + blk * (BN * 128) + off, 16, 1024), kk > 0);
    }
    wg_commit();
    wg_wait0();
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
      for (int x = 0; x < 4; ++x) reg_fence(s[j][x]);
#else
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < (FULLS ? 32 : 16); ++kk) {
      const int c0 = (FULLS ? 0 : dh * 32) + 2 * kk;
      uint32_t a0, a1, a2, a3;
      ldsm4(s_q + lay<ROWS>(arow, c0 + achk), a0, a1, a2, a3);
#pragma unroll
      for (int p = 0; p < BN / 16; ++p) {
        uint32_t b0, b1, b2, b3;
        ldsm4(kb + swz(16 * p + krow, c0 + kchk), b0, b1, b2, b3);
        mma(s[2 * p], a0, a1, a2, a3, b0, b1);
        mma(s[2 * p + 1], a0, a1, a2, a3, b2, b3);
      }
    }
#endif
#if !FULLS  // add the other D half's partial scores
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
      xs[(warp * (BN / 8) + j) * 32 + lane] = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
#endif
#if SPLITKV
    cp_wait<2 * NS - 2>();  // V of tile t too
#if WGMMA
    proxy_fence();
#endif
#endif
#if PAIRBAR && !SPLITKV && !FULLS
    asm volatile("bar.sync %0, 64;\n" ::"r"(1 + rg));
#elif SPLITKV || !FULLS
    __syncthreads();  // the exchange, and (SPLITKV) every thread's V copies
#endif
    const int key0 = a + t * BN;
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#if FULLS
      const float4 o4 = make_float4(0.f, 0.f, 0.f, 0.f);
#else
      const float4 o4 = xs[(((warp ^ 4)) * (BN / 8) + j) * 32 + lane];
#endif
      const int kc = key0 + 8 * j + 2 * (lane & 3);
      const bool v0 = kc < e, v1 = kc + 1 < e;
      s[j][0] = v0 ? (s[j][0] + o4.x) * scale_log2 : -INFINITY;
      s[j][1] = v1 ? (s[j][1] + o4.y) * scale_log2 : -INFINITY;
      s[j][2] = v0 ? (s[j][2] + o4.z) * scale_log2 : -INFINITY;
      s[j][3] = v1 ? (s[j][3] + o4.w) * scale_log2 : -INFINITY;
      mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
      mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
    const float al0 = exp2f(m0 - mx0), al1 = exp2f(m1 - mx1);  // the first tile: exp2(-inf) = 0
    m0 = mx0;
    m1 = mx1;
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      s[j][0] = exp2f(s[j][0] - mx0);
      s[j][1] = exp2f(s[j][1] - mx0);
      s[j][2] = exp2f(s[j][2] - mx1);
      s[j][3] = exp2f(s[j][3] - mx1);
      l0 = (j == 0 ? l0 * al0 : l0) + s[j][0] + s[j][1];
      l1 = (j == 0 ? l1 * al1 : l1) + s[j][2] + s[j][3];
    }
#pragma unroll
    for (int p = 0; p < BN / 16; ++p) {  // the score C fragments are P's A fragments
      pa[p][0] = pack_bf16(s[2 * p][0], s[2 * p][1]);
      pa[p][1] = pack_bf16(s[2 * p][2], s[2 * p][3]);
      pa[p][2] = pack_bf16(s[2 * p + 1][0], s[2 * p + 1][1]);
      pa[p][3] = pack_bf16(s[2 * p + 1][2], s[2 * p + 1][3]);
    }
#if LAZY
    if (__any_sync(0xffffffff, al0 != 1.f || al1 != 1.f))
#endif
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[j][0] *= al0;
      o[j][1] *= al0;
      o[j][2] *= al1;
      o[j][3] *= al1;
    }
    // o[:, half] += P . V[:, half]
#if WGMMA
#pragma unroll
    for (int j = 0; j < 32; ++j)
      for (int x = 0; x < 4; ++x) reg_fence(o[j][x]);
    wg_fence();
#pragma unroll
    for (int p = 0; p < BN / 16; ++p)  // 16 keys: rows 16p.. of the tile, 2 groups of 8 at 1024 B
#pragma unroll
      for (int nb = 0; nb < 4; ++nb)   // 64-column blocks of this D half, BN x 128 B apart
        wg_pv(&o[8 * nb], pa[p], gdesc(vb + (dh * 4 + nb) * (BN * 128) + p * 2048, BN * 128, 1024));
    wg_commit();
    wg_wait0();
#pragma unroll
    for (int j = 0; j < 32; ++j)
      for (int x = 0; x < 4; ++x) reg_fence(o[j][x]);
#else
#pragma unroll
    for (int p = 0; p < BN / 16; ++p) {
#pragma unroll
      for (int j2 = 0; j2 < 16; ++j2) {
        uint32_t b0, b1, b2, b3;
        ldsm4t(vb + swz(16 * p + vrow, dh * 32 + 2 * j2 + vchk), b0, b1, b2, b3);
        mma(o[2 * j2], pa[p][0], pa[p][1], pa[p][2], pa[p][3], b0, b1);
        mma(o[2 * j2 + 1], pa[p][0], pa[p][1], pa[p][2], pa[p][3], b2, b3);
      }
    }
#endif
    __syncthreads();  // stage st is refilled by the next iteration's issue
  }
  cp_wait<0>();

  // A row that met a non-finite value is made NaN whole, as the Triton tile does: a NaN in V
  // reaches only one D half's columns, and a stale read must show in the whole row.
  int bad = 0;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    bad |= (!isfinite(o[j][0]) || !isfinite(o[j][1])) ? 1 : 0;
    bad |= (!isfinite(o[j][2]) || !isfinite(o[j][3])) ? 2 : 0;
  }
  bad |= __shfl_xor_sync(0xffffffff, bad, 1);
  bad |= __shfl_xor_sync(0xffffffff, bad, 2);
  int* flags = reinterpret_cast<int*>(xs);
  __syncthreads();  // the score exchange buffer is free
  flags[warp * 32 + lane] = bad;
  __syncthreads();
  bad |= flags[(warp ^ 4) * 32 + lane];

  l0 += __shfl_xor_sync(0xffffffff, l0, 1);
  l0 += __shfl_xor_sync(0xffffffff, l0, 2);
  l1 += __shfl_xor_sync(0xffffffff, l1, 1);
  l1 += __shfl_xor_sync(0xffffffff, l1, 2);
  float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  if (bad & 1) inv0 = __int_as_float(0x7fc00000);  // NaN
  if (bad & 2) inv1 = __int_as_float(0x7fc00000);
  const float LN2 = 0.6931471805599453f;
  const int r0 = rg * 16 + (lane >> 2), r1 = r0 + 8;
  const int t0 = r0 / GROUP, t1 = r1 / GROUP;
  const long long part0 = ((long long)(q0 + t0) * Hq + kh * GROUP + r0 % GROUP) * P + part_base + sp;
  const long long part1 = ((long long)(q0 + t1) * Hq + kh * GROUP + r1 % GROUP) * P + part_base + sp;
  const int col = dh * 256 + 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    if (t0 < nq)
      *reinterpret_cast<float2*>(po + part0 * D + col + 8 * j) = make_float2(o[j][0] * inv0, o[j][1] * inv0);
    if (t1 < nq)
      *reinterpret_cast<float2*>(po + part1 * D + col + 8 * j) = make_float2(o[j][2] * inv1, o[j][3] * inv1);
  }
  if (dh == 0 && (lane & 3) == 0) {
    if (t0 < nq) plse[part0] = l0 > 0.f ? (m0 + log2f(l0)) * LN2 : -INFINITY;
    if (t1 < nq) plse[part1] = l1 > 0.f ? (m1 + log2f(l1)) * LN2 : -INFINITY;
  }
}
