// kdtree-engine: the portable kernel (mma.sync m16n8k16 bf16 -> fp32, cp.async
// gathers): what every device but an sm_90a-built H100/H200 runs, sm_120 first.
//
// Tile KDTREE_TILE_MMA_64X32_QREG (89 KB of shared memory, so one CTA per SM within
// sm_120's 99 KB per block): 64 query rows, 8 warps; warp (rg, kh) owns rows
// rg*16 .. +16. For S it holds its rows' Q fragments for half of the 576 dimensions
// (kh: 0..287 or 288..575; 72 registers, loaded once) and computes a partial S over
// that half for the tile's 32 keys; partners (rg, 0) and (rg, 1) swap partials through
// a 2 KB slab each and one 64-thread named barrier, so both hold the same full S
// (a + b == b + a exactly). Each then runs the same online softmax (lazy maximum),
// keeps P in registers as the A operand, and accumulates O for its rows and its half
// (kh) of the 512 value columns (128 registers). K/V tiles of 32 keys are loaded once
// per CTA for all 64 rows by 16-byte cp.async gathers (one slot = 1152 contiguous
// bytes), double-buffered; slot ids travel a tile ahead through shared memory; the
// tree mask is read only for tiles that reach the drafts. docs/kernel-notes.md
// (sm_120 entries) has the measurements, and the Q-in-shared-memory tiles this
// replaced (16 and 64 rows, 2 and 8 warps).
#pragma once

#include "common.cuh"
#include "tiles.h"

namespace kdtree {

// ------------------------------------------------ Q in registers (sm_120's tile)
namespace qreg {
constexpr int BM = 64;
constexpr int WARPS = tiles::MMA_QREG_WARPS;  // 4 row groups x 2 halves
constexpr int THREADS = WARPS * 32;
constexpr int KSTEPS = D / 2 / 16;  // k16 steps over one half of the dimensions (18)
// Warp kh's half of the dimensions: nope dims 256 kh .. +256 (16 steps, 128-byte aligned
// chunk groups), then rope dims 512 + 32 kh .. +32 (2 steps). First 16-byte chunk of step k:
constexpr int NOPE_STEPS = 16;
__host__ __device__ constexpr int step_chunk(int kh, int k) {
  return k < NOPE_STEPS ? 32 * kh + 2 * k : 64 + 4 * kh + 2 * (k - NOPE_STEPS);
}
// Rows of 1152 bytes, no padding, 16-byte chunks swizzled within each 128-byte group:
// chunk c of row r sits at chunk c ^ (r & 7). ldmatrix's 8 rows of one chunk then hit
// 8 distinct bank groups, and each cp.async row segment stays 128-byte aligned (ncu: the
// padded 1168-byte rows cost 12.5 shared-memory wavefronts per cp.async, ideal 4).
constexpr int RB = ROW_BYTES;
__device__ __forceinline__ uint32_t swz(int row, int chunk) { return static_cast<uint32_t>(row * RB + ((chunk ^ (row & 7)) << 4)); }
constexpr int K_BYTES = BN * RB;  // one key stage
constexpr int SLAB_OFF = 2 * K_BYTES;
constexpr int SLAB_WARP = 16 * BN;  // floats of one warp's partial S
constexpr int RING_OFF = SLAB_OFF + WARPS * SLAB_WARP * 4;  // [2 tiles][BN] prefix slot ids, 8 bytes each
constexpr int SMEM = RING_OFF + 2 * BN * 8;
constexpr int TPR = THREADS / BN;   // loader threads per key row
#ifndef KDTREE_QREG_VBUF
#define KDTREE_QREG_VBUF 3
#endif
constexpr int VBUF = KDTREE_QREG_VBUF;  // V fragment buffers of the PV loop (loads VBUF - 1 steps ahead)
// The lazy maximum (RESCALE_LOG2, common.cuh); O is rescaled only when some row of the warp moved.
static_assert(SMEM == tiles::mma_qreg_bytes(), "tiles.h disagrees with the kernel's layout");
static_assert(BM * RB <= SLAB_OFF, "Q is staged in the two key stages");
static_assert(THREADS % BN == 0, "loader needs whole threads per key row");
static_assert(BN == tiles::MMA_BN, "the split schedule's step (Params::split_keys) is one of these tiles");

// the two warps of row group rg (64 threads): named barrier rg + 1 (0 is __syncthreads)
// (immediate ids, so ptxas reserves 5 barriers, not all 16)
__device__ __forceinline__ void pair_sync(int rg) {
  switch (rg) {
    case 0: asm volatile("bar.sync 1, 64;\n" ::: "memory"); break;
    case 1: asm volatile("bar.sync 2, 64;\n" ::: "memory"); break;
    case 2: asm volatile("bar.sync 3, 64;\n" ::: "memory"); break;
    default: asm volatile("bar.sync 4, 64;\n" ::: "memory"); break;
  }
}
}  // namespace qreg

__global__ void __launch_bounds__(qreg::THREADS, 1) verify_attn_kernel_mma_qreg(const Params p) {
  using namespace qreg;
  extern __shared__ __align__(128) unsigned char smem[];
  float4* slab = reinterpret_cast<float4*>(smem + SLAB_OFF);  // [warp][4 n8 tiles][32 lanes]

  pdl_main_prologue();
  const int rt = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rg = warp & 3, kh = warp >> 2;
  const int g = lane >> 2, tq = lane & 3;

  Work w;
  if (!setup_work(p, b, rt * BM, split, BN, tid, w)) return;
  const int qo_start = w.qo_start, kv_lo = w.kv_lo, N = w.N, rows = w.rows, r0 = w.r0, L = w.L;
  const int t_begin = w.t_begin, t_end = w.t_end, H = p.H;
  const bool partial = w.splits > 1;

  // ---- Q: BM rows x 72 chunks staged in the key stages, then this warp's fragments ----
  for (int c = tid; c < BM * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, ch = c % CHUNKS;
    const int rr = r0 + r;
    const bool ok = rr < rows;
    const int tok = ok ? rr / H : 0, head = ok ? rr % H : 0;
    const __nv_bfloat16* src = p.q + static_cast<int64_t>(qo_start + tok) * p.q_st +
                               static_cast<int64_t>(head) * p.q_sh + ch * 8;
    cp_async16(smem_u32(smem) + swz(r, ch), ok ? src : p.q, ok);
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  uint32_t qf[KSTEPS][4];  // A fragments: rows rg*16.., dimensions kh*288 + 16k ..
  {
    const uint32_t qs = smem_u32(smem);
    const int qrow = rg * 16 + (lane & 15);
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) ldsm_x4(qs + swz(qrow, step_chunk(kh, k) + (lane >> 4)), qf[k][0], qf[k][1], qf[k][2], qf[k][3]);
  }
  __syncthreads();  // every warp holds its fragments: the stages take keys now

  const int lrow = tid / TPR, lsub = tid % TPR;
  auto issue_tile = [&](int stage, KeySrc src) {
    unsigned char* dst = smem + stage * K_BYTES + lrow * RB;
    const int x = lrow & 7;
#pragma unroll
    for (int ch = lsub; ch < CHUNKS; ch += TPR)
      cp_async16(smem_u32(dst + ((ch ^ x) << 4)), src.valid ? src.ptr + ch * 8 : p.kv, src.valid);
  };
  // Slot ids travel a tile ahead through shared memory (cp.async, no register held and
  // no load waited on: ncu showed the loader's address math waiting on a slot id loaded
  // into a register a tile earlier): warp 0 copies tile t + 2's ids while tile t runs.
  unsigned char* ring = smem + RING_OFF;
  auto load_ring = [&](int tile) {
    if (tid < BN) {
      const int pos = tile * BN + tid;
      const bool ok = pos < L;
      const uint32_t dst = smem_u32(ring + ((tile & 1) * BN + tid) * 8);
      if (p.kv_indices_64)
        cp_async8(dst, ok ? static_cast<const void*>(static_cast<const int64_t*>(p.kv_indices) + kv_lo + pos) : p.kv, ok);
      else
        cp_async4(dst, ok ? static_cast<const void*>(static_cast<const int32_t*>(p.kv_indices) + kv_lo + pos) : p.kv, ok);
    }
  };
  auto ring_slot = [&](int tile) -> int64_t {
    if (tile * BN + lrow >= L) return -1;
    const unsigned char* src = ring + ((tile & 1) * BN + lrow) * 8;
    return p.kv_indices_64 ? *reinterpret_cast<const int64_t*>(src)
                           : static_cast<int64_t>(*reinterpret_cast<const int32_t*>(src));
  };
  issue_tile(0, key_source(p, t_begin * BN + lrow, L, N, kv_lo, qo_start));
  if (t_begin + 1 < t_end) load_ring(t_begin + 1);
  cp_async_commit();

  float acc[128];  // O: n8 block i of this warp's 256 columns in acc[4i .. 4i+3] (mma C layout)
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F};
  float l_run[2] = {0.f, 0.f};
  const uint32_t k_base = smem_u32(smem);
  float4* mine = slab + warp * (SLAB_WARP / 4);
  const float4* theirs = slab + (warp ^ 4) * (SLAB_WARP / 4);

  for (int tile = t_begin; tile < t_end; ++tile) {
    const int stage = (tile - t_begin) & 1;
    cp_async_wait_all();
    __syncthreads();  // tile ready; everyone is done with the other stage and with the slab
    if (tile + 1 < t_end) {
      issue_tile(stage ^ 1, key_resolve(p, ring_slot(tile + 1), (tile + 1) * BN + lrow, L, N, qo_start));
      if (tile + 2 < t_end) load_ring(tile + 2);
      cp_async_commit();
    }
    const uint32_t kst = k_base + stage * K_BYTES;

    // ---- partial S over this warp's half of the dimensions: 16 rows x 32 keys ----
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    {
      // B fragments (8 keys x 16 dims each), two n8 tiles per ldmatrix.x4, two buffers: the
      // load for step k + 1 of tiles 2 jp, 2 jp + 1 is issued as soon as step k's MMAs of
      // those tiles have taken their operands, two MMAs ahead of its use (ncu: HMMAs waited
      // on their ldmatrix when the loads came just before them).
      // Lanes 0-7 address key rows 8 j + x, chunk c; 8-15 the same rows, chunk c + 1
      // (c = step_chunk(kh, k)); 16-31 the same for rows 8 (j + 1) + x. Swizzled, the lane's
      // chunk offset is (bx ^ 2 (k & 3)) + 8 (k >> 2) + 32 kh within the nope dims and
      // (bx ^ 4 kh ^ 2 (k - 16)) + 64 in the rope dims, bx = b ^ x.
      const int x = lane & 7, bx = ((lane >> 3) & 1) ^ x;
      const uint32_t kb = kst + x * RB;
      const uint32_t nope = (bx << 4), rope = ((bx ^ (4 * kh)) << 4);
      auto kaddr = [&](int j, int k) {
        return kb + j * 8 * RB +
               (k < NOPE_STEPS ? (nope ^ (32 * (k & 3))) + (k >> 2) * 128 + kh * 512
                               : (rope ^ (32 * (k - NOPE_STEPS))) + 64 * 16);
      };
      // (r + 8) & 7 == r & 7: rows 8 further on take the same swizzle. One x4 instead of two
      // x2 halves the load instructions (entry M2: 0.5-1% in the emulation, and the sm_120
      // build's loads run further ahead of their HMMAs)
      const uint32_t kb4 = ((lane >> 4) & 1) * 8 * RB;
      uint32_t bq[2][4];
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) ldsm_x4(kb4 + kaddr(2 * jp, 0), bq[jp][0], bq[jp][1], bq[jp][2], bq[jp][3]);
#pragma unroll
      for (int k = 0; k < KSTEPS; ++k) {
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          mma16816(s[2 * jp], qf[k][0], qf[k][1], qf[k][2], qf[k][3], bq[jp][0], bq[jp][1]);
          mma16816(s[2 * jp + 1], qf[k][0], qf[k][1], qf[k][2], qf[k][3], bq[jp][2], bq[jp][3]);
          if (k + 1 < KSTEPS) ldsm_x4(kb4 + kaddr(2 * jp, k + 1), bq[jp][0], bq[jp][1], bq[jp][2], bq[jp][3]);
        }
      }
    }
    // ---- swap partials with the partner warp: both then hold the same full S ----
#pragma unroll
    for (int j = 0; j < 4; ++j) mine[j * 32 + lane] = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
    pair_sync(rg);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 v = theirs[j * 32 + lane];
      s[j][0] += v.x; s[j][1] += v.y; s[j][2] += v.z; s[j][3] += v.w;
    }
    // ---- scale, mask, online softmax (lazy maximum) for rows g, g + 8 ----
    // (the mask's whereabouts are re-derived in the rare tiles that reach the drafts:
    // registers are what this tile is short of)
    if (tile * BN + BN > L) {
      Work wm;
      wm.L = L;
      wm.KV = L + N;
      wm.mask_base = p.mask_indptr[b];
      wm.mask_ok = N == 0 || (wm.mask_base >= 0 && wm.mask_base + static_cast<int64_t>(N) * wm.KV <= p.mask_len);
      const int row0 = rt * BM + rg * 16 + g;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + (e >> 1) * 8;
        const int tok = row < N * H ? row / H : -1;
#pragma unroll
        for (int j = 0; j < 4; ++j) s[j][e] = masked_score(p, wm, s[j][e], tile * BN + j * 8 + tq * 2 + (e & 1), tok, true);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= p.scale_log2;
    }
    float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
    float corr[2];
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      corr[h] = 1.f;
      if (mx[h] > m_run[h] + RESCALE_LOG2) {  // first visible key, or passed by more than 2^8
        corr[h] = m_run[h] == -CUDART_INF_F ? 0.f : fast_exp2(m_run[h] - mx[h]);
        m_run[h] = mx[h];
        moved = true;
      }
    }
    const float msub[2] = {m_run[0] == -CUDART_INF_F ? 0.f : m_run[0], m_run[1] == -CUDART_INF_F ? 0.f : m_run[1]};
    float rs[2] = {0.f, 0.f};
    uint32_t pa[2][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p0 = fast_exp2(s[j][0] - msub[0]), p1 = fast_exp2(s[j][1] - msub[0]);
      const float p2 = fast_exp2(s[j][2] - msub[1]), p3 = fast_exp2(s[j][3] - msub[1]);
      rs[0] += p0 + p1;
      rs[1] += p2 + p3;
      // C layout of n8 tile j -> A layout of k16 block j / 2
      pa[j >> 1][(j & 1) * 2 + 0] = pack_bf16(p0, p1);
      pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16(p2, p3);
    }
    l_run[0] = l_run[0] * corr[0] + rs[0];
    l_run[1] = l_run[1] * corr[1] + rs[1];
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        acc[4 * i + 0] *= corr[0]; acc[4 * i + 1] *= corr[0];
        acc[4 * i + 2] *= corr[1]; acc[4 * i + 3] *= corr[1];
      }
    }

    // ---- O[16 x 256] += P[16 x 32] V[32 x 256] (columns kh*256 ..) ----
    // 32 steps (2 key halves x 16 column pairs of n8 tiles); V fragments by ldmatrix.x4.trans
    // in three rotating buffers, loaded two steps ahead of their MMAs
    {
      // key row 16 kk + 8 b + x, chunk 32 kh + h + 2 n2 (n2 = i & 15, h = lane >> 4): swizzled,
      // (hx ^ 2 (n2 & 3)) + 8 (n2 >> 2) + 32 kh with hx = h ^ x
      const int x = lane & 7, hx = (lane >> 4) ^ x;
      const uint32_t vb = kst + (((lane >> 3) & 1) * 8 + x) * RB + kh * 512;
      const uint32_t hx16 = hx << 4;
      constexpr int STEPS = (BN / 16) * 16;
      auto vaddr = [&](int i) {
        const int n2 = i & 15;
        return vb + (i >> 4) * 16 * RB + (hx16 ^ (32 * (n2 & 3))) + (n2 >> 2) * 128;
      };
      uint32_t vv[VBUF][4];
#pragma unroll
      for (int i = 0; i < VBUF - 1; ++i) ldsm_x4_t(vaddr(i), vv[i][0], vv[i][1], vv[i][2], vv[i][3]);
#pragma unroll
      for (int i = 0; i < STEPS; ++i) {
        constexpr int A = VBUF - 1;  // loads ahead
        if (i + A < STEPS) ldsm_x4_t(vaddr(i + A), vv[(i + A) % VBUF][0], vv[(i + A) % VBUF][1], vv[(i + A) % VBUF][2], vv[(i + A) % VBUF][3]);
        const uint32_t* a = pa[i >> 4];
        const int n2 = i & 15;
        mma16816(&acc[8 * n2], a[0], a[1], a[2], a[3], vv[i % VBUF][0], vv[i % VBUF][1]);
        mma16816(&acc[8 * n2 + 4], a[0], a[1], a[2], a[3], vv[i % VBUF][2], vv[i % VBUF][3]);
      }
    }
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  store_rows(p, acc, m_run, l_run, rt * BM + rg * 16 + g, N * H, qo_start, split, partial, kh, tq);
}

}  // namespace kdtree
