// kdtree-engine: what every kernel of the library shares: the launch parameters
// (Params), the tile-independent constants, the PTX helpers (cp.async, ldmatrix,
// mma.sync, PDL), and the per-CTA work setup: which request, row tile and key
// tiles a CTA takes, the device-side checks of indptrs, slot ids and mask
// extents, the tree-mask test and the epilogue that writes O and the LSE.
//
// The split schedule is the device's, since a captured graph replays new lengths: the host's
// num_splits sizes the grid and the workspace and is only the most splits a request may take.
// Every CTA of the main kernels and the combine derives its request's own split count from the
// lengths it reads (split_plan: about 128 keys per split at the least, every split non-empty),
// so a graph captured with the GPU-filling maximum launches the CTAs of a short prefix
// and exits the rest at once; a request of one split writes O and the LSE itself and
// the combine skips its rows. No host value and no extra kernel is involved.
//
// Device-side checks never trust a device value: a bad one sets a bit in the
// workspace's error word (KDTREE_ERR_*) and the read it would have caused is
// skipped. The word is sticky: no kernel clears it; kdtree_read_device_error
// reads it and then clears it (the workspace header starts zeroed).
#pragma once
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
constexpr int BN = 32;                    // keys per tile of the portable kernel
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
// The lazy maximum of both kernels: a row's running maximum moves only when a key tile
// passes it by more than 2^RESCALE_LOG2 (log2 units); below that, P is taken against the
// stale maximum (values up to 2^8, exact after the final division by l).
constexpr float RESCALE_LOG2 = 8.f;
constexpr int WS_HEADER = 256;            // bytes of workspace header (error word, counters)
// Split-KV partial outputs are bf16 (FlashInfer's choice: its decode keeps them in the output
// type, only the LSEs in fp32; FlashMLA keeps fp32). It halves the bytes the main kernel
// writes and the combine reads (17 MB -> 8.6 MB at bs1 N16 H8 64k), at one more bf16
// rounding per split, merged in fp32 (2-5% faster at bs1 on the H200, within the oracle's bounds).
using part_t = __nv_bfloat16;
constexpr int WS_FAST_BOXES = 1;         // header word: 32-row boxes the contiguous fast path loaded
// After the header, where a call has splits: the batch schedule's per-request (first partial row,
// splits), PLAN_MAX_BS of them (Params::plan_meta), then the partials.
constexpr int WS_PLAN_BYTES = 1024;
constexpr int WS_PARTS = WS_HEADER + WS_PLAN_BYTES;  // bytes of workspace before the partials
// Partial rows the workspace holds, per row and split of the grid. The 3-D grid needs one
// (T * H * num_splits); the batch schedule's budget is at most one CTA an SM and PLAN_BM partial
// rows a CTA, and at 2 the workspace lets it take every SM where T * H * num_splits / PLAN_BM
// fell short of them (choose_num_splits rounds the wave down: 128 of 132 CTAs at bs32 N8 H16,
// 2 splits; taking all 132 made the H200's ragged batches up to 3% faster).
constexpr int WS_PART_FACTOR = 2;

struct Params {
  const __nv_bfloat16* q;
  int64_t q_st, q_sh;
  const __nv_bfloat16* k_ext;
  int64_t k_ext_st;
  const __nv_bfloat16* kv;
  int64_t kv_st, pool_size;
  const void* qo_indptr;  // int64 (qo_indptr_64) or int32
  const void* kv_indptr;  // int64 (kv_indptr_64) or int32
  int qo_indptr_64, kv_indptr_64;
  const void* draft_slots;  // NULL: drafts from k_ext; else their pool slots (int64 if draft_slots_64)
  int draft_slots_64;
  const void* kv_indices;
  int kv_indices_64;
  int64_t kv_indices_len;
  const uint8_t* mask;
  const int64_t* mask_indptr;
  int64_t mask_len;
  __nv_bfloat16* o;
  int64_t o_st, o_sh;
  float* lse;
  part_t* o_part;    // partial rows (T*H*num_splits*WS_PART_FACTOR of them), each 512 wide: see Work::slot0
  float* lse_part;   // their LSEs, one per partial row
  int* err;
  int bs, H, max_n, T, num_splits;  // num_splits: the grid's (the workspace: T*H*num_splits*WS_PART_FACTOR partial rows)
  int split_keys;  // keys per step of the split schedule: one tile, or the sm90 kernel's pair of blocks
  // The batch schedule (batch_plan): 1 when the grid is 1-D, split_budget CTAs, each mapped on
  // the device to a (request, row tile, split); 0 for the (row tiles, num_splits, bs) grid of
  // split_plan.
  int planned, split_budget;
  // The batch schedule's (first partial row, splits) of each request, written by the request's
  // first CTA and read by the combine after griddepcontrol.wait: a combine that derived the
  // plan again cost bs32 and bs64 calls 8-10 us on the H200. In the workspace, after the header.
  int2* plan_meta;
  // One arrival counter per partial row of split 0 (index slot_b + r), for the combine's pieces
  // (combine.cuh combine_pieces_kernel): the request's first CTA zeroes its rows' counters, the
  // combine's pieces of a long row count themselves in, and the last merges the chunks. In the
  // workspace, after the LSEs.
  int* plan_cnt;
  // The step plan (KdtreeVerifyArgs::plan; NULL: each CTA derives its job, batch_plan): a
  // header naming the shape it was made for, each CTA's job, and each request's rows (for the
  // combine's check). Written by plan_kernel (plan.cu) in a KDTREE_PLAN_MAKE call, read by the
  // main kernels after griddepcontrol.wait and by the combine after its own.
  unsigned char* plan;
  float scale_log2;
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

// mbarriers (try_wait: sm_90 and newer, sm_120 included), and setmaxnreg
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// arrive on `bar` when all of this thread's earlier cp.asyncs have landed
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\n"
      "bra LAB_WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(bar), "r"(parity) : "memory");
}
// setmaxnreg exists in arch-specific code only (sm_90a, sm_100a, sm_120a ...). Elsewhere (a generic
// sm_90 or sm_120 build) it is a no-op: the kernel stays correct, within its launch bound's registers.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(__CUDA_ARCH_SPECIFIC__) || defined(__CUDA_ARCH_FAMILY_SPECIFIC__)
#define KDTREE_HAS_SETMAXNREG 1
#else
#define KDTREE_HAS_SETMAXNREG 0
#endif
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#if KDTREE_HAS_SETMAXNREG
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#if KDTREE_HAS_SETMAXNREG
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}


__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
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
// The main kernels' first statements. They are launched as programmatic dependents (launch.h
// launch_main), so nothing the kernels before them wrote (q, the pool, the indices, the
// workspace the last combine read) may be touched before griddepcontrol.wait; the combine
// may launch at once (it waits for this grid in its own griddepcontrol.wait).
__device__ __forceinline__ void pdl_main_prologue() {
  pdl_launch_dependents();
  pdl_wait_primary();
}

// Sets error bits for this call (sticky until kdtree_read_device_error reads them).
__device__ __forceinline__ void report_error(int* err, int bits) { atomicOr(err, bits); }

// 2^x on the MUFU unit alone: exp2f adds a range check and two scalings per call to keep
// denormal results, which a softmax weight below 2^-126 does not need (it flushes to 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Element i of an index array that is int64 (is64) or int32.
__device__ __forceinline__ int64_t load_index(const void* a, int is64, int64_t i) {
  return is64 ? reinterpret_cast<const int64_t*>(a)[i] : static_cast<int64_t>(reinterpret_cast<const int32_t*>(a)[i]);
}
__device__ __forceinline__ int64_t load_slot(const Params& p, int64_t i) { return load_index(p.kv_indices, p.kv_indices_64, i); }

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
    const int64_t t = qo_start + pos - L;
    if (!p.draft_slots) {
      s.ptr = p.k_ext + t * p.k_ext_st;
      s.valid = true;
    } else {  // SGLang wrote the drafts' latents into the pool at out_cache_loc before attention
      const int64_t ds = load_index(p.draft_slots, p.draft_slots_64, t);
      if (ds >= 0 && ds < p.pool_size) {
        s.ptr = p.kv + ds * p.kv_st;
        s.valid = true;
      } else {
        report_error(p.err, KDTREE_ERR_SLOT);
      }
    }
  }
  return s;
}

__device__ __forceinline__ KeySrc key_source(const Params& p, int pos, int L, int N, int64_t kv_start,
                                             int qo_start) {
  return key_resolve(p, key_slot(p, pos, L, kv_start), pos, L, N, qo_start);
}

// A request's split schedule over KV keys (its prefix and drafts), from the grid's
// num_splits and the kernel's step of split_keys keys (the unit a split is cut in):
// ceil(KV / SPLIT_MIN_KEYS) splits (the host hint's rule, op.py choose_num_splits: more
// would add partials to write and merge for little), at most num_splits and MAX_SPLITS,
// of `per` steps each; the count is then trimmed so that every split is non-empty. The
// main kernels and the combine both call this, so they agree on which splits of a row
// hold partials. (The sm90 kernel's step is its pair of 64-key blocks, 128 keys: a
// split never ends half-way through a pair, and a prefix of up to num_splits x 128 keys
// takes one pair per split.)
constexpr int SPLIT_MIN_KEYS = 128;
// The combine keeps a row's weights in shared memory (1024 splits fill any GPU).
constexpr int MAX_SPLITS = 1024;
struct SplitPlan {
  int splits, per;  // splits of this request; steps of split_keys keys per split
};
__host__ __device__ __forceinline__ SplitPlan split_plan(int KV, int num_splits, int split_keys) {
  const int want = max(1, min(min(num_splits, MAX_SPLITS), (KV + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS));
  const int steps = max(1, (KV + split_keys - 1) / split_keys);
  const int per = (steps + want - 1) / want;
  return {(steps + per - 1) / per, per};
}

// Request b's lengths from its indptrs, checked: a device value is never trusted. `bad` is 0
// or the error bit of the first check that fails (KDTREE_ERR_QO_INDPTR, then _KV_INDPTR); the
// other fields hold only when it is 0 (in range then: the narrowing is exact). The main
// kernels' setup_work, the batch schedule's plan_terms and the combine's combine_row read a
// request through this one helper, so that all three agree on which requests are well formed.
struct Request {
  int bad;
  int qo_lo, N, kv_lo, L;  // first token, drafts, first kv_indices entry, prefix length
};
__device__ __forceinline__ Request load_request(const Params& p, int b) {
  const int64_t qo_lo = load_index(p.qo_indptr, p.qo_indptr_64, b), qo_hi = load_index(p.qo_indptr, p.qo_indptr_64, b + 1);
  const int64_t kv_lo = load_index(p.kv_indptr, p.kv_indptr_64, b), kv_hi = load_index(p.kv_indptr, p.kv_indptr_64, b + 1);
  Request r{0, 0, 0, 0, 0};
  if (qo_lo < 0 || qo_hi < qo_lo || qo_hi > p.T || qo_hi - qo_lo > p.max_n) r.bad = KDTREE_ERR_QO_INDPTR;
  else if (kv_lo < 0 || kv_hi < kv_lo || kv_hi > p.kv_indices_len || kv_hi > INT32_MAX) r.bad = KDTREE_ERR_KV_INDPTR;
  if (r.bad) return r;
  r.qo_lo = static_cast<int>(qo_lo);
  r.N = static_cast<int>(qo_hi - qo_lo);
  r.kv_lo = static_cast<int>(kv_lo);
  r.L = static_cast<int>(kv_hi - kv_lo);
  return r;
}

// The batch schedule (for ragged batches): one wave of split_budget CTAs shared by the
// whole batch in proportion to its work, computed on the device from the step's lengths, so
// that a captured graph adapts to the prefixes it replays (FlashMLA's get_mla_metadata does
// this in a kernel of its own, once per step; here warp 0 of each main-kernel CTA derives
// it in a few hundred cycles, and the request's first CTA hands its (slot, splits) to
// the combine through Params::plan_meta). Request b has rt_b row tiles and steps_b steps of
// split_keys keys; all take the same `per` steps per split, the smallest (at least
// SPLIT_MIN_KEYS keys) for which the CTAs sum_b rt_b * ceil(steps_b / per) fit the budget.
// So a long request of a batch of short ones takes most of the GPU instead of its 1/bs share
// (split_plan's cap: on the H200 one 64k prefix among seven 1k ran 4x slower than FlashMLA). A
// uniform batch gets split_plan's counts. The CTAs are numbered request by request, row tile
// fastest (the row tiles of a split read the same keys together), and a request of several
// splits owns the partial rows slot_b .. slot_b + splits_b * rows_b (split s, row r at
// slot_b + s * rows_b + r), packed in request order: at most split_budget * PLAN_BM rows,
// which the host keeps within the workspace's T * H * num_splits * WS_PART_FACTOR.
constexpr int PLAN_PER_LANE = 4;
constexpr int PLAN_MAX_BS = 32 * PLAN_PER_LANE;  // the host takes the 3-D grid beyond this
static_assert(PLAN_MAX_BS * 8 <= WS_PLAN_BYTES, "the workspace holds a (slot, splits) pair per request");
constexpr int PLAN_BM = 64;  // rows per CTA of both kernels (static_assert there)
struct BatchJob {
  int b = -1;     // the request (-1: this CTA has no work)
  int local;      // the CTA's index among the request's (row tile fastest)
  int splits, per;
  int rows;       // the request's rows, N * H (-1: malformed; its one CTA's setup_work reports it)
  int slot;       // first partial row of the request
};
__device__ __forceinline__ int plan_tiles(int rows) { return rows < 0 ? 1 : (rows + PLAN_BM - 1) / PLAN_BM; }
// A request's steps of split_keys keys, ceil((L + N) / split_keys) and at least 1: the batch
// schedule's term (plan_terms) and the step plan's check in setup_work, one formula for both.
// In int, exact for any L load_request accepts (<= INT32_MAX: L + N itself could overflow, so
// the remainder takes the drafts); an int64 division here spilled the sm_120 tile (20 B on sm_120a).
__device__ __forceinline__ int request_steps(int L, int N, int split_keys) {
  return max(1, L / split_keys + (L % split_keys + N + split_keys - 1) / split_keys);
}
// Request i's rows and steps. A malformed request takes one CTA of one split (rows = -1),
// whose setup_work reports it; an empty one (N = 0) takes none.
__device__ __forceinline__ void plan_terms(const Params& p, int i, int& rows, int& steps) {
  rows = 0;
  steps = 1;
  if (i >= p.bs) return;
  const Request r = load_request(p, i);
  // the request's mask offset, which its CTAs' setup_work reads next: into this SM's L1 with the
  // indptrs this warp just read, so that the job's own reads after the plan hit L1
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p.mask_indptr + i));
  if (r.bad) {
    rows = -1;
    return;
  }
  rows = r.N * p.H;
  steps = request_steps(r.L, r.N, p.split_keys);
}
// The job of CTA `cta` (find_b < 0) or the schedule of request find_b (the combine), by one
// whole warp (every lane calls it with the same arguments; the result is the same in each).
__device__ __forceinline__ BatchJob batch_plan(const Params& p, int cta, int find_b) {
  const int lane = threadIdx.x & 31;
  const int chunks = (p.bs + 31) / 32;  // <= PLAN_PER_LANE (the host)
  int rw[PLAN_PER_LANE], st[PLAN_PER_LANE];
  int64_t work = 0;  // sum of row tiles * steps
  int tiles = 0, smax = 1;
#pragma unroll
  for (int k = 0; k < PLAN_PER_LANE; ++k) {
    if (k < chunks) plan_terms(p, lane + 32 * k, rw[k], st[k]);
    else { rw[k] = 0; st[k] = 1; }
    const int rt = plan_tiles(rw[k]);
    work += static_cast<int64_t>(rt) * st[k];
    tiles += rt;
    if (rt > 0) smax = max(smax, st[k]);
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    work += __shfl_xor_sync(0xffffffffu, work, d);
    tiles += __shfl_xor_sync(0xffffffffu, tiles, d);
    smax = max(smax, __shfl_xor_sync(0xffffffffu, smax, d));
  }
  const int budget = p.split_budget;
  const int per_min = (SPLIT_MIN_KEYS + p.split_keys - 1) / p.split_keys;
  int per = max(per_min, smax);  // one split each: what a budget the row tiles fill leaves
  if (budget > tiles) {
    // the answer lies in [ceil(work / budget), ceil(work / (budget - tiles))]: at least the
    // first, since ctas(per) >= work / per; the second fits, since ctas(per) < work / per + tiles
    int lo = static_cast<int>(min(static_cast<int64_t>(smax), (work + budget - 1) / budget));
    int hi = static_cast<int>(min(static_cast<int64_t>(smax), (work + budget - tiles - 1) / (budget - tiles)));
    lo = max(per_min, lo);
    hi = max(lo, hi);
    while (lo < hi) {  // warp-uniform
      const int mid = (lo + hi) >> 1;
      int n = 0;  // CTAs at `mid` steps a split (each term capped: the sum stays exact below the budget)
#pragma unroll
      for (int k = 0; k < PLAN_PER_LANE; ++k)  // (k < chunks: a division per request, none for the lanes' empty terms)
        if (k < chunks) n += min(plan_tiles(rw[k]) * ((st[k] + mid - 1) / mid), budget + 1);
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) n += __shfl_xor_sync(0xffffffffu, n, d);
      if (n <= budget) hi = mid;
      else lo = mid + 1;
    }
    per = lo;
  }
  BatchJob job{-1, 0, 1, per, 0, 0};
  int cta_carry = 0, slot_carry = 0;
#pragma unroll
  for (int k = 0; k < PLAN_PER_LANE; ++k) {
    if (k < chunks && job.b < 0) {  // warp-uniform
      const int rt = plan_tiles(rw[k]), rows = max(rw[k], 0), sp = (st[k] + per - 1) / per;
      const int cnt = rt * sp, slots = sp > 1 ? sp * rows : 0;
      int ci = cnt, si = slots;  // inclusive scans over the lanes
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int a = __shfl_up_sync(0xffffffffu, ci, d), b2 = __shfl_up_sync(0xffffffffu, si, d);
        if (lane >= d) { ci += a; si += b2; }
      }
      const int c0 = cta_carry + ci - cnt, s0 = slot_carry + si - slots;
      const bool mine = find_b >= 0 ? lane + 32 * k == find_b : (cta >= c0 && cta < c0 + cnt);
      const unsigned hit = __ballot_sync(0xffffffffu, mine);
      if (hit) {
        const int src = __ffs(hit) - 1;
        job.b = 32 * k + src;
        job.local = cta - __shfl_sync(0xffffffffu, c0, src);
        job.splits = __shfl_sync(0xffffffffu, sp, src);
        job.rows = __shfl_sync(0xffffffffu, rw[k], src);
        job.slot = __shfl_sync(0xffffffffu, s0, src);
      }
      cta_carry += __shfl_sync(0xffffffffu, ci, 31);
      slot_carry += __shfl_sync(0xffffffffu, si, 31);
    }
  }
  return job;
}

// The step plan's layout (Params::plan): PLAN_HDR_WORDS header words, then one int4 a CTA of the
// budget (pack_job), then one int per request (its rows, 0 for a malformed one).
constexpr int PLAN_MAGIC = 0x6b647033;  // "kdp3"
constexpr int PLAN_HDR_WORDS = 8;       // magic, bs, H, max_n, T, num_splits, split_keys, split_budget
constexpr int PLAN_JOBS_OFF = 32;
constexpr int PLAN_ROWS_OFF = PLAN_JOBS_OFF + 16 * MAX_SPLITS;
constexpr int PLAN_BYTES = PLAN_ROWS_OFF + 4 * PLAN_MAX_BS;
static_assert(PLAN_HDR_WORDS * 4 <= PLAN_JOBS_OFF && PLAN_JOBS_OFF % 16 == 0, "the jobs are int4-aligned after the header");
static_assert(PLAN_MAX_BS < 255 && MAX_SPLITS < 2048 && (1 << 24) > MAX_SPLITS * PLAN_BM, "pack_job's fields");
static_assert(KDTREE_MAX_DRAFTS * KDTREE_MAX_HEADS < (1 << 20), "pack_job's rows field");
// A job in one int4: x = (b + 1) | local << 8, y = splits | (rows + 1) << 11, z = per, w = slot.
__device__ __forceinline__ int4 pack_job(const BatchJob& j) {
  return make_int4((j.b + 1) | (j.local << 8), j.splits | ((j.rows + 1) << 11), j.per, j.slot);
}
__device__ __forceinline__ BatchJob unpack_job(int4 v) {
  BatchJob j;
  j.b = (v.x & 255) - 1;
  j.local = v.x >> 8;
  j.splits = v.y & 2047;
  j.rows = (v.y >> 11) - 1;
  j.per = v.z;
  j.slot = v.w;
  return j;
}
// The header a plan for this call's shape holds (plan_kernel writes it; the main kernels compare it).
__device__ __forceinline__ int plan_header_word(const Params& p, int i) {
  switch (i) {
    case 0: return PLAN_MAGIC;
    case 1: return p.bs;
    case 2: return p.H;
    case 3: return p.max_n;
    case 4: return p.T;
    case 5: return p.num_splits;
    case 6: return p.split_keys;
    default: return p.split_budget;
  }
}

// A main kernel's CTA under the batch schedule: warp 0 derives the CTA's job (batch_plan) into
// shared memory at job_s, the CTA meets at a barrier, and every thread reads it (the other warps
// wait there: with every warp running the plan ptxas spilled and serialized the sm90 kernel's
// wgmma). The request's first CTA hands the combine its partials' place, (slot, splits), through
// Params::plan_meta (every request with rows has one; the combine reads it after its
// griddepcontrol.wait) and zeroes its rows' arrival counters (Params::plan_cnt; this grid's
// griddepcontrol.wait has seen the previous call's combine finish). job.b < 0: the CTA has no work (uniform over the CTA).
__device__ __forceinline__ BatchJob planned_job(const Params& p, BatchJob* job_s, int tid, int& rt, int& split) {
  if (tid < 32) {
    BatchJob j;
    bool derive = true;
    if (p.plan) {  // the step plan: the header and this CTA's job in one round trip
      const int4* pl = reinterpret_cast<const int4*>(p.plan);
      const int4 h0 = pl[0], h1 = pl[1], v = pl[PLAN_JOBS_OFF / 16 + blockIdx.x];
      const int hdr[PLAN_HDR_WORDS] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
      derive = false;
#pragma unroll
      for (int i = 0; i < PLAN_HDR_WORDS; ++i) derive |= hdr[i] != plan_header_word(p, i);
      if (!derive) j = unpack_job(v);
      else if (tid == 0 && blockIdx.x == 0) report_error(p.err, KDTREE_ERR_PLAN);  // made for another shape
    }
    if (derive) j = batch_plan(p, blockIdx.x, -1);
    if (tid == 0) *job_s = j;
    if (j.b >= 0 && j.local == 0) {  // warp 0 alone: in every warp, ptxas serialized the sm90 kernel's wgmma
      if (tid == 0) p.plan_meta[j.b] = make_int2(j.slot, j.splits);
      if (j.splits > 1)  // the combine's arrival counters of the request's rows start at zero
        for (int i = tid; i < j.rows; i += 32) p.plan_cnt[j.slot + i] = 0;
    }
  }
  __syncthreads();
  const BatchJob job = *job_s;
  if (job.b >= 0) {
    const int tiles = plan_tiles(job.rows);
    rt = job.local % tiles;
    split = job.local / tiles;
  }
  return job;
}

// What one CTA works on: request b's query rows r0 .. r0+BM and key tiles [t_begin, t_end)
// of the request's `splits` splits (one: O and the LSE go straight to the output).
struct Work {
  int qo_start, kv_lo, N, rows, r0, L, KV, t_begin, t_end, splits;
  int64_t slot0, slot_stride;  // partial row of split s, request row r: slot0 + s * slot_stride + r
  int64_t mask_base;
  bool mask_ok;
};

// Where request b's mask rows (N drafts, each over KV keys) start in p.mask, and whether all of
// them lie inside it. setup_work reports a window that does not (KDTREE_ERR_MASK); the sm_120
// tile derives it again in its draft tiles rather than hold it in registers (mma_kernel.cuh).
__device__ __forceinline__ void mask_window(const Params& p, int b, int N, int KV, Work& w) {
  w.mask_base = p.mask_indptr[b];
  w.mask_ok = N == 0 || (w.mask_base >= 0 && w.mask_base + static_cast<int64_t>(N) * KV <= p.mask_len);
}

// Read and validate request b's metadata (device values, never trusted: a bad
// value sets a bit in *err and the CTA does nothing). Returns false when the
// CTA has no work: a split past its request's count (split_plan) writes nothing,
// and the combine reads only the splits below that count.
// `job`: the batch schedule's where PLANNED (a grid of batch_plan), else unused (the 3-D grid's
// split_plan).
template <bool PLANNED>
__device__ __forceinline__ bool setup_work(const Params& p, int b, int r0, int split, int bn, int tid, Work& w,
                                           const BatchJob& job) {
  const bool reporter = tid == 0 && r0 == 0 && split == 0;
  const Request rq = load_request(p, b);
  if (rq.bad) {
    if (reporter) report_error(p.err, rq.bad);
    return false;
  }
  w.qo_start = rq.qo_lo;
  w.N = rq.N;
  w.kv_lo = rq.kv_lo;
  w.rows = w.N * p.H;
  w.r0 = r0;
  if (r0 >= w.rows) return false;  // no such row tile for this request (combine skips it too)
  w.L = rq.L;
  w.KV = w.L + w.N;
  if (PLANNED && p.plan) {  // the step plan's request: the lengths it was made from must be these
    const int steps = request_steps(w.L, w.N, p.split_keys);
    if (job.rows != w.rows || (steps + job.per - 1) / job.per != job.splits) {
      if (tid == 0) report_error(p.err, KDTREE_ERR_PLAN);
      return false;
    }
  }
  const SplitPlan sp = PLANNED ? SplitPlan{job.splits, job.per} : split_plan(w.KV, p.num_splits, p.split_keys);
  if (split >= sp.splits) return false;  // a split this request does not need (split 0 always is)
  w.splits = sp.splits;
  w.slot0 = PLANNED ? job.slot : static_cast<int64_t>(w.qo_start) * p.H;
  w.slot_stride = PLANNED ? job.rows : static_cast<int64_t>(p.T) * p.H;
  mask_window(p, b, w.N, w.KV, w);
  if (!w.mask_ok && reporter) report_error(p.err, KDTREE_ERR_MASK);
  // split < sp.splits: its first step lies before the end, so t_begin < t_end
  const int ntiles = (w.KV + bn - 1) / bn, tiles_per = sp.per * (p.split_keys / bn);
  w.t_begin = split * tiles_per;
  w.t_end = min(ntiles, w.t_begin + tiles_per);
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
// o when the request has one split, bf16 normalised partials (part_t) plus the fp32 LSE to
// the workspace (`partial`: it has several, Work::splits; uniform over the CTA), row r of the
// request at partial row part_slot + r (Work::slot0 + split * Work::slot_stride).
//
// Partials in 16-byte stores: lane tq of a quad holds columns 8i + 2tq, +1 of each n8 block i.
// Two butterfly rounds per four blocks 4j .. 4j + 3 give lane tq all 8 columns of block 4j + tq:
// round 1 (xor 1) leaves lanes 2c, 2c + 1 with columns 4c .. 4c + 3 of blocks b, 2 + b
// (b = tq & 1), round 2 (xor 2) with 8 columns of block tq. One STG.128 per four blocks where a
// plain store takes four: on the H200, bf16 partials in 4-byte stores (half a sector each) were
// up to 25% slower than fp32 ones, in 16-byte stores 2-5% faster. Every lane shuffles, also
// those of rows past the request (the shuffles take the whole warp); only the stores are predicated.
__device__ __forceinline__ void store_rows(const Params& p, const float* acc, const float* m_run,
                                           const float* l_run, int r0, int rows, int qo_start,
                                           int64_t part_slot, bool partial, int half, int tq) {
  const int H = p.H;
  // row h's 1/l and natural-log LSE (an empty row: 0 and -inf)
  auto norm = [&](int h, float& inv, float& lse) {
    inv = l_run[h] > 0.f ? 1.f / l_run[h] : 0.f;
    lse = l_run[h] > 0.f ? (m_run[h] + log2f(l_run[h])) * LN2 : -CUDART_INF_F;
  };
  if (partial) {  // two loops, not one with a branch: one spills 8 B in the sm_120 tile
    const bool b = tq & 1, c = (tq >> 1) & 1;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = r0 + 8 * h;
      const bool valid = rr < rows;
      float inv, lse;
      norm(h, inv, lse);
      const int64_t slot = part_slot + rr;
      part_t* row = p.o_part + slot * DV + half * 256;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t w[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) w[u] = pack_bf16(acc[4 * (4 * j + u) + 2 * h] * inv, acc[4 * (4 * j + u) + 2 * h + 1] * inv);
        const uint32_t r0w = __shfl_xor_sync(0xffffffffu, b ? w[0] : w[1], 1);
        const uint32_t r1w = __shfl_xor_sync(0xffffffffu, b ? w[2] : w[3], 1);
        const uint2 lo_blk = b ? make_uint2(r0w, w[1]) : make_uint2(w[0], r0w);  // block b, columns 4c ..
        const uint2 hi_blk = b ? make_uint2(r1w, w[3]) : make_uint2(w[2], r1w);  // block 2 + b
        const uint2 send = c ? lo_blk : hi_blk, keep = c ? hi_blk : lo_blk;
        const uint2 got = make_uint2(__shfl_xor_sync(0xffffffffu, send.x, 2), __shfl_xor_sync(0xffffffffu, send.y, 2));
        const uint2 first = c ? got : keep, second = c ? keep : got;  // columns 0-3, 4-7 of block 4j + tq
        if (valid) *reinterpret_cast<uint4*>(row + (4 * j + tq) * 8) = make_uint4(first.x, first.y, second.x, second.y);
      }
      if (valid && half == 0 && tq == 0) p.lse_part[slot] = lse;
    }
    return;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = r0 + 8 * h;
    if (rr >= rows) continue;
    float inv, lse;
    norm(h, inv, lse);
    const int tok = rr / H, head = rr % H;
    __nv_bfloat16* dst = p.o + static_cast<int64_t>(qo_start + tok) * p.o_st +
                         static_cast<int64_t>(head) * p.o_sh + half * 256 + tq * 2;
#pragma unroll
    for (int i = 0; i < 32; ++i)
      *reinterpret_cast<__nv_bfloat162*>(dst + i * 8) =
          __floats2bfloat162_rn(acc[4 * i + 2 * h] * inv, acc[4 * i + 2 * h + 1] * inv);
    if (p.lse && half == 0 && tq == 0) p.lse[static_cast<int64_t>(qo_start) * H + rr] = lse;
  }
}

}  // namespace kdtree
