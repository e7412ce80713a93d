// kdtree-engine: tree-verify MLA attention over SGLang's paged bf16 KV cache.
//
// Design (docs/kernel-notes.md has the reasoning and the measurements):
// - All N x H query rows of a request share one latent KV head, so a CTA takes
//   BM consecutive query rows of one request (row r = token r / H, head r % H;
//   those rows are contiguous in q) and streams the request's keys through
//   shared memory once for all of them.
// - Split-KV: the key range (prefix + N drafts) of a request is cut into
//   num_splits pieces of whole BN-key tiles, computed on the device from
//   kv_indptr, so one long request fills the GPU and the grid does not depend
//   on device values (CUDA-graph safe). A combine kernel merges the pieces by
//   their log-sum-exp. With one split the main kernel writes bf16 output itself.
// - Tensor cores through mma.sync m16n8k16 bf16 (sm_80+, so one source serves
//   sm_90 and sm_120). 2*RG warps: warp (rg, kh) computes S for query rows
//   rg*16.. and keys kh*BN/2.. over all 576 dims, S goes through shared memory,
//   every warp then applies the online softmax to its 16 rows x BN keys and
//   accumulates O for its 16 rows x 256 value columns (kh picks the half).
// - Keys arrive by 16-byte cp.async gathers (one slot = 1152 contiguous bytes),
//   double-buffered: tile i+1 loads while tile i computes. Slot ids are
//   prefetched two tiles ahead into registers.
// - The tree mask is read only for the last keys (the drafts): prefix tiles
//   take no mask at all.
#include <cuda.h>  // CUtensorMap (types only: the encoder comes through cudaGetDriverEntryPointByVersion)
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kdtree_verify.h"

#ifndef KDTREE_ARCHS
#define KDTREE_ARCHS "unknown"
#endif

namespace kdtree {

constexpr int D = KDTREE_HEAD_DIM;        // 576
constexpr int DV = KDTREE_V_DIM;          // 512
constexpr int ROW_BYTES = D * 2;          // 1152
constexpr int CHUNKS = ROW_BYTES / 16;    // 72 16-byte pieces per latent
constexpr int SROW = ROW_BYTES + 16;      // padded smem row: ldmatrix rows hit distinct banks
constexpr int BN = 32;                    // keys per tile
constexpr int SPAD = BN + 8;              // S row stride (floats)
#ifndef KDTREE_SACC
#define KDTREE_SACC 4
#endif
constexpr int SACC = KDTREE_SACC;         // independent S accumulator sets (see the S loop)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr int WS_HEADER = 256;            // bytes of workspace before the partials
constexpr int WS_FAST_BOXES = 1;         // header word: 32-row boxes the contiguous fast path loaded

struct Params {
  const __nv_bfloat16* q;
  int64_t q_st, q_sh;
  const __nv_bfloat16* k_ext;
  int64_t k_ext_st;
  const __nv_bfloat16* kv;
  int64_t kv_st, pool_size;
  const int32_t* qo_indptr;
  const int32_t* kv_indptr;
  const void* kv_indices;
  int kv_indices_64;
  int64_t kv_indices_len;
  const uint8_t* mask;
  const int64_t* mask_indptr;
  int64_t mask_len;
  __nv_bfloat16* o;
  int64_t o_st, o_sh;
  float* lse;
  float* o_part;     // [num_splits, T*H, 512]
  float* lse_part;   // [num_splits, T*H]
  int* err;
  int bs, H, max_n, T, num_splits;
  float scale_log2;
};

template <int RG>
struct Cfg {
  static constexpr int BM = RG * 16;
  static constexpr int WARPS = RG * 2;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int Q_BYTES = BM * SROW;
  static constexpr int K_BYTES = BN * SROW;
  static constexpr int S_BYTES = BM * SPAD * 4;
  static constexpr int SMEM = Q_BYTES + 2 * K_BYTES + S_BYTES;
  // Key-tile loader: THREADS / BN threads per key row.
  static constexpr int TPR = THREADS / BN;
  static_assert(THREADS % BN == 0, "loader needs whole threads per key row");
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  int n = valid ? 16 : 0;  // 0 -> zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                          uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// D = A(16x16 bf16, row) * B(16x8 bf16, col) + D, fp32 accumulate.
__device__ __forceinline__ void mma16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Programmatic dependent launch (sm_90+): the main kernel lets the combine launch
// early (its CTAs then wait in griddepcontrol.wait for the main grid's completion and
// memory), hiding the launch gap between the two; no-ops on older archs.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The error word is cleared by clear_error_kernel, the main kernel's PDL primary: the
// main kernel starts before that clear has run, so a report waits for it first (only
// on the error path; the happy path never waits).
__device__ __forceinline__ void report_error(int* err, int bits) {
  pdl_wait_primary();
  atomicOr(err, bits);
}

// Clears the workspace header (the error word) for this call. It lets the main kernel
// launch at once (launch_dependents at entry): a graph then runs no memset node and
// no launch gap before the main kernel, whose first reads are inputs written before
// this kernel started.
__global__ void clear_error_kernel(int* header) {
  pdl_launch_dependents();
  header[threadIdx.x] = 0;
}

// 2^x on the MUFU unit alone: exp2f adds a range check and two scalings per call to keep
// denormal results, which a softmax weight below 2^-126 does not need (it flushes to 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ int64_t load_slot(const Params& p, int64_t i) {
  return p.kv_indices_64 ? reinterpret_cast<const int64_t*>(p.kv_indices)[i]
                         : static_cast<int64_t>(reinterpret_cast<const int32_t*>(p.kv_indices)[i]);
}

// Source of key position `pos` of a request (prefix slot, draft row, or none).
struct KeySrc {
  const __nv_bfloat16* ptr;
  bool valid;
};

// In two steps, so that a slot id's global load can be issued a tile early and waited
// for only when its copy is issued: key_slot loads (prefix keys only, -1 otherwise),
// key_resolve checks the id and makes the source; key_source does both at once.
__device__ __forceinline__ int64_t key_slot(const Params& p, int pos, int L, int64_t kv_start) {
  return pos < L ? load_slot(p, kv_start + pos) : -1;
}
__device__ __forceinline__ KeySrc key_resolve(const Params& p, int64_t slot, int pos, int L, int N, int qo_start) {
  KeySrc s{p.kv, false};
  if (pos < L) {
    if (slot >= 0 && slot < p.pool_size) {
      s.ptr = p.kv + slot * p.kv_st;
      s.valid = true;
    } else {
      report_error(p.err, KDTREE_ERR_SLOT);
    }
  } else if (pos < L + N) {
    s.ptr = p.k_ext + static_cast<int64_t>(qo_start + pos - L) * p.k_ext_st;
    s.valid = true;
  }
  return s;
}

__device__ __forceinline__ KeySrc key_source(const Params& p, int pos, int L, int N, int64_t kv_start,
                                             int qo_start) {
  return key_resolve(p, key_slot(p, pos, L, kv_start), pos, L, N, qo_start);
}

// What one CTA works on: request b's query rows r0 .. r0+BM and key tiles [t_begin, t_end).
struct Work {
  int qo_start, kv_lo, N, rows, r0, L, KV, t_begin, t_end;
  int64_t mask_base;
  bool mask_ok;
};

// Read and validate request b's metadata (device values, never trusted: a bad
// value sets a bit in *err and the CTA does nothing). Returns false when the
// CTA has no work; an empty split still marks its rows' LSE so combine skips it.
__device__ __forceinline__ bool setup_work(const Params& p, int b, int r0, int bm, int split, int bn,
                                           int tid, int nthreads, Work& w) {
  const bool reporter = tid == 0 && r0 == 0 && split == 0;
  w.qo_start = p.qo_indptr[b];
  const int qo_end = p.qo_indptr[b + 1];
  w.kv_lo = p.kv_indptr[b];
  const int kv_hi = p.kv_indptr[b + 1];
  w.N = qo_end - w.qo_start;
  if (w.qo_start < 0 || w.N < 0 || qo_end > p.T || w.N > p.max_n) {
    if (reporter) report_error(p.err, KDTREE_ERR_QO_INDPTR);
    return false;
  }
  if (w.kv_lo < 0 || kv_hi < w.kv_lo || kv_hi > p.kv_indices_len) {
    if (reporter) report_error(p.err, KDTREE_ERR_KV_INDPTR);
    return false;
  }
  w.rows = w.N * p.H;
  w.r0 = r0;
  if (r0 >= w.rows) return false;  // no such row tile for this request (combine skips it too)
  w.L = kv_hi - w.kv_lo;
  w.KV = w.L + w.N;
  w.mask_base = p.mask_indptr[b];
  w.mask_ok = w.N == 0 || (w.mask_base >= 0 && w.mask_base + static_cast<int64_t>(w.N) * w.KV <= p.mask_len);
  if (!w.mask_ok && reporter) report_error(p.err, KDTREE_ERR_MASK);
  const int ntiles = (w.KV + bn - 1) / bn;
  const int per = (ntiles + p.num_splits - 1) / p.num_splits;
  w.t_begin = split * per;
  w.t_end = min(ntiles, w.t_begin + per);
  if (w.t_begin >= w.t_end) {
    if (p.num_splits > 1) {
      const int64_t grow0 = static_cast<int64_t>(w.qo_start) * p.H + r0;
      for (int r = tid; r < bm && r0 + r < w.rows; r += nthreads)
        p.lse_part[static_cast<int64_t>(split) * p.T * p.H + grow0 + r] = -CUDART_INF_F;
    }
    return false;
  }
  return true;
}

// Tree mask: keys past the end are hidden; draft keys (pos >= L) are visible iff the
// FULL_MASK row of `tok` says so (rows past the request, tok < 0, see every key).
__device__ __forceinline__ bool key_hidden(const Params& p, const Work& w, int pos, int tok) {
  if (pos >= w.KV) return true;
  if (pos >= w.L && tok >= 0)
    return !(w.mask_ok && p.mask[w.mask_base + static_cast<int64_t>(tok) * w.KV + pos] != 0);
  return false;
}
// Scale a score to log2 units and apply the tree mask.
__device__ __forceinline__ float masked_score(const Params& p, const Work& w, float s, int pos, int tok,
                                             bool needs_mask) {
  if (needs_mask && key_hidden(p, w, pos, tok)) return -CUDART_INF_F;
  return s * p.scale_log2;
}
// Write one thread's two query rows (r0 = row g, r0 + 8) of O, 256 columns starting at
// half * 256 (acc in mma C layout: n8 block i in acc[4i..4i+3]), and their LSE: bf16 to
// o with one split, fp32 normalised partials plus LSE to the workspace with several.
__device__ __forceinline__ void store_rows(const Params& p, const float* acc, const float* m_run,
                                           const float* l_run, int r0, int rows, int qo_start,
                                           int split, int half, int tq) {
  const int H = p.H;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = r0 + 8 * h;
    if (rr >= rows) continue;
    const float inv = l_run[h] > 0.f ? 1.f / l_run[h] : 0.f;
    const float lse = l_run[h] > 0.f ? (m_run[h] + log2f(l_run[h])) * LN2 : -CUDART_INF_F;
    const int tok = rr / H, head = rr % H;
    const int64_t grow = static_cast<int64_t>(qo_start) * H + rr;
    if (p.num_splits > 1) {
      float* dst = p.o_part + (static_cast<int64_t>(split) * p.T * H + grow) * DV + half * 256 + tq * 2;
#pragma unroll
      for (int i = 0; i < 32; ++i)
        *reinterpret_cast<float2*>(dst + i * 8) = make_float2(acc[4 * i + 2 * h] * inv, acc[4 * i + 2 * h + 1] * inv);
      if (half == 0 && tq == 0) p.lse_part[static_cast<int64_t>(split) * p.T * H + grow] = lse;
    } else {
      __nv_bfloat16* dst = p.o + static_cast<int64_t>(qo_start + tok) * p.o_st +
                           static_cast<int64_t>(head) * p.o_sh + half * 256 + tq * 2;
#pragma unroll
      for (int i = 0; i < 32; ++i)
        *reinterpret_cast<__nv_bfloat162*>(dst + i * 8) =
            __floats2bfloat162_rn(acc[4 * i + 2 * h] * inv, acc[4 * i + 2 * h + 1] * inv);
      if (p.lse && half == 0 && tq == 0) p.lse[grow] = lse;
    }
  }
}

template <int RG>
__global__ void __launch_bounds__(Cfg<RG>::THREADS, 1) verify_attn_kernel(const Params p) {
  using C = Cfg<RG>;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* q_s = smem;
  unsigned char* k_s = smem + C::Q_BYTES;  // 2 stages
  float* s_s = reinterpret_cast<float*>(smem + C::Q_BYTES + 2 * C::K_BYTES);

  pdl_launch_dependents();
  const int rt = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rg = warp % RG, kh = warp / RG;
  const int g = lane >> 2, tq = lane & 3;

  Work w;
  if (!setup_work(p, b, rt * C::BM, C::BM, split, BN, tid, C::THREADS, w)) return;
  const int qo_start = w.qo_start, kv_lo = w.kv_lo, N = w.N, rows = w.rows, r0 = w.r0, L = w.L;
  const int t_begin = w.t_begin, t_end = w.t_end, H = p.H;

  // ---- Q tile: BM rows x 72 chunks ----
  for (int c = tid; c < C::BM * CHUNKS; c += C::THREADS) {
    const int r = c / CHUNKS, ch = c % CHUNKS;
    const int rr = r0 + r;
    const bool ok = rr < rows;
    const int tok = ok ? rr / H : 0, head = ok ? rr % H : 0;
    const __nv_bfloat16* src = p.q + static_cast<int64_t>(qo_start + tok) * p.q_st +
                               static_cast<int64_t>(head) * p.q_sh + ch * 8;
    cp_async16(smem_u32(q_s + r * SROW + ch * 16), ok ? src : p.q, ok);
  }

  // ---- key loader: TPR threads per key row, each thread CHUNKS/TPR-ish pieces ----
  const int lrow = tid / C::TPR, lsub = tid % C::TPR;
  auto issue_tile = [&](int tile, int stage, KeySrc src) {
    unsigned char* dst = k_s + stage * C::K_BYTES + lrow * SROW;
    for (int ch = lsub; ch < CHUNKS; ch += C::TPR)
      cp_async16(smem_u32(dst + ch * 16), src.valid ? src.ptr + ch * 8 : p.kv, src.valid);
  };
  // this thread's key row: its slot id is loaded one tile before its copy is issued
  issue_tile(t_begin, 0, key_source(p, t_begin * BN + lrow, L, N, kv_lo, qo_start));
  cp_async_commit();
  int64_t slot_next = key_slot(p, (t_begin + 1) * BN + lrow, L, kv_lo);

  // ---- running state: O (16 rows x 256 cols per warp), row max / sum for rows g, g+8 ----
  float acc[128];  // n8 block i of this warp's 256 columns in acc[4i .. 4i+3] (mma C layout)
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F};
  float l_run[2] = {0.f, 0.f};

  // rows of this thread inside the request, and their tokens (for the mask)
  const int myrow0 = r0 + rg * 16 + g, myrow1 = myrow0 + 8;
  const int tok0 = myrow0 < rows ? myrow0 / H : -1;
  const int tok1 = myrow1 < rows ? myrow1 / H : -1;

  const uint32_t q_base = smem_u32(q_s);
  const uint32_t k_base = smem_u32(k_s);

  for (int tile = t_begin; tile < t_end; ++tile) {
    const int stage = (tile - t_begin) & 1;
    cp_async_wait_all();
    __syncthreads();  // tile ready; everyone is done with the other stage and with s_s
    if (tile + 1 < t_end) {
      issue_tile(tile + 1, stage ^ 1, key_resolve(p, slot_next, (tile + 1) * BN + lrow, L, N, qo_start));
      cp_async_commit();
      slot_next = key_slot(p, (tile + 2) * BN + lrow, L, kv_lo);  // used next iteration
    }
    const uint32_t kst = k_base + stage * C::K_BYTES;

    // ---- S = Q K^T for rows rg*16.., keys kh*16.. (two n8 tiles) over 576 dims ----
    // SACC independent accumulator sets break the 36-long dependent MMA chain
    // (each HMMA waits for the previous one on the same accumulator).
    float s[2][4];
    {
      float sp[SACC][2][4];
#pragma unroll
      for (int a = 0; a < SACC; ++a)
#pragma unroll
        for (int j = 0; j < 2; ++j) sp[a][j][0] = sp[a][j][1] = sp[a][j][2] = sp[a][j][3] = 0.f;
      const uint32_t qa = q_base + (rg * 16 + (lane & 15)) * SROW + (lane >> 4) * 16;
      const uint32_t kb =
          kst + (kh * 16 + (lane & 7) + ((lane >> 4) << 3)) * SROW + ((lane >> 3) & 1) * 16;
#pragma unroll
      for (int k = 0; k < D / 16; ++k) {
        uint32_t a0, a1, a2, a3, b0, b1, b2, b3;
        ldsm_x4(qa + k * 32, a0, a1, a2, a3);
        ldsm_x4(kb + k * 32, b0, b1, b2, b3);
        mma16816(sp[k % SACC][0], a0, a1, a2, a3, b0, b1);
        mma16816(sp[k % SACC][1], a0, a1, a2, a3, b2, b3);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = 0.f;
#pragma unroll
          for (int a = 0; a < SACC; ++a) v += sp[a][j][e];
          s[j][e] = v;
        }
    }
    // ---- scale, mask, publish S ----
    {
      const int kpos0 = tile * BN + kh * 16;
      const bool needs_mask = tile * BN + BN > L;  // tile reaches the drafts (or past the end)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = kh * 16 + j * 8 + tq * 2 + (e & 1);
          const int row = rg * 16 + g + (e >> 1) * 8;
          const int pos = kpos0 + j * 8 + tq * 2 + (e & 1);
          s_s[row * SPAD + col] = masked_score(p, w, s[j][e], pos, (e >> 1) ? tok1 : tok0, needs_mask);
        }
      }
    }
    __syncthreads();

    // ---- online softmax over this tile for rows g, g+8 (all BN keys) ----
    float sv[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 lo = *reinterpret_cast<const float2*>(&s_s[(rg * 16 + g) * SPAD + j * 8 + tq * 2]);
      const float2 hi =
          *reinterpret_cast<const float2*>(&s_s[(rg * 16 + g + 8) * SPAD + j * 8 + tq * 2]);
      sv[j][0] = lo.x; sv[j][1] = lo.y; sv[j][2] = hi.x; sv[j][3] = hi.y;
    }
    float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(sv[j][0], sv[j][1]));
      mx[1] = fmaxf(mx[1], fmaxf(sv[j][2], sv[j][3]));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    }
    float corr[2], msub[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      msub[h] = mx[h] == -CUDART_INF_F ? 0.f : mx[h];  // a row with nothing visible yet
      corr[h] = exp2f(m_run[h] - msub[h]);             // exp2(-inf) = 0 on the first tile
      m_run[h] = mx[h];
    }
    float rs[2] = {0.f, 0.f};
    uint32_t pa[2][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p0 = exp2f(sv[j][0] - msub[0]), p1 = exp2f(sv[j][1] - msub[0]);
      const float p2 = exp2f(sv[j][2] - msub[1]), p3 = exp2f(sv[j][3] - msub[1]);
      rs[0] += p0 + p1;
      rs[1] += p2 + p3;
      // C layout of n8 tile j -> A layout of k16 block j/2
      pa[j >> 1][(j & 1) * 2 + 0] = pack_bf16(p0, p1);
      pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16(p2, p3);
    }
    l_run[0] = l_run[0] * corr[0] + rs[0];
    l_run[1] = l_run[1] * corr[1] + rs[1];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      acc[4 * i + 0] *= corr[0]; acc[4 * i + 1] *= corr[0];
      acc[4 * i + 2] *= corr[1]; acc[4 * i + 3] *= corr[1];
    }

    // ---- O[16 x 256] += P[16 x BN] V[BN x 256] (columns kh*256..) ----
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t vb = kst + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SROW +
                          (kh * 256 + (lane >> 4) * 8) * 2;
#pragma unroll
      for (int n2 = 0; n2 < 16; ++n2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(vb + n2 * 32, b0, b1, b2, b3);
        mma16816(&acc[8 * n2], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b0, b1);
        mma16816(&acc[8 * n2 + 4], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b2, b3);
      }
    }
  }

  // ---- epilogue ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  store_rows(p, acc, m_run, l_run, myrow0, rows, qo_start, split, kh, tq);
}

}  // namespace kdtree

#include "verify_attn_sm90.cuh"

namespace kdtree {

// Merge the splits of each query row by their log-sum-exp, 128 threads (4 columns each)
// per row. Few splits (<= COMBINE_NARROW_MAX): 512-thread CTAs of 4 rows, each thread
// walks the splits itself. Many splits: one row per CTA of G groups of 128 threads; the
// LSEs go through shared memory once (max, then weights) and group q sums splits q,
// q + G, ... with COMBINE_UNROLL loads in flight (a serial walk over 66 splits was
// latency-bound), then the groups meet in shared memory. G = 8 (64 splits in flight, one
// round at bs1) above COMBINE_WIDE8_MIN splits, else 4: 1024-thread CTAs halve the CTAs
// resident per SM, which costs more than it saves at 16 splits (bs1 N64 H8 65k +4 us).
constexpr int COMBINE_GROUPS = 4;
constexpr int COMBINE_UNROLL = 8;
constexpr int COMBINE_THREADS = 128 * COMBINE_GROUPS;
constexpr int COMBINE_WIDE8_MIN = 33;
constexpr int COMBINE_NARROW_MAX = 8;
constexpr int COMBINE_MAX_SPLITS = 1024;  // weights cached in shared memory; more splits re-read the LSE

// Which token/head a global row is, or false when no request owns it / its request is
// malformed (the main kernel flags those).
__device__ __forceinline__ bool combine_row(const Params& p, int64_t grow, int& tok, int& head) {
  tok = static_cast<int>(grow / p.H);
  head = static_cast<int>(grow % p.H);
  if (tok >= p.qo_indptr[p.bs]) return false;  // a token no request owns
  int b = 0;  // the request owning tok (bs is small; a linear scan keeps this simple and exact)
  while (b + 1 < p.bs && p.qo_indptr[b + 1] <= tok) ++b;
  const int N = p.qo_indptr[b + 1] - p.qo_indptr[b];
  if (N < 0 || N > p.max_n) return false;
  const int kv_lo = p.kv_indptr[b], kv_hi = p.kv_indptr[b + 1];
  return !(kv_lo < 0 || kv_hi < kv_lo || kv_hi > p.kv_indices_len);
}

__device__ __forceinline__ void combine_store(const Params& p, int tok, int head, int c, float4 o, float sum,
                                              float mx, int64_t grow, bool lse_writer) {
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  __nv_bfloat16* dst = p.o + static_cast<int64_t>(tok) * p.o_st + static_cast<int64_t>(head) * p.o_sh + c;
  reinterpret_cast<__nv_bfloat162*>(dst)[0] = __floats2bfloat162_rn(o.x * inv, o.y * inv);
  reinterpret_cast<__nv_bfloat162*>(dst)[1] = __floats2bfloat162_rn(o.z * inv, o.w * inv);
  if (p.lse && lse_writer) p.lse[grow] = sum > 0.f ? mx + logf(sum) : -CUDART_INF_F;
}

__global__ void __launch_bounds__(COMBINE_THREADS) combine_narrow_kernel(const Params p) {
  pdl_wait_primary();
  const int64_t TH = static_cast<int64_t>(p.T) * p.H;
  const int64_t grow = static_cast<int64_t>(blockIdx.x) * COMBINE_GROUPS + threadIdx.x / 128;
  int tok, head;
  if (grow >= TH || !combine_row(p, grow, tok, head)) return;
  const int S = p.num_splits, c = (threadIdx.x % 128) * 4;
  float mx = -CUDART_INF_F;
  for (int s = 0; s < S; ++s) mx = fmaxf(mx, p.lse_part[s * TH + grow]);
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  float sum = 0.f;
  if (mx != -CUDART_INF_F) {
#pragma unroll COMBINE_NARROW_MAX
    for (int s = 0; s < S; ++s) {
      const float ls = p.lse_part[s * TH + grow];
      if (ls == -CUDART_INF_F) continue;  // empty split: its O was never written
      const float wt = __expf(ls - mx);
      sum += wt;
      const float4 v = *reinterpret_cast<const float4*>(p.o_part + (s * TH + grow) * DV + c);
      o.x += wt * v.x; o.y += wt * v.y; o.z += wt * v.z; o.w += wt * v.w;
    }
  }
  combine_store(p, tok, head, c, o, sum, mx, grow, c == 0);
}

template <int G>
constexpr int COMBINE_WIDE_THREADS = 128 * G;  // G groups of 128 threads

template <int G>
__global__ void __launch_bounds__(COMBINE_WIDE_THREADS<G>) combine_wide_kernel(const Params p) {
  constexpr int NT = COMBINE_WIDE_THREADS<G>;
  __shared__ float w_s[COMBINE_MAX_SPLITS];
  __shared__ float red[NT / 32];
  __shared__ float4 part[G - 1][128];
  pdl_wait_primary();
  const int64_t grow = blockIdx.x;  // global row = token * H + head
  int tok, head;
  if (!combine_row(p, grow, tok, head)) return;  // uniform over the CTA

  const int64_t TH = static_cast<int64_t>(p.T) * p.H;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int S = p.num_splits;
  const bool cached = S <= COMBINE_MAX_SPLITS;
  float mx = -CUDART_INF_F;  // max of the LSEs
  for (int s = tid; s < S; s += NT) {
    const float ls = p.lse_part[s * TH + grow];
    if (cached) w_s[s] = ls;
    mx = fmaxf(mx, ls);
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int i = 1; i < NT / 32; ++i) mx = fmaxf(mx, red[i]);
  __syncthreads();  // red is reused for the sum below
  // weights exp(lse - max); an empty split (LSE -inf, O never written) weighs 0
  float sum = 0.f;
  if (mx != -CUDART_INF_F) {
    for (int s = tid; s < S; s += NT) {
      const float ls = cached ? w_s[s] : p.lse_part[s * TH + grow];
      const float wt = ls == -CUDART_INF_F ? 0.f : __expf(ls - mx);
      if (cached) w_s[s] = wt;
      sum += wt;
    }
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
  if (lane == 0) red[warp] = sum;
  __syncthreads();
  sum = 0.f;
#pragma unroll
  for (int i = 0; i < NT / 32; ++i) sum += red[i];

  const int grp = tid / 128, c = (tid % 128) * 4;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  if (sum > 0.f) {
    const float* base = p.o_part + grow * DV + c;
    for (int s0 = grp; s0 < S; s0 += G * COMBINE_UNROLL) {
      float4 v[COMBINE_UNROLL];
      float wt[COMBINE_UNROLL];
#pragma unroll
      for (int u = 0; u < COMBINE_UNROLL; ++u) {
        const int s = s0 + u * G;
        wt[u] = 0.f;
        v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (s < S) {
          if (cached) {
            wt[u] = w_s[s];
          } else {
            const float ls = p.lse_part[s * TH + grow];
            wt[u] = ls == -CUDART_INF_F ? 0.f : __expf(ls - mx);
          }
          if (wt[u] > 0.f) v[u] = *reinterpret_cast<const float4*>(base + s * TH * DV);
        }
      }
#pragma unroll
      for (int u = 0; u < COMBINE_UNROLL; ++u) {
        o.x += wt[u] * v[u].x; o.y += wt[u] * v[u].y; o.z += wt[u] * v[u].z; o.w += wt[u] * v[u].w;
      }
    }
  }
  if (grp > 0) part[grp - 1][tid % 128] = o;
  __syncthreads();
  if (grp > 0) return;
#pragma unroll
  for (int q = 0; q < G - 1; ++q) {
    const float4 v = part[q][tid];
    o.x += v.x; o.y += v.y; o.z += v.z; o.w += v.w;
  }
  combine_store(p, tok, head, c, o, sum, mx, grow, tid == 0);
}

}  // namespace kdtree

// ------------------------------------------------------------------ C ABI
namespace {
thread_local char g_err[512] = "";

int fail(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_err, sizeof g_err, fmt, ap);
  va_end(ap);
  return code;
}

// Big tile (64 rows, 8 warps) where a block may take ~156 KB of shared memory
// (sm_90), else 16 rows (2 warps, ~94 KB: sm_120's 99 KB limit).
int pick_rg(int device, int* rg_out);

// Which kernel runs on `device`: 2 = wgmma (sm_90a build on a CC 9.0 device),
// 4 = mma.sync 64 rows, 1 = mma.sync 16 rows (small shared memory).
// KDTREE_KERNEL=mma forces the portable kernel (for A/B measurements).
int pick_kernel(int device, int* which) {
  int major = 0, minor = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "cudaDeviceGetAttribute: %s", cudaGetErrorString(e));
  static const bool force_mma = [] {
    const char* v = getenv("KDTREE_KERNEL");
    return v && strcmp(v, "mma") == 0;
  }();
  if (major == 9 && minor == 0 && strstr(KDTREE_ARCHS, "sm_90a") && !force_mma) {
    *which = 2;
    return KDTREE_OK;
  }
  return pick_rg(device, which);
}

int pick_rg(int device, int* rg_out) {
  int optin = 0;
  cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "cudaDeviceGetAttribute: %s", cudaGetErrorString(e));
  *rg_out = optin >= kdtree::Cfg<4>::SMEM ? 4 : 1;
  return KDTREE_OK;
}

// Launches `kernel` as a programmatic dependent of the kernel before it on `stream`
// (it may start once that one's CTAs have all called launch_dependents).
template <typename K, typename... Args>
cudaError_t launch_pdl(K kernel, dim3 grid, int threads, int smem, cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

int launch_combine(const kdtree::Params& p, cudaStream_t stream);

template <int RG>
int launch(const kdtree::Params& p, cudaStream_t stream) {
  using C = kdtree::Cfg<RG>;
  static bool configured[64] = {false};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 64 && !configured[dev]) {
    cudaError_t e = cudaFuncSetAttribute(kdtree::verify_attn_kernel<RG>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
    if (e == cudaErrorInvalidDeviceFunction || e == cudaErrorNoKernelImageForDevice) {
      cudaGetLastError();
      return fail(KDTREE_ENOARCH, "no kernel image for this device in %s (built for %s)",
                  "libkdtree_verify", KDTREE_ARCHS);
    }
    if (e != cudaSuccess) return fail(KDTREE_ECUDA, "cudaFuncSetAttribute: %s", cudaGetErrorString(e));
    configured[dev] = true;
  }
  const int row_tiles = (p.max_n * p.H + C::BM - 1) / C::BM;
  dim3 grid(row_tiles, p.num_splits, p.bs);
  cudaError_t e = launch_pdl(kdtree::verify_attn_kernel<RG>, grid, C::THREADS, C::SMEM, stream, p);
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction)
    return fail(KDTREE_ENOARCH, "no kernel image for this device (library built for %s)", KDTREE_ARCHS);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "verify kernel launch: %s", cudaGetErrorString(e));
  return launch_combine(p, stream);
}
template <int G>
cudaError_t launch_wide(dim3 grid, cudaStream_t stream, const kdtree::Params& p) {
  return launch_pdl(kdtree::combine_wide_kernel<G>, grid, kdtree::COMBINE_WIDE_THREADS<G>, 0, stream, p);
}
int launch_combine(const kdtree::Params& p, cudaStream_t stream) {
  if (p.num_splits <= 1) return KDTREE_OK;
  const int64_t rows = static_cast<int64_t>(p.T) * p.H;
  const bool narrow = p.num_splits <= kdtree::COMBINE_NARROW_MAX;
  const dim3 grid(static_cast<unsigned>(narrow ? (rows + kdtree::COMBINE_GROUPS - 1) / kdtree::COMBINE_GROUPS : rows));
  cudaError_t e;
  if (narrow)
    e = launch_pdl(kdtree::combine_narrow_kernel, grid, kdtree::COMBINE_THREADS, 0, stream, p);
  else if (p.num_splits >= kdtree::COMBINE_WIDE8_MIN)
    e = launch_wide<8>(grid, stream, p);
  else
    e = launch_wide<4>(grid, stream, p);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "combine kernel launch: %s", cudaGetErrorString(e));
  return KDTREE_OK;
}

// The pool as a TMA tensor map ([pool_size, 576] bf16, boxes of 32 rows x 64 columns,
// 128B swizzle: one producer warp's rows of one chunk in the layout the sm90 kernel's
// key buffers use). False when the fast path is off (KDTREE_TMA=0, read on every call
// so that a test can compare both paths in one process), the driver has no encoder, or
// the pool does not fit a TMA coordinate; the kernel then gathers every block. The
// last map is kept per thread: a serving loop passes the same pool on every call.
bool pool_tensor_map(const kdtree::Params& p, CUtensorMap* map) {
  const char* off = getenv("KDTREE_TMA");
  if (off && strcmp(off, "0") == 0) return false;
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (!encode || p.pool_size < kdtree::sm90::RUN_ROWS || p.pool_size > 0x7fffffff) return false;
  struct Last {
    const void* kv = nullptr;
    int64_t pool_size = 0, kv_st = 0;
    CUtensorMap map;
  };
  thread_local Last last;
  if (last.kv == p.kv && last.pool_size == p.pool_size && last.kv_st == p.kv_st) {
    *map = last.map;
    return true;
  }
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kdtree::D), static_cast<cuuint64_t>(p.pool_size)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.kv_st) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(kdtree::sm90::RUN_ROWS)};
  const cuuint32_t estr[2] = {1, 1};
  if (encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(p.kv), dims, strides, box, estr,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return false;
  last.kv = p.kv;
  last.pool_size = p.pool_size;
  last.kv_st = p.kv_st;
  last.map = *map;
  return true;
}

int launch_sm90(const kdtree::Params& p, cudaStream_t stream) {
  namespace s9 = kdtree::sm90;
  static bool configured[64] = {false};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 64 && !configured[dev]) {
    cudaError_t e = cudaFuncSetAttribute(s9::verify_attn_kernel_sm90, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         s9::SMEM);
    if (e != cudaSuccess) return fail(KDTREE_ECUDA, "cudaFuncSetAttribute (sm90): %s", cudaGetErrorString(e));
    configured[dev] = true;
  }
  const int row_tiles = (p.max_n * p.H + s9::BM - 1) / s9::BM;
  dim3 grid(row_tiles, p.num_splits, p.bs);
  CUtensorMap map;
  memset(&map, 0, sizeof map);
  const int use_tma = pool_tensor_map(p, &map) ? 1 : 0;
  cudaError_t e = launch_pdl(s9::verify_attn_kernel_sm90, grid, s9::THREADS, s9::SMEM, stream, p, map, use_tma);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "verify kernel (sm90) launch: %s", cudaGetErrorString(e));
  return launch_combine(p, stream);
}
}  // namespace

extern "C" {

const char* kdtree_kernel_name(int device) {
  int which = 0;
  if (pick_kernel(device, &which) != KDTREE_OK) return "unknown";
  return which == 2 ? "wgmma-sm90a-seesaw-64x64" : which == 4 ? "mma.sync-64x32" : "mma.sync-16x32";
}


int kdtree_abi_version(void) { return KDTREE_ABI_VERSION; }
const char* kdtree_last_error(void) { return g_err; }
const char* kdtree_build_info(void) { return KDTREE_ARCHS; }

int kdtree_block_rows(int device) {
  int rg = 0;
  if (pick_rg(device, &rg) != KDTREE_OK) return -1;
  return rg * 16;
}

int64_t kdtree_workspace_bytes(int64_t total_rows, int32_t num_splits) {
  if (total_rows < 0 || num_splits < 1) return -1;
  if (num_splits == 1) return kdtree::WS_HEADER;
  const int64_t o = total_rows * num_splits * kdtree::DV * 4;
  const int64_t l = total_rows * num_splits * 4;
  return kdtree::WS_HEADER + o + ((l + 255) / 256) * 256;
}

int kdtree_verify_attn(const KdtreeVerifyArgs* a, void* stream_) {
  g_err[0] = '\0';
  if (!a) return fail(KDTREE_EINVAL, "args is NULL");
  if (a->abi_version != KDTREE_ABI_VERSION)
    return fail(KDTREE_EINVAL, "abi_version %d, library speaks %d", a->abi_version, KDTREE_ABI_VERSION);
  if (a->bs < 0) return fail(KDTREE_EINVAL, "bs must be >= 0, got %d", a->bs);
  if (a->num_heads < 1 || a->num_heads > KDTREE_MAX_HEADS)
    return fail(KDTREE_EINVAL, "num_heads must be in [1, %d], got %d", KDTREE_MAX_HEADS, a->num_heads);
  if (a->max_n < 0 || a->max_n > KDTREE_MAX_DRAFTS)
    return fail(KDTREE_EINVAL, "max_n must be in [0, %d], got %d", KDTREE_MAX_DRAFTS, a->max_n);
  if (a->num_splits < 1 || a->num_splits > 65535)
    return fail(KDTREE_EINVAL, "num_splits must be in [1, 65535], got %d", a->num_splits);
  // > 0: the kernels take row maxima of raw scores and scale them afterwards
  if (!(a->sm_scale > 0.f) || !(a->sm_scale < 3.0e38f))
    return fail(KDTREE_EINVAL, "sm_scale must be a positive finite float, got %g", (double)a->sm_scale);
  if (a->total_tokens < 0) return fail(KDTREE_EINVAL, "total_tokens must be >= 0");
  if (!a->q || !a->k_ext || !a->kv || !a->qo_indptr || !a->kv_indptr || !a->mask_indptr || !a->o ||
      !a->workspace)
    return fail(KDTREE_EINVAL, "a required pointer (q, k_ext, kv, qo_indptr, kv_indptr, mask_indptr, o, "
                               "workspace) is NULL");
  // Empty tensors may come with a NULL pointer; their lengths are 0, so the
  // device checks flag any read of them and the kernel never dereferences them.
  if ((!a->kv_indices && a->kv_indices_len != 0) || (!a->mask && a->mask_len != 0))
    return fail(KDTREE_EINVAL, "kv_indices or mask is NULL but has a non-zero length");
  if (a->kv_indices_len < 0 || a->mask_len < 0 || a->pool_size < 1)
    return fail(KDTREE_EINVAL, "kv_indices_len and mask_len must be >= 0 and pool_size >= 1");
  const int64_t need = kdtree_workspace_bytes(static_cast<int64_t>(a->total_tokens) * a->num_heads, a->num_splits);
  if (a->workspace_bytes < need)
    return fail(KDTREE_EINVAL, "workspace has %lld bytes, needs %lld", (long long)a->workspace_bytes,
                (long long)need);
  auto aligned16 = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  if (!aligned16(a->q) || !aligned16(a->k_ext) || !aligned16(a->kv) || !aligned16(a->o) ||
      !aligned16(a->workspace))
    return fail(KDTREE_EINVAL, "q, k_ext, kv, o and workspace must be 16-byte aligned");
  if (a->q_stride_tok % 8 || a->q_stride_head % 8 || a->k_ext_stride_tok % 8 || a->kv_stride_slot % 8 ||
      a->o_stride_tok % 8 || a->o_stride_head % 8)
    return fail(KDTREE_EINVAL, "strides must be multiples of 8 elements (16 bytes)");

  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "cudaGetDevice: %s", cudaGetErrorString(e));
  kdtree::clear_error_kernel<<<1, kdtree::WS_HEADER / 4, 0, stream>>>(static_cast<int*>(a->workspace));
  e = cudaGetLastError();
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction)
    return fail(KDTREE_ENOARCH, "no kernel image for this device (library built for %s)", KDTREE_ARCHS);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "clearing the error word: %s", cudaGetErrorString(e));
  if (a->bs == 0 || a->total_tokens == 0 || a->max_n == 0) return KDTREE_OK;

  kdtree::Params p{};
  p.q = static_cast<const __nv_bfloat16*>(a->q);
  p.q_st = a->q_stride_tok;
  p.q_sh = a->q_stride_head;
  p.k_ext = static_cast<const __nv_bfloat16*>(a->k_ext);
  p.k_ext_st = a->k_ext_stride_tok;
  p.kv = static_cast<const __nv_bfloat16*>(a->kv);
  p.kv_st = a->kv_stride_slot;
  p.pool_size = a->pool_size;
  p.qo_indptr = a->qo_indptr;
  p.kv_indptr = a->kv_indptr;
  p.kv_indices = a->kv_indices;
  p.kv_indices_64 = a->kv_indices_is_64;
  p.kv_indices_len = a->kv_indices_len;
  p.mask = a->mask;
  p.mask_indptr = a->mask_indptr;
  p.mask_len = a->mask_len;
  p.o = static_cast<__nv_bfloat16*>(a->o);
  p.o_st = a->o_stride_tok;
  p.o_sh = a->o_stride_head;
  p.lse = a->lse;
  unsigned char* ws = static_cast<unsigned char*>(a->workspace);
  p.err = reinterpret_cast<int*>(ws);
  const int64_t rows = static_cast<int64_t>(a->total_tokens) * a->num_heads;
  p.o_part = reinterpret_cast<float*>(ws + kdtree::WS_HEADER);
  p.lse_part = p.o_part + rows * a->num_splits * kdtree::DV;
  p.bs = a->bs;
  p.H = a->num_heads;
  p.max_n = a->max_n;
  p.T = a->total_tokens;
  p.num_splits = a->num_splits;
  p.scale_log2 = a->sm_scale * kdtree::LOG2E;

  int which = 0;
  int rc = pick_kernel(dev, &which);
  if (rc != KDTREE_OK) return rc;
  if (which == 2) return launch_sm90(p, stream);
  return which == 4 ? launch<4>(p, stream) : launch<1>(p, stream);
}

int kdtree_read_device_error(const void* workspace, void* stream_, int32_t* bits) {
  if (!workspace || !bits) return fail(KDTREE_EINVAL, "workspace and bits must not be NULL");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  cudaError_t e = cudaMemcpyAsync(bits, workspace, sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "reading the device error word: %s", cudaGetErrorString(e));
  return KDTREE_OK;
}

int kdtree_read_fast_path_boxes(const void* workspace, void* stream_, int32_t* boxes) {
  if (!workspace || !boxes) return fail(KDTREE_EINVAL, "workspace and boxes must not be NULL");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  const unsigned char* word = static_cast<const unsigned char*>(workspace) + 4 * kdtree::WS_FAST_BOXES;
  cudaError_t e = cudaMemcpyAsync(boxes, word, sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "reading the fast-path count: %s", cudaGetErrorString(e));
  return KDTREE_OK;
}

}  // extern "C"
