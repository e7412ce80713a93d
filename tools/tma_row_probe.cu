// Can TMA gather single key rows into the sm90 kernel's 128B-swizzled key buffers, and is it
// faster than the cp.async gather? (docs/kernel-notes.md, entry I7 lead 2 and I8.)
//
// 1. Layout: a 2-D tensor map over a [rows, 576] bf16 pool with boxes of 1 row x 64 columns
//    and 128B swizzle. One box per row r = 0..7 of an 8-row chunk, each to base + 128 r
//    (base 1024-aligned, so only r = 0 is 1024-aligned). If the swizzle follows the
//    shared-memory address, 16-byte piece q of row r lands at base + 128 r + 16 (q ^ r):
//    the layout the kernel's cp.async gather writes and wgmma reads. The probe reports
//    where each piece landed, or the launch error when the boxes are refused.
// 2. Latency: each of 132 CTAs gathers 64 random rows x 9 chunks (73.7 KB, one key block)
//    from a pool larger than L2, one block at a time (issue, wait, next), with
//    (a) 16-byte cp.async, 8 lanes per row, 64 threads, as the kernel's producer does (its
//    zero-fill form, and the plain form beside it), or
//    (b) 1-row TMA boxes, 9 per row, issued by one thread per row, completing on one mbarrier.
//    Reported: microseconds per block and CTA, the exposed latency of one block's gather.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc -o tma_row_probe tools/tma_row_probe.cu
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "sm90_kernel.cuh"

constexpr int D = 576;               // bf16 per row
constexpr int ROW_BYTES = D * 2;     // 1152
constexpr int CHUNK = 64 * 128;      // 64 rows x 128 bytes
constexpr int BLOCK = 9 * CHUNK;     // one key block, 73,728 bytes
constexpr int POOL_ROWS = 1 << 18;   // 302 MB: past the H200's L2
constexpr int BLOCKS_PER_CTA = 64;

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);         \
      return 1;                                                                                \
    }                                                                                          \
  } while (0)

// the kernel's own wrappers (so the probe exercises exactly the instructions the producer issues):
// smem_u32, cp_async16 (common.cuh); mbar_init, fence_mbar_init, mbar_arrive_expect_tx, mbar_wait,
// tma_load_2d (sm90_kernel.cuh)
using kdtree::cp_async16;
using kdtree::smem_u32;
using kdtree::sm90::fence_mbar_init;
using kdtree::sm90::mbar_arrive_expect_tx;
using kdtree::sm90::mbar_init;
using kdtree::sm90::mbar_wait;
using kdtree::sm90::tma_load_2d;

// 1. eight rows of chunk 0, one box each, to base + 128 r; the 1 KB copied out as it landed
__global__ void layout_probe(const __grid_constant__ CUtensorMap map, const int* rows, uint16_t* out) {
  __shared__ __align__(1024) unsigned char buf[1024];
  __shared__ __align__(8) uint64_t bar;
  const uint32_t b = smem_u32(&bar);
  if (threadIdx.x == 0) {
    mbar_init(b, 1);
    fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbar_arrive_expect_tx(b, 8 * 128);
    for (int r = 0; r < 8; ++r) tma_load_2d(smem_u32(buf) + 128 * r, &map, 0, rows[r], b);
  }
  mbar_wait(b, 0);
  for (int i = threadIdx.x; i < 512; i += blockDim.x) out[i] = reinterpret_cast<const uint16_t*>(buf)[i];
}

// 2a. the producer's gather: 8 lanes per row, 16-byte pieces, 64 threads, swizzled like the kernel;
// PLAIN: `cp.async.cg ... 16` without the source-size operand of the kernel's cp_async16 (its
// zero-fill form), to time the two forms in one process (entry I8)
template <bool PLAIN>
__global__ void __launch_bounds__(64) gather_cp_async(const __nv_bfloat16* pool, const int* slots, long long* cycles) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = smem_u32(smem);
  const int t = threadIdx.x, q = t & 7;
  const long long t0 = clock64();
  for (int blk = 0; blk < BLOCKS_PER_CTA; ++blk) {
    const int* s = slots + (static_cast<long long>(blockIdx.x) * BLOCKS_PER_CTA + blk) * 64;
    for (int r = t >> 3; r < 64; r += 8) {  // 8 rows per pass
      const char* src = reinterpret_cast<const char*>(pool) + static_cast<long long>(s[r]) * ROW_BYTES + q * 16;
      const uint32_t dst = base + r * 128 + ((q ^ (r & 7)) << 4);
#pragma unroll
      for (int c = 0; c < 9; ++c) {
        if (PLAIN)
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + c * CHUNK), "l"(src + c * 128));
        else
          cp_async16(dst + c * CHUNK, src + c * 128, true);
      }
    }
    kdtree::cp_async_commit();
    kdtree::cp_async_wait_all();
    __syncthreads();
  }
  if (t == 0) cycles[blockIdx.x] = clock64() - t0;
}

// 2b. 1-row TMA boxes: thread r issues row r's 9 chunks; one mbarrier per block
__global__ void __launch_bounds__(64) gather_tma_rows(const __grid_constant__ CUtensorMap map, const int* slots,
                                                      long long* cycles) {
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) uint64_t bar;
  const uint32_t base = smem_u32(smem), b = smem_u32(&bar);
  const int r = threadIdx.x;
  if (r == 0) {
    mbar_init(b, 1);
    fence_mbar_init();
  }
  __syncthreads();
  const long long t0 = clock64();
  for (int blk = 0; blk < BLOCKS_PER_CTA; ++blk) {
    const int slot = slots[(static_cast<long long>(blockIdx.x) * BLOCKS_PER_CTA + blk) * 64 + r];
    if (r == 0) mbar_arrive_expect_tx(b, BLOCK);
    __syncthreads();  // the expected bytes are posted before any box can complete
#pragma unroll
    for (int c = 0; c < 9; ++c) tma_load_2d(base + c * CHUNK + r * 128, &map, c * 64, slot, b);
    mbar_wait(b, blk & 1);
    __syncthreads();
  }
  if (r == 0) cycles[blockIdx.x] = clock64() - t0;
}

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  int clk_khz = 0;
  CK(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0));
  printf("device %s, %d SMs, cc %d.%d\n", prop.name, prop.multiProcessorCount, prop.major, prop.minor);

  // pool: element (row, col) = 16-bit pattern (row * 7 + col) & 0xffff, so a piece names its row and column
  std::vector<uint16_t> host(static_cast<size_t>(POOL_ROWS) * D);
  for (size_t r = 0; r < POOL_ROWS; ++r)
    for (int c = 0; c < D; ++c) host[r * D + c] = static_cast<uint16_t>((r * 7 + c) & 0xffff);
  void* pool = nullptr;
  CK(cudaMalloc(&pool, host.size() * 2));
  CK(cudaMemcpy(pool, host.data(), host.size() * 2, cudaMemcpyHostToDevice));

  CUtensorMap map;
  const cuuint64_t dims[2] = {D, POOL_ROWS};
  const cuuint64_t strides[1] = {ROW_BYTES};
  const cuuint32_t box[2] = {64, 1};
  const cuuint32_t estr[2] = {1, 1};
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult qr;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &qr));
  if (qr != cudaDriverEntryPointSuccess || !fn) {
    printf("no cuTensorMapEncodeTiled in this driver\n");
    return 1;
  }
  auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  CUresult cr = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, pool, dims, strides, box, estr,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                       CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  printf("tensor map, 1-row x 64-column boxes, 128B swizzle: %s\n", cr == CUDA_SUCCESS ? "encoded" : "REFUSED");
  if (cr != CUDA_SUCCESS) return 1;

  // 1. layout
  const int rows_h[8] = {5, 1000, 77, 123456, 9, 250000, 31, 4242};
  int* rows_d = nullptr;
  uint16_t* out_d = nullptr;
  CK(cudaMalloc(&rows_d, sizeof rows_h));
  CK(cudaMalloc(&out_d, 1024));
  CK(cudaMemcpy(rows_d, rows_h, sizeof rows_h, cudaMemcpyHostToDevice));
  layout_probe<<<1, 32>>>(map, rows_d, out_d);
  cudaError_t le = cudaDeviceSynchronize();
  if (le != cudaSuccess) {
    printf("layout probe: the boxes at base + 128 r failed: %s\n", cudaGetErrorString(le));
    return 1;
  }
  uint16_t got[512];
  CK(cudaMemcpy(got, out_d, 1024, cudaMemcpyDeviceToHost));
  int addr_swz = 0, box_swz = 0, other = 0;
  for (int r = 0; r < 8; ++r)
    for (int q = 0; q < 8; ++q) {
      const uint16_t want = static_cast<uint16_t>((rows_h[r] * 7 + q * 8) & 0xffff);  // first element of piece q
      if (got[r * 64 + ((q ^ r) * 8)] == want) ++addr_swz;   // placed by the address's row bits
      else if (got[r * 64 + q * 8] == want) ++box_swz;       // placed as if each box were its own row 0
      else ++other;
    }
  printf("layout probe: of 64 pieces, %d at the address-swizzled place (what the kernel needs), %d unswizzled, %d elsewhere\n",
         addr_swz, box_swz, other);

  // 2. latency of one block's gather, random slots
  const int ctas = prop.multiProcessorCount;
  std::vector<int> slots(static_cast<size_t>(ctas) * BLOCKS_PER_CTA * 64);
  srand(1);
  for (auto& s : slots) s = static_cast<int>((static_cast<unsigned>(rand()) * 2654435761u) % POOL_ROWS);
  int* slots_d = nullptr;
  long long* cyc_d = nullptr;
  CK(cudaMalloc(&slots_d, slots.size() * sizeof(int)));
  CK(cudaMalloc(&cyc_d, ctas * sizeof(long long)));
  CK(cudaMemcpy(slots_d, slots.data(), slots.size() * sizeof(int), cudaMemcpyHostToDevice));
  CK(cudaFuncSetAttribute(gather_cp_async<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, BLOCK + 1024));
  CK(cudaFuncSetAttribute(gather_cp_async<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, BLOCK + 1024));
  CK(cudaFuncSetAttribute(gather_tma_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, BLOCK + 1024));
  std::vector<long long> cyc(ctas);
  for (int rep = 0; rep < 3; ++rep) {
    for (int v = 0; v < 3; ++v) {
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      CK(cudaMemset(cyc_d, 0, ctas * sizeof(long long)));
      cudaEventRecord(e0);
      const auto* pb = static_cast<const __nv_bfloat16*>(pool);
      if (v == 0) gather_cp_async<false><<<ctas, 64, BLOCK + 1024>>>(pb, slots_d, cyc_d);
      else if (v == 1) gather_cp_async<true><<<ctas, 64, BLOCK + 1024>>>(pb, slots_d, cyc_d);
      else gather_tma_rows<<<ctas, 64, BLOCK + 1024>>>(map, slots_d, cyc_d);
      cudaEventRecord(e1);
      CK(cudaEventSynchronize(e1));
      CK(cudaGetLastError());
      float ms = 0.f;
      cudaEventElapsedTime(&ms, e0, e1);
      CK(cudaMemcpy(cyc.data(), cyc_d, ctas * sizeof(long long), cudaMemcpyDeviceToHost));
      double mean = 0;
      for (long long c : cyc) mean += static_cast<double>(c) / ctas;
      const double us_block = ms * 1e3 / BLOCKS_PER_CTA;
      printf("round %d %-24s %7.3f ms, %6.2f us per block and CTA (%.0f cycles by clock64), %.2f TB/s\n", rep,
             v == 0 ? "cp.async (kernel's)" : v == 1 ? "cp.async (plain form)" : "1-row TMA boxes", ms, us_block, mean / BLOCKS_PER_CTA,
             static_cast<double>(ctas) * BLOCKS_PER_CTA * BLOCK / (ms * 1e-3) / 1e12);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
    }
  }
  return 0;
}
