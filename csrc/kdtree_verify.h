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

#define KDTREE_ABI_VERSION 1

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

typedef struct KdtreeVerifyArgs {
  int32_t abi_version;  // KDTREE_ABI_VERSION

  // Queries [T, H, 576] bf16; last dim contiguous; strides in elements.
  const void* q;
  int64_t q_stride_tok, q_stride_head;
  // Draft latents [T, 576] bf16 (k_ext[t, 0, :]); V = first 512.
  const void* k_ext;
  int64_t k_ext_stride_tok;
  // KV pool [pool_size, 576] bf16 (kv_buffer[slot, 0, :]).
  const void* kv;
  int64_t kv_stride_slot;
  int64_t pool_size;

  const int32_t* qo_indptr;   // [bs + 1]
  const int32_t* kv_indptr;   // [bs + 1]
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

  int32_t bs, num_heads, max_n, total_tokens, num_splits;
  float sm_scale;             // softmax scale, must be > 0
} KdtreeVerifyArgs;

int kdtree_abi_version(void);
// Text of the last error on this thread ("" if none).
const char* kdtree_last_error(void);
// Archs compiled into this library, e.g. "sm_90,sm_120".
const char* kdtree_build_info(void);
// The kernel variant that runs on `device` ("wgmma-sm90a-64x64", "mma.sync-64x32", ...).
const char* kdtree_kernel_name(int device);
// Query rows one CTA handles on `device` (the split heuristic needs it); <0 on error.
int kdtree_block_rows(int device);
// Workspace the call needs; the first 256 bytes hold the device error word and
// the fast-path count (kdtree_read_fast_path_boxes).
int64_t kdtree_workspace_bytes(int64_t total_rows, int32_t num_splits);
// Launch on `stream` (a cudaStream_t). Returns KDTREE_OK or an error code.
int kdtree_verify_attn(const KdtreeVerifyArgs* args, void* stream);
// Device error bits of the last call that used `workspace` (synchronises on `stream`).
int kdtree_read_device_error(const void* workspace, void* stream, int32_t* bits);
// Blocks of 32 key rows the last call that used `workspace` loaded through the
// contiguous fast path (one TMA box per 64 columns instead of a per-row gather;
// sm_90a only; KDTREE_TMA=0 turns it off). Synchronises on `stream`.
int kdtree_read_fast_path_boxes(const void* workspace, void* stream, int32_t* boxes);

#ifdef __cplusplus
}
#endif
