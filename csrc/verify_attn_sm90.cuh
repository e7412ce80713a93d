// kdtree-engine: the Hopper (sm_90a) instance of the verify kernel, with wgmma.
//
// Same work split, metadata checks, masking, split-KV and epilogue as the
// portable mma.sync kernel (verify_attn_flash.cu includes this file after
// those helpers). What changes is how the tensor cores are fed:
// - 2 warpgroups, 64 query rows, 64-key tiles. Q (64 x 576) and each key tile
//   (64 x 576) sit in shared memory in the 128-byte-swizzled layout wgmma reads
//   directly (9 chunks of 64 rows x 64 columns), so Q is never re-read through
//   registers: S = Q K^T is 36 wgmma.m64n32k16 per warpgroup, warpgroup w taking
//   keys w*32..w*32+31.
// - The two warpgroups exchange only their row maxima (and, at the end, row
//   sums) through shared memory; each writes its half of P (bf16) into a
//   swizzled 64 x 64 tile.
// - O = P V: warpgroup w owns columns w*256..w*256+255, 4 wgmma.m64n256k16 per
//   tile with V read from the same key tile (MN-major, transposed B).
// - Key tiles double-buffered with 16-byte cp.async gathers (page size 1).
#pragma once

#include "wgmma_ops.cuh"

namespace kdtree {
namespace sm90 {

constexpr int BM = 64;
constexpr int BN = 64;
constexpr int THREADS = 256;
constexpr int CHUNK = 64 * 128;               // one 64-row x 64-column swizzled chunk (bytes)
constexpr int TILE = 9 * CHUNK;               // 64 rows x 576 columns
constexpr int Q_OFF = 0;
constexpr int K_OFF = TILE;                   // 2 stages
constexpr int P_OFF = 3 * TILE;               // 64 x 64 bf16
constexpr int RED_OFF = P_OFF + CHUNK;        // [2 warpgroups][64 rows] fp32 maxima, then the same for sums
constexpr int FLAG_OFF = RED_OFF + 2 * 2 * 64 * 4;  // [2 tile parities] int: some row's maximum jumped
constexpr int SMEM = FLAG_OFF + 16 + 1024;          // + slack to align the base to 1024
// A row's maximum is re-agreed between the warpgroups only when a tile's score exceeds
// the running one by more than 2^RESCALE_LOG2 (log2 units); below that, P is taken
// against the stale maximum (values up to 2^8, exact after the final division by l).
constexpr float RESCALE_LOG2 = 8.f;

// Byte offset of 16-byte piece g (0..71) of row r in a swizzled 576-wide tile.
__device__ __forceinline__ uint32_t swz(int r, int g) {
  return (g >> 3) * CHUNK + r * 128 + (((g & 7) ^ (r & 7)) << 4);
}

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

__global__ void __launch_bounds__(THREADS, 1) verify_attn_kernel_sm90(const Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  // align to 1024 by an offset from smem_raw, so that the compiler keeps the shared address
  // space (plain STS/LDS, not generic stores) for everything derived from it
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sbase = smem_u32(smem);
  float* red = reinterpret_cast<float*>(smem + RED_OFF);
  int* jumped = reinterpret_cast<int*>(smem + FLAG_OFF);
  if (threadIdx.x < 2) jumped[threadIdx.x] = 0;  // published by the loop's first barrier

  pdl_launch_dependents();
  const int rt = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31;
  // warpgroup index, provably warp-uniform (so descriptors stay in uniform registers)
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0), wwarp = (tid >> 5) & 3;
  const int g = lane >> 2, tq = lane & 3;

  Work w;
  if (!setup_work(p, b, rt * BM, BM, split, BN, tid, THREADS, w)) return;
  const int H = p.H;

  // loader: 4 threads per row (64 rows), 18 pieces each. Piece gi = lsub + 4 j sits in
  // chunk j / 2 at swizzled column (gi & 7) ^ (row & 7), and gi & 7 = lsub + 4 (j & 1):
  // two per-thread offsets plus compile-time constants.
  const int lrow = tid >> 2, lsub = tid & 3;
  const uint32_t lo_even = lrow * 128 + ((lsub ^ (lrow & 7)) << 4);
  const uint32_t lo_odd = lrow * 128 + (((lsub + 4) ^ (lrow & 7)) << 4);
  auto issue_row = [&](uint32_t dst, const __nv_bfloat16* src, bool valid) {
#pragma unroll
    for (int j = 0; j < CHUNKS / 4; ++j)
      cp_async16(dst + (j >> 1) * CHUNK + ((j & 1) ? lo_odd : lo_even), src + (lsub + 4 * j) * 8, valid);
  };
  {
    const int rr = w.r0 + lrow;
    const bool ok = rr < w.rows;
    const int tok = ok ? rr / H : 0, head = ok ? rr % H : 0;
    const __nv_bfloat16* src = p.q + static_cast<int64_t>(w.qo_start + tok) * p.q_st + static_cast<int64_t>(head) * p.q_sh;
    issue_row(sbase + Q_OFF, ok ? src : p.q, ok);
  }
  auto issue_tile = [&](int stage, KeySrc src) {
    issue_row(sbase + K_OFF + stage * TILE, src.valid ? src.ptr : p.kv, src.valid);
  };
  // this thread's key row: its slot id is loaded one tile before its copy is issued
  issue_tile(0, key_source(p, w.t_begin * BN + lrow, w.L, w.N, w.kv_lo, w.qo_start));
  cp_async_commit();
  int64_t slot_next = key_slot(p, (w.t_begin + 1) * BN + lrow, w.L, w.kv_lo);

  // Descriptors of the operand bases; a k-step or a stage adds (byte offset >> 4) to the
  // start-address field, which cannot carry out of it (shared addresses < 2^18).
  const uint64_t dq0 = desc(sbase + Q_OFF, 16, 1024);
  const uint64_t dk0 = desc(sbase + K_OFF + wg * 32 * 128, 16, 1024);
  const uint64_t dp0 = desc(sbase + P_OFF, 16, 1024);
  const uint64_t dv0 = desc(sbase + K_OFF + wg * 4 * CHUNK, CHUNK, 1024);

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F};  // running maxima, log2 units
  float l_run[2] = {0.f, 0.f};  // over this warpgroup's keys only; summed at the end
  const int row0 = wwarp * 16 + g;  // this thread's rows in the tile: row0, row0 + 8
  const int myrow0 = w.r0 + row0;
  const int tok0 = myrow0 < w.rows ? myrow0 / H : -1;
  const int tok1 = myrow0 + 8 < w.rows ? (myrow0 + 8) / H : -1;
  const float scale = p.scale_log2;

  for (int tile = w.t_begin; tile < w.t_end; ++tile) {
    const int stage = (tile - w.t_begin) & 1;
    cp_async_wait_all();
    fence_proxy_async();  // cp.async writes -> visible to the wgmma (async) proxy
    __syncthreads();
    const uint64_t st = static_cast<uint64_t>(stage * (TILE >> 4));

    // ---- S[64 x 32] = Q K^T for keys wg*32.. (raw scores), issued before the next
    // tile's copies so that the tensor cores work while this thread's cp.asyncs queue ----
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    fence_regs<16>(s);
    wg_arrive();
#pragma unroll
    for (int k = 0; k < 36; ++k) {
      const uint64_t off = static_cast<uint64_t>(((k >> 2) * CHUNK + (k & 3) * 32) >> 4);
      wgmma_m64n32k16_ss(s, dq0 + off, dk0 + st + off, k > 0);
    }
    wg_commit();
    if (tile + 1 < w.t_end) {  // the other stage: its last reader (PV of tile - 1) is done
      issue_tile(stage ^ 1, key_resolve(p, slot_next, (tile + 1) * BN + lrow, w.L, w.N, w.qo_start));
      cp_async_commit();
      slot_next = key_slot(p, (tile + 2) * BN + lrow, w.L, w.kv_lo);  // used next iteration
    }
    wg_wait0();
    fence_regs<16>(s);

    // ---- mask (only the tile that reaches the drafts or the end), row max across both warpgroups ----
    if (tile * BN + BN > w.L) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = tile * BN + wg * 32 + j * 8 + tq * 2 + (e & 1);
          if (key_hidden(p, w, pos, (e >> 1) ? tok1 : tok0)) s[4 * j + e] = -CUDART_INF_F;
        }
    }
    float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(s[4 * j + 0], s[4 * j + 1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      mx[h] *= scale;
    }
    // P against the running maximum; a row whose tile maximum jumps past it by more than
    // 2^RESCALE_LOG2 flags the tile, and then both warpgroups agree on new maxima (their
    // tile maxima through `red`) and redo P. Most tiles of a long prefix skip that barrier.
    if (tq == 0) {
      red[wg * 64 + row0] = mx[0];
      red[wg * 64 + row0 + 8] = mx[1];
    }
    if (mx[0] > m_run[0] + RESCALE_LOG2 || mx[1] > m_run[1] + RESCALE_LOG2) jumped[tile & 1] = 1;
    if (threadIdx.x == 0) jumped[(tile + 1) & 1] = 0;  // last read before this tile's top barrier
    unsigned char* pt = smem + P_OFF;
    float rs[2];
    auto write_p = [&](const float* msub) {
      rs[0] = rs[1] = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float p0 = fast_exp2(fmaf(s[4 * j + 0], scale, -msub[0])), p1 = fast_exp2(fmaf(s[4 * j + 1], scale, -msub[0]));
        const float p2 = fast_exp2(fmaf(s[4 * j + 2], scale, -msub[1])), p3 = fast_exp2(fmaf(s[4 * j + 3], scale, -msub[1]));
        rs[0] += p0 + p1;
        rs[1] += p2 + p3;
        const int unit = wg * 4 + j;  // 8-key piece of the 64-key row
        *reinterpret_cast<uint32_t*>(pt + row0 * 128 + ((unit ^ (row0 & 7)) << 4) + tq * 4) = pack_bf16(p0, p1);
        *reinterpret_cast<uint32_t*>(pt + (row0 + 8) * 128 + ((unit ^ ((row0 + 8) & 7)) << 4) + tq * 4) =
            pack_bf16(p2, p3);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        rs[h] += __shfl_xor_sync(0xffffffffu, rs[h], 1);
        rs[h] += __shfl_xor_sync(0xffffffffu, rs[h], 2);
      }
    };
    {
      const float msub[2] = {m_run[0] == -CUDART_INF_F ? 0.f : m_run[0], m_run[1] == -CUDART_INF_F ? 0.f : m_run[1]};
      write_p(msub);
    }
    fence_proxy_async();  // P written by ordinary stores -> read by wgmma
    __syncthreads();
    if (jumped[tile & 1]) {  // CTA-uniform: read after the barrier, cleared a tile later
      float corr[2], msub[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float other = red[(wg ^ 1) * 64 + row0 + 8 * h];
        const float m_new = fmaxf(m_run[h], fmaxf(mx[h], other));
        msub[h] = m_new == -CUDART_INF_F ? 0.f : m_new;
        corr[h] = fast_exp2(m_run[h] - msub[h]);
        m_run[h] = m_new;
      }
      write_p(msub);  // each thread rewrites only its own P entries
#pragma unroll
      for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * corr[h] + rs[h];
      if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          o[4 * i + 0] *= corr[0]; o[4 * i + 1] *= corr[0];
          o[4 * i + 2] *= corr[1]; o[4 * i + 3] *= corr[1];
        }
      }
      fence_proxy_async();
      __syncthreads();
    } else {
      l_run[0] += rs[0];
      l_run[1] += rs[1];
    }

    // ---- O[64 x 256] += P[64 x 64] V[64 x 256] (columns wg*256..) ----
    fence_regs<128>(o);
    wg_arrive();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      wgmma_m64n256k16_ss_tb(o, dp0 + static_cast<uint64_t>((ks * 32) >> 4),
                             dv0 + st + static_cast<uint64_t>((ks * 2048) >> 4), 1);
    wg_commit();
    wg_wait0();
    fence_regs<128>(o);
  }

  // ---- row sums of both warpgroups, then the shared epilogue ----
  __syncthreads();
  float* red_sum = red + 128;
  if (tq == 0) {
    red_sum[wg * 64 + row0] = l_run[0];
    red_sum[wg * 64 + row0 + 8] = l_run[1];
  }
  __syncthreads();
  l_run[0] += red_sum[(wg ^ 1) * 64 + row0];
  l_run[1] += red_sum[(wg ^ 1) * 64 + row0 + 8];
  store_rows(p, o, m_run, l_run, myrow0, w.rows, w.qo_start, split, wg, tq);
#endif
}

}  // namespace sm90
}  // namespace kdtree
