// kdtree-engine: host-side launchers, one per kernel family (launch_mma.cu,
// launch_sm90.cu, combine.cu), called by the C ABI (kdtree_verify.cu) once it has
// checked the arguments and chosen the configuration (config.cc).
#pragma once

#include <cuda_runtime.h>

#include "common.cuh"

namespace kdtree {
namespace host {

// Record an error message for kdtree_last_error and return `code`.
int fail(int code, const char* fmt, ...);

// Launch `kernel` as a programmatic dependent of the kernel before it on `stream`
// (it may start once that one's CTAs have all called launch_dependents).
template <typename K, typename... Args>
cudaError_t launch_pdl(K kernel, dim3 grid, int threads, int smem, cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// Raise `kernel`'s dynamic shared-memory limit on the current device to `bytes`
// (once per device and size; the emulation asks for more than the tile uses).
template <typename K>
int allow_smem(K kernel, int bytes, int* allowed_per_device, const char* what) {
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) return fail(KDTREE_ECUDA, "device index %d out of range", dev);
  if (allowed_per_device[dev] >= bytes) return KDTREE_OK;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaErrorInvalidDeviceFunction || e == cudaErrorNoKernelImageForDevice) {
    cudaGetLastError();
    return fail(KDTREE_ENOARCH, "no %s kernel image for this device in libkdtree_verify (built for %s)", what,
                KDTREE_ARCHS);
  }
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "cudaFuncSetAttribute (%s, %d B): %s", what, bytes, cudaGetErrorString(e));
  allowed_per_device[dev] = bytes;
  return KDTREE_OK;
}

// Merge the splits (no-op with one split): a programmatic dependent of the main kernel.
int launch_combine(const Params& p, cudaStream_t stream);

// Launch a main kernel in configuration `cfg` over its grid (launch_main below), then the
// combine. The main kernel is itself a programmatic dependent of the kernel before it on the
// stream, so that its launch overlaps that kernel's tail (3-4 us a batched call on the H200); its
// inputs were written by the kernels before it, so its first statement is griddepcontrol.wait
// (common.cuh pdl_main_prologue), before it reads or writes any memory.
template <typename K, typename... Args>
int launch_main(K kernel, int* allowed, const char* what, int block_rows, const Params& p, const KdtreeConfig& cfg,
                cudaStream_t stream, const Args&... args) {
  int rc = allow_smem(kernel, cfg.smem_request, allowed, what);
  if (rc != KDTREE_OK) return rc;
  const int row_tiles = (p.max_n * p.H + block_rows - 1) / block_rows;
  // the batch schedule's one wave (common.cuh batch_plan), or (row tiles, splits, requests)
  const dim3 grid = p.planned ? dim3(static_cast<unsigned>(p.split_budget)) : dim3(row_tiles, p.num_splits, p.bs);
  cudaError_t e = launch_pdl(kernel, grid, cfg.threads, cfg.smem_request, stream, args...);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction)
    return fail(KDTREE_ENOARCH, "no kernel image for this device (library built for %s)", KDTREE_ARCHS);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "verify kernel (%s) launch: %s", what, cudaGetErrorString(e));
  return launch_combine(p, stream);
}

// The step plan (plan.cu): the batch schedule of p.split_budget CTAs into p.plan.
int launch_plan(const Params& p, cudaStream_t stream);

int launch_mma(const Params& p, const KdtreeConfig& cfg, cudaStream_t stream);
int launch_sm90(const Params& p, const KdtreeConfig& cfg, cudaStream_t stream);

}  // namespace host
}  // namespace kdtree
