// kdtree-engine: the tiles' shapes and shared-memory sizes, in plain C++ so that the
// configuration choice (config.cc) and the CPU tests that compile it alone see the
// same numbers as the kernels (each kernel static_asserts its layout against these).
#pragma once

#include "kdtree_verify.h"

namespace kdtree {
namespace tiles {

constexpr int D = KDTREE_HEAD_DIM;  // 576
constexpr int ROW_BYTES = D * 2;    // 1152 bytes per latent
constexpr int MMA_BN = 32;         // keys per tile of the mma.sync tile
// Q in registers: 8 math warps and a producer warpgroup (the key loads);
// two key stages + a partial-S slab per math warp (16 rows x 32 keys fp32) + a full and an
// empty mbarrier per stage (128 bytes, for alignment) + Q's rope dims (64 rows x 128 bytes) +
// two running row sums per math thread.
constexpr int MMA_QREG_WARPS = 8;
constexpr int MMA_QREG_PRODUCER_WARPS = 4;
constexpr int mma_qreg_bytes() { return 2 * MMA_BN * ROW_BYTES + MMA_QREG_WARPS * 16 * MMA_BN * 4 + 128 + 64 * 128 + 32 * MMA_QREG_WARPS * 8; }

// sm90: Q + two 64-key buffers (9 swizzled 64 x 64 chunks each), published maxima and
// row sums, 14 mbarriers, the CTA's first partial row and job, and 1 KB to align the base to 1024.
constexpr int SM90_BN = 64;  // keys per block, taken in pairs
constexpr int SM90_TILE = 9 * 64 * 128;
constexpr int sm90_bytes() { return 3 * SM90_TILE + 2 * 2 * 64 * 4 + 14 * 8 + 8 + 32 + 1024; }

struct Tile {
  int id, kernel, block_rows, threads, smem;
  const char* name;
};
constexpr Tile TILES[] = {
    {KDTREE_TILE_SM90_64X64, KDTREE_KERNEL_SM90, 64, 384, sm90_bytes(), "wgmma-sm90a-seesaw-64x64"},
    {KDTREE_TILE_MMA_64X32_QREG, KDTREE_KERNEL_MMA, 64, 32 * (MMA_QREG_WARPS + MMA_QREG_PRODUCER_WARPS), mma_qreg_bytes(),
     "mma.sync-64x32-qreg"},
};

// sm_120's per-SM limits (RTX PRO 6000 Blackwell, RTX 5090), as CCCL's sm_120 arch_traits gives them.
constexpr int SM120_SMEM_PER_SM = 100 * 1024;
constexpr int SM120_SMEM_PER_BLOCK = 99 * 1024;
constexpr int SM120_THREADS_PER_SM = 1536;
constexpr int RESERVED_SMEM_PER_BLOCK = 1024;  // the driver's share of each block (sm_80 and newer)
constexpr int MAX_BLOCKS_PER_SM = 32;

}  // namespace tiles
}  // namespace kdtree
