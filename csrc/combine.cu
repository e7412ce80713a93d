// kdtree-engine: host launch of the split-KV combine (combine.cuh).
#include "combine.cuh"
#include "launch.h"

namespace kdtree {
namespace host {

namespace {
template <int G>
cudaError_t launch_wide(dim3 grid, cudaStream_t stream, const Params& p) {
  return launch_pdl(combine_wide_kernel<G>, grid, COMBINE_WIDE_THREADS<G>, 0, stream, p);
}
template <int MAXS>
cudaError_t launch_narrow(int64_t rows, cudaStream_t stream, const Params& p) {
  const dim3 grid(static_cast<unsigned>((rows + COMBINE_NARROW_ROWS - 1) / COMBINE_NARROW_ROWS));
  return launch_pdl(combine_narrow_kernel<MAXS>, grid, COMBINE_NARROW_THREADS, 0, stream, p);
}
}  // namespace

int launch_combine(const Params& p, cudaStream_t stream) {
  if (p.num_splits <= 1) return KDTREE_OK;
  const int64_t rows = static_cast<int64_t>(p.T) * p.H;
  // the narrow instance with the fewest splits that holds the grid's (a row's count is at
  // most that: split_plan); the one-pass kernels and the wide one take one row per CTA
  const dim3 grid(static_cast<unsigned>(rows));
  cudaError_t e;
  if (p.num_splits <= 2)
    e = launch_narrow<2>(rows, stream, p);
  else if (p.num_splits <= 4)
    e = launch_narrow<4>(rows, stream, p);
  else if (p.num_splits <= 8)
    e = launch_narrow<8>(rows, stream, p);
  else if (p.num_splits <= COMBINE_NARROW_MAX)
    e = launch_narrow<16>(rows, stream, p);
  else if (p.num_splits <= 32)
    e = launch_pdl(combine_onepass_kernel<8, 4>, grid, 512, 0, stream, p);
  else if (p.num_splits <= 8 * COMBINE_ONE_PASS64)
    e = launch_pdl(combine_onepass_kernel<8, COMBINE_ONE_PASS64>, grid, 512, 0, stream, p);
  else
    e = launch_wide<8>(grid, stream, p);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "combine kernel launch: %s", cudaGetErrorString(e));
  return KDTREE_OK;
}

}  // namespace host
}  // namespace kdtree
