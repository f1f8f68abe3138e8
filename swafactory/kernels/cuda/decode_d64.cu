// Split-KV paged decode at head_dim 64 with the split merge in a thread-block cluster.
//
// Why a kernel of our own: a small batch of a long context (GPT-OSS-20b at bs 8: 8 requests x 8
// KV heads, 8192 keys each) needs its keys split over many CTAs to fill the GPU, and a split
// Triton kernel pays a second launch (the merge) per layer. Here the CLUSTER splits of one
// (request, KV head) are one thread-block cluster: each CTA reduces its keys to an unnormalised
// partial state in its own shared memory, and rank 0 merges the CLUSTER states through
// distributed shared memory (Hopper), adds the sink and writes o and the LSE. One launch a layer.
// Measured on the H200 (bench/results/README.md): a bs-64 full layer at 96% of
// copy bandwidth (Triton: 91%); at bs 8 a full layer takes about 52 us against a 32 us floor, as
// Triton's kernel + merge do, so the merge launch was not what held bs 8 back.
//
// Inside a CTA: 4 warps share a cp.async ring of NS stages of BN keys (K and V rows of this
// KV head, gathered by kv_indices); warp w takes keys 16w..16w+15 of each 64, with its own
// online softmax. Keys are the MMA's M dimension and the GROUP (<= 8) query heads its N, so the
// GQA group fills an m16n8k16 tile with no padding rows: S^T = K . Q^T, then O^T += V^T . P^T
// (V^T from ldmatrix.trans, P^T from the score fragment by movmatrix.trans).
//
// This step's K/V (new_kv): the key list holds the new token once, at q's position (the
// contract of a decode list). That entry's row is read from kn/vn (the step's k, v) instead of
// the pool, and rank 0 writes kn/vn to pool row wloc unless it is below dummy_rows (a padding
// request's write to the dummy page is dropped). No CTA reads row wloc, so the write does not
// race; and the list keeps its length, so 8192 keys split into eight equal 16-tile shares.
//
// Keys no query may see (past q, outside the window) are not read (cp.async zero-fill) and score
// -inf, so NaN in an unowned row never enters the sum; a visible NaN propagates to o.
//
// Grid (CLUSTER, Hkv, B), clusters along x; 128 threads; dynamic shared memory SMEM_BYTES.
#include "decode_common.cuh"

#ifndef BN
#define BN 64  // keys per tile: 64 or 128 (each warp takes 16 of every 64)
#endif
#define D 64
#define RPT (BN / 16)             // rows each thread copies per tile
#define NT 128
#define ROWB (D * 2)              // bytes of one bf16 row of one KV head
#define TILE_BYTES (BN * ROWB)    // K (or V) of one tile: 8 KB
#define STAGE_BYTES (2 * TILE_BYTES)
#define TR (2 * NS)               // ring slots of pool rows and positions
#define TAB_OFF (NS * STAGE_BYTES + NS * BN * 4)
#define SMEM_BYTES (TAB_OFF + TR * 2 * BN * 4 + 2048)
static_assert(GROUP >= 1 && GROUP <= 8, "GROUP is the MMA's N (8)");
static_assert(BN == 64 || BN == 128, "BN: 64 or 128 keys");
static_assert(NS * STAGE_BYTES >= 4 * 8 * D * 4 + 2 * 4 * 8 * 4, "merge buffers reuse the ring");

// row r, 16-byte chunk c of a [BN, 64] bf16 tile -> byte offset; chunks XOR-swizzled by r % 8 so
// ldmatrix's eight rows hit eight different bank groups
__device__ __forceinline__ uint32_t swz(int r, int c) { return r * ROWB + ((c ^ (r & 7)) << 4); }


// q: [B, Hq, 64] bf16 (strides sqt, sqh elements; last dim contiguous), one query per request
// k, v: [pool rows, Hkv, 64] bf16 (strides skr, skh / svr, svh elements)
// kv_indptr: [B+1] int32; kv_indices: [total_kv] int32 pool rows; q_pos: [B] int32;
// kv_pos: [total_kv] int32; sinks: [Hq] fp32 or null
// kn, vn: [B, Hkv, 64] bf16 (strides snt, snh) this step's rows, wloc: [B] int64 their pool
//   rows, read for the list's entry at q's position; or all three null (read from the pool)
// o: [B, Hq, 64] bf16 (strides sot, soh); lse: [B, Hq] fp32 (natural log)
// window: keys with q_pos - kv_pos < window are visible (0: no window); scale_log2: softmax
//   scale x log2(e)
extern "C" __global__ void KERNEL_ATTRS
    decode_d64(const __nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ k,
               __nv_bfloat16* __restrict__ v, const int* __restrict__ kv_indptr,
               const int* __restrict__ kv_indices, const int* __restrict__ q_pos,
               const int* __restrict__ kv_pos, const float* __restrict__ sinks,
               const __nv_bfloat16* __restrict__ kn, const __nv_bfloat16* __restrict__ vn,
               const long long* __restrict__ wloc, __nv_bfloat16* __restrict__ o,
               float* __restrict__ lse, long long sqt, long long sqh, long long skr,
               long long skh, long long svr, long long svh, long long snt, long long snh,
               long long sot, long long soh, int Hq, int window, int dummy_rows,
               float scale_log2) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  int* s_vis = reinterpret_cast<int*>(smem + NS * STAGE_BYTES);  // [NS][BN] visibility

  const int rank = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const bool fused = kn != nullptr;

  const int kv0 = kv_indptr[b], n = kv_indptr[b + 1] - kv0;
  const int qp = q_pos[b];
  const int chunk = (((n + CLUSTER - 1) / CLUSTER + BN - 1) / BN) * BN;
  const int lo = min(rank * chunk, n), hi = min(lo + chunk, n);
  const int ntiles = (hi - lo + BN - 1) / BN;

  // this step's row of KV head kh, written by rank 0 after its loop (no CTA reads row wloc):
  // loaded here so the two dependent loads do not hold up the prologue
  const bool writer = fused && rank == 0 && tid < 16;
  long long wrow = -1;
  int4 wval = make_int4(0, 0, 0, 0);
  if (writer) {
    wrow = wloc[b];
    wval = reinterpret_cast<const int4*>((tid < 8 ? kn : vn) + b * snt + kh * snh)[tid & 7];
  }

  // Q^T as the MMA's B operand: b0 = Q[row g][16 ks + 2c, +1], b1 = Q[row g][16 ks + 8 + 2c, +1]
  uint32_t qb[4][2];
  {
    const bool ok = g < GROUP;
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(q + b * sqt + (kh * GROUP + (ok ? g : 0)) * sqh);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      qb[ks][0] = ok ? qr[8 * ks + c] : 0u;
      qb[ks][1] = ok ? qr[8 * ks + 4 + c] : 0u;
    }
  }

  // loads: eight threads copy a row's eight 16-byte chunks (a warp instruction reads four whole
  // 128-byte rows); thread tid takes chunk tid % 8 of rows tid / 8 + 16 i. A tile's pool rows and
  // positions come into a shared-memory ring by cp.async too, in the group of the tile NS - 1
  // before it, so issuing a tile never waits on a global load: reading them into registers a
  // tile ahead held every tile for one load latency (2x slower at bs 8, bench/results/
  // probe-decode-cuda-eec90d0.json).
  const int lrow = tid >> 3, lch = tid & 7;
  auto tab = [&](int t) {  // pool rows and positions of tile t into ring slot t % TR
    if (t * BN >= hi - lo) return;
    load_tab<BN, NT, true>(s_base + TAB_OFF + (t % TR) * (2 * BN * 4), kv_indices, kv_pos, kv0,
                           lo, t, hi, tid);
  };
  auto issue = [&](int t) {  // tile t into stage t % NS, its rows from ring slot t % TR
    const int st = t % NS;
    const uint32_t kb = s_base + st * STAGE_BYTES, vb = kb + TILE_BYTES;
    const int* tb = reinterpret_cast<const int*>(smem + TAB_OFF + (t % TR) * (2 * BN * 4));
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = lrow + 16 * i;
      const int row = tb[r], pos = tb[BN + r];
      bool vis = lo + t * BN + r < hi && pos <= qp;
      if (vis && window > 0) vis = qp - pos < window;
      const __nv_bfloat16* ks = k;
      const __nv_bfloat16* vs = v;
      if (vis) {
        if (fused && pos == qp) {  // this step's key: from the inputs, not the pool
          ks = kn + b * snt + kh * snh;
          vs = vn + b * snt + kh * snh;
        } else {
          ks = k + row * skr + kh * skh;
          vs = v + row * svr + kh * svh;
        }
      }
      cp_async16(kb + swz(r, lch), ks + lch * 8, vis);
      cp_async16(vb + swz(r, lch), vs + lch * 8, vis);
      if (lch == 0) s_vis[st * BN + r] = vis ? 1 : 0;
    }
  };

  ring_start<NS>(tab, issue, ntiles);

  float oacc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) oacc[j][0] = oacc[j][1] = oacc[j][2] = oacc[j][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows 2c and 2c + 1

  const int kr = warp * 16 + (lane & 15), kc = lane >> 4;                  // K: ldmatrix
  const int vr = warp * 16 + (lane & 7) + 8 * (lane >> 4), vc = (lane >> 3) & 1;  // V: .trans

  for (int t = 0; t < ntiles; ++t) {
    cp_wait<NS - 2>();  // tile t has landed (this thread's copies)
    __syncthreads();    // everyone's copies of tile t; everyone is done with tile t - 1's stage
    if (t + NS - 1 < ntiles) issue(t + NS - 1);
    tab(t + 2 * NS - 2);
    cp_commit();
    const int st = t % NS;
    const uint32_t kb = s_base + st * STAGE_BYTES, vb = kb + TILE_BYTES;
#pragma unroll
    for (int sub = 0; sub < BN / 64; ++sub) {  // this warp's 16 keys of each 64
      const int k0 = 64 * sub;
      float s[4] = {0.f, 0.f, 0.f, 0.f};  // S^T: keys g, g + 8 of this warp x rows 2c, 2c + 1
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        uint32_t a[4];
        ldsm4(kb + swz(k0 + kr, 2 * ks + kc), a);
        mma_bf16(s, a, qb[ks][0], qb[ks][1]);
      }
      const bool v0 = s_vis[st * BN + k0 + warp * 16 + g] != 0;
      const bool v1 = s_vis[st * BN + k0 + warp * 16 + g + 8] != 0;
      s[0] = v0 ? s[0] * scale_log2 : -INFINITY;
      s[1] = v0 ? s[1] * scale_log2 : -INFINITY;
      s[2] = v1 ? s[2] * scale_log2 : -INFINITY;
      s[3] = v1 ? s[3] * scale_log2 : -INFINITY;
      const float mn0 = fmaxf(m0, xmax(fmaxf(s[0], s[2])));
      const float mn1 = fmaxf(m1, xmax(fmaxf(s[1], s[3])));
      const float r0 = mn0 == -INFINITY ? 0.f : mn0, r1 = mn1 == -INFINITY ? 0.f : mn1;
      const float al0 = ex2(m0 - r0), al1 = ex2(m1 - r1);
      const float p0 = ex2(s[0] - r0), p1 = ex2(s[1] - r1);
      const float p2 = ex2(s[2] - r0), p3 = ex2(s[3] - r1);
      l0 = l0 * al0 + p0 + p2;
      l1 = l1 * al1 + p1 + p3;
      m0 = mn0;
      m1 = mn1;
      const uint32_t pb0 = movtrans(pack_bf16(p0, p1)), pb1 = movtrans(pack_bf16(p2, p3));
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        oacc[j][0] *= al0;
        oacc[j][1] *= al1;
        oacc[j][2] *= al0;
        oacc[j][3] *= al1;
        uint32_t a[4];
        ldsm4t(vb + swz(k0 + vr, 2 * j + vc), a);
        mma_bf16(oacc[j], a, pb0, pb1);
      }
    }
  }
  if (writer && wrow >= dummy_rows)  // 16-byte chunks: threads 0-7 the K row, 8-15 the V row
    reinterpret_cast<int4*>(tid < 8 ? k + wrow * skr + kh * skh
                                    : v + wrow * svr + kh * svh)[tid & 7] = wval;
  cp_wait<0>();
  __syncthreads();  // the ring is free: reuse it for the merge

  // the four warps' states -> this CTA's (unnormalised, relative to its max) state
  float* w_m = reinterpret_cast<float*>(smem);  // [4][8]
  float* w_l = w_m + 32;                         // [4][8]
  float* w_o = w_l + 32;                         // [4][8][64]: o[row][d]
  float* x_m = w_o + 4 * 8 * D;                  // [8]  this CTA's state, read by rank 0
  float* x_l = x_m + 8;                          // [8]
  float* x_o = x_l + 8;                          // [8][64]
  l0 = xsum(l0);
  l1 = xsum(l1);
  if (g == 0) {
    w_m[warp * 8 + 2 * c] = m0;
    w_m[warp * 8 + 2 * c + 1] = m1;
    w_l[warp * 8 + 2 * c] = l0;
    w_l[warp * 8 + 2 * c + 1] = l1;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // oacc[j]: d 16j + g (+8) x rows 2c, 2c + 1
    float* wo = w_o + warp * 8 * D;
    wo[(2 * c) * D + 16 * j + g] = oacc[j][0];
    wo[(2 * c + 1) * D + 16 * j + g] = oacc[j][1];
    wo[(2 * c) * D + 16 * j + g + 8] = oacc[j][2];
    wo[(2 * c + 1) * D + 16 * j + g + 8] = oacc[j][3];
  }
  __syncthreads();
  const int row = tid >> 4, d4 = (tid & 15) * 4;  // each thread: one row, four columns
  {
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) mx = fmaxf(mx, w_m[w * 8 + row]);
    const float ref = mx == -INFINITY ? 0.f : mx;
    float l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float f = ex2(w_m[w * 8 + row] - ref);
      l += f * w_l[w * 8 + row];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] += f * w_o[(w * 8 + row) * D + d4 + i];
    }
    if ((tid & 15) == 0) {
      x_m[row] = mx;
      x_l[row] = l;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) x_o[row * D + d4 + i] = acc[i];
  }
#if CLUSTER > 1
  cluster_sync();  // every CTA's state is in its shared memory
  if (rank == 0) {
    const uint32_t am = static_cast<uint32_t>(__cvta_generic_to_shared(x_m + row));
    const uint32_t al = static_cast<uint32_t>(__cvta_generic_to_shared(x_l + row));
    const uint32_t ao = static_cast<uint32_t>(__cvta_generic_to_shared(x_o + row * D + d4));
    float ms[CLUSTER], ls[CLUSTER];
    float4 os[CLUSTER];
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) {  // every remote load in flight at once
      ms[r] = ld_rank(am, r);
      ls[r] = ld_rank(al, r);
      os[r] = ld_rank4(ao, r);
    }
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) mx = fmaxf(mx, ms[r]);
#else
  __syncthreads();
  {
    float ms[1] = {x_m[row]};
    float mx = ms[0];
#endif
    const int head = kh * GROUP + row;
    float sk = -INFINITY;
    if (sinks != nullptr && row < GROUP) sk = sinks[head] * 1.4426950408889634f;
    mx = fmaxf(mx, sk);
    const float ref = mx == -INFINITY ? 0.f : mx;
    float l = sinks != nullptr ? ex2(sk - ref) : 0.f;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) {
      const float f = ex2(ms[r] - ref);
#if CLUSTER > 1
      l += f * ls[r];
      acc[0] += f * os[r].x;
      acc[1] += f * os[r].y;
      acc[2] += f * os[r].z;
      acc[3] += f * os[r].w;
#else
      l += f * x_l[row];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] += f * x_o[row * D + d4 + i];
#endif
    }
    if (row < GROUP) {
      const bool ok = l != 0.f;  // NaN stays NaN: a visible stale read must show
      const float inv = ok ? 1.f / l : 0.f;
      uint2 out;
      out.x = pack_bf16(ok ? acc[0] * inv : 0.f, ok ? acc[1] * inv : 0.f);
      out.y = pack_bf16(ok ? acc[2] * inv : 0.f, ok ? acc[3] * inv : 0.f);
      *reinterpret_cast<uint2*>(o + b * sot + head * soh + d4) = out;
      if ((tid & 15) == 0)
        lse[(long long)b * Hq + head] = ok ? (ref + log2f(l)) * 0.6931471805599453f : -INFINITY;
    }
  }
#if CLUSTER > 1
  cluster_sync();  // rank 0 has read every CTA's shared memory before any exits
#endif
}
