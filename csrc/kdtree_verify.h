// kdtree-engine: C ABI of the tree-verify MLA attention kernel.
//
// One request b of a batch attends, for each of its N draft tokens and H query
// heads, over its cached prefix (slot ids kv_indices[kv_indptr[b]:kv_indptr[b+1]]
// into a paged bf16 pool of 576-wide latents) followed by its own N drafts
// (k_ext rows qo_indptr[b]..qo_indptr[b+1]) under a tree mask in SGLang's
// FULL_MASK layout. V is the first 512 values of each latent.
//
// Everything launches on the caller's stream: no host sync, no allocation, no
// host read of device values, so a call can be captured in a CUDA graph.
// Values that can only be checked on the device (slot ids, indptr contents,
// mask extents) are checked there: an offending read is skipped (never out of
// bounds) and a bit is set in *err (see KDTREE_ERR_*), which the caller may read
// after synchronising (the Python binding does so in debug mode).
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KDTREE_ABI_VERSION 3  // 3: the step plan (KdtreeVerifyArgs::plan)

#define KDTREE_HEAD_DIM 576
#define KDTREE_V_DIM 512
#define KDTREE_MAX_HEADS 128
#define KDTREE_MAX_DRAFTS 128

// Return codes.
#define KDTREE_OK 0
#define KDTREE_EINVAL 1    // a host-checkable argument is wrong (see kdtree_last_error)
#define KDTREE_ECUDA 2     // a CUDA runtime call failed
#define KDTREE_ENOARCH 3   // the library holds no kernel for this device

// Device-side error bits written to *err.
#define KDTREE_ERR_SLOT 1        // a slot id outside [0, pool_size)
#define KDTREE_ERR_KV_INDPTR 2   // kv_indptr not monotone or beyond kv_indices_len
#define KDTREE_ERR_QO_INDPTR 4   // qo_indptr not monotone, beyond total_tokens, or N > max_n
#define KDTREE_ERR_MASK 8        // a mask row would read beyond mask_len
#define KDTREE_ERR_PLAN 16       // the step plan was made for another shape or other lengths (see plan_mode)

// Which kernel runs (the kernel) and which shape of it (the tile) are two facts.
#define KDTREE_KERNEL_SM90 1     // wgmma, FlashMLA's seesaw schedule (sm_90a only)
#define KDTREE_KERNEL_MMA 2      // portable mma.sync + cp.async (sm_80 and newer, sm_120)
#define KDTREE_TILE_SM90_64X64 1       // 64 rows, 64-key blocks, 3 warpgroups, ~218 KB
#define KDTREE_TILE_MMA_64X32_QREG 2   // 64 rows, 32-key tiles, 8 math + 4 producer warps, Q in registers, 98 KB

// Targets: what the configuration is chosen for.
#define KDTREE_TARGET_NATIVE 0   // the device itself
#define KDTREE_TARGET_SM120 120  // sm_120's limits on a CC >= 9.0 device (ignored on a real sm_120)

// plan_mode of KdtreeVerifyArgs: the step plan. Under the batch schedule (bs > 1 with splits)
// every main-kernel CTA finds its (request, row tile, split) from the step's lengths. The
// plan is that schedule computed once per verify step by a small kernel and kept in a
// caller-owned buffer that the step's other calls (the model's other layers, same batch,
// same lengths) read with one load a CTA, as FlashMLA's calls read get_mla_metadata's output.
// A call of another shape than the plan's derives its schedule itself and sets
// KDTREE_ERR_PLAN; a CTA whose request's lengths differ from the plan's skips its work and
// sets it too (its rows are then not written). Calls outside the batch schedule (bs 1, or a
// batch that fills the GPU) neither make nor read a plan.
#define KDTREE_PLAN_NONE 0   // derive the schedule in the call (plan unused)
#define KDTREE_PLAN_MAKE 1   // compute the plan from this call's lengths into plan, then run from it
#define KDTREE_PLAN_USE 2    // run from the plan a KDTREE_PLAN_MAKE call of this step made

// Flags of kdtree_choose_config.
#define KDTREE_CFG_HAS_SM90A 1   // the library holds sm_90a code
#define KDTREE_CFG_FORCE_MMA 2   // take the portable kernel even where the sm90 one could run

// What the choice of kernel and tile reads of a device (cudaDeviceProp's fields).
typedef struct KdtreeDeviceProps {
  int32_t cc_major, cc_minor;
  int32_t sm_count;
  int32_t max_threads_per_sm;
  int64_t smem_per_block_optin;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
  int64_t smem_per_sm;           // cudaDevAttrMaxSharedMemoryPerMultiprocessor
} KdtreeDeviceProps;

typedef struct KdtreeConfig {
  int32_t kernel;        // KDTREE_KERNEL_*
  int32_t tile;          // KDTREE_TILE_*
  int32_t block_rows;    // query rows per CTA
  int32_t threads;       // per CTA
  int32_t smem_bytes;    // dynamic shared memory the tile uses
  int32_t smem_request;  // what the launch asks for (> smem_bytes only to cap CTAs per SM when emulating)
  int32_t ctas_per_sm;   // CTAs per SM on the target
  int32_t emulated;      // 1: sm_120's limits applied on another device
  int32_t target_cc;     // compute capability the choice was made for (major * 10 + minor)
  char name[48];         // e.g. "mma.sync-64x32-qreg"
  char note[200];        // why the choice failed ("" on success)
} KdtreeConfig;

typedef struct KdtreeVerifyArgs {
  int32_t abi_version;  // KDTREE_ABI_VERSION

  // Queries [T, H, 576] bf16; last dim contiguous; strides in elements.
  const void* q;
  int64_t q_stride_tok, q_stride_head;
  // Draft latents [T, 576] bf16 (k_ext[t, 0, :]); V = first 512. When draft_slots is
  // not NULL the drafts are read from the pool at those slots instead (SGLang's
  // out_cache_loc: it writes the drafts' latents there before attention) and k_ext
  // may be NULL.
  const void* k_ext;
  int64_t k_ext_stride_tok;
  const void* draft_slots;    // [T] int64 (draft_slots_is_64) or int32, or NULL
  int32_t draft_slots_is_64;
  // KV pool [pool_size, 576] bf16 (kv_buffer[slot, 0, :]).
  const void* kv;
  int64_t kv_stride_slot;
  int64_t pool_size;

  const void* qo_indptr;      // [bs + 1], int64 (qo_indptr_is_64) or int32
  const void* kv_indptr;      // [bs + 1], int64 (kv_indptr_is_64) or int32
  int32_t qo_indptr_is_64, kv_indptr_is_64;
  const void* kv_indices;     // int64 (kv_indices_is_64) or int32
  int32_t kv_indices_is_64;
  int64_t kv_indices_len;
  const uint8_t* mask;        // FULL_MASK, bool/uint8, non-zero = visible
  const int64_t* mask_indptr; // [bs + 1]
  int64_t mask_len;

  void* o;                    // [T, H, 512] bf16, last dim contiguous
  int64_t o_stride_tok, o_stride_head;
  float* lse;                 // [T, H] fp32 contiguous, natural log; may be NULL

  void* workspace;            // kdtree_workspace_bytes(T * H, num_splits) bytes
  int64_t workspace_bytes;

  // num_splits: the grid's split count (and the workspace's); each request takes at most
  // ceil((prefix + N) / 128) of them, chosen on the device from its lengths
  int32_t bs, num_heads, max_n, total_tokens, num_splits;
  float sm_scale;             // softmax scale, must be > 0
  int32_t target;             // KDTREE_TARGET_*

  // The step plan (ABI 3; KDTREE_PLAN_*): kdtree_plan_bytes() bytes, 16-byte aligned, on the
  // call's device; NULL (and plan_mode KDTREE_PLAN_NONE) for none.
  int32_t plan_mode;
  void* plan;
  int64_t plan_bytes;
} KdtreeVerifyArgs;

int kdtree_abi_version(void);
// Text of the last error on this thread ("" if none).
const char* kdtree_last_error(void);
// Archs compiled into this library, e.g. "sm_90,sm_120".
const char* kdtree_build_info(void);
// The kernel and tile for a device: a pure function (no CUDA call) of its properties,
// the target, `flags` (KDTREE_CFG_*) and `tile` (0: choose; else a KDTREE_TILE_* of the
// portable kernel to force). KDTREE_OK, or KDTREE_EINVAL / KDTREE_ENOARCH with the
// reason in out->note.
int kdtree_choose_config(const KdtreeDeviceProps* props, int32_t target, int32_t flags, int32_t tile,
                         KdtreeConfig* out);
// The configuration a call with `target` gets on `device` (reads the device's
// properties and KDTREE_KERNEL); KDTREE_OK or an error code.
int kdtree_device_config(int device, int32_t target, KdtreeConfig* out);
// Workspace the call needs; the first 256 bytes are its header (the device error
// word and the fast-path count) and must be zero when the workspace is first used.
int64_t kdtree_workspace_bytes(int64_t total_rows, int32_t num_splits);
// Bytes of a step plan (KdtreeVerifyArgs::plan); the same for every shape.
int64_t kdtree_plan_bytes(void);
// Launch on `stream` (a cudaStream_t). Returns KDTREE_OK or an error code.
int kdtree_verify_attn(const KdtreeVerifyArgs* args, void* stream);
// Device error bits set by the calls on `workspace` since the last read; clears them
// (synchronises on `stream`).
int kdtree_read_device_error(const void* workspace, void* stream, int32_t* bits);
// Blocks of 32 key rows that the calls on `workspace` since the last read loaded
// through the contiguous fast path (one TMA box per 64 columns instead of a per-row
// gather; sm_90a only; KDTREE_TMA=0 turns it off); clears the count (synchronises).
int kdtree_read_fast_path_boxes(const void* workspace, void* stream, int32_t* boxes);

#ifdef __cplusplus
}
#endif
