// kdtree-engine: the portable kernel (mma.sync m16n8k16 bf16 -> fp32, cp.async
// gathers): what every device but an sm_90a-built H100/H200 runs, sm_120 first.
//
// Tile KDTREE_TILE_MMA_64X32_QREG (98.1 KB of shared memory, so one CTA per SM within
// sm_120's 99 KB per block): 64 query rows, 8 math warps and a producer warpgroup.
// Math warp (rg, kh) = (w >> 1, w & 1) owns rows rg*16 .. +16. For S it holds its rows' Q
// fragments for the nope half kh (dims 256 kh .. +256, 64 registers, loaded once) and reads
// its 32 rope dims from shared memory at each tile; it computes a partial S over that half
// of the 576 dimensions for the tile's 32 keys; partners (rg, 0) and (rg, 1) swap partials
// through a 2 KB slab each and one 64-thread named barrier, so both hold the same full S
// (a + b == b + a exactly; a warp's slab is written again once its partner has read it, a
// barrier per warp). Each then runs the same online softmax (lazy maximum), keeps P
// in registers as the A operand, and accumulates O for its rows and its half (kh) of the
// 512 value columns (128 registers). The producer warpgroup loads each 32-key tile once per
// CTA for all 64 rows by 16-byte cp.async gathers (one slot = 1152 contiguous bytes) into
// two stages, a full and an empty mbarrier each, so that no __syncthreads holds the math
// warps in step; setmaxnreg gives the math warps 240 registers and the producers 24 (sm_90a,
// sm_120a). The tree mask is read only for tiles that reach the drafts. No sm_120 GPU was at
// hand: the figures below are this tile's, run on an H200 in the sm_120 emulation.
#pragma once

#include "common.cuh"
#include "tiles.h"

namespace kdtree {

// ------------------------------------------------ Q in registers (sm_120's tile)
namespace qreg {
constexpr int BM = 64;
constexpr int WARPS = tiles::MMA_QREG_WARPS;  // math warps: 4 row groups x 2 halves
constexpr int PWARPS = tiles::MMA_QREG_PRODUCER_WARPS;  // producer warps: the key loads
constexpr int MATH_THREADS = WARPS * 32;
constexpr int PTHREADS = PWARPS * 32;
constexpr int THREADS = MATH_THREADS + PTHREADS;
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
constexpr int BAR_OFF = SLAB_OFF + WARPS * SLAB_WARP * 4;  // full[2], empty[2]
// Q's rope dimensions (chunks 64..71 of each row; chunk c of row r at (c ^ (r & 7))): loaded
// from here at every tile, so that the math warps hold only the nope dims (64 registers)
constexpr int JOB_OFF = BAR_OFF + 32;  // the batch schedule's job (warp 0 derives it for all), in the barriers' slack
static_assert(JOB_OFF + sizeof(BatchJob) <= BAR_OFF + 128, "the job fits beside the four mbarriers");
constexpr int QR_OFF = BAR_OFF + 128;
constexpr int QR_ROW = 8 * 16;
// Each math thread's two running row sums (fp32): in shared memory, read and written once per
// tile off the products' path, because 240 registers hold everything else (ptxas spilled them)
constexpr int LR_OFF = QR_OFF + BM * QR_ROW;
constexpr int Q_TPR = THREADS / BM;  // threads per Q row while Q is staged (6)
static_assert(THREADS % BM == 0 && CHUNKS % Q_TPR == 0, "Q's staging gives each row whole threads and each thread whole chunks");
constexpr int SMEM = LR_OFF + MATH_THREADS * 8;
// setmaxnreg moves registers from the producer warpgroup to the math warps
// (384 threads x 168 at launch = 64,512 = 2 x 128 x 240 + 128 x 24: setmaxnreg.inc waits for
// registers the pool does not hold, so the sum must fit exactly)
constexpr int MATH_REGS = 240, PRODUCER_REGS = 24;
constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;  // what __launch_bounds__(THREADS, 1) leaves each thread
static_assert(MATH_THREADS * MATH_REGS + PTHREADS * PRODUCER_REGS <= LAUNCH_REGS * THREADS,
              "setmaxnreg.inc would wait for registers the CTA's pool never holds: the kernel would hang");
#ifndef KDTREE_QREG_VBUF
#define KDTREE_QREG_VBUF 3
#endif
constexpr int VBUF = KDTREE_QREG_VBUF;  // V fragment buffers of the PV loop (loads VBUF - 1 steps ahead)
// The lazy maximum (RESCALE_LOG2, common.cuh); O is rescaled only when some row of the warp moved.
static_assert(SMEM == tiles::mma_qreg_bytes(), "tiles.h disagrees with the kernel's layout");
static_assert(BM * RB <= SLAB_OFF, "Q is staged in the two key stages");
static_assert(PWARPS == 4, "the producers are one warpgroup (setmaxnreg acts on whole warpgroups)");
static_assert(PTHREADS == 4 * BN, "4 producer threads per key row");
static_assert(BN == tiles::MMA_BN, "the split schedule's step (Params::split_keys) is one of these tiles");
static_assert(BM == PLAN_BM, "the batch schedule (batch_plan) counts row tiles of PLAN_BM rows");

// Row group rg's two warps are 2 rg and 2 rg + 1: they sit on two SMSPs, and each SMSP holds
// warps of two row groups, which drift apart once no __syncthreads holds them in step (H200:
// partners w, w + 4 on one SMSP were 0.5-1.6% slower on 6 of 8 shapes, level at 23k, 0.4% faster
// at H128)
__device__ __forceinline__ int warp_rg(int warp) { return warp >> 1; }
__device__ __forceinline__ int warp_kh(int warp) { return warp & 1; }
constexpr int PARTNER_XOR = 1;

// The two warps of row group rg (64 threads) meet at named barrier rg + 1 to swap partial S
// (pair_sync). Warp w's slab is free again at barrier 5 + w (slab_free_*): its partner arrives
// once it has read the slab, and w syncs before writing it again, so w waits for that read and
// not for the partner to finish its next S (the symmetric 64-thread barrier this replaced:
// 3.5% at H128 and N32, 1.4% at bs8, on the H200). 0 is __syncthreads; 13 barriers in all.
// (The id is a register, as slab_free_*'s are: the four-way switch of immediate ids it replaced
// compiled to a branch and four predicated BAR.SYNCs in the tile's loop.)
__device__ __forceinline__ void pair_sync(int rg) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(rg + 1) : "memory");
}
constexpr uint32_t SLAB_BAR0 = 5;
static_assert(SLAB_BAR0 + WARPS <= 16, "a CTA has 16 named barriers");
// (bar.sync/bar.arrive: the ISA's producer/consumer pair, "an arrive synchronizes with a sync on the
// same barrier"; each phase is one arrive of the partner's 32 threads and one sync of w's 32)
__device__ __forceinline__ void slab_free_wait(int w) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(SLAB_BAR0 + w) : "memory");
}
__device__ __forceinline__ void slab_free_arrive(int w) {
  asm volatile("bar.arrive %0, 64;\n" ::"r"(SLAB_BAR0 + w) : "memory");
}
}  // namespace qreg

// Under the batch schedule, the CTA's request and row tile from its job in shared memory (the 3-D
// grid's are blockIdx.z and blockIdx.x): read again wherever the kernel needs them rather than
// held in registers across the main loop, where they spilled.
__device__ __forceinline__ void cta_job_tile(const unsigned char* smem, int& b, int& rt) {
  const BatchJob& js = *reinterpret_cast<const BatchJob*>(smem + qreg::JOB_OFF);
  b = js.b;
  rt = js.local % plan_tiles(js.rows);
}

// PLANNED: a 1-D grid of the batch schedule (common.cuh batch_plan), else (row tiles, splits, bs).
// Every use of the CTA's request, row tile or split past setup_work goes through cta_job_tile or
// the job in shared memory (the draft tiles' mask, the epilogue; blockIdx is the 3-D grid's).
template <bool PLANNED>
__global__ void __launch_bounds__(qreg::THREADS, 1) verify_attn_kernel_mma_qreg(const Params p) {
  using namespace qreg;
  extern __shared__ __align__(128) unsigned char smem[];
  float4* slab = reinterpret_cast<float4*>(smem + SLAB_OFF);  // [warp][4 n8 tiles][32 lanes]
  const uint32_t bars = smem_u32(smem + BAR_OFF);
  auto full = [&](int stage) { return bars + 8u * stage; };
  auto empty = [&](int stage) { return bars + 16u + 8u * stage; };

  pdl_main_prologue();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int rt = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  BatchJob job;
  if (PLANNED) {  // warp 0 derives the CTA's job (common.cuh planned_job) for all
    job = planned_job(p, reinterpret_cast<BatchJob*>(smem + JOB_OFF), tid, rt, split);
    if (job.b < 0) return;  // uniform over the CTA
    b = job.b;
  }

  Work w;
  if (!setup_work<PLANNED>(p, b, rt * BM, split, BN, tid, w, job)) return;  // uniform over the CTA
  const int qo_start = w.qo_start, kv_lo = w.kv_lo, N = w.N, rows = w.rows, r0 = w.r0, L = w.L;
  const int t_begin = w.t_begin, t_end = w.t_end, H = p.H;

  if (tid == 0) {
    mbar_init(full(0), PTHREADS);  // each producer thread's copies of the tile
    mbar_init(full(1), PTHREADS);
    mbar_init(empty(0), MATH_THREADS);  // every math thread is done with the stage
    mbar_init(empty(1), MATH_THREADS);
    fence_mbar_init();
  }
  // ---- Q: BM rows x 72 chunks staged in the key stages (all threads): Q_TPR threads per row,
  // chunks sub + Q_TPR j, so that a thread divides by H once (a division per chunk was ~70
  // instructions of the staging loop's 12 iterations) and each row's 6 threads copy
  // 96 contiguous bytes per iteration ----
  {
    const int r = tid / Q_TPR, sub = tid % Q_TPR;
    const int rr = r0 + r;
    const bool ok = rr < rows;
    const int tok = ok ? rr / H : 0, head = ok ? rr % H : 0;
    const __nv_bfloat16* src = ok ? p.q + static_cast<int64_t>(qo_start + tok) * p.q_st + static_cast<int64_t>(head) * p.q_sh : p.q;
    const uint32_t qs = smem_u32(smem), rope = smem_u32(smem + QR_OFF) + r * QR_ROW;
#pragma unroll
    for (int j = 0; j < CHUNKS / Q_TPR; ++j) {
      const int ch = sub + Q_TPR * j;
      const uint32_t dst = ch < 64 ? qs + swz(r, ch) : rope + (((ch - 64) ^ (r & 7)) << 4);
      cp_async16(dst, ok ? src + ch * 8 : p.q, ok);
    }
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  // The math warps take their Q fragments from the staged rows. Both roles then meet at one
  // __syncthreads, after which the stages take keys: a __syncthreads reached from two call sites
  // (one per role) is undefined for the aligned bar.sync it compiles to, and synccheck failed the
  // kernel on it ("Divergent thread(s) in block").
  const int rg = warp_rg(warp), kh = warp_kh(warp);
  const int g = lane >> 2, tq = lane & 3;
  uint32_t qf[NOPE_STEPS][4];  // A fragments: rows rg*16.., dimensions kh*256 + 16k ..
  const int qrow = rg * 16 + (lane & 15);
  if (warp < WARPS) {
    const uint32_t qs = smem_u32(smem);
#pragma unroll
    for (int k = 0; k < NOPE_STEPS; ++k) ldsm_x4(qs + swz(qrow, step_chunk(kh, k) + (lane >> 4)), qf[k][0], qf[k][1], qf[k][2], qf[k][3]);
  }
  // rope steps 16, 17: chunks 4 kh + 2 (k - 16) + (lane >> 4) of QR; (c ^ x) differs from c in its low
  // 3 bits only, and c + 2 = c ^ 2 here (c even in its pair), so step 17's address is step 16's ^ 32
  const uint32_t qr_addr = smem_u32(smem + QR_OFF) + qrow * QR_ROW + (((4 * kh + (lane >> 4)) ^ (qrow & 7)) << 4);
  __syncthreads();  // every math warp holds its fragments: the stages take keys now

  if (warp >= WARPS) {
    // ---------------- producer: every key tile into its stage, a tile ahead ----------------
    // 4 threads per key row, each 18 of its 72 chunks (c = sub + 4 i)
    setmaxnreg_dec<PRODUCER_REGS>();
    const int ptid = tid - MATH_THREADS, prow = ptid >> 2, sub = ptid & 3;
    // chunk sub + 4 i of row r sits at ((sub + 4 i) ^ (r & 7)): 128 (i >> 1) + 16 (sub ^ x ^ 4 (i & 1))
    for (int tile = t_begin; tile < t_end; ++tile) {
      const int n = tile - t_begin, stage = n & 1;
      if (n >= 2) mbar_wait(empty(stage), ((n >> 1) - 1) & 1);
      const KeySrc src = key_source(p, tile * BN + prow, L, N, kv_lo, qo_start);
      const uint32_t dst = smem_u32(smem) + stage * K_BYTES + prow * RB;
      const uint32_t o0 = static_cast<uint32_t>((sub ^ (prow & 7)) << 4), o1 = o0 ^ 64u;
      const unsigned char* s8 = reinterpret_cast<const unsigned char*>(src.valid ? src.ptr : p.kv) + 16 * sub;
#pragma unroll
      for (int i = 0; i < CHUNKS / 4; ++i)
        cp_async16(dst + 128u * (i >> 1) + ((i & 1) ? o1 : o0), s8 + 64 * i, src.valid);
      cp_async_mbar_arrive(full(stage));
    }
    cp_async_wait_all();
    return;
  }

  // ---------------- math warps ----------------
  setmaxnreg_inc<MATH_REGS>();

  float acc[128];  // O: n8 block i of this warp's 256 columns in acc[4i .. 4i+3] (mma C layout)
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F};
  float2* const l_sm = reinterpret_cast<float2*>(smem + LR_OFF) + tid;
  *l_sm = make_float2(0.f, 0.f);
  const uint32_t k_base = smem_u32(smem);
  float4* mine = slab + warp * (SLAB_WARP / 4);
  const float4* theirs = slab + (warp ^ PARTNER_XOR) * (SLAB_WARP / 4);

  for (int tile = t_begin; tile < t_end; ++tile) {
    const int n = tile - t_begin, stage = n & 1;
    mbar_wait(full(stage), (n >> 1) & 1);
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
      // x2 halves the load instructions (0.4-0.8% on the H200, emulated, and the sm_120
      // build's loads run further ahead of their HMMAs)
      const uint32_t kb4 = ((lane >> 4) & 1) * 8 * RB;
      uint32_t bq[2][4], qr[2][4];
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) ldsm_x4(kb4 + kaddr(2 * jp, 0), bq[jp][0], bq[jp][1], bq[jp][2], bq[jp][3]);
#pragma unroll
      for (int k = 0; k < KSTEPS; ++k) {
        if (k == NOPE_STEPS - 2) {
          ldsm_x4(qr_addr, qr[0][0], qr[0][1], qr[0][2], qr[0][3]);
          ldsm_x4(qr_addr ^ 32u, qr[1][0], qr[1][1], qr[1][2], qr[1][3]);
        }
        const uint32_t* a = k < NOPE_STEPS ? qf[k] : qr[k - NOPE_STEPS];
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          mma16816(s[2 * jp], a[0], a[1], a[2], a[3], bq[jp][0], bq[jp][1]);
          mma16816(s[2 * jp + 1], a[0], a[1], a[2], a[3], bq[jp][2], bq[jp][3]);
          if (k + 1 < KSTEPS) ldsm_x4(kb4 + kaddr(2 * jp, k + 1), bq[jp][0], bq[jp][1], bq[jp][2], bq[jp][3]);
        }
      }
    }
    // ---- swap partials with the partner warp: both then hold the same full S ----
    if (n > 0) slab_free_wait(warp);  // the partner has read this warp's last partial
#pragma unroll
    for (int j = 0; j < 4; ++j) mine[j * 32 + lane] = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
    pair_sync(rg);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 v = theirs[j * 32 + lane];
      s[j][0] += v.x; s[j][1] += v.y; s[j][2] += v.z; s[j][3] += v.w;
    }
    slab_free_arrive(warp ^ PARTNER_XOR);  // its partial is read: the partner may write it again
    // ---- scale, mask, online softmax (lazy maximum) for rows g, g + 8 ----
    // (the mask's whereabouts are re-derived in the rare tiles that reach the drafts:
    // registers are what this tile is short of)
    if (tile * BN + BN > L) {
      // (the request's draft count and the CTA's indices are read again rather than held)
      int bz = blockIdx.z, rtm = blockIdx.x;
      if (PLANNED) cta_job_tile(smem, bz, rtm);
      const int Nm = static_cast<int>(load_index(p.qo_indptr, p.qo_indptr_64, bz + 1) -
                                      load_index(p.qo_indptr, p.qo_indptr_64, bz));
      Work wm;
      wm.L = L;
      wm.KV = L + Nm;
      mask_window(p, bz, Nm, wm.KV, wm);
      const int row0 = rtm * BM + rg * 16 + g;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + (e >> 1) * 8;
        const int tok = row < Nm * H ? row / H : -1;
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
    {
      float2 l = *l_sm;
      l.x = l.x * corr[0] + rs[0];
      l.y = l.y * corr[1] + rs[1];
      *l_sm = l;
    }
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
    mbar_arrive(empty(stage));  // this thread's reads of the stage are done
  }

  // the partner's arrive after the last tile: every phase of barrier 5 + w completes before exit
  if (t_end > t_begin) slab_free_wait(warp);
  const float2 l_fin = *l_sm;
  float l_run[2] = {l_fin.x, l_fin.y};

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  int r_tile = blockIdx.x;
  int64_t part_slot = (static_cast<int64_t>(blockIdx.y) * p.T + qo_start) * H;
  if (PLANNED) {  // the job again, from shared memory
    const BatchJob& js = *reinterpret_cast<const BatchJob*>(smem + JOB_OFF);
    int jb;
    cta_job_tile(smem, jb, r_tile);
    part_slot = js.slot + static_cast<int64_t>(js.local / plan_tiles(js.rows)) * js.rows;
  }
  store_rows(p, acc, m_run, l_run, r_tile * BM + rg * 16 + g, N * H, qo_start, part_slot, w.splits > 1, kh, tq);
}

}  // namespace kdtree
