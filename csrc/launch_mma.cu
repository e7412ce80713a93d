// kdtree-engine: host launch of the portable mma.sync kernel in the configured tile.
#include "launch.h"
#include "mma_kernel.cuh"

namespace kdtree {
namespace host {

namespace {
int allowed_qreg[2][64];
}  // namespace

int launch_mma(const Params& p, const KdtreeConfig& cfg, cudaStream_t stream) {
  if (cfg.tile != KDTREE_TILE_MMA_64X32_QREG || cfg.threads != qreg::THREADS || cfg.smem_bytes != qreg::SMEM)
    return fail(KDTREE_EINVAL, "configuration %s (tile %d, %d threads, %d B) matches no portable kernel", cfg.name,
                cfg.tile, cfg.threads, cfg.smem_bytes);
  if (p.planned)
    return launch_main(verify_attn_kernel_mma_qreg<true>, allowed_qreg[1], "mma.sync-64x32-qreg", qreg::BM, p, cfg,
                       stream, p);
  return launch_main(verify_attn_kernel_mma_qreg<false>, allowed_qreg[0], "mma.sync-64x32-qreg", qreg::BM, p, cfg,
                     stream, p);
}

}  // namespace host
}  // namespace kdtree
