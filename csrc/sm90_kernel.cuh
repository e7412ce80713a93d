// kdtree-engine: the Hopper (sm_90a) instance of the verify kernel, with wgmma.
//
// Same work split, metadata checks, masking, split-KV and epilogue as the
// portable mma.sync kernel (common.cuh). What changes is how the tensor cores are fed, on FlashMLA's
// staggered ("seesaw") dense-decode schedule:
// - 64 query rows, 64-key blocks taken in pairs. Q (64 x 576) and two key
//   blocks (64 x 576 each) sit in shared memory in the 128-byte-swizzled layout
//   wgmma reads directly (9 chunks of 64 rows x 64 columns). Buffer 0 holds the
//   even blocks of the split, buffer 1 the odd ones.
// - Warpgroup 0 computes S of block 2j, warpgroup 1 of block 2j + 1 (36
//   wgmma.m64n64k16 each); O is split by columns (warpgroup w owns 256 w ..
//   256 w + 255, 4 wgmma.m64n256k16 per block with V read from the key buffer,
//   MN-major). Each block's P (bf16) is written over its buffer's rope chunk
//   (chunk 8, read only by that block's S) and read by both warpgroups.
// - A row's maximum after block b is the lazy update of the one after block
//   b - 1 (moved only when the block passes it by more than 2^RESCALE_LOG2), so
//   warpgroup 1's softmax of block 2j + 1 waits for warpgroup 0's of block 2j
//   (mbarrier hand(0)) and warpgroup 0's PV of block 2j + 1 for warpgroup 1's
//   (hand(1)). O and the row sums are rescaled whenever the maximum
//   their next P refers to moved (rarely, with the lazy rule).
//     warpgroup 0: S(2j), softmax, PV_L(2j), [hand(1)] PV_L(2j + 1), S(2j + 2) ...
//     warpgroup 1: S(2j + 1), [hand(0)] softmax, PV_R(2j), PV_R(2j + 1), ...
// - A producer warpgroup gathers key rows (page size 1) with 16-byte cp.async,
//   eight lanes per 128-byte line, and reloads a buffer piece group by piece
//   group as its readers finish (chunks 0-3 after warpgroup 0's PV, 4-7 after
//   warpgroup 1's, 8 = P after both): one "full" and one "empty" mbarrier per
//   buffer and piece group (a lane per row, 32 lines a warp instruction, was 2x slower, H200).
// - Contiguous fast path (4-5% at 64k-91k on the H200): a producer warp whose 32 rows of a
//   block are prefix keys in consecutive slots (checked per block with one vote, so it is
//   taken only where the run is known contiguous) loads them with one TMA box
//   (32 rows x 64 columns, 128B swizzle, the same layout) per chunk, issued by
//   lane 0 against the same "full" mbarrier, instead of 32 row gathers. The
//   count of such blocks goes to the workspace header (kdtree_read_fast_path_boxes).
// - L2 prefetch: where a request spans several row tiles, row tile 0's producer asks L2
//   for each gathered row of a buffer's next block as soon as it has issued this one's
//   copies, a pair before those of the next block may be issued.
#pragma once

#include <cuda.h>  // CUtensorMap

#include "common.cuh"
#include "tiles.h"
#include "wgmma_ops.cuh"

namespace kdtree {
namespace sm90 {

constexpr int BM = 64;
constexpr int BN = 64;
constexpr int THREADS = 384;                        // warpgroups 0, 1: math; 2: producer
constexpr int CHUNK = 64 * 128;                     // one 64-row x 64-column swizzled chunk (bytes)
constexpr int TILE = 9 * CHUNK;                     // 64 rows x 576 columns
constexpr int Q_OFF = 0;                            // Q, then key buffer 0 at TILE, buffer 1 at 2 TILE
constexpr int MPUB_OFF = 3 * TILE;                  // [2 buffers][64] published maxima, then [2][64] row sums
constexpr int BAR_OFF = MPUB_OFF + 2 * 2 * 64 * 4;  // full[2 buffers][3 groups], empty[2][3], hand[2]
constexpr int SLOT_OFF = BAR_OFF + 14 * 8;           // the CTA's first partial row (int64; the epilogue's)
constexpr int JOB_OFF = SLOT_OFF + 8;               // the batch schedule's job (warp 0 derives it for all)
static_assert(sizeof(BatchJob) <= 32 && JOB_OFF % 8 == 0, "the job's bytes in the layout");
constexpr int SMEM = JOB_OFF + 32 + 1024;           // + slack to align the base to 1024
static_assert(SMEM == tiles::sm90_bytes() && TILE == tiles::SM90_TILE, "tiles.h disagrees with the kernel's layout");
static_assert(BN == tiles::SM90_BN, "the split schedule's step (Params::split_keys) is two of these blocks");
static_assert(BM == PLAN_BM, "the batch schedule (batch_plan) counts row tiles of PLAN_BM rows");
constexpr int G03 = 0, G47 = 1, G8 = 2;             // piece groups of a block
constexpr int RUN_ROWS = 32;                        // rows per producer warp: a TMA box when contiguous
// (the lazy maximum: RESCALE_LOG2, common.cuh)

// wgmma shared-memory descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = static_cast<uint64_t>((saddr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}

__device__ __forceinline__ void wg_arrive() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// rows [row, row + RUN_ROWS) x columns [col, col + 64) of the pool, 128B-swizzled, to dst
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int col, int row, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(bar) : "memory");
}
// ask L2 for `bytes` at src: no shared-memory side, nothing to wait for
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void math_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }
// S[64 x 64] += Q K^T over k-steps [K0, K1) of 16 columns (k = 4 chunk + step; the first
// step of all, k = 0, overwrites the accumulator), issued without a wait
template <int K0, int K1>
__device__ __forceinline__ void s_steps(float* s, uint64_t dq0, uint64_t dk0) {
#pragma unroll
  for (int k = K0; k < K1; ++k) {
    const uint64_t off = static_cast<uint64_t>(((k >> 2) * CHUNK + (k & 3) * 32) >> 4);
    wgmma_m64n64k16_ss(s, dq0 + off, dk0 + off, k > 0);
  }
}

// `tmap`: the pool as a [pool_size, 576] bf16 tensor (RUN_ROWS x 64 boxes, 128B swizzle);
// a producer warp whose 32 rows are one contiguous run of prefix slots copies them with
// 9 TMA loads per block when `use_tma` (else, and for every other warp, the gather).
// PLANNED: a 1-D grid of the batch schedule (common.cuh batch_plan), else (row tiles, splits, bs).
template <bool PLANNED>
__global__ void __launch_bounds__(THREADS, 1)
    verify_attn_kernel_sm90(const Params p, const __grid_constant__ CUtensorMap tmap, int use_tma) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sbase = smem_u32(smem);
  float* mpub = reinterpret_cast<float*>(smem + MPUB_OFF);  // [buffer][row]: maximum after that buffer's block
  const uint32_t bars = sbase + BAR_OFF;
  auto full = [&](int buf, int grp) { return bars + 8u * (3 * buf + grp); };
  auto empty = [&](int buf, int grp) { return bars + 48u + 8u * (3 * buf + grp); };
  // hand(w): warpgroup w's P and maxima of its block of the pair published (128 arrivals a phase;
  // phase j = pair j). An mbarrier rather than named barriers 2 / 3: racecheck reports the
  // named-barrier hand-off (correct by the PTX memory model); the order of events is the same
  auto hand = [&](int w) { return bars + 96u + 8u * w; };

  pdl_main_prologue();
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  int rt = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  BatchJob job;
  if (PLANNED) {  // warp 0 derives the CTA's job (common.cuh planned_job) for all
    job = planned_job(p, reinterpret_cast<BatchJob*>(smem + JOB_OFF), tid, rt, split);
    if (job.b < 0) return;  // uniform over the CTA
    b = job.b;
  }

  Work w;
  if (!setup_work<PLANNED>(p, b, rt * BM, split, BN, tid, w, job)) return;  // uniform over the CTA
  const int H = p.H;
  const int npairs = (w.t_end - w.t_begin + 1) / 2;
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 6; ++i) mbar_init(bars + 8u * i, 64);  // full: 64 producer rows each
#pragma unroll
    for (int buf = 0; buf < 2; ++buf) {
      mbar_init(empty(buf, G03), 128);  // warpgroup 0's PV_L
      mbar_init(empty(buf, G47), 128);  // warpgroup 1's PV_R
      mbar_init(empty(buf, G8), 256);   // P: both PVs
      mbar_init(hand(buf), 128);        // warpgroup buf's maxima and P
    }
    fence_mbar_init();
    *reinterpret_cast<int64_t*>(smem + SLOT_OFF) = w.slot0 + split * w.slot_stride;  // read in the epilogue
  }
  if (wg < 2) {  // Q rows, by the math warpgroups: 4 threads per row, 18 pieces each
    const int lrow = tid >> 2, lsub = tid & 3;
    const uint32_t lo_even = lrow * 128 + ((lsub ^ (lrow & 7)) << 4);
    const uint32_t lo_odd = lrow * 128 + (((lsub + 4) ^ (lrow & 7)) << 4);
    const int rr = w.r0 + lrow;
    const bool ok = rr < w.rows;
    const int tok = ok ? rr / H : 0, head = ok ? rr % H : 0;
    const __nv_bfloat16* src = ok ? p.q + static_cast<int64_t>(w.qo_start + tok) * p.q_st + static_cast<int64_t>(head) * p.q_sh : p.q;
#pragma unroll
    for (int j = 0; j < CHUNKS / 4; ++j)
      cp_async16(sbase + Q_OFF + (j >> 1) * CHUNK + ((j & 1) ? lo_odd : lo_even), src + (lsub + 4 * j) * 8, ok);
    cp_async_commit();
  }
  __syncthreads();  // mbarriers initialised and visible before any use

  if (wg == 2) {
    // ---------------- producer: 64 threads per buffer (x) ----------------
    // Each thread resolves one key row's source (row = pt & 63); the copies are issued
    // with 8 lanes per row (lane & 7: the 16-byte piece of a 128-byte chunk line), so a
    // warp instruction moves four whole 128-byte lines: lane rsub copies rows
    // 4 i + rsub of its warp's 32, their sources taken from the owning lanes by shuffle.
    setmaxnreg_dec<56>();  // 168 x 384 registers at launch = 56 x 128 (here) + 224 x 256 (math); 48 spilled with the prefetch
    const int pt = tid - 256, x = pt >> 6, row = pt & 63;
    const int lane = tid & 31, q = lane & 7, rsub = lane >> 3;
    const uint32_t blk = sbase + (1 + x) * TILE + (pt & 32) * 128 + rsub * 128;
    const uint32_t wbase = sbase + (1 + x) * TILE + (pt & 32) * 128;  // this warp's 32 rows of chunk 0
    int64_t slot = key_slot(p, (w.t_begin + x) * BN + row, w.L, w.kv_lo);
    int boxes = 0;  // blocks this warp loaded through the fast path (warp-uniform)
    // L2 prefetch of the gathered prefix rows (5% at bs1 N16 H8 64k on the H200): it hides
    // the gather's DRAM latency where a request's rows span several row tiles (the roofline's
    // compute side: each key row feeds >= 128 query rows). A request of one row tile (<= 64 rows,
    // ~120 FLOP per byte) is below the H200's ridge: its batch streams from DRAM at ~3.3 TB/s,
    // and the prefetch only adds requests to the queue (bs64 N4 H16 4k +3-4%).
    const bool prefetch = rt == 0 && w.rows > BM;
    for (int j = 0; j < npairs; ++j) {
      const int tile = w.t_begin + 2 * j + x;
      const int pos = tile * BN + row;
      const int64_t cur = slot;
      const KeySrc k = key_resolve(p, slot, pos, w.L, w.N, w.qo_start);
      slot = key_slot(p, (tile + 2) * BN + row, w.L, w.kv_lo);  // consumed next pair
      // contiguous run: this warp's 32 rows are prefix keys in slots slot0 .. slot0 + 31
      // (key_resolve checked each against the pool); issue-side only, no barrier
      const int64_t slot0 = __shfl_sync(0xffffffffu, cur, 0);
      const bool run = use_tma && __all_sync(0xffffffffu, k.valid && pos < w.L && cur == slot0 + lane);
      const long long own = reinterpret_cast<long long>(k.valid ? k.ptr : p.kv);
      const uint32_t vmask = __ballot_sync(0xffffffffu, k.valid);
      // the 8 rows' sources, taken from their lanes once per block and before any wait: a
      // released piece group's copies then go out with no shuffle in front of them
      // (the math warpgroups waited on groups 4-7 and 8; 3-6% of a call on the H200)
      const __nv_bfloat16* srcs[8];
#pragma unroll
      for (int i = 0; i < 8; ++i)
        srcs[i] = reinterpret_cast<const __nv_bfloat16*>(__shfl_sync(0xffffffffu, own, 4 * i + rsub)) + q * 8;
      auto issue = [&](int c0, int c1) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int src_lane = 4 * i + rsub;
          const __nv_bfloat16* src = srcs[i];
          const bool valid = (vmask >> src_lane) & 1u;
          const uint32_t dst = blk + i * 512 + ((q ^ ((4 * (i & 1)) + rsub)) << 4);
#pragma unroll
          for (int c = c0; c < c1; ++c) cp_async16(dst + c * CHUNK, src + c * 64, valid);
        }
      };
      const uint32_t par = (j - 1) & 1;  // this buffer's previous block released
      if (run) {  // warp-uniform: lane 0 loads each piece group with one box per chunk
        ++boxes;
#pragma unroll
        for (int grp = 0; grp < 3; ++grp) {
          const int c0 = 4 * grp, c1 = grp == G8 ? 9 : c0 + 4;
          if (j > 0) mbar_wait(empty(x, grp), par);
          if (lane == 0) {
            mbar_arrive_expect_tx(full(x, grp), (c1 - c0) * RUN_ROWS * 128);
#pragma unroll
            for (int c = c0; c < c1; ++c) tma_load_2d(wbase + c * CHUNK, &tmap, c * 64, static_cast<int>(slot0), full(x, grp));
          } else {
            mbar_arrive(full(x, grp));
          }
        }
        continue;
      }
      // the gather: the same code as without the fast path
      if (j > 0) mbar_wait(empty(x, G03), par);
      issue(0, 4);
      cp_async_mbar_arrive(full(x, G03));
      if (j > 0) mbar_wait(empty(x, G47), par);
      issue(4, 8);
      cp_async_mbar_arrive(full(x, G47));
      if (j > 0) mbar_wait(empty(x, G8), par);
      issue(8, 9);
      cp_async_mbar_arrive(full(x, G8));
      // this row of the buffer's next block, into L2 a pair before its copies may be issued
      // (they wait for the readers of this one): by row tile 0 only, and only where the
      // request has several row tiles (see `prefetch`); slot >= 0 only for a prefix key
      // (key_slot), so the row is inside the prefix
      if (prefetch && j + 1 < npairs && slot >= 0 && slot < p.pool_size)
        prefetch_l2(p.kv + slot * p.kv_st, ROW_BYTES);
    }
    cp_async_wait_all();
    // the count the tests and gates read back (kdtree_read_fast_path_boxes reads and clears it)
    if (boxes && lane == 0) atomicAdd(p.err + WS_FAST_BOXES, boxes);
    return;
  }

  // ---------------- math warpgroups: wg computes S of buffer wg's blocks, O[:, 256 wg ..] ----------------
  setmaxnreg_inc<224>();
  const int lane = tid & 31, wwarp = (tid >> 5) & 3;
  const int g = lane >> 2, tq = lane & 3;
  const int row0 = wwarp * 16 + g;  // this thread's rows in the tile: row0, row0 + 8
  const int myrow0 = w.r0 + row0;
  const int tok0 = myrow0 < w.rows ? myrow0 / H : -1;
  const int tok1 = myrow0 + 8 < w.rows ? (myrow0 + 8) / H : -1;
  const float scale = p.scale_log2;
  const uint32_t buf0 = sbase + TILE, buf1 = sbase + 2 * TILE;
  const uint64_t dq0 = desc(sbase + Q_OFF, 16, 1024);
  const uint64_t dk0 = desc(wg ? buf1 : buf0, 16, 1024);
  const uint64_t dp[2] = {desc(buf0 + 8 * CHUNK, 16, 1024), desc(buf1 + 8 * CHUNK, 16, 1024)};
  const uint64_t dv[2] = {desc(buf0 + wg * 4 * CHUNK, CHUNK, 1024), desc(buf1 + wg * 4 * CHUNK, CHUNK, 1024)};
  unsigned char* pt = smem + (1 + wg) * TILE + 8 * CHUNK;  // this warpgroup's P: its buffer's chunk 8
  const int my_v = wg ? G47 : G03;                        // the V half this warpgroup reads

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_cur[2] = {-CUDART_INF_F, -CUDART_INF_F};  // the maximum O and l are scaled to (log2 units)
  float l_run[2] = {0.f, 0.f};                      // over this warpgroup's blocks only; summed at the end
  cp_async_wait_all();
  fence_proxy_async();
  math_sync();  // Q landed (every math thread's pieces)

  // O and l to maximum m_to (per row; most calls change nothing)
  auto rescale = [&](const float* m_to) {
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      corr[h] = m_to[h] == m_cur[h] ? 1.f : fast_exp2(m_cur[h] - m_to[h]);  // -inf -> finite: 0
      m_cur[h] = m_to[h];
      l_run[h] *= corr[h];
    }
    if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        o[4 * i + 0] *= corr[0]; o[4 * i + 1] *= corr[0];
        o[4 * i + 2] *= corr[1]; o[4 * i + 3] *= corr[1];
      }
    }
  };
  // O[64 x 256] += P V of buffer `buf` (columns wg*256..)
  auto pv = [&](int buf, uint32_t par) {
    mbar_wait(full(buf, my_v), par);  // complete by now; orders the other warpgroup's view of it
    fence_proxy_async();
    fence_regs<128>(o);
    wg_arrive();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      wgmma_m64n256k16_ss_tb(o, dp[buf] + static_cast<uint64_t>((ks * 32) >> 4),
                             dv[buf] + static_cast<uint64_t>((ks * 2048) >> 4), 1);
    wg_commit();
    wg_wait0();
    fence_regs<128>(o);
    mbar_arrive(empty(buf, my_v));
    mbar_arrive(empty(buf, G8));
  };

  for (int j = 0; j < npairs; ++j) {
    const uint32_t par = j & 1;
    const int tile = w.t_begin + 2 * j + wg;

    // ---- S[64 x 64] = Q K^T of this warpgroup's block, piece group by piece group ----
    float s[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    fence_regs<32>(s);
    // the k-steps of piece groups G03 (chunks 0-3), G47 (4-7) and G8 (8), each as its
    // pieces land (one call per group with constant bounds: written as a loop over the
    // groups, nvcc keeps it rolled, 12 HGMMA instead of 36)
    mbar_wait(full(wg, G03), par);
    fence_proxy_async();
    wg_arrive();
    s_steps<0, 16>(s, dq0, dk0);
    mbar_wait(full(wg, G47), par);
    fence_proxy_async();
    s_steps<16, 32>(s, dq0, dk0);
    mbar_wait(full(wg, G8), par);
    fence_proxy_async();
    s_steps<32, 36>(s, dq0, dk0);
    wg_commit();
    wg_wait0();
    fence_regs<32>(s);

    // ---- mask (the block that reaches the drafts or the end, or lies past this split) ----
    const bool in_split = tile < w.t_end;
    if (!in_split || tile * BN + BN > w.L) {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = tile * BN + jj * 8 + tq * 2 + (e & 1);
          if (!in_split || key_hidden(p, w, pos, (e >> 1) ? tok1 : tok0)) s[4 * jj + e] = -CUDART_INF_F;
        }
    }
    float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      mx[0] = fmaxf(mx[0], fmaxf(s[4 * jj + 0], s[4 * jj + 1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[4 * jj + 2], s[4 * jj + 3]));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      mx[h] *= scale;
    }

    // ---- the maximum after the previous block: warpgroup 0 holds it (its O is scaled to
    // the one after block 2j - 1), warpgroup 1 waits for warpgroup 0's block 2j ----
    float m_prev[2];
    if (wg == 1) {
      mbar_wait(hand(0), par);  // P0 and the maxima after block 2j published
      m_prev[0] = mpub[row0];
      m_prev[1] = mpub[row0 + 8];
    } else {
      m_prev[0] = m_cur[0];
      m_prev[1] = m_cur[1];
    }
    // lazy update: move a row's maximum only when this block passes it by > 2^RESCALE_LOG2
    float m_new[2], msub[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_new[h] = mx[h] > m_prev[h] + RESCALE_LOG2 ? mx[h] : m_prev[h];
      msub[h] = m_new[h] == -CUDART_INF_F ? 0.f : m_new[h];
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const float p0 = fast_exp2(fmaf(s[4 * jj + 0], scale, -msub[0])), p1 = fast_exp2(fmaf(s[4 * jj + 1], scale, -msub[0]));
      const float p2 = fast_exp2(fmaf(s[4 * jj + 2], scale, -msub[1])), p3 = fast_exp2(fmaf(s[4 * jj + 3], scale, -msub[1]));
      rs[0] += p0 + p1;
      rs[1] += p2 + p3;
      *reinterpret_cast<uint32_t*>(pt + row0 * 128 + ((jj ^ (row0 & 7)) << 4) + tq * 4) = pack_bf16(p0, p1);
      *reinterpret_cast<uint32_t*>(pt + (row0 + 8) * 128 + ((jj ^ ((row0 + 8) & 7)) << 4) + tq * 4) = pack_bf16(p2, p3);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rs[h] += __shfl_xor_sync(0xffffffffu, rs[h], 1);
      rs[h] += __shfl_xor_sync(0xffffffffu, rs[h], 2);
    }
    if (tq == 0) {
      mpub[wg * 64 + row0] = m_new[0];
      mpub[wg * 64 + row0 + 8] = m_new[1];
    }
    fence_proxy_async();  // P written by ordinary stores -> read by wgmma (both warpgroups)
    mbar_arrive(hand(wg));  // block 2j + wg's P and maxima (release: every thread arrives after its stores)

    if (wg == 0) {
      // PV_L(2j) with the maxima after block 2j, then PV_L(2j + 1) with those after 2j + 1
      rescale(m_new);
      l_run[0] += rs[0];
      l_run[1] += rs[1];
      pv(0, par);
      mbar_wait(hand(1), par);  // P1 and the maxima after block 2j + 1
      const float m1[2] = {mpub[64 + row0], mpub[64 + row0 + 8]};
      rescale(m1);
      pv(1, par);
    } else {
      // PV_R(2j) with the maxima after block 2j (m_prev), then PV_R(2j + 1) with its own
      rescale(m_prev);
      pv(0, par);
      rescale(m_new);
      l_run[0] += rs[0];
      l_run[1] += rs[1];
      pv(1, par);
    }
  }

  // ---- both warpgroups end scaled to the maxima after the last block; sum the row sums ----
  float* red_sum = mpub + 128;
  if (tq == 0) {
    red_sum[wg * 64 + row0] = l_run[0];
    red_sum[wg * 64 + row0 + 8] = l_run[1];
  }
  math_sync();
  l_run[0] += red_sum[(wg ^ 1) * 64 + row0];
  l_run[1] += red_sum[(wg ^ 1) * 64 + row0 + 8];
  store_rows(p, o, m_cur, l_run, myrow0, w.rows, w.qo_start, *reinterpret_cast<const int64_t*>(smem + SLOT_OFF),
             w.splits > 1, wg, tq);
#endif
}

}  // namespace sm90
}  // namespace kdtree
