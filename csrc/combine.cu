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
}  // namespace

int launch_combine(const Params& p, cudaStream_t stream) {
  if (p.num_splits <= 1) return KDTREE_OK;
  const int64_t rows = static_cast<int64_t>(p.T) * p.H;
  const bool narrow = p.num_splits <= COMBINE_NARROW_MAX;
  const dim3 grid(static_cast<unsigned>(narrow ? (rows + COMBINE_GROUPS - 1) / COMBINE_GROUPS : rows));
  cudaError_t e;
  if (narrow)
    e = launch_pdl(combine_narrow_kernel, grid, COMBINE_THREADS, 0, stream, p);
  else if (p.num_splits >= COMBINE_WIDE8_MIN)
    e = launch_wide<8>(grid, stream, p);
  else
    e = launch_wide<4>(grid, stream, p);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "combine kernel launch: %s", cudaGetErrorString(e));
  return KDTREE_OK;
}

}  // namespace host
}  // namespace kdtree
