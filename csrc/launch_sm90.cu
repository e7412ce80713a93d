// kdtree-engine: host launch of the sm_90a wgmma kernel, with the pool's TMA tensor
// map for the contiguous fast path.
#include <cudaTypedefs.h>
#include <stdlib.h>
#include <string.h>

#include "launch.h"
#include "sm90_kernel.cuh"

namespace kdtree {
namespace host {

namespace {
// The pool as a TMA tensor map ([pool_size, 576] bf16, boxes of 32 rows x 64 columns,
// 128B swizzle: one producer warp's rows of one chunk in the layout the sm90 kernel's
// key buffers use). False when the fast path is off (KDTREE_TMA=0, read on every call
// so that a test can compare both paths in one process), the driver has no encoder, or
// the pool does not fit a TMA coordinate; the kernel then gathers every block. The
// last map is kept per thread: a serving loop passes the same pool on every call.
bool pool_tensor_map(const Params& p, CUtensorMap* map) {
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

}  // namespace

int launch_sm90(const Params& p, const KdtreeConfig& cfg, cudaStream_t stream) {
  namespace s9 = kdtree::sm90;
  static int allowed[2][64];
  if (cfg.threads != s9::THREADS || cfg.smem_bytes != s9::SMEM)
    return fail(KDTREE_EINVAL, "configuration %s (%d threads, %d B) is not the sm90 kernel's", cfg.name, cfg.threads,
                cfg.smem_bytes);
  CUtensorMap map;
  memset(&map, 0, sizeof map);
  const int use_tma = pool_tensor_map(p, &map) ? 1 : 0;
  if (p.planned)
    return launch_main(s9::verify_attn_kernel_sm90<true>, allowed[1], "sm90", s9::BM, p, cfg, stream, p, map, use_tma);
  return launch_main(s9::verify_attn_kernel_sm90<false>, allowed[0], "sm90", s9::BM, p, cfg, stream, p, map, use_tma);
}

}  // namespace host
}  // namespace kdtree
