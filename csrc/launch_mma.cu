// kdtree-engine: host launch of the portable mma.sync kernel in the configured tile.
#include "launch.h"
#include "mma_kernel.cuh"

namespace kdtree {
namespace host {

namespace {
template <typename K>
int launch_tile(K kernel, int* allowed, const char* what, int block_rows, const Params& p, const KdtreeConfig& cfg,
                cudaStream_t stream) {
  int rc = allow_smem(kernel, cfg.smem_request, allowed, what);
  if (rc != KDTREE_OK) return rc;
  const int row_tiles = (p.max_n * p.H + block_rows - 1) / block_rows;
  const dim3 grid(row_tiles, p.num_splits, p.bs);
  // A plain launch: the inputs were written by the kernels before it on the stream,
  // whose memory a programmatic dependent could see only after griddepcontrol.wait.
  kernel<<<grid, cfg.threads, cfg.smem_request, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction)
    return fail(KDTREE_ENOARCH, "no kernel image for this device (library built for %s)", KDTREE_ARCHS);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "verify kernel (%s) launch: %s", what, cudaGetErrorString(e));
  return launch_combine(p, stream);
}
int allowed_qreg[64];
}  // namespace

int launch_mma(const Params& p, const KdtreeConfig& cfg, cudaStream_t stream) {
  if (cfg.tile != KDTREE_TILE_MMA_64X32_QREG || cfg.threads != qreg::THREADS || cfg.smem_bytes != qreg::SMEM)
    return fail(KDTREE_EINVAL, "configuration %s (tile %d, %d threads, %d B) matches no portable kernel", cfg.name,
                cfg.tile, cfg.threads, cfg.smem_bytes);
  return launch_tile(verify_attn_kernel_mma_qreg, allowed_qreg, "mma.sync-64x32-qreg", qreg::BM, p, cfg, stream);
}

}  // namespace host
}  // namespace kdtree
