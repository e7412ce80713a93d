// kdtree-engine: the split-KV combine. A request of several splits (common.cuh
// split_plan, at most num_splits) has its main-kernel CTAs write bf16 partial outputs
// (part_t) and their fp32 LSE per split into the workspace; these kernels merge them in
// fp32 into the bf16 output (and the LSE). Rows of a request of one split were written by
// the main kernel and are skipped. Launched (whenever num_splits > 1) as a programmatic
// dependent of the main kernel (they wait in griddepcontrol.wait for its memory).
#pragma once

#include "common.cuh"

namespace kdtree {

// Merge the splits of each query row by their log-sum-exp. Few splits (<= COMBINE_NARROW_MAX):
// 512-thread CTAs of 8 rows, 64 threads (8 columns each) per row, every split of the row
// loaded at once (combine_narrow_kernel, below). Many splits: one row per CTA of G groups
// of 128 threads (4 columns each), group q taking splits q, q + G, ...: up to
// G x COMBINE_ONE_PASS splits in one pass (below), more in two, where the LSEs go through
// shared memory once (max, then weights) and each group sums its splits with COMBINE_UNROLL
// loads in flight (a serial walk over 66 splits was latency-bound; each split below the row's
// count wrote its partial, so the loads wait for no weight); then the groups meet in shared
// memory. The host takes it, with G = 8, for more than 8 x COMBINE_ONE_PASS64 splits
// (combine_onepass_kernel below takes fewer).
constexpr int COMBINE_UNROLL = 8;
// A row of at most G x COMBINE_ONE_PASS splits in a wide CTA of G groups (all of them at bs 1
// on 132 SMs: 66 splits) takes one round trip to memory and one barrier: each group loads its
// splits' partials and LSEs at once, merges them against its own maximum, and group 0 merges
// the groups' (maximum, sum, partial) triples. The two-pass walk below it (the LSEs, two
// barriers, the weights, then the partials in rounds of COMBINE_UNROLL) takes three round
// trips at 66 splits. COMBINE_ONE_PASS registers of float4 per thread: 9 keeps combine_wide<8>
// within the 64 registers of its 1024-thread CTA.
constexpr int COMBINE_ONE_PASS = 9;

// Which token/head a global row is, its request b and how many splits that request took (the
// main kernels' split_plan), or false when there is nothing to merge: no request owns the row,
// its request is malformed (the main kernel flags those) or took one split (the main kernel
// wrote the row itself). It reads only inputs, none of the main kernel's results, so the
// combines call it before griddepcontrol.wait: it overlaps the main kernel's tail. The owning
// request is found by binary search over qo_indptr (a linear scan is up to bs dependent loads
// per thread). Split s of the row is partial row slot0 + s * stride (Work::slot0).
// PLANNED (the batch schedule): the request's splits and its packed block are the main kernel's
// (Params::plan_meta), so here slot0 is the row's index in its request and `splits` is unknown
// until planned_row, after the wait.
template <bool PLANNED>
__device__ __forceinline__ bool combine_row(const Params& p, int64_t grow, int& tok, int& head, int& b, int& splits,
                                            int64_t& slot0, int64_t& stride) {
  tok = static_cast<int>(grow / p.H);
  head = static_cast<int>(grow % p.H);
  auto qo = [&](int i) { return load_index(p.qo_indptr, p.qo_indptr_64, i); };
  if (tok >= qo(p.bs)) return false;  // a token no request owns
  // the first b with qo(b + 1) > tok (exists: qo(bs) > tok). Reads stay in [0, bs] even if
  // qo_indptr is not monotonic; the main kernel flags such a batch.
  int hi = p.bs - 1;
  b = 0;
  while (b < hi) {
    const int mid = (b + hi) >> 1;
    if (qo(mid + 1) > tok) hi = mid; else b = mid + 1;
  }
  const Request r = load_request(p, b);
  if (r.bad || tok < r.qo_lo) return false;  // (tok < qo_lo + N: the search)
  if (PLANNED) {
    splits = 0;
    slot0 = grow - static_cast<int64_t>(r.qo_lo) * p.H;
    stride = static_cast<int64_t>(r.N) * p.H;
    return true;
  }
  splits = split_plan(r.L + r.N, p.num_splits, p.split_keys).splits;
  slot0 = grow;
  stride = static_cast<int64_t>(p.T) * p.H;
  return splits > 1;
}

// After griddepcontrol.wait, under the batch schedule: the row's splits and the first partial
// row of its request, as the request's first main-kernel CTA wrote them. False for a request of
// one split (the main kernel wrote its rows).
// With a step plan, the rows it was made for must be the request's: a request whose rows it does
// not cover (its lengths changed since the plan was made) sets KDTREE_ERR_PLAN. Loaded beside
// plan_meta after the wait and compared only once both are in (plan_rows, then check_plan_rows):
// a compare and its atomic between the two loads put a second L2 round trip on the combine's
// critical path (0.5-1.4% of a planned call on the H200).
__device__ __forceinline__ int64_t plan_rows(const Params& p, int b, int64_t rows) {
  return p.plan ? reinterpret_cast<const int*>(p.plan + PLAN_ROWS_OFF)[b] : rows;
}
__device__ __forceinline__ void check_plan_rows(const Params& p, int64_t planned, int64_t rows) {
  if (planned != rows) report_error(p.err, KDTREE_ERR_PLAN);
}
template <bool PLANNED>
__device__ __forceinline__ bool planned_row(const Params& p, int b, int& splits, int64_t& slot0, int64_t rows) {
  if (!PLANNED) return true;
  const int64_t prow = plan_rows(p, b, rows);
  const int2 m = p.plan_meta[b];
  if (threadIdx.x == 0) check_plan_rows(p, prow, rows);
  splits = m.y;
  slot0 += m.x;
  return splits > 1;
}

// A split's weight in its row's merge: exp(lse - max) of the row's LSEs, and 0 for a
// split with no visible key of this row (LSE -inf; mx is finite wherever this is called).
__device__ __forceinline__ float split_weight(float ls, float mx) {
  return ls == -CUDART_INF_F ? 0.f : __expf(ls - mx);
}

// Four consecutive columns of a partial, as fp32 (part_t: common.cuh).
__device__ __forceinline__ float4 load_part4(const part_t* src) {
  const uint2 raw = *reinterpret_cast<const uint2*>(src);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// A load from the workspace; CG: past L1 (ld.global.cg), for what other CTAs of this grid wrote
// (combine_pieces_kernel's chunk results).
template <bool CG, typename T>
__device__ __forceinline__ T load_ws(const T* src) {
  if constexpr (CG) return __ldcg(src);
  else return *src;
}

// o += wt x the 8 bf16 columns in raw (one 16-byte load of a partial), in fp32.
__device__ __forceinline__ void add_weighted8(float (&o)[8], float wt, const uint4& raw) {
  const uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w4[k]));
    o[2 * k] += wt * v.x;
    o[2 * k + 1] += wt * v.y;
  }
}

// Merge splits s0, s0 + step, ... (N of them; one at or past the row's S counts as empty) of
// a row (partial rows slot0 + s * stride) at columns c .. c + 7 into (o, mx, sum), for the
// narrow and one-pass kernels: each split's 8 columns of bf16 partial (one 16-byte load) and
// its fp32 LSE, every load issued before any is used (each split below S wrote its partial, so
// no load waits for a weight: one round trip to memory for all N), then merged in fp32 against
// the running maximum mx: o = the sum of exp(lse - mx) x partial and sum = the sum of
// exp(lse - mx), both rescaled when mx moves and 0 while no split has a visible key (mx -inf).
// CG: the loads bypass L1 (load_ws).
template <int N, bool CG = false>
__device__ __forceinline__ void merge_splits8(const Params& p, int64_t slot0, int64_t stride, int c, int s0, int step,
                                              int S, float (&o)[8], float& mx, float& sum) {
  const part_t* base = p.o_part + slot0 * DV + c;
  uint4 raw[N];
  float ls[N];
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const int s = s0 + u * step;
    raw[u] = s < S ? load_ws<CG>(reinterpret_cast<const uint4*>(base + s * stride * DV)) : make_uint4(0u, 0u, 0u, 0u);
    ls[u] = s < S ? load_ws<CG>(p.lse_part + slot0 + s * stride) : -CUDART_INF_F;
  }
  float m = mx;  // the running maximum (-inf before the first chunk, when o and sum are 0)
#pragma unroll
  for (int u = 0; u < N; ++u) m = fmaxf(m, ls[u]);
  if (m == -CUDART_INF_F) return;  // no split so far has a visible key: o, sum stay 0
  const float keep = split_weight(mx, m);  // 0 before the first chunk
  sum *= keep;
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] *= keep;
  mx = m;
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const float wt = split_weight(ls[u], m);  // 0 past S and for a split with no visible key
    sum += wt;
    add_weighted8(o, wt, raw[u]);
  }
}

// Splits s0 .. s0 + N - 1 (those below S) of a row merged afresh into (o, mx, sum), as
// merge_splits8 does, but with the LSEs spread over the warp's lanes (lane u loads split s0 + u's
// and the weights reach the other lanes by shuffle): N - 1 registers fewer per thread, which keeps
// the pieces' instances within the narrow kernel's caps. CG: the loads bypass L1 (load_ws).
// Every lane of the warp calls it.
template <int N, bool CG>
__device__ __forceinline__ void merge_chunk8(const Params& p, int64_t slot0, int64_t stride, int c, int s0, int S,
                                             float (&o)[8], float& mx, float& sum) {
  static_assert(N <= 32, "one LSE per lane");
  const part_t* base = p.o_part + slot0 * DV + c;
  const int lane = threadIdx.x & 31;
  uint4 raw[N];
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const uint4* src = reinterpret_cast<const uint4*>(base + (s0 + u) * stride * DV);
    raw[u] = s0 + u < S ? load_ws<CG>(src) : make_uint4(0u, 0u, 0u, 0u);
  }
  const float* lsrc = p.lse_part + slot0 + (s0 + lane) * stride;
  const float ls = lane < N && s0 + lane < S ? load_ws<CG>(lsrc) : -CUDART_INF_F;
  float m = ls;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = 0.f;
  sum = 0.f;
  mx = m;
  if (m == -CUDART_INF_F) return;  // no split has a visible key: o, sum stay 0 (warp-uniform)
  const float w = split_weight(ls, m);  // 0 on the lanes past N or S and for a split with no visible key
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const float wt = __shfl_sync(0xffffffffu, w, u);
    sum += wt;
    add_weighted8(o, wt, raw[u]);
  }
}

// Row (slot0, stride)'s splits s0, s0 + step, ... below S merged into (o, mx, sum): the first
// MAXC in one round trip (merge_splits8), which is all of a 3-D-grid row (its S never exceeds
// the instance's MAXC, LOOP false). Under the batch schedule (LOOP: the one-pass kernels) a row
// may hold more: its further splits follow MAXC a round trip (MAXC / 2 on sm_120, whose ptxas
// spilled a walk of MAXC).
template <int MAXC, bool LOOP>
__device__ __forceinline__ void merge_row8(const Params& p, int64_t slot0, int64_t stride, int c, int s0, int step,
                                           int S, float (&o)[8], float& mx, float& sum) {
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = 0.f;
  mx = -CUDART_INF_F;
  sum = 0.f;
  merge_splits8<MAXC>(p, slot0, stride, c, s0, step, S, o, mx, sum);
  if (!LOOP) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
  constexpr int C2 = MAXC > 1 ? MAXC / 2 : 1;  // sm_120's ptxas spilled a walk of MAXC (168 B at 16)
#else
  constexpr int C2 = MAXC;
#endif
#pragma unroll 1
  for (int s = s0 + MAXC * step; s < S; s += C2 * step) merge_splits8<C2>(p, slot0, stride, c, s, step, S, o, mx, sum);
}

// Row grow's columns c .. c + 7 of O (o / sum as bf16, one 16-byte store: aligned by the ABI)
// and, from the thread of column 0, its LSE (mx + ln sum; -inf for a row with no visible key).
// The narrow and one-pass kernels' store (in the one-pass kernel only group 0 gets here);
// combine_store is the wide kernel's.
__device__ __forceinline__ void store_row8(const Params& p, int c, const float (&o)[8], float sum, float mx,
                                           int64_t grow) {
  const int tok = static_cast<int>(grow / p.H), head = static_cast<int>(grow % p.H);  // (not kept live: registers)
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  uint32_t packed[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) packed[k] = pack_bf16(o[2 * k] * inv, o[2 * k + 1] * inv);
  __nv_bfloat16* dst = p.o + static_cast<int64_t>(tok) * p.o_st + static_cast<int64_t>(head) * p.o_sh + c;
  *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  if (p.lse && c == 0) p.lse[grow] = sum > 0.f ? mx + logf(sum) : -CUDART_INF_F;
}

__device__ __forceinline__ void combine_store(const Params& p, int tok, int head, int c, float4 o, float sum,
                                              float mx, int64_t grow, bool lse_writer) {
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  __nv_bfloat16* dst = p.o + static_cast<int64_t>(tok) * p.o_st + static_cast<int64_t>(head) * p.o_sh + c;
  reinterpret_cast<__nv_bfloat162*>(dst)[0] = __floats2bfloat162_rn(o.x * inv, o.y * inv);
  reinterpret_cast<__nv_bfloat162*>(dst)[1] = __floats2bfloat162_rn(o.z * inv, o.w * inv);
  if (p.lse && lse_writer) p.lse[grow] = sum > 0.f ? mx + logf(sum) : -CUDART_INF_F;
}

// The narrow combine (num_splits <= COMBINE_NARROW_MAX): one row per 64 threads, 8 columns
// (one 16-byte load of bf16) per thread per split, every split's partial and LSE loaded at
// once (merge_splits8: one round trip to memory for the row; the looped walk it replaced made
// two dependent round trips per split, the LSE and then the partial behind a branch on it:
// 16 at bs8's 8 splits; 2-7% of the batched calls on the H200). MAXS >= the grid's num_splits >=
// the row's S (split_plan): the host picks the instance, so the register arrays stay as short
// as the call allows and the occupancy of the few-split calls (bs64 N4 H16: 2 splits, 4096
// rows) stays whole. At 16 splits (bs1 N64 H8 64k, N4 H128) it is faster than the wide
// kernel's one pass (2-6% of the call on the H200).
constexpr int COMBINE_NARROW_THREADS = 512;
constexpr int COMBINE_NARROW_ROWS = COMBINE_NARROW_THREADS / 64;
constexpr int COMBINE_NARROW_MAX = 16;  // instances for 2, 4, 8 and 16 splits (combine.cu)
// resident CTAs per SM each instance is built for (its register cap: 64K / (512 x this))
template <int MAXS>
constexpr int COMBINE_NARROW_MIN_BLOCKS = MAXS <= 2 ? 4 : MAXS <= 4 ? 3 : MAXS <= 8 ? 2 : 1;
// the batch schedule's instances (combine_pieces_kernel: a piece merges PIECE_SPLITS splits, at
// least MAXS, and its plan lookup holds a few more registers): one CTA fewer where that does not
// fit (sm_120's ptxas needs more: it spilled 8-168 B at these caps, so there they take one CTA)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
template <int MAXS>
constexpr int COMBINE_PLANNED_MIN_BLOCKS = 1;
#else
template <int MAXS>
constexpr int COMBINE_PLANNED_MIN_BLOCKS = MAXS <= 8 ? 2 : 1;
#endif

// The 3-D grid's rows (combine_row): S <= the grid's num_splits <= MAXS.
template <int MAXS>
__global__ void __launch_bounds__(COMBINE_NARROW_THREADS, COMBINE_NARROW_MIN_BLOCKS<MAXS>)
    combine_narrow_kernel(const Params p) {
  const int64_t TH = static_cast<int64_t>(p.T) * p.H;
  const int64_t grow = static_cast<int64_t>(blockIdx.x) * COMBINE_NARROW_ROWS + threadIdx.x / 64;
  int tok, head, b, S;  // S: the splits of this row's request b
  int64_t slot0, stride;
  const bool owned = grow < TH && combine_row<false>(p, grow, tok, head, b, S, slot0, stride);  // inputs only: before the wait
  pdl_wait_primary();
  if (!owned) return;
  const int c = (threadIdx.x % 64) * 8;
  float o[8], mx, sum;
  merge_row8<MAXS, false>(p, slot0, stride, c, 0, 1, S, o, mx, sum);
  store_row8(p, c, o, sum, mx, grow);
}

// The batch schedule's narrow combine: pieces of PIECE_SPLITS<MAXS> splits of a row, so that a
// long row of a ragged batch is merged by many 64-thread groups at once instead of one walking
// its splits (one 64k request among seven 1k ones: 57 splits, 8 round trips in a row on 16 of
// the H200's 132 SMs: 71 us a call, 57 in pieces). Request b of S_b > 1 splits has C_b =
// ceil(S_b / K) chunks a row. The work is cut in units of COMBINE_NARROW_ROWS groups, one
// CTA's iteration, each unit of one request (a request's units are padded to whole units);
// the units are numbered request by request and CTA x takes units x, x + gridDim.x, ...
// - C = 1 (every row of a uniform batch): a unit holds 8 rows, one a group, each merged into O
//   as combine_narrow_kernel does.
// - 1 < C <= 8: a unit holds floor(8 / C) rows, a row's C chunks in consecutive groups of the
//   CTA. Each group merges its chunk (fp32 o, maximum and sum) into shared memory; after a
//   barrier the row's first group merges the C results and stores the row. No second round
//   trip to memory: a version that wrote each chunk's result to the workspace, counted it in on
//   an arrival counter and had the last group reload them from L2 cost ragged batches 1-2.5 us
//   a call on the H200.
// - C > 8 (a row of more than 8 K splits): pieces of one chunk a group, chunk-major; piece c
//   writes its result as the partial of split cK (normalised bf16 and its LSE), then counts
//   itself in on the row's counter (Params::plan_cnt, zeroed by the main kernel); the last of
//   the C merges the chunk results, splits 0, K, 2K, ..., from L2 (one round trip for C <= K,
//   one result a round trip past that).
// Before the wait each CTA reads every request's lengths (load_request: inputs only); after it,
// their (slot, splits) pairs (plan_meta), and 128 threads scan the units into shared memory.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
template <int MAXS>
constexpr int PIECE_SPLITS = MAXS == 2 ? 4 : 8;  // sm_120's ptxas spilled 6 B at 16 under the 128-register cap
#else
template <int MAXS>
constexpr int PIECE_SPLITS = MAXS == 2 ? 4 : MAXS == 4 ? 8 : MAXS;
#endif
template <int MAXS>
__global__ void __launch_bounds__(COMBINE_NARROW_THREADS, COMBINE_PLANNED_MIN_BLOCKS<MAXS>)
    combine_pieces_kernel(const Params p) {
  constexpr int K = PIECE_SPLITS<MAXS>, G = COMBINE_NARROW_ROWS;
  __shared__ int pfx[PLAN_MAX_BS + 1];  // the first unit of each request; pfx[PLAN_MAX_BS]: all
  __shared__ int rows_s[PLAN_MAX_BS], qlo_s[PLAN_MAX_BS];
  __shared__ int2 meta_s[PLAN_MAX_BS];
  __shared__ int wsum[PLAN_MAX_BS / 32];
  __shared__ int last_s[G];
  __shared__ float4 part_s[G][2][64];  // 1 < C <= 8: each group's chunk result, o (8 per thread)
  __shared__ float2 ms_s[G];           // and its (maximum, sum)
  const int tid = threadIdx.x, lane = tid & 31, grp = tid / 64, gt = tid % 64, c = gt * 8;
  int rows = 0, qlo = 0;
  if (tid < p.bs) {  // (p.bs <= PLAN_MAX_BS: the host)
    const Request r = load_request(p, tid);
    if (!r.bad) { rows = r.N * p.H; qlo = r.qo_lo; }  // a malformed request: the main kernel flagged it
  }
  pdl_wait_primary();
  const int64_t prow = tid < p.bs ? plan_rows(p, tid, rows) : rows;
  int units = 0;
  int2 m = make_int2(0, 1);
  if (rows > 0) {  // (plan_meta holds only the requests with rows)
    m = p.plan_meta[tid];
    if (m.y > 1) {
      const int C = (m.y + K - 1) / K;
      units = C == 1 ? (rows + G - 1) / G : C <= G ? (rows + G / C - 1) / (G / C) : (rows * C + G - 1) / G;
    }
  }
  int inc = units;  // inclusive scan over threads 0 .. PLAN_MAX_BS - 1
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int a = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += a;
  }
  if (tid < PLAN_MAX_BS) {
    if (lane == 31) wsum[tid / 32] = inc;
    rows_s[tid] = rows;
    qlo_s[tid] = qlo;
    meta_s[tid] = m;
  }
  __syncthreads();
  if (tid < PLAN_MAX_BS) {
    int off = 0;
#pragma unroll
    for (int w = 0; w < PLAN_MAX_BS / 32; ++w) off += w < tid / 32 ? wsum[w] : 0;
    pfx[tid] = off + inc - units;
    if (tid == PLAN_MAX_BS - 1) pfx[PLAN_MAX_BS] = off + inc;
  }
  __syncthreads();
  if (tid < p.bs) check_plan_rows(p, prow, rows);  // (after the scan: its atomic stays off the loads' path)
  const int total = pfx[PLAN_MAX_BS];
  const uint32_t bar_id = 1 + grp, bar_n = 64;  // the group's named barrier (two warps)
  auto group_sync = [&] { asm volatile("bar.sync %0, %1;" ::"r"(bar_id), "r"(bar_n) : "memory"); };
  for (int u = blockIdx.x; u < total; u += gridDim.x) {  // CTA-uniform
    int b = 0, hi = p.bs - 1;  // the last request whose first unit is <= u
    while (b < hi) {
      const int mid = (b + hi + 1) >> 1;
      if (pfx[mid] <= u) b = mid; else hi = mid - 1;
    }
    const int rb = rows_s[b], S = meta_s[b].y, C = (S + K - 1) / K, local = u - pfx[b];
    const bool in_cta = C > 1 && C <= G;  // CTA-uniform: a row's chunks in groups rr C .. rr C + C - 1
    // this group's row r and chunk ch: of a unit of rows (1 < C <= 8), else one row (C = 1) or
    // one chunk of a long row (C > 8, chunk-major) a group
    int r, ch;
    bool mine;  // group-uniform: false for a padded unit's idle group
    if (in_cta) {
      const int rr = grp / C;
      ch = grp % C;
      r = local * (G / C) + rr;
      mine = rr < G / C && r < rb;
    } else {
      const int j = local * G + grp;
      r = j % rb;
      ch = j / rb;
      mine = j < rb * C;
    }
    const int64_t slot0 = static_cast<int64_t>(meta_s[b].x) + r;
    float o[8], mx, sum;
    if (mine) merge_chunk8<K, false>(p, slot0, rb, c, ch * K, S, o, mx, sum);
    if (in_cta) {
      if (mine) {
        part_s[grp][0][gt] = make_float4(o[0], o[1], o[2], o[3]);
        part_s[grp][1][gt] = make_float4(o[4], o[5], o[6], o[7]);
        if (gt == 0) ms_s[grp] = make_float2(mx, sum);
      }
      __syncthreads();
      if (mine && ch == 0) {
        float mt = -CUDART_INF_F;
        for (int q = 0; q < C; ++q) mt = fmaxf(mt, ms_s[grp + q].x);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = 0.f;
        sum = 0.f;
        if (mt != -CUDART_INF_F) {
#pragma unroll 1
          for (int q = 0; q < C; ++q) {
            const float2 ms = ms_s[grp + q];
            const float wt = split_weight(ms.x, mt);  // 0 for a chunk with no visible key
            const float4 a = part_s[grp + q][0][gt], a2 = part_s[grp + q][1][gt];
            sum += wt * ms.y;
            o[0] += wt * a.x; o[1] += wt * a.y; o[2] += wt * a.z; o[3] += wt * a.w;
            o[4] += wt * a2.x; o[5] += wt * a2.y; o[6] += wt * a2.z; o[7] += wt * a2.w;
          }
        }
        store_row8(p, c, o, sum, mt, static_cast<int64_t>(qlo_s[b]) * p.H + r);
      }
      __syncthreads();  // part_s is read before the next unit overwrites it
      continue;
    }
    if (!mine) continue;
    if (C > 1) {
      // the chunk's result as split ch * K's partial, once every thread of the group has read
      // that split's LSE
      group_sync();
      const int64_t lead = slot0 + static_cast<int64_t>(ch) * K * rb;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      uint32_t packed[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) packed[k] = pack_bf16(o[2 * k] * inv, o[2 * k + 1] * inv);
      *reinterpret_cast<uint4*>(p.o_part + lead * DV + c) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      if (c == 0) p.lse_part[lead] = sum > 0.f ? mx + logf(sum) : -CUDART_INF_F;
      __threadfence();  // the result reaches L2 before the counter moves
      group_sync();
      if (c == 0) last_s[grp] = atomicAdd(p.plan_cnt + slot0, 1) == C - 1;
      group_sync();
      if (!last_s[grp]) continue;  // group-uniform
      __threadfence();
      // the chunks' results (split u K of the row: stride K rb), from L2: one round trip for
      // C <= K; past that (S > K^2: a rare very long row) one a round trip, in few registers
      const int64_t cstride = static_cast<int64_t>(K) * rb;
      if (C <= K) {
        merge_chunk8<K, true>(p, slot0, cstride, c, 0, C, o, mx, sum);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = 0.f;
        mx = -CUDART_INF_F;
        sum = 0.f;
#pragma unroll 1
        for (int q = 0; q < C; ++q) merge_splits8<1, true>(p, slot0, cstride, c, q, 1, C, o, mx, sum);
      }
    }
    store_row8(p, c, o, sum, mx, static_cast<int64_t>(qlo_s[b]) * p.H + r);
  }
}

// 17 to 8 x COMBINE_ONE_PASS64 splits (bs1 on 132 SMs: 33 or 66): one row per CTA of G groups
// of 64 threads (8 columns each, 16-byte loads), group q taking splits q, q + G, ... (at most
// PASS each), every load at once; the groups meet in shared memory as in combine_wide_kernel's
// one pass. Against that pass (128 threads per group, 8-byte loads, 1024 threads) it is 1 us
// faster at bs1 N16 H8 1k and 4k and 1-2 us at 23k-91k, on the H200.
constexpr int COMBINE_ONE_PASS64 = 10;
template <int G, int PASS, bool PLANNED>
__global__ void __launch_bounds__(64 * G) combine_onepass_kernel(const Params p) {
  __shared__ float4 part[G - 1][64][2];
  __shared__ float gms[2 * G];
  const int64_t grow = blockIdx.x;
  int tok, head, b, S;
  int64_t slot0, stride;
  const bool owned = combine_row<PLANNED>(p, grow, tok, head, b, S, slot0, stride);  // inputs only: before the wait
  pdl_wait_primary();
  if (!owned || !planned_row<PLANNED>(p, b, S, slot0, stride)) return;  // uniform over the CTA
  const int tid = threadIdx.x, grp = tid / 64, t = tid % 64, c = t * 8;
  float o[8], gm, gsum;  // the group's splits grp, grp + G, ... merged against their maximum gm
  merge_row8<PASS, PLANNED>(p, slot0, stride, c, grp, G, S, o, gm, gsum);
  if (grp > 0) {
    part[grp - 1][t][0] = make_float4(o[0], o[1], o[2], o[3]);
    part[grp - 1][t][1] = make_float4(o[4], o[5], o[6], o[7]);
    if (t == 0) { gms[2 * grp] = gm; gms[2 * grp + 1] = gsum; }
  }
  __syncthreads();
  if (grp > 0) return;
  float mx = gm;
#pragma unroll
  for (int q = 1; q < G; ++q) mx = fmaxf(mx, gms[2 * q]);
  float sum = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (mx != -CUDART_INF_F) {
    const float w0 = split_weight(gm, mx);  // a group without a visible split weighs 0
    sum = w0 * gsum;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = w0 * o[k];
#pragma unroll
    for (int q = 1; q < G; ++q) {
      const float wq = split_weight(gms[2 * q], mx);
      const float4 a = part[q - 1][t][0], b = part[q - 1][t][1];
      sum += wq * gms[2 * q + 1];
      acc[0] += wq * a.x; acc[1] += wq * a.y; acc[2] += wq * a.z; acc[3] += wq * a.w;
      acc[4] += wq * b.x; acc[5] += wq * b.y; acc[6] += wq * b.z; acc[7] += wq * b.w;
    }
  }
  store_row8(p, c, acc, sum, mx, grow);
}

template <int G>
constexpr int COMBINE_WIDE_THREADS = 128 * G;  // G groups of 128 threads

template <int G, bool PLANNED>
__global__ void __launch_bounds__(COMBINE_WIDE_THREADS<G>) combine_wide_kernel(const Params p) {
  constexpr int NT = COMBINE_WIDE_THREADS<G>;
  __shared__ float w_s[MAX_SPLITS];  // a row's LSEs, then its weights
  __shared__ float red[NT / 32];
  __shared__ float4 part[G - 1][128];
  static_assert(2 * G <= MAX_SPLITS, "the one-pass path keeps each group's maximum and sum in w_s");
  const int64_t grow = blockIdx.x;  // global row = token * H + head
  int tok, head, b, S;  // S: the splits of this row's request b
  int64_t slot0, stride;
  const bool owned = combine_row<PLANNED>(p, grow, tok, head, b, S, slot0, stride);  // inputs only: before the wait
  pdl_wait_primary();
  if (!owned || !planned_row<PLANNED>(p, b, S, slot0, stride)) return;  // uniform over the CTA
  if (!PLANNED) {  // (the 3-D grid's layout, spelled here: ptxas spilled it as combine_row's outputs on sm_120)
    slot0 = grow;
    stride = static_cast<int64_t>(p.T) * p.H;
  }

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = tid / 128, c = (tid % 128) * 4;
  // the groups' sums of their splits meet in shared memory; group 0 writes the row
  auto finish = [&](float4 o, float sum, float mx) {
    if (grp > 0) part[grp - 1][tid % 128] = o;
    __syncthreads();
    if (grp > 0) return;
#pragma unroll
    for (int q = 0; q < G - 1; ++q) {
      const float4 v = part[q][tid];
      o.x += v.x; o.y += v.y; o.z += v.z; o.w += v.w;
    }
    combine_store(p, tok, head, c, o, sum, mx, grow, tid == 0);
  };
  if (S <= G * COMBINE_ONE_PASS) {  // uniform over the CTA (one row)
    const part_t* base = p.o_part + slot0 * DV + c;
    float4 v[COMBINE_ONE_PASS];
    float lm[COMBINE_ONE_PASS];  // splits grp, grp + G, ...: the same words for the whole group
#pragma unroll
    for (int u = 0; u < COMBINE_ONE_PASS; ++u) {
      const int s = grp + u * G;
      v[u] = s < S ? load_part4(base + s * stride * DV) : make_float4(0.f, 0.f, 0.f, 0.f);
      lm[u] = s < S ? p.lse_part[slot0 + s * stride] : -CUDART_INF_F;
    }
    float gm = -CUDART_INF_F;  // the group's maximum
#pragma unroll
    for (int u = 0; u < COMBINE_ONE_PASS; ++u) gm = fmaxf(gm, lm[u]);
    float gsum = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (gm != -CUDART_INF_F) {
#pragma unroll
      for (int u = 0; u < COMBINE_ONE_PASS; ++u) {
        const float wt = split_weight(lm[u], gm);
        gsum += wt;
        o.x += wt * v[u].x; o.y += wt * v[u].y; o.z += wt * v[u].z; o.w += wt * v[u].w;
      }
    }
    if (grp > 0) {
      part[grp - 1][tid % 128] = o;
      if (tid % 128 == 0) { w_s[2 * grp] = gm; w_s[2 * grp + 1] = gsum; }
    }
    __syncthreads();
    if (grp > 0) return;
    float mx = gm;  // the row's maximum: over the groups'
#pragma unroll
    for (int q = 1; q < G; ++q) mx = fmaxf(mx, w_s[2 * q]);
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (mx != -CUDART_INF_F) {
      const float w0 = split_weight(gm, mx);  // a group without a visible split weighs 0
      sum = w0 * gsum;
      acc = make_float4(w0 * o.x, w0 * o.y, w0 * o.z, w0 * o.w);
#pragma unroll
      for (int q = 1; q < G; ++q) {
        const float wq = split_weight(w_s[2 * q], mx);
        const float4 vq = part[q - 1][tid];
        sum += wq * w_s[2 * q + 1];
        acc.x += wq * vq.x; acc.y += wq * vq.y; acc.z += wq * vq.z; acc.w += wq * vq.w;
      }
    }
    combine_store(p, tok, head, c, acc, sum, mx, grow, tid == 0);
    return;
  }
  float mx = -CUDART_INF_F;  // max of the LSEs
  for (int s = tid; s < S; s += NT) {
    const float ls = p.lse_part[slot0 + s * stride];
    w_s[s] = ls;
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
  float sum = 0.f;
  if (mx != -CUDART_INF_F) {
    for (int s = tid; s < S; s += NT) {
      const float wt = split_weight(w_s[s], mx);
      w_s[s] = wt;
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

  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  if (sum > 0.f) {
    const part_t* base = p.o_part + slot0 * DV + c;
    for (int s0 = grp; s0 < S; s0 += G * COMBINE_UNROLL) {
      float4 v[COMBINE_UNROLL];
#pragma unroll
      for (int u = 0; u < COMBINE_UNROLL; ++u) {
        const int s = s0 + u * G;
        v[u] = s < S ? load_part4(base + s * stride * DV) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < COMBINE_UNROLL; ++u) {
        const int s = s0 + u * G;
        if (s >= S) break;
        const float wt = w_s[s];
        o.x += wt * v[u].x; o.y += wt * v[u].y; o.z += wt * v[u].z; o.w += wt * v[u].w;
      }
    }
  }
  finish(o, sum, mx);
}

}  // namespace kdtree
