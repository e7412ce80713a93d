// kdtree-engine: which kernel and which tile a device gets. A pure function of the
// device's properties, the target and two flags: no CUDA call, so the CPU tests
// compile this file alone and check it for sm_120, sm_90, sm_89 and sm_80.
//
// - sm_90 with sm_90a code in the library: the wgmma kernel (unless forced portable).
// - compute capability >= 8.0 otherwise: the portable mma.sync kernel, in the tile
//   with Q in registers (98 KB: fits sm_120's and sm_89's 99 KB per block).
// - KDTREE_TARGET_SM120 on a CC >= 9.0 device that is not sm_120: the choice an
//   sm_120 GPU gets (its compute capability, shared-memory limits and threads per SM,
//   this device's SM count), and a shared-memory request padded so that no more CTAs
//   fit per SM than fit on sm_120. A real sm_120 device ignores the target.
#include <stdio.h>
#include <string.h>

#include "tiles.h"

namespace {

using kdtree::tiles::Tile;

const Tile* find_tile(int id) {
  for (const Tile& t : kdtree::tiles::TILES)
    if (t.id == id) return &t;
  return nullptr;
}

int ctas_per_sm(const KdtreeDeviceProps& d, const Tile& t, int smem) {
  const int64_t per_block = smem + kdtree::tiles::RESERVED_SMEM_PER_BLOCK;
  int64_t n = d.smem_per_sm / per_block;
  if (d.max_threads_per_sm > 0 && d.max_threads_per_sm / t.threads < n) n = d.max_threads_per_sm / t.threads;
  if (n > kdtree::tiles::MAX_BLOCKS_PER_SM) n = kdtree::tiles::MAX_BLOCKS_PER_SM;
  return static_cast<int>(n);
}

int refuse(KdtreeConfig* out, int code, const char* msg) {
  snprintf(out->note, sizeof out->note, "%s", msg);
  return code;
}

}  // namespace

extern "C" int kdtree_choose_config(const KdtreeDeviceProps* props, int32_t target, int32_t flags, int32_t tile,
                                    KdtreeConfig* out) {
  if (!out) return KDTREE_EINVAL;
  memset(out, 0, sizeof *out);
  char msg[200];
  if (!props) return refuse(out, KDTREE_EINVAL, "props is NULL");
  const KdtreeDeviceProps dev = *props;
  if (dev.cc_major < 1 || dev.cc_minor < 0 || dev.sm_count < 1 || dev.smem_per_block_optin < 1 || dev.smem_per_sm < 1) {
    snprintf(msg, sizeof msg, "device properties out of range (cc %d.%d, %d SMs, %lld B per block, %lld B per SM)",
             dev.cc_major, dev.cc_minor, dev.sm_count, (long long)dev.smem_per_block_optin, (long long)dev.smem_per_sm);
    return refuse(out, KDTREE_EINVAL, msg);
  }
  if (target != KDTREE_TARGET_NATIVE && target != KDTREE_TARGET_SM120) {
    snprintf(msg, sizeof msg, "target must be %d (native) or %d (sm_120 emulation), got %d", KDTREE_TARGET_NATIVE,
             KDTREE_TARGET_SM120, target);
    return refuse(out, KDTREE_EINVAL, msg);
  }
  const int cc = dev.cc_major * 10 + dev.cc_minor;
  KdtreeDeviceProps eff = dev;
  if (target == KDTREE_TARGET_SM120 && dev.cc_major != 12) {
    if (cc < 90) {
      snprintf(msg, sizeof msg,
               "KDTREE_TARGET=sm_120 emulates sm_120 on a GPU of compute capability >= 9.0; this one is %d.%d",
               dev.cc_major, dev.cc_minor);
      return refuse(out, KDTREE_EINVAL, msg);
    }
    eff.cc_major = 12;
    eff.cc_minor = 0;
    eff.smem_per_block_optin = kdtree::tiles::SM120_SMEM_PER_BLOCK;
    eff.smem_per_sm = kdtree::tiles::SM120_SMEM_PER_SM;
    eff.max_threads_per_sm = kdtree::tiles::SM120_THREADS_PER_SM;
    out->emulated = 1;
    flags &= ~KDTREE_CFG_HAS_SM90A;  // sm_120 has no wgmma
  }
  const int ecc = eff.cc_major * 10 + eff.cc_minor;
  out->target_cc = ecc;
  const Tile* t = nullptr;
  if (tile != 0) {
    t = find_tile(tile);
    if (!t || t->kernel != KDTREE_KERNEL_MMA) {
      snprintf(msg, sizeof msg, "tile %d is not a tile of the portable kernel (KDTREE_TILE_MMA_*)", tile);
      return refuse(out, KDTREE_EINVAL, msg);
    }
  } else if (ecc == 90 && (flags & KDTREE_CFG_HAS_SM90A) && !(flags & KDTREE_CFG_FORCE_MMA) &&
             eff.smem_per_block_optin >= find_tile(KDTREE_TILE_SM90_64X64)->smem) {
    t = find_tile(KDTREE_TILE_SM90_64X64);
  } else {
    t = find_tile(KDTREE_TILE_MMA_64X32_QREG);
  }
  if (ecc < 80) {
    snprintf(msg, sizeof msg, "the kernels need compute capability >= 8.0 (bf16 mma.sync, cp.async); this is %d.%d",
             eff.cc_major, eff.cc_minor);
    return refuse(out, KDTREE_ENOARCH, msg);
  }
  if (t->smem > eff.smem_per_block_optin) {
    snprintf(msg, sizeof msg, "tile %s needs %d B of shared memory per block; the %s allows %lld", t->name, t->smem,
             out->emulated ? "sm_120 target" : "device", (long long)eff.smem_per_block_optin);
    return refuse(out, KDTREE_EINVAL, msg);
  }
  out->kernel = t->kernel;
  out->tile = t->id;
  out->block_rows = t->block_rows;
  out->threads = t->threads;
  out->smem_bytes = t->smem;
  out->ctas_per_sm = ctas_per_sm(eff, *t, t->smem);
  out->smem_request = t->smem;
  if (out->ctas_per_sm < 1) {
    snprintf(msg, sizeof msg, "tile %s does not fit one CTA per SM", t->name);
    return refuse(out, KDTREE_EINVAL, msg);
  }
  if (out->emulated) {
    // The smallest request with which this device holds no more CTAs per SM than sm_120.
    const int64_t per_block = dev.smem_per_sm / (out->ctas_per_sm + 1) + 1;  // (c + 1) of these exceed the SM
    int64_t req = per_block - kdtree::tiles::RESERVED_SMEM_PER_BLOCK;
    if (req < t->smem) req = t->smem;
    if (req > dev.smem_per_block_optin) {
      snprintf(msg, sizeof msg, "cannot cap this device at %d CTAs per SM: it would need %lld B per block, it allows %lld",
               out->ctas_per_sm, (long long)req, (long long)dev.smem_per_block_optin);
      return refuse(out, KDTREE_EINVAL, msg);
    }
    out->smem_request = static_cast<int32_t>(req);
  }
  snprintf(out->name, sizeof out->name, "%s%s", t->name, out->emulated ? " (sm_120 emulation)" : "");
  return KDTREE_OK;
}
