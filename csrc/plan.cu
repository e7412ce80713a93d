// kdtree-engine: the step plan (KdtreeVerifyArgs::plan, KDTREE_PLAN_MAKE): the batch schedule
// of every main-kernel CTA, computed once per verify step, as FlashMLA's get_mla_metadata
// computes its schedule once per step in a kernel of its own. The step's other calls read
// their CTA's job with one load (common.cuh planned_job) instead of each CTA's warp 0
// deriving it from every request's lengths: 1.3-3.4 us a call on the H200's batched shapes in
// a build that skipped the derivation, of which the step plan took back about half.
#include "launch.h"

namespace kdtree {

constexpr int PLAN_THREADS = 256;  // 8 warps, one CTA's job each

// Warp w of the grid writes CTA w's job (batch_plan, the same function a call without a plan
// runs in each CTA); CTA 0 also writes the header and each request's rows. A programmatic
// dependent of the kernel before it (its inputs: the indptrs), and the primary of the main kernel.
__global__ void __launch_bounds__(PLAN_THREADS) plan_kernel(const Params p) {
  pdl_main_prologue();
  const int warp = blockIdx.x * (PLAN_THREADS / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (warp < p.split_budget) {  // warp-uniform
    const BatchJob j = batch_plan(p, warp, -1);
    if (lane == 0) reinterpret_cast<int4*>(p.plan + PLAN_JOBS_OFF)[warp] = pack_job(j);
  }
  if (blockIdx.x != 0) return;
  for (int b = threadIdx.x; b < p.bs; b += PLAN_THREADS) {  // (p.bs <= PLAN_MAX_BS: the host)
    int rows, steps;
    plan_terms(p, b, rows, steps);
    reinterpret_cast<int*>(p.plan + PLAN_ROWS_OFF)[b] = max(rows, 0);  // the combine's convention
  }
  if (threadIdx.x < PLAN_HDR_WORDS) reinterpret_cast<int*>(p.plan)[threadIdx.x] = plan_header_word(p, threadIdx.x);
}

namespace host {

int launch_plan(const Params& p, cudaStream_t stream) {
  const int warps = PLAN_THREADS / 32;
  const dim3 grid(static_cast<unsigned>((p.split_budget + warps - 1) / warps));
  cudaError_t e = launch_pdl(plan_kernel, grid, PLAN_THREADS, 0, stream, p);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction)
    return fail(KDTREE_ENOARCH, "no plan kernel image for this device (library built for %s)", KDTREE_ARCHS);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "plan kernel launch: %s", cudaGetErrorString(e));
  return KDTREE_OK;
}

}  // namespace host
}  // namespace kdtree
