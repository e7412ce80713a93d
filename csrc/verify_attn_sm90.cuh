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
constexpr int SMEM = RED_OFF + 2 * 2 * 64 * 4 + 1024;  // + slack to align the base to 1024

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
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t sbase = smem_u32(smem);
  float* red = reinterpret_cast<float*>(smem + RED_OFF);

  const int rt = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7, wwarp = (tid >> 5) & 3;
  const int g = lane >> 2, tq = lane & 3;

  Work w;
  if (!setup_work(p, b, rt * BM, BM, split, BN, tid, THREADS, w)) return;
  const int H = p.H;

  // loader: 4 threads per row (64 rows), 18 pieces each
  const int lrow = tid >> 2, lsub = tid & 3;
  {
    const int rr = w.r0 + lrow;
    const bool ok = rr < w.rows;
    const int tok = ok ? rr / H : 0, head = ok ? rr % H : 0;
    const __nv_bfloat16* src = p.q + static_cast<int64_t>(w.qo_start + tok) * p.q_st + static_cast<int64_t>(head) * p.q_sh;
    for (int gi = lsub; gi < CHUNKS; gi += 4)
      cp_async16(sbase + Q_OFF + swz(lrow, gi), ok ? src + gi * 8 : p.q, ok);
  }
  auto issue_tile = [&](int stage, KeySrc src) {
    const uint32_t dst = sbase + K_OFF + stage * TILE;
    for (int gi = lsub; gi < CHUNKS; gi += 4)
      cp_async16(dst + swz(lrow, gi), src.valid ? src.ptr + gi * 8 : p.kv, src.valid);
  };
  KeySrc src_next = key_source(p, w.t_begin * BN + lrow, w.L, w.N, w.kv_lo, w.qo_start);
  issue_tile(0, src_next);
  cp_async_commit();
  if (w.t_begin + 1 < w.t_end) src_next = key_source(p, (w.t_begin + 1) * BN + lrow, w.L, w.N, w.kv_lo, w.qo_start);

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F};
  float l_run[2] = {0.f, 0.f};  // over this warpgroup's keys only; summed at the end
  const int row0 = wwarp * 16 + g;  // this thread's rows in the tile: row0, row0 + 8
  const int myrow0 = w.r0 + row0;
  const int tok0 = myrow0 < w.rows ? myrow0 / H : -1;
  const int tok1 = myrow0 + 8 < w.rows ? (myrow0 + 8) / H : -1;

  for (int tile = w.t_begin; tile < w.t_end; ++tile) {
    const int stage = (tile - w.t_begin) & 1;
    cp_async_wait_all();
    fence_proxy_async();  // cp.async writes -> visible to the wgmma (async) proxy
    __syncthreads();
    if (tile + 1 < w.t_end) {
      issue_tile(stage ^ 1, src_next);
      cp_async_commit();
      if (tile + 2 < w.t_end) src_next = key_source(p, (tile + 2) * BN + lrow, w.L, w.N, w.kv_lo, w.qo_start);
    }
    const uint32_t kst = sbase + K_OFF + stage * TILE;

    // ---- S[64 x 32] = Q K^T for keys wg*32.. ----
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    fence_regs<16>(s);
    wg_arrive();
#pragma unroll
    for (int k = 0; k < 36; ++k) {
      const int c = k >> 2, kin = k & 3;
      wgmma_m64n32k16_ss(s, desc(sbase + Q_OFF + c * CHUNK + kin * 32, 16, 1024),
                         desc(kst + c * CHUNK + wg * 32 * 128 + kin * 32, 16, 1024), k > 0);
    }
    wg_commit();
    wg_wait0();
    fence_regs<16>(s);

    // ---- mask, row max across both warpgroups ----
    const bool needs_mask = tile * BN + BN > w.L;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = tile * BN + wg * 32 + j * 8 + tq * 2 + (e & 1);
        s[4 * j + e] = masked_score(p, w, s[4 * j + e], pos, (e >> 1) ? tok1 : tok0, needs_mask);
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
    }
    if (tq == 0) {
      red[wg * 64 + row0] = mx[0];
      red[wg * 64 + row0 + 8] = mx[1];
    }
    __syncthreads();
    float corr[2], msub[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float other = red[(wg ^ 1) * 64 + row0 + 8 * h];
      const float m_new = fmaxf(m_run[h], fmaxf(mx[h], other));
      msub[h] = m_new == -CUDART_INF_F ? 0.f : m_new;
      corr[h] = exp2f(m_run[h] - msub[h]);
      m_run[h] = m_new;
    }
    // ---- P (bf16, swizzled K-major 64 x 64) and the row sums of this warpgroup's keys ----
    float rs[2] = {0.f, 0.f};
    unsigned char* pt = smem + P_OFF;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p0 = exp2f(s[4 * j + 0] - msub[0]), p1 = exp2f(s[4 * j + 1] - msub[0]);
      const float p2 = exp2f(s[4 * j + 2] - msub[1]), p3 = exp2f(s[4 * j + 3] - msub[1]);
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
      l_run[h] = l_run[h] * corr[h] + rs[h];
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      o[4 * i + 0] *= corr[0]; o[4 * i + 1] *= corr[0];
      o[4 * i + 2] *= corr[1]; o[4 * i + 3] *= corr[1];
    }
    fence_proxy_async();  // P written by ordinary stores -> read by wgmma
    __syncthreads();

    // ---- O[64 x 256] += P[64 x 64] V[64 x 256] (columns wg*256..) ----
    fence_regs<128>(o);
    wg_arrive();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      wgmma_m64n256k16_ss_tb(o, desc(sbase + P_OFF + ks * 32, 16, 1024),
                             desc(kst + wg * 4 * CHUNK + ks * 2048, CHUNK, 1024), 1);
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
