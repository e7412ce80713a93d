// The H200's (or any GPU's) mma.sync m16n8k16 bf16 -> fp32 ceiling: operands in registers,
// no shared or global memory in the loop, every warp running ACC independent accumulator
// chains. The ceiling the portable kernel (and so the sm_120 emulation) can approach on
// this GPU, against which its figures are read (docs/kernel-notes.md, issue 15).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o mma_peak tools/mma_peak.cu && ./mma_peak
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include <type_traits>

constexpr int ITERS = 4096;  // loop trips per launch

// ACC: independent accumulator chains per warp (the latency hiding within a warp)
template <int ACC>
__global__ void mma_loop(float* sink, uint32_t seed) {
  uint32_t a0 = seed ^ threadIdx.x, a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u, b0 = a0 * 11u, b1 = a0 * 13u;
  a0 &= 0x3f803f80u; a1 &= 0x3f803f80u; a2 &= 0x3f803f80u; a3 &= 0x3f803f80u; b0 &= 0x3f803f80u; b1 &= 0x3f803f80u;
  float d[ACC][4] = {};
  for (int it = 0; it < ITERS; ++it) {
#pragma unroll
    for (int j = 0; j < ACC; ++j)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < ACC; ++j) s += d[j][0] + d[j][1] + d[j][2] + d[j][3];
  if (s == 12345.f) sink[threadIdx.x] = s;  // keeps the loop alive
}

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  int clk_khz = 0;
  cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0);
  printf("device %s, %d SMs, cc %d.%d, max clock %.0f MHz\n", prop.name, prop.multiProcessorCount, prop.major,
         prop.minor, clk_khz / 1e3);
  float* sink = nullptr;
  cudaMalloc(&sink, 4096);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  // acc_c: std::integral_constant<int, chains>, so that the chain count is the kernel's own
  auto run = [&](auto acc_c, int wpb) {
    constexpr int acc = decltype(acc_c)::value;
    const auto kernel = mma_loop<acc>;
    const int blocks = prop.multiProcessorCount;  // one block per SM
    kernel<<<blocks, wpb * 32>>>(sink, 1u);       // warm-up (clocks up)
    cudaEventRecord(e0);
    const int reps = 5;
    for (int r = 0; r < reps; ++r) kernel<<<blocks, wpb * 32>>>(sink, 1u);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, e0, e1);
    const double flops = double(reps) * blocks * wpb * ITERS * acc * (2.0 * 16 * 8 * 16);
    const double per_sm_clk = flops / (ms * 1e-3) / prop.multiProcessorCount / (clk_khz * 1e3);
    printf("mma.sync m16n8k16 bf16->f32: %2d warps/SM, %d chains per warp: %.1f TFLOP/s, %.0f FLOP/clk/SM at max clock\n",
           wpb, acc, flops / (ms * 1e-3) / 1e12, per_sm_clk);
  };
  for (int wpb : {4, 8, 16, 32}) {
    run(std::integral_constant<int, 1>{}, wpb);
    run(std::integral_constant<int, 2>{}, wpb);
    run(std::integral_constant<int, 4>{}, wpb);
    run(std::integral_constant<int, 8>{}, wpb);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    printf("error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
