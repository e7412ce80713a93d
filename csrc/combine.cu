// kdtree-engine: host launch of the split-KV combine (combine.cuh).
#include "combine.cuh"
#include "launch.h"

namespace kdtree {
namespace host {

namespace {
template <int G, bool PL>
cudaError_t launch_wide(dim3 grid, cudaStream_t stream, const Params& p) {
  return launch_pdl(combine_wide_kernel<G, PL>, grid, COMBINE_WIDE_THREADS<G>, 0, stream, p);
}
template <int MAXS, bool PL>
cudaError_t launch_narrow(int64_t rows, cudaStream_t stream, const Params& p) {
  const dim3 grid(static_cast<unsigned>((rows + COMBINE_NARROW_ROWS - 1) / COMBINE_NARROW_ROWS));
  if constexpr (PL) return launch_pdl(combine_pieces_kernel<MAXS>, grid, COMBINE_NARROW_THREADS, 0, stream, p);
  else return launch_pdl(combine_narrow_kernel<MAXS>, grid, COMBINE_NARROW_THREADS, 0, stream, p);
}
// the narrow instance with the fewest splits that holds the grid's num_splits (a row's count
// under the 3-D grid is at most that: split_plan; under the batch schedule combine_pieces_kernel
// cuts a longer row into pieces); the one-pass kernels and the wide one take one row per CTA
template <bool PL>
cudaError_t launch_any(const Params& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.T) * p.H;
  const dim3 grid(static_cast<unsigned>(rows));
  if (p.num_splits <= 2) return launch_narrow<2, PL>(rows, stream, p);
  if (p.num_splits <= 4) return launch_narrow<4, PL>(rows, stream, p);
  if (p.num_splits <= 8) return launch_narrow<8, PL>(rows, stream, p);
  if (p.num_splits <= COMBINE_NARROW_MAX) return launch_narrow<16, PL>(rows, stream, p);
  if (p.num_splits <= 32) return launch_pdl(combine_onepass_kernel<8, 4, PL>, grid, 512, 0, stream, p);
  if (p.num_splits <= 8 * COMBINE_ONE_PASS64)
    return launch_pdl(combine_onepass_kernel<8, COMBINE_ONE_PASS64, PL>, grid, 512, 0, stream, p);
  // (the batch schedule takes bs > 1, so more than 8 x COMBINE_ONE_PASS64 splits only on a GPU of
  // more than 160 SMs, e.g. sm_120's 188: there the wide kernel of 1024 threads spilled, 512 do not)
  if constexpr (PL) return launch_wide<4, true>(grid, stream, p);
  else return launch_wide<8, false>(grid, stream, p);
}
}  // namespace

int launch_combine(const Params& p, cudaStream_t stream) {
  if (p.num_splits <= 1) return KDTREE_OK;
  const cudaError_t e = p.planned ? launch_any<true>(p, stream) : launch_any<false>(p, stream);
  if (e != cudaSuccess) return fail(KDTREE_ECUDA, "combine kernel launch: %s", cudaGetErrorString(e));
  return KDTREE_OK;
}

}  // namespace host
}  // namespace kdtree
