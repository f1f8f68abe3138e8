// Split-KV paged decode over an fp8 e4m3 pool, head_dim 256 or 512 (Gemma 4's two layer groups).
//
// Why a kernel of our own: an fp8 pool should halve a decode step's time, and neither library
// kernel gets there on SM90. FlashInfer's fp8 decode beats its bf16 by 1.23x at head_dim 256 and
// has no head_dim-512 fp8 kernel; our Triton tile converts e4m3 at about the bf16 tile's time
// per key (bench/results/probe-fp8-tile-5705fd3.md). Here e4m3 bytes go from shared memory
// straight into the MMA's register layout (ldmatrix on byte pairs, one prmt for V, cvt to fp16)
// and meet fp16 tensor cores, with no shared-memory round trip for the conversion.
//
// Layout. Keys are the MMA's M dimension and the GROUP (<= 8) query heads its N (m16n8k16, fp16
// in, fp32 accumulate), as in decode_d64.cu. The four warps split head_dim: warp w owns d in
// [w D/4, (w+1) D/4). S^T = K . Q^T is summed over the warps' slices through shared memory, so
// every warp holds the same scores and the same online softmax; O^T += V^T . P^T needs no
// exchange (each warp accumulates its own d). Reading K as the A operand by ldmatrix gives a
// thread four consecutive bytes d 4c..4c+3 of a key; the MMA's k index is permuted to match
// (k 2c, 2c+1 <- d 4c, 4c+1; k 2c+8, 2c+9 <- d 4c+2, 4c+3) and Q's B fragment is built with the
// same permutation (a dot product does not care about the order of its terms). V^T comes from
// ldmatrix.trans (two keys x two d per thread) and a prmt that pairs the keys of each d.
//
// Scales: stored = K / k_scale, V / v_scale (per layer). k_scale joins the softmax scale on the
// fp32 scores, v_scale the output. q is rounded to fp16 (|q| < 65504).
//
// Splits: the CLUSTER splits of one (request, KV head) are one thread-block cluster and rank 0
// merges their states through distributed shared memory, adds the sink, writes o and the LSE.
// Keys no query may see (past q, outside the window) are not read (cp.async zero-fill) and score
// -inf; a visible NaN propagates to o. The step's K/V is stored (quantized) before this kernel.
//
// Grid (CLUSTER, Hkv, B), clusters along x; 128 threads; dynamic shared memory SMEM_BYTES.
#include "decode_common.cuh"

#ifndef D
#define D 512  // head_dim: 256 or 512
#endif
#ifndef BN
#define BN 32  // keys per tile: 32 or 64
#endif
#define NT 128
#define DW (D / 4)               // d of one warp
#define CH (D / 16)              // 16-byte chunks of one row (one KV head's e4m3 row: D bytes)
#define MT (BN / 16)             // 16-key MMA tiles per tile
#define TILE_BYTES (BN * D)      // K (or V) of one tile
#define STAGE_BYTES (2 * TILE_BYTES)
#define TR (2 * NS)              // ring slots of pool rows and positions
#define VIS_OFF (NS * STAGE_BYTES)
#define TAB_OFF (VIS_OFF + NS * BN * 4)
#define RED_OFF (TAB_OFF + TR * 2 * BN * 4)
#define SMEM_BYTES (RED_OFF + 4 * MT * 32 * 16)
static_assert(D == 256 || D == 512, "head_dim 256 or 512");
static_assert(GROUP >= 1 && GROUP <= 8, "GROUP is the MMA's N (8)");
static_assert(BN == 32 || BN == 64, "BN: 32 or 64 keys");
static_assert(NS * STAGE_BYTES >= (16 + 8 * D) * 4, "the merge state reuses the ring");
static_assert(NT % CH == 0 && BN % (NT / CH) == 0, "whole rows per copy pass");

// row r, 16-byte chunk c of a [BN, D] e4m3 tile -> byte offset; chunks XOR-swizzled by r % 8 so
// ldmatrix's eight rows hit eight different bank groups
__device__ __forceinline__ uint32_t swz(int r, int c) { return r * D + ((c ^ (r & 7)) << 4); }

// four e4m3 bytes -> (bytes 0, 1) and (bytes 2, 3) as fp16 pairs, the lower byte in the lower half
__device__ __forceinline__ void e4m3x4(uint32_t x, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.rn.f16x2.e4m3x2 %0, a;\n"
      "cvt.rn.f16x2.e4m3x2 %1, b;\n}\n" : "=r"(lo), "=r"(hi) : "r"(x));
}
__device__ __forceinline__ uint32_t prmt(uint32_t x, uint32_t sel) {
  uint32_t y;
  asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(y) : "r"(x), "r"(sel));
  return y;
}


// q: [B, Hq, D] bf16 (strides sqt, sqh elements; last dim contiguous), one query per request
// k, v: [pool rows, Hkv, D] e4m3 bytes (strides skr, skh / svr, svh)
// kv_indptr: [B+1] int32; kv_indices: [total_kv] int32 pool rows; q_pos: [B] int32;
// kv_pos: [total_kv] int32; sinks: [Hq] fp32 or null
// o: [B, Hq, D] bf16 (strides sot, soh); lse: [B, Hq] fp32 (natural log)
// window: keys with q_pos - kv_pos < window are visible (0: no window); scale_log2: softmax
//   scale x k_scale x log2(e); v_scale: the V pool's scale
extern "C" __global__ void KERNEL_ATTRS
    decode_fp8(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ k,
               const uint8_t* __restrict__ v, const int* __restrict__ kv_indptr,
               const int* __restrict__ kv_indices, const int* __restrict__ q_pos,
               const int* __restrict__ kv_pos, const float* __restrict__ sinks,
               __nv_bfloat16* __restrict__ o, float* __restrict__ lse, long long sqt,
               long long sqh, long long skr, long long skh, long long svr, long long svh,
               long long sot, long long soh, int Hq, int window, float scale_log2,
               float v_scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  int* s_vis = reinterpret_cast<int*>(smem + VIS_OFF);  // [NS][BN] visibility
  float4* s_red = reinterpret_cast<float4*>(smem + RED_OFF);  // [4 warps][MT][32 lanes]

  const int rank = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;

  const int kv0 = kv_indptr[b], n = kv_indptr[b + 1] - kv0;
  const int qp = q_pos[b];
  const int chunk = (((n + CLUSTER - 1) / CLUSTER + BN - 1) / BN) * BN;
  const int lo = min(rank * chunk, n), hi = min(lo + chunk, n);
  const int ntiles = (hi - lo + BN - 1) / BN;

  // Q^T B fragments of this warp's d slice, k permuted as K's A fragment (see the header):
  // b0 = Q[g][16x + 4c, +1], b1 = Q[g][16x + 4c + 2, +3] for each chunk x of the slice
  uint32_t qb[DW / 16][2];
  {
    const bool ok = g < GROUP;
    const __nv_bfloat16* qr = q + b * sqt + (kh * GROUP + (ok ? g : 0)) * sqh + warp * DW;
#pragma unroll
    for (int x = 0; x < DW / 16; ++x) {
      const uint2 w = *reinterpret_cast<const uint2*>(qr + 16 * x + 4 * c);
      const float2 f0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
      const float2 f1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
      qb[x][0] = ok ? pack_f16(f0.x, f0.y) : 0u;
      qb[x][1] = ok ? pack_f16(f1.x, f1.y) : 0u;
    }
  }

  // loads: CH threads copy a row's 16-byte chunks; thread tid takes chunk tid % CH of rows
  // tid / CH + (NT / CH) i. Pool rows and positions come a tile group ahead through a
  // shared-memory ring (as in decode_d64.cu), so issuing a tile never waits on a global load.
  const int lrow = tid / CH, lch = tid % CH;
  auto tab = [&](int t) {  // pool rows and positions of tile t into ring slot t % TR
    if (t * BN >= hi - lo) return;
    load_tab<BN, NT, false>(s_base + TAB_OFF + (t % TR) * (2 * BN * 4), kv_indices, kv_pos, kv0,
                           lo, t, hi, tid);
  };
  auto issue = [&](int t) {  // tile t into stage t % NS, its rows from ring slot t % TR
    const int st = t % NS;
    const uint32_t kb = s_base + st * STAGE_BYTES, vb = kb + TILE_BYTES;
    const int* tb = reinterpret_cast<const int*>(smem + TAB_OFF + (t % TR) * (2 * BN * 4));
#pragma unroll
    for (int i = 0; i < BN / (NT / CH); ++i) {
      const int r = lrow + (NT / CH) * i;
      const int row = tb[r], pos = tb[BN + r];
      bool vis = lo + t * BN + r < hi && pos <= qp;
      if (vis && window > 0) vis = qp - pos < window;
      const uint8_t* ks = vis ? k + row * skr + kh * skh : k;
      const uint8_t* vs = vis ? v + row * svr + kh * svh : v;
      cp_async16(kb + swz(r, lch), ks + lch * 16, vis);
      cp_async16(vb + swz(r, lch), vs + lch * 16, vis);
      if (lch == 0) s_vis[st * BN + r] = vis ? 1 : 0;
    }
  };

  ring_start<NS>(tab, issue, ntiles);

  float oacc[DW / 16][4];  // O^T of this warp's d: chunk y, rows d 16y + 2g (+1) x heads 2c, 2c+1
#pragma unroll
  for (int y = 0; y < DW / 16; ++y) oacc[y][0] = oacc[y][1] = oacc[y][2] = oacc[y][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // heads 2c and 2c + 1

  const int lr = lane & 15, lc = lane >> 4;  // ldmatrix: key lr of a 16-key tile, chunk + lc
  const int x0 = warp * (DW / 16);           // this warp's first chunk

  for (int t = 0; t < ntiles; ++t) {
    cp_wait<NS - 2>();  // tile t has landed (this thread's copies)
    __syncthreads();    // everyone's copies of tile t; everyone is done with tile t - 1
    if (t + NS - 1 < ntiles) issue(t + NS - 1);
    tab(t + 2 * NS - 2);
    cp_commit();
    const int st = t % NS;
    const uint32_t kb = s_base + st * STAGE_BYTES, vb = kb + TILE_BYTES;

    // S^T over this warp's d slice, then summed over the four warps
    float s[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      s[mt][0] = s[mt][1] = s[mt][2] = s[mt][3] = 0.f;
#pragma unroll
      for (int x = 0; x < DW / 16; x += 2) {
        uint32_t r[4], a[4];
        ldsm4(kb + swz(16 * mt + lr, x0 + x + lc), r);
        e4m3x4(r[0], a[0], a[2]);  // key g: k 2c, 2c+1 | 2c+8, 2c+9
        e4m3x4(r[1], a[1], a[3]);  // key g + 8
        mma_f16(s[mt], a, qb[x][0], qb[x][1]);
        e4m3x4(r[2], a[0], a[2]);  // the next chunk
        e4m3x4(r[3], a[1], a[3]);
        mma_f16(s[mt], a, qb[x + 1][0], qb[x + 1][1]);
      }
      s_red[(warp * MT + mt) * 32 + lane] = make_float4(s[mt][0], s[mt][1], s[mt][2], s[mt][3]);
    }
    __syncthreads();
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float4 a = s_red[mt * 32 + lane];
#pragma unroll
      for (int w = 1; w < 4; ++w) {
        const float4 e = s_red[(w * MT + mt) * 32 + lane];
        a.x += e.x;
        a.y += e.y;
        a.z += e.z;
        a.w += e.w;
      }
      const bool v0 = s_vis[st * BN + 16 * mt + g] != 0;
      const bool v1 = s_vis[st * BN + 16 * mt + g + 8] != 0;
      s[mt][0] = v0 ? a.x * scale_log2 : -INFINITY;
      s[mt][1] = v0 ? a.y * scale_log2 : -INFINITY;
      s[mt][2] = v1 ? a.z * scale_log2 : -INFINITY;
      s[mt][3] = v1 ? a.w * scale_log2 : -INFINITY;
      mx0 = fmaxf(mx0, fmaxf(s[mt][0], s[mt][2]));
      mx1 = fmaxf(mx1, fmaxf(s[mt][1], s[mt][3]));
    }
    const float mn0 = fmaxf(m0, xmax(mx0)), mn1 = fmaxf(m1, xmax(mx1));
    const float r0 = mn0 == -INFINITY ? 0.f : mn0, r1 = mn1 == -INFINITY ? 0.f : mn1;
    const float al0 = ex2(m0 - r0), al1 = ex2(m1 - r1);
    m0 = mn0;
    m1 = mn1;
    l0 *= al0;
    l1 *= al1;
#pragma unroll
    for (int y = 0; y < DW / 16; ++y) {
      oacc[y][0] *= al0;
      oacc[y][1] *= al1;
      oacc[y][2] *= al0;
      oacc[y][3] *= al1;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {  // 16 keys: one k step of O^T += V^T . P^T
      const float p0 = ex2(s[mt][0] - r0), p1 = ex2(s[mt][1] - r1);
      const float p2 = ex2(s[mt][2] - r0), p3 = ex2(s[mt][3] - r1);
      l0 += p0 + p2;
      l1 += p1 + p3;
      const uint32_t pb0 = movtrans(pack_f16(p0, p1)), pb1 = movtrans(pack_f16(p2, p3));
#pragma unroll
      for (int y = 0; y < DW / 16; y += 2) {
        uint32_t r[4], a[4];
        ldsm4t(vb + swz(16 * mt + lr, x0 + y + lc), r);
        // r: keys 2c, 2c+1 x d 2g, 2g+1 of a chunk; prmt pairs the keys of each d
        e4m3x4(prmt(r[0], 0x3120), a[0], a[1]);  // keys 2c, 2c+1 at d 2g | 2g + 1
        e4m3x4(prmt(r[1], 0x3120), a[2], a[3]);  // keys 2c+8, 2c+9
        mma_f16(oacc[y], a, pb0, pb1);
        e4m3x4(prmt(r[2], 0x3120), a[0], a[1]);  // the next chunk
        e4m3x4(prmt(r[3], 0x3120), a[2], a[3]);
        mma_f16(oacc[y + 1], a, pb0, pb1);
      }
    }
  }
  cp_wait<0>();
  __syncthreads();  // the ring is free: the CTA's state goes there

  // this CTA's state (unnormalised, relative to its max): m, l [8] and o [8][D]
  float* x_m = reinterpret_cast<float*>(smem);
  float* x_l = x_m + 8;
  float* x_o = x_l + 8;
  l0 = xsum(l0);
  l1 = xsum(l1);
  if (warp == 0 && g == 0) {
    x_m[2 * c] = m0;
    x_m[2 * c + 1] = m1;
    x_l[2 * c] = l0;
    x_l[2 * c + 1] = l1;
  }
#pragma unroll
  for (int y = 0; y < DW / 16; ++y) {
    const int d = warp * DW + 16 * y + 2 * g;
    x_o[(2 * c) * D + d] = oacc[y][0];
    x_o[(2 * c + 1) * D + d] = oacc[y][1];
    x_o[(2 * c) * D + d + 1] = oacc[y][2];
    x_o[(2 * c + 1) * D + d + 1] = oacc[y][3];
  }
#if CLUSTER > 1
  cluster_sync();  // every CTA's state is in its shared memory
  if (rank == 0) {
#else
  __syncthreads();
  {
#endif
    const int row = tid >> 4, c16 = tid & 15;  // each thread: one head row, D / 16 columns
    float ms[CLUSTER], ls[CLUSTER];
#if CLUSTER > 1
    const uint32_t am = static_cast<uint32_t>(__cvta_generic_to_shared(x_m + row));
    const uint32_t al = static_cast<uint32_t>(__cvta_generic_to_shared(x_l + row));
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) {
      ms[r] = ld_rank(am, r);
      ls[r] = ld_rank(al, r);
    }
#else
    ms[0] = x_m[row];
    ls[0] = x_l[row];
#endif
    const int head = kh * GROUP + row;
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) mx = fmaxf(mx, ms[r]);
    float sk = -INFINITY;
    if (sinks != nullptr && row < GROUP) sk = sinks[head] * 1.4426950408889634f;
    mx = fmaxf(mx, sk);
    const float ref = mx == -INFINITY ? 0.f : mx;
    float l = sinks != nullptr ? ex2(sk - ref) : 0.f;
    float f[CLUSTER];
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) {
      f[r] = ex2(ms[r] - ref);
      l += f[r] * ls[r];
    }
    const bool ok = l != 0.f;  // NaN stays NaN: a visible stale read must show
    const float inv = ok ? v_scale / l : 0.f;
#pragma unroll
    for (int i = 0; i < D / 64; ++i) {  // four columns at a time, 64 apart
      const int d4 = 64 * i + 4 * c16;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int r = 0; r < CLUSTER; ++r) {
#if CLUSTER > 1
        const float4 e = ld_rank4(
            static_cast<uint32_t>(__cvta_generic_to_shared(x_o + row * D + d4)), r);
#else
        const float4 e = *reinterpret_cast<const float4*>(x_o + row * D + d4);
#endif
        acc.x += f[r] * e.x;
        acc.y += f[r] * e.y;
        acc.z += f[r] * e.z;
        acc.w += f[r] * e.w;
      }
      if (row < GROUP) {
        uint2 out;
        out.x = pack_bf16(ok ? acc.x * inv : 0.f, ok ? acc.y * inv : 0.f);
        out.y = pack_bf16(ok ? acc.z * inv : 0.f, ok ? acc.w * inv : 0.f);
        *reinterpret_cast<uint2*>(o + b * sot + head * soh + d4) = out;
      }
    }
    if (row < GROUP && c16 == 0)
      lse[(long long)b * Hq + head] = ok ? (ref + log2f(l)) * 0.6931471805599453f : -INFINITY;
  }
#if CLUSTER > 1
  cluster_sync();  // rank 0 has read every CTA's shared memory before any exits
#endif
}
