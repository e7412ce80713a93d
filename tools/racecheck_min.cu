// racecheck_min: the sm90 kernel's hand-off of the row maxima (csrc/sm90_kernel.cuh,
// verify_attn_kernel_sm90) alone, for compute-sanitizer's racecheck (issue 16).
// docs/kernel-notes.md, "Issue 16: racecheck and the hand-off of the row maxima", has
// the argument and what each run below means; tools/gpu_session.sh, step racecheck, runs them.
//
//   nvcc -O2 -lineinfo -gencode=arch=compute_90a,code=sm_90a -o racecheck_min tools/racecheck_min.cu
//   nvcc -O2 -lineinfo -arch=sm_80 -o racecheck_min tools/racecheck_min.cu   (no --env wgmma/fence)
//   compute-sanitizer --tool racecheck --racecheck-report all ./racecheck_min [options]
//
// The pattern, as in the kernel's main loop (per iteration k = the kernel's pair j):
//   warpgroup 0: [S] write mpub[row]       bar.arrive 2  [PV 0]  bar.sync 3  read mpub[64 + row]  [PV 1]
//   warpgroup 1: [S] bar.sync 2  read mpub[row]  write mpub[64 + row]  bar.arrive 3  [PV 0] [PV 1]
// with the kernel's thread -> row map (row0 = 16 warp + lane / 4, rows row0 and row0 + 8; the
// thread with lane % 4 == 0 writes, all four lanes of the row read), the kernel's one
// `bar.arrive %0, 256` with the barrier id 2 + wg in a register, and after the loop the row
// sums through mpub[128 ..] and bar.sync 1 (math_sync). A third warpgroup (--threads 384) is
// the kernel's producer: idle, or with --env mbar it arrives on a "full" mbarrier per buffer
// and iteration and waits on its "empty" one, which the math warpgroups wait on and release
// around their S and PV, as the kernel does.
//
// Every value published is the iteration number and address (enc below); every read is
// checked against the value of its own iteration and the mismatches are counted. Exit 0 when
// no read saw another iteration's value (with --broken: when the checker did see the race),
// 1 when it did (with --broken: 3 when it did not), 2 on a usage or CUDA error.
//
// Options (defaults first):
//   --iters 4 --blocks 2 --threads 384|256
//   --handoff arrive       the kernel's: writer `bar.arrive %0, 256` (id in a register), reader bar.sync 2 / 3
//             arrive-pred2 the same with warpgroup 1's bar.sync 2 predicated (@p bar.sync, p = wg == 1), the
//                          form ptxas gives the kernel from a3b8b58 on (0cf4172: a branch around it)
//             arrive-imm   the same with the ids as immediates (two bar.arrive instructions)
//             sync         writer `bar.sync %0, 256` too (both sides block)
//             mbar         two mbarriers (count 128): writer mbarrier.arrive, reader try_wait.parity k & 1
//   --env none|kernel|LIST what the kernel does between the hand-offs; LIST of mbar (the producer and
//                          the full/empty mbarriers), wgmma (wgmma.fence/commit_group/wait_group around S
//                          and each PV, no MMA issued; sm_90a), fence (fence.proxy.async before the
//                          writer's arrive; sm_90); kernel = mbar,wgmma,fence
//   --order free|kernel|mirror|writer-first|reader-first|XY
//                          who reaches barrier 2 (X) and barrier 3 (Y) first: w = the writer, r = the
//                          reader, - = free. The side that goes second spins on a global counter (relaxed
//                          loads: no ordering that racecheck or the memory model could use) until all
//                          four warps of the first side have counted themselves in, then sleeps
//                          --sleep-ns 20000 so that they are inside the barrier. kernel = rw (in the
//                          kernel warpgroup 1 waits at barrier 2; warpgroup 1 arrives at barrier 3 while
//                          warpgroup 0 is still in its PV), mirror = wr. Spins are bounded (counted as
//                          timeouts, never a hang).
//   --broken none|raw|war  raw: warpgroup 1 reads mpub[row] before its bar.sync 2 (barrier 2 forced
//                          reader-first, so it reads the previous iteration's value); war: warpgroup 0
//                          writes iteration k + 1's maxima right after its bar.arrive 2 of iteration k
//                          and warpgroup 1 reads after that write (a global counter says when). Every
//                          barrier is still executed as often as in the correct pattern: no hang.
//                          racecheck names what it sees: raw breaks a read-after-write hand-off, so
//                          it sees the [RAW] read first and the [W] write second (a WAR hazard); war
//                          gives the [WAR] write first and the [R1] read second (a RAW hazard).
// The access lines are tagged [W] [R1] [R0] [RAW] [WAR] [RS] for racecheck's reports
// (grep -n '// \[' tools/racecheck_min.cu).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CK(x)                                                                     \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      fprintf(stderr, "racecheck_min: %s: %s\n", #x, cudaGetErrorString(e_));    \
      exit(2);                                                                    \
    }                                                                             \
  } while (0)

enum Handoff { H_ARRIVE = 0, H_ARRIVE_PRED2, H_ARRIVE_IMM, H_SYNC, H_MBAR };
enum Broken { B_NONE = 0, B_RAW, B_WAR };
enum EnvBits { E_MBAR = 1, E_WGMMA = 2, E_FENCE = 4 };
enum Order { O_FREE = 0, O_WRITER_FIRST, O_READER_FIRST };
enum Caps { CAP_WGMMA = 1, CAP_FENCE = 2 };

struct Config {
  int iters, handoff, env, order2, order3, broken;
  unsigned sleep_ns;
  long long spin_budget;  // clock64 cycles before a spin gives up
};

constexpr int MAX_RECORDS = 16;
struct Mismatch {
  int block, tid, iter, addr;
  float got, want;
};
struct Result {
  int mismatches, timeouts, caps, pad;
  Mismatch rec[MAX_RECORDS];
};
// per block: [barrier 2: writer, reader], [barrier 3: writer, reader], early writes (--broken war)
constexpr int CTL_PER_BLOCK = 8;

// the value published for address `addr` (0..127) in iteration k: exact in fp32
__host__ __device__ __forceinline__ float enc(int k, int addr) { return static_cast<float>(k * 128 + addr) + 0.5f; }

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
#else
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
#endif
  } while (!done);
}
__device__ __forceinline__ int ld_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// spin until *p >= target (a global counter); false after `budget` cycles
__device__ bool wait_count(const int* p, int target, long long budget) {
  const long long t0 = clock64();
  while (ld_relaxed(p) < target) {
    if (clock64() - t0 > budget) return false;
    __nanosleep(100);
  }
  return true;
}
// the warpgroup-level instructions around the kernel's S and PV, without an MMA (sm_90a)
__device__ __forceinline__ void wg_ops(int env) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if (env & E_WGMMA) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
#else
  (void)env;
#endif
}
__device__ __forceinline__ void fence_proxy_async(int env) {
#if __CUDA_ARCH__ >= 900
  if (env & E_FENCE) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
  (void)env;
#endif
}

// HANDOFF a template argument, so that each variant's barrier instructions are plain ones as in the
// kernel (a run-time switch lets ptxas predicate them or merge the variants' instructions)
template <int HANDOFF>
__global__ void __launch_bounds__(384, 1) handoff_kernel(const Config cfg, int* ctl, Result* res) {
  __shared__ __align__(16) float mpub[256];  // [2][64] published maxima, then [2][64] row sums (the kernel's)
  __shared__ __align__(8) uint64_t bars[6];  // full[2], empty[2] (--env mbar), hand[2] (--handoff mbar)
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const uint32_t b0 = smem_u32(bars);
  auto full = [&](int x) { return b0 + 8u * x; };
  auto empty = [&](int x) { return b0 + 16u + 8u * x; };
  auto hand = [&](int x) { return b0 + 32u + 8u * x; };
  int* c = ctl + blockIdx.x * CTL_PER_BLOCK;

  if (tid == 0) {
    if (blockIdx.x == 0) {
      int caps = 0;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      caps |= CAP_WGMMA;
#endif
#if __CUDA_ARCH__ >= 900
      caps |= CAP_FENCE;
#endif
      res->caps = caps;
    }
    mbar_init(full(0), 64);    // the producer's 64 threads per buffer
    mbar_init(full(1), 64);
    mbar_init(empty(0), 256);  // both math warpgroups' PV of that buffer
    mbar_init(empty(1), 256);
    mbar_init(hand(0), 128);   // warpgroup w's 128 threads publish through hand(w)
    mbar_init(hand(1), 128);
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
  }
  __syncthreads();

  if (wg == 2) {  // the kernel's producer warpgroup: 64 threads per buffer x
    if (cfg.env & E_MBAR) {
      const int x = (tid - 256) >> 6;
      for (int k = 0; k < cfg.iters; ++k) {
        if (k > 0) mbar_wait(empty(x), (k - 1) & 1);  // this buffer's previous block released
        mbar_arrive(full(x));
      }
    }
    return;
  }

  const int lane = tid & 31, wwarp = (tid >> 5) & 3;
  const int g = lane >> 2, tq = lane & 3;
  const int row0 = wwarp * 16 + g;  // this thread's rows: row0, row0 + 8 (the kernel's map)

  auto check = [&](int k, int addr, float got, float want) {
    if (got != want) {
      const int i = atomicAdd(&res->mismatches, 1);
      if (i < MAX_RECORDS) res->rec[i] = Mismatch{static_cast<int>(blockIdx.x), tid, k, addr, got, want};
    }
  };
  // who reaches barrier b first (side 0: writer, 1: reader): the side that goes second waits
  // until all four warps of the other side have counted themselves in, then gives them time
  // to enter the barrier; each side counts itself in just before its barrier instruction
  const bool ordered = cfg.order2 != O_FREE || cfg.order3 != O_FREE;  // else: none of this code runs
  auto wait_turn = [&](int b, int side, int k) {
    if (!ordered) return;
    const int ord = b == 2 ? cfg.order2 : cfg.order3;
    if ((ord == O_WRITER_FIRST && side == 1) || (ord == O_READER_FIRST && side == 0)) {
      const bool ok = wait_count(c + (b - 2) * 2 + (side ^ 1), 4 * (k + 1), cfg.spin_budget);
      if (!ok && lane == 0) atomicAdd(&res->timeouts, 1);
      __nanosleep(cfg.sleep_ns);
    }
    __syncwarp();
  };
  auto count_in = [&](int b, int side) {
    if (!ordered) return;
    __syncwarp();
    if (lane == 0) atomicAdd(c + (b - 2) * 2 + side, 1);
    __syncwarp();
  };
  // the reader's side of barrier b (2: warpgroup 1 waits for warpgroup 0, 3: the reverse)
  auto take = [&](int b, uint32_t par) {
    if constexpr (HANDOFF == H_MBAR) {
      mbar_wait(hand(b - 2), par);
    } else {
      if (b == 2) asm volatile("bar.sync 2, 256;\n" ::: "memory");
      else asm volatile("bar.sync 3, 256;\n" ::: "memory");
    }
  };
  // the writer's side, one code path for both warpgroups as in the kernel
  auto publish = [&]() {
    if constexpr (HANDOFF == H_ARRIVE || HANDOFF == H_ARRIVE_PRED2) {
      asm volatile("bar.arrive %0, 256;\n" ::"r"(2 + wg) : "memory");
    } else if constexpr (HANDOFF == H_ARRIVE_IMM) {
      if (wg == 0) asm volatile("bar.arrive 2, 256;\n" ::: "memory");
      else asm volatile("bar.arrive 3, 256;\n" ::: "memory");
    } else if constexpr (HANDOFF == H_SYNC) {
      asm volatile("bar.sync %0, 256;\n" ::"r"(2 + wg) : "memory");
    } else {
      mbar_arrive(hand(wg));
    }
  };
  // the kernel's PV of buffer `buf`: its key block landed, the MMA, the buffer released
  auto pv = [&](int buf, uint32_t par) {
    if (cfg.env & E_MBAR) mbar_wait(full(buf), par);
    wg_ops(cfg.env);
    if (cfg.env & E_MBAR) mbar_arrive(empty(buf));
  };

  float l_run = 0.f;
  for (int k = 0; k < cfg.iters; ++k) {
    const uint32_t par = k & 1;
    if (cfg.env & E_MBAR) mbar_wait(full(wg), par);  // S of this warpgroup's block
    wg_ops(cfg.env);

    // warpgroup 1: the maxima after warpgroup 0's block (barrier 2)
    float m_prev[2] = {0.f, 0.f};
    if (wg == 1) {
      if (cfg.broken == B_RAW) {
        m_prev[0] = mpub[row0];      // [RAW] read before the barrier
        m_prev[1] = mpub[row0 + 8];  // [RAW]
      }
      wait_turn(2, 1, k);
      count_in(2, 1);
      if constexpr (HANDOFF != H_ARRIVE_PRED2) take(2, par);
    }
    if constexpr (HANDOFF == H_ARRIVE_PRED2)  // executed by both warpgroups, a barrier for warpgroup 1 only
      asm volatile("{\n.reg .pred p;\nsetp.eq.s32 p, %0, 1;\n@p bar.sync 2, 256;\n}\n" ::"r"(wg) : "memory");
    if (wg == 1) {
      if (cfg.broken == B_WAR && k + 1 < cfg.iters) {  // until warpgroup 0 wrote k + 1's maxima
        const bool ok = wait_count(c + 4, 4 * (k + 1), cfg.spin_budget);
        if (!ok && lane == 0) atomicAdd(&res->timeouts, 1);
        __syncwarp();
      }
      if (cfg.broken != B_RAW) {
        m_prev[0] = mpub[row0];      // [R1] warpgroup 0's maxima of iteration k
        m_prev[1] = mpub[row0 + 8];  // [R1]
      }
      check(k, row0, m_prev[0], enc(k, row0));
      check(k, row0 + 8, m_prev[1], enc(k, row0 + 8));
    }

    // both: publish this warpgroup's maxima (one code path, as in the kernel)
    wait_turn(2 + wg, 0, k);
    if (tq == 0) {
      mpub[wg * 64 + row0] = enc(k, wg * 64 + row0);          // [W]
      mpub[wg * 64 + row0 + 8] = enc(k, wg * 64 + row0 + 8);  // [W]
    }
    fence_proxy_async(cfg.env);
    count_in(2 + wg, 0);
    publish();

    if (wg == 0) {
      if (cfg.broken == B_WAR && k + 1 < cfg.iters) {
        if (tq == 0) {
          mpub[row0] = enc(k + 1, row0);          // [WAR] iteration k + 1's write, before barrier 3 of k
          mpub[row0 + 8] = enc(k + 1, row0 + 8);  // [WAR]
        }
        __syncwarp();
        if (lane == 0) atomicAdd(c + 4, 1);
        __syncwarp();
      }
      pv(0, par);
      wait_turn(3, 1, k);
      count_in(3, 1);
      take(3, par);
      const float m1[2] = {mpub[64 + row0], mpub[64 + row0 + 8]};  // [R0] warpgroup 1's maxima of iteration k
      check(k, 64 + row0, m1[0], enc(k, 64 + row0));
      check(k, 64 + row0 + 8, m1[1], enc(k, 64 + row0 + 8));
      pv(1, par);
    } else {
      pv(0, par);
      pv(1, par);
    }
    l_run += 1.f;
  }

  // the row sums, as in the kernel's epilogue: mpub[128 ..] and bar.sync 1
  float* red = mpub + 128;
  if (tq == 0) {
    red[wg * 64 + row0] = l_run + wg;      // [RS]
    red[wg * 64 + row0 + 8] = l_run + wg;  // [RS]
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  const int peer = wg ^ 1;
  const float want = static_cast<float>(cfg.iters + peer);
  check(cfg.iters, 128 + peer * 64 + row0, red[peer * 64 + row0], want);          // [RS]
  check(cfg.iters, 128 + peer * 64 + row0 + 8, red[peer * 64 + row0 + 8], want);  // [RS]
}

static void usage() {
  fprintf(stderr,
          "usage: racecheck_min [--iters N] [--blocks N] [--threads 384|256] [--handoff arrive|arrive-pred2|arrive-imm|sync|mbar]\n"
          "                     [--env none|kernel|mbar,wgmma,fence] [--order free|kernel|mirror|writer-first|reader-first|XY]\n"
          "                     [--broken none|raw|war] [--sleep-ns N]   (the file's header says what each does)\n");
  exit(2);
}

static int parse_order(char ch) {
  if (ch == 'w') return O_WRITER_FIRST;
  if (ch == 'r') return O_READER_FIRST;
  if (ch == '-') return O_FREE;
  usage();
  return 0;
}

int main(int argc, char** argv) {
  Config cfg{4, H_ARRIVE, 0, O_FREE, O_FREE, B_NONE, 20000u, 1ll << 31};
  int blocks = 2, threads = 384;
  const char *handoff = "arrive", *env = "none", *order = "free", *broken = "none";
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (i + 1 >= argc) usage();
    const char* v = argv[++i];
    if (!strcmp(a, "--iters")) cfg.iters = atoi(v);
    else if (!strcmp(a, "--blocks")) blocks = atoi(v);
    else if (!strcmp(a, "--threads")) threads = atoi(v);
    else if (!strcmp(a, "--sleep-ns")) cfg.sleep_ns = static_cast<unsigned>(atoi(v));
    else if (!strcmp(a, "--handoff")) handoff = v;
    else if (!strcmp(a, "--env")) env = v;
    else if (!strcmp(a, "--order")) order = v;
    else if (!strcmp(a, "--broken")) broken = v;
    else usage();
  }
  if (cfg.iters < 1 || cfg.iters > 100000 || blocks < 1 || blocks > 1024 || (threads != 256 && threads != 384)) usage();
  if (!strcmp(handoff, "arrive")) cfg.handoff = H_ARRIVE;
  else if (!strcmp(handoff, "arrive-pred2")) cfg.handoff = H_ARRIVE_PRED2;
  else if (!strcmp(handoff, "arrive-imm")) cfg.handoff = H_ARRIVE_IMM;
  else if (!strcmp(handoff, "sync")) cfg.handoff = H_SYNC;
  else if (!strcmp(handoff, "mbar")) cfg.handoff = H_MBAR;
  else usage();
  if (!strcmp(env, "kernel")) {
    cfg.env = E_MBAR | E_WGMMA | E_FENCE;
  } else if (strcmp(env, "none")) {
    char buf[64];
    snprintf(buf, sizeof buf, "%s", env);
    for (char* t = strtok(buf, ","); t; t = strtok(nullptr, ",")) {
      if (!strcmp(t, "mbar")) cfg.env |= E_MBAR;
      else if (!strcmp(t, "wgmma")) cfg.env |= E_WGMMA;
      else if (!strcmp(t, "fence")) cfg.env |= E_FENCE;
      else usage();
    }
  }
  if (!strcmp(order, "kernel")) order = "rw";
  else if (!strcmp(order, "mirror")) order = "wr";
  else if (!strcmp(order, "writer-first")) order = "ww";
  else if (!strcmp(order, "reader-first")) order = "rr";
  else if (!strcmp(order, "free")) order = "--";
  if (strlen(order) != 2) usage();
  cfg.order2 = parse_order(order[0]);
  cfg.order3 = parse_order(order[1]);
  if (!strcmp(broken, "raw")) {
    cfg.broken = B_RAW;
    cfg.order2 = O_READER_FIRST;  // warpgroup 0 writes only after warpgroup 1's early read
  } else if (!strcmp(broken, "war")) {
    cfg.broken = B_WAR;
  } else if (strcmp(broken, "none")) {
    usage();
  }
  if ((cfg.env & E_MBAR) && threads != 384) {
    fprintf(stderr, "racecheck_min: --env mbar needs the producer warpgroup (--threads 384)\n");
    return 2;
  }
  const char* ord_name[] = {"free", "writer-first", "reader-first"};
  printf("racecheck_min: handoff=%s env=%s%s%s%s order=barrier2:%s,barrier3:%s broken=%s iters=%d blocks=%d threads=%d sleep_ns=%u\n",
         handoff, cfg.env ? "" : "none", (cfg.env & E_MBAR) ? "mbar," : "", (cfg.env & E_WGMMA) ? "wgmma," : "",
         (cfg.env & E_FENCE) ? "fence" : "", ord_name[cfg.order2], ord_name[cfg.order3], broken, cfg.iters, blocks,
         threads, cfg.sleep_ns);

  int* ctl = nullptr;
  Result* res = nullptr;
  CK(cudaMalloc(&ctl, sizeof(int) * CTL_PER_BLOCK * blocks));
  CK(cudaMalloc(&res, sizeof(Result)));
  CK(cudaMemset(ctl, 0, sizeof(int) * CTL_PER_BLOCK * blocks));
  CK(cudaMemset(res, 0, sizeof(Result)));
  switch (cfg.handoff) {
    case H_ARRIVE: handoff_kernel<H_ARRIVE><<<blocks, threads>>>(cfg, ctl, res); break;
    case H_ARRIVE_PRED2: handoff_kernel<H_ARRIVE_PRED2><<<blocks, threads>>>(cfg, ctl, res); break;
    case H_ARRIVE_IMM: handoff_kernel<H_ARRIVE_IMM><<<blocks, threads>>>(cfg, ctl, res); break;
    case H_SYNC: handoff_kernel<H_SYNC><<<blocks, threads>>>(cfg, ctl, res); break;
    default: handoff_kernel<H_MBAR><<<blocks, threads>>>(cfg, ctl, res); break;
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  Result h;
  CK(cudaMemcpy(&h, res, sizeof h, cudaMemcpyDeviceToHost));
  CK(cudaFree(ctl));
  CK(cudaFree(res));

  if (((cfg.env & E_WGMMA) && !(h.caps & CAP_WGMMA)) || ((cfg.env & E_FENCE) && !(h.caps & CAP_FENCE))) {
    fprintf(stderr, "racecheck_min: --env %s asks for instructions this build lacks (build for sm_90a)\n", env);
    return 2;
  }
  const long long reads = static_cast<long long>(blocks) * (cfg.iters * 512 + 512);
  printf("racecheck_min: reads checked %lld, mismatches %d, spin timeouts %d\n", reads, h.mismatches, h.timeouts);
  for (int i = 0; i < h.mismatches && i < MAX_RECORDS; ++i) {
    const Mismatch& m = h.rec[i];
    printf("racecheck_min:   block %d thread %d iteration %d mpub[%d] = %.1f, want %.1f\n", m.block, m.tid, m.iter,
           m.addr, m.got, m.want);
  }
  if (cfg.broken == B_NONE) {
    if (h.mismatches == 0) {
      printf("racecheck_min: OK: every read saw the value of its own iteration\n");
      return 0;
    }
    printf("racecheck_min: FAIL: %d reads saw another iteration's value\n", h.mismatches);
    return 1;
  }
  if (h.mismatches > 0) {
    printf("racecheck_min: OK (broken=%s): the checker caught the race, %d stale or early reads\n", broken,
           h.mismatches);
    return 0;
  }
  printf("racecheck_min: FAIL (broken=%s): no read saw another iteration's value\n", broken);
  return 3;
}
