// kdtree-engine: the C ABI (kdtree_verify.h). Checks every argument the host can
// check, chooses the kernel and tile for the device and target (config.cc), fills
// the kernel parameters and hands them to the launcher of that kernel.
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "launch.h"
#include "tiles.h"

namespace kdtree {
namespace host {

namespace {
thread_local char g_err[512] = "";
}

int fail(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_err, sizeof g_err, fmt, ap);
  va_end(ap);
  return code;
}

namespace {

// The properties config.cc reads, once per device (they do not change while the process runs).
int device_props(int device, KdtreeDeviceProps* out) {
  static KdtreeDeviceProps cache[64];
  static bool have[64];
  if (device < 0 || device >= 64) return fail(KDTREE_EINVAL, "device %d out of range [0, 64)", device);
  if (!have[device]) {
    KdtreeDeviceProps d{};
    int v[6] = {0, 0, 0, 0, 0, 0};
    const cudaDeviceAttr attrs[6] = {cudaDevAttrComputeCapabilityMajor, cudaDevAttrComputeCapabilityMinor,
                                     cudaDevAttrMultiProcessorCount, cudaDevAttrMaxThreadsPerMultiProcessor,
                                     cudaDevAttrMaxSharedMemoryPerBlockOptin, cudaDevAttrMaxSharedMemoryPerMultiprocessor};
    for (int i = 0; i < 6; ++i) {
      cudaError_t e = cudaDeviceGetAttribute(&v[i], attrs[i], device);
      if (e != cudaSuccess) return fail(KDTREE_ECUDA, "cudaDeviceGetAttribute(%d): %s", device, cudaGetErrorString(e));
    }
    d.cc_major = v[0];
    d.cc_minor = v[1];
    d.sm_count = v[2];
    d.max_threads_per_sm = v[3];
    d.smem_per_block_optin = v[4];
    d.smem_per_sm = v[5];
    cache[device] = d;
    have[device] = true;
  }
  *out = cache[device];
  return KDTREE_OK;
}

// KDTREE_KERNEL=mma forces the portable kernel (for A/B measurements; read once per process).
int env_flags() {
  static const int flags = [] {
    int f = strstr(KDTREE_ARCHS, "sm_90a") ? KDTREE_CFG_HAS_SM90A : 0;
    const char* v = getenv("KDTREE_KERNEL");
    if (v && strcmp(v, "mma") == 0) f |= KDTREE_CFG_FORCE_MMA;
    return f;
  }();
  return flags;
}

}  // namespace
}  // namespace host
}  // namespace kdtree

using kdtree::host::fail;

extern "C" {

int kdtree_abi_version(void) { return KDTREE_ABI_VERSION; }
const char* kdtree_last_error(void) { return kdtree::host::g_err; }
const char* kdtree_build_info(void) { return KDTREE_ARCHS; }

int kdtree_device_config(int device, int32_t target, KdtreeConfig* out) {
  if (!out) return fail(KDTREE_EINVAL, "out is NULL");
  // Chosen once per device and target: the properties and KDTREE_KERNEL do not change while
  // the process runs, and this sits on every call's path.
  static KdtreeConfig cache[64][2];
  static bool have[64][2];
  const int t = target == KDTREE_TARGET_NATIVE ? 0 : target == KDTREE_TARGET_SM120 ? 1 : -1;
  const bool cacheable = device >= 0 && device < 64 && t >= 0;  // a bad target is refused below
  if (cacheable && have[device][t]) {
    *out = cache[device][t];
    return KDTREE_OK;
  }
  KdtreeDeviceProps d;
  int rc = kdtree::host::device_props(device, &d);
  if (rc != KDTREE_OK) return rc;
  rc = kdtree_choose_config(&d, target, kdtree::host::env_flags(), 0, out);
  if (rc != KDTREE_OK) return fail(rc, "%s", out->note);
  if (cacheable) {
    cache[device][t] = *out;
    have[device][t] = true;
  }
  return KDTREE_OK;
}

namespace {
// Bytes of the workspace's fp32 LSEs, and of its int32 arrival counters after them (one per
// partial row each), rounded up to 256.
int64_t lse_region_bytes(int64_t partial_rows) { return ((partial_rows * 4 + 255) / 256) * 256; }
}  // namespace

int64_t kdtree_workspace_bytes(int64_t total_rows, int32_t num_splits) {
  if (total_rows < 0 || num_splits < 1) return -1;
  if (num_splits == 1) return kdtree::WS_HEADER;
  const int64_t prow = total_rows * num_splits * kdtree::WS_PART_FACTOR;  // partial rows
  const int64_t o = prow * kdtree::DV * static_cast<int64_t>(sizeof(kdtree::part_t));
  return kdtree::WS_PARTS + o + 2 * lse_region_bytes(prow);  // the LSEs, then Params::plan_cnt
}

int64_t kdtree_plan_bytes(void) { return kdtree::PLAN_BYTES; }

int kdtree_verify_attn(const KdtreeVerifyArgs* a, void* stream_) {
  kdtree::host::g_err[0] = '\0';
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
  if (!a->q || !a->kv || !a->qo_indptr || !a->kv_indptr || !a->mask_indptr || !a->o || !a->workspace)
    return fail(KDTREE_EINVAL, "a required pointer (q, kv, qo_indptr, kv_indptr, mask_indptr, o, workspace) is NULL");
  if (!a->k_ext && !a->draft_slots)
    return fail(KDTREE_EINVAL, "k_ext and draft_slots are both NULL: the drafts' latents come from one of them");
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
  if (a->plan_mode != KDTREE_PLAN_NONE && a->plan_mode != KDTREE_PLAN_MAKE && a->plan_mode != KDTREE_PLAN_USE)
    return fail(KDTREE_EINVAL, "plan_mode must be KDTREE_PLAN_NONE, _MAKE or _USE (0, 1, 2), got %d", a->plan_mode);
  if (a->plan_mode != KDTREE_PLAN_NONE) {
    if (!a->plan || !aligned16(a->plan))
      return fail(KDTREE_EINVAL, "plan_mode %d needs a 16-byte aligned plan buffer, got %p", a->plan_mode, a->plan);
    if (a->plan_bytes < kdtree::PLAN_BYTES)
      return fail(KDTREE_EINVAL, "plan has %lld bytes, needs kdtree_plan_bytes() = %d", (long long)a->plan_bytes,
                  kdtree::PLAN_BYTES);
  }
  if (!aligned16(a->q) || (a->k_ext && !aligned16(a->k_ext)) || !aligned16(a->kv) || !aligned16(a->o) ||
      !aligned16(a->workspace))
    return fail(KDTREE_EINVAL, "q, k_ext, kv, o and workspace must be 16-byte aligned");
  if (a->q_stride_tok % 8 || a->q_stride_head % 8 || a->k_ext_stride_tok % 8 || a->kv_stride_slot % 8 ||
      a->o_stride_tok % 8 || a->o_stride_head % 8)
    return fail(KDTREE_EINVAL, "strides must be multiples of 8 elements (16 bytes)");

  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "cudaGetDevice: %s", cudaGetErrorString(e));
  KdtreeConfig cfg;
  int rc = kdtree_device_config(dev, a->target, &cfg);  // a bad target is refused even for an empty batch
  if (rc != KDTREE_OK) return rc;
  if (a->bs == 0 || a->total_tokens == 0 || a->max_n == 0) return KDTREE_OK;

  kdtree::Params p{};
  p.q = static_cast<const __nv_bfloat16*>(a->q);
  p.q_st = a->q_stride_tok;
  p.q_sh = a->q_stride_head;
  p.k_ext = static_cast<const __nv_bfloat16*>(a->k_ext);
  p.k_ext_st = a->k_ext_stride_tok;
  p.draft_slots = a->draft_slots;
  p.draft_slots_64 = a->draft_slots_is_64;
  p.kv = static_cast<const __nv_bfloat16*>(a->kv);
  p.kv_st = a->kv_stride_slot;
  p.pool_size = a->pool_size;
  p.qo_indptr = a->qo_indptr;
  p.kv_indptr = a->kv_indptr;
  p.qo_indptr_64 = a->qo_indptr_is_64;
  p.kv_indptr_64 = a->kv_indptr_is_64;
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
  p.plan_meta = reinterpret_cast<int2*>(ws + kdtree::WS_HEADER);
  p.o_part = reinterpret_cast<kdtree::part_t*>(ws + kdtree::WS_PARTS);
  const int64_t prow = rows * a->num_splits * kdtree::WS_PART_FACTOR;  // kdtree_workspace_bytes' partial rows
  p.lse_part = reinterpret_cast<float*>(p.o_part + prow * kdtree::DV);  // after the partials (16-byte aligned)
  p.plan_cnt = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(p.lse_part) + lse_region_bytes(prow));
  p.bs = a->bs;
  p.H = a->num_heads;
  p.max_n = a->max_n;
  p.T = a->total_tokens;
  p.num_splits = a->num_splits;
  // the unit a request's splits are cut in (common.cuh split_plan): what one iteration of
  // the kernel takes, a 32-key tile or the sm90 kernel's pair of 64-key blocks
  p.split_keys = cfg.kernel == KDTREE_KERNEL_SM90 ? 2 * kdtree::tiles::SM90_BN : kdtree::tiles::MMA_BN;
  p.scale_log2 = a->sm_scale * kdtree::LOG2E;
  // The batch schedule (common.cuh batch_plan), in both kernels: one wave of CTAs shared by the
  // batch's requests by their work, where the batch leaves CTAs for splits and fits the plan's
  // registers, and has more than one request (one gets the same counts from split_plan, without
  // the plan's ~4 us at bs1 N16 H8 1k on the H200). The
  // budget is one CTA per SM (op.py choose_num_splits' wave) and at most what the workspace's
  // T * H * num_splits * WS_PART_FACTOR partial rows hold at block_rows rows a CTA. KDTREE_SCHED=grid takes the
  // (row tiles, num_splits, bs) grid of split_plan instead (read on every call, for A/B runs).
  // op.py split_budget restates this rule for the tests.
  {
    KdtreeDeviceProps d;
    rc = kdtree::host::device_props(dev, &d);
    if (rc != KDTREE_OK) return rc;
    const int64_t row_tiles = (static_cast<int64_t>(a->max_n) * a->num_heads + cfg.block_rows - 1) / cfg.block_rows;
    const int64_t tiles = row_tiles * a->bs;
    const int64_t slot_ctas = rows * a->num_splits * kdtree::WS_PART_FACTOR / cfg.block_rows;
    const int64_t budget = std::min<int64_t>(std::min<int64_t>(d.sm_count, slot_ctas), kdtree::MAX_SPLITS);
    const char* sched = getenv("KDTREE_SCHED");
    const bool grid_forced = sched && strcmp(sched, "grid") == 0;
    p.planned = !grid_forced && a->bs > 1 && a->num_splits > 1 && a->bs <= kdtree::PLAN_MAX_BS && budget > tiles;
    p.split_budget = p.planned ? static_cast<int>(budget) : 0;
  }
  // the step plan: only the batch schedule has one (a call outside it neither makes nor reads it)
  p.plan = p.planned && a->plan_mode != KDTREE_PLAN_NONE ? static_cast<unsigned char*>(a->plan) : nullptr;

  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  if (p.plan && a->plan_mode == KDTREE_PLAN_MAKE) {
    rc = kdtree::host::launch_plan(p, stream);
    if (rc != KDTREE_OK) return rc;
  }
  if (cfg.kernel == KDTREE_KERNEL_SM90) return kdtree::host::launch_sm90(p, cfg, stream);
  return kdtree::host::launch_mma(p, cfg, stream);
}

namespace {
// Read one 32-bit word of the workspace header and clear it (synchronises on `stream`).
int read_header_word(const void* workspace, void* stream_, int word, int32_t* value, const char* what) {
  if (!workspace || !value) return fail(KDTREE_EINVAL, "workspace and the output pointer must not be NULL");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  unsigned char* w = static_cast<unsigned char*>(const_cast<void*>(workspace)) + 4 * word;
  cudaError_t e = cudaMemcpyAsync(value, w, sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaMemsetAsync(w, 0, sizeof(int32_t), stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "reading the %s: %s", what, cudaGetErrorString(e));
  return KDTREE_OK;
}
}  // namespace

int kdtree_read_device_error(const void* workspace, void* stream, int32_t* bits) {
  return read_header_word(workspace, stream, 0, bits, "device error word");
}

int kdtree_read_fast_path_boxes(const void* workspace, void* stream, int32_t* boxes) {
  return read_header_word(workspace, stream, kdtree::WS_FAST_BOXES, boxes, "fast-path count");
}

}  // extern "C"
