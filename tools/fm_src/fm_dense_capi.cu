// A C ABI around FlashMLA's sm_90 dense decode, built from FlashMLA's own source by
// tools/build_fm_src.py, so that a probe can time FlashMLA's kernel beside a variant of it
// (e.g. one that loads no keys) in the process that times ours. Nothing here is FlashMLA's
// code: the calls below are what FlashMLA's csrc/api/dense_decode.h makes, for one KV head
// (MLA: h_k = 1), with the caller's buffers in place of the torch tensors it allocates.
//
// Layouts (h_k = 1, so FlashMLA's head transpose is the identity):
//   q          bf16 [b, s_q, h_q, 576]
//   kcache     bf16 [num_blocks, 64, 1, 576]
//   block_table int32 [b, max_blocks]     seqlens_k int32 [b]
//   sched      int32 [num_sm_parts, fm_src_meta_ints()]   num_splits int32 [b + 1]
//   out        bf16 [b, s_q, h_q, 512]    lse float [b, s_q * h_q]
//   lse_accum  float [b + num_sm_parts, s_q * h_q]
//   o_accum    float [b + num_sm_parts, s_q * h_q, 512]
#include <cmath>
#include <cuda_runtime.h>

#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {
constexpr int kHeadDimK = 576;
constexpr int kHeadDimV = 512;
constexpr int kPage = 64;
constexpr int kBlockM = 64;
}  // namespace

extern "C" {

int fm_src_meta_ints() { return int(sizeof(DecodingSchedMeta) / sizeof(int)); }

// FlashMLA's split count: the SMs over the 64-row query tiles of one KV head.
int fm_src_num_sm_parts(int num_sms, int s_q, int h_q) {
    if (num_sms <= 0 || s_q <= 0 || h_q <= 0) return -1;
    int tiles = (s_q * h_q + kBlockM - 1) / kBlockM;
    int parts = num_sms / tiles;
    return parts > 1 ? parts : 1;
}

// The tile schedule (FlashMLA's get_mla_metadata kernel), from the lengths on the device.
int fm_src_sched(int b, int s_q, int* seqlens_k, int* sched, int* num_splits, int num_sm_parts,
                 void* stream) {
    if (b <= 0 || s_q <= 0 || num_sm_parts <= 0 || !seqlens_k || !sched || !num_splits) return 1;
    GetDecodeSchedMetaParams p = {
        b, s_q,
        kPage,
        5,  // fixed_overhead_num_blocks, as FlashMLA's dense_decode.h passes it
        -1, -1,
        nullptr, nullptr,
        seqlens_k,
        reinterpret_cast<DecodingSchedMeta*>(sched),
        num_splits,
        num_sm_parts,
        static_cast<cudaStream_t>(stream),
    };
    smxx::decode::run_get_decoding_sched_meta_kernel(p);
    return cudaGetLastError() == cudaSuccess ? 0 : 2;
}

// One decode call: the main kernel, then the combine (FlashMLA's two launches a call).
int fm_src_decode(int b, int s_q, int h_q, int num_blocks, int max_blocks, float scale,
                  void* q, void* kcache, int* block_table, int* seqlens_k,
                  int* sched, int* num_splits, int num_sm_parts,
                  void* out, float* lse, float* lse_accum, float* o_accum, void* stream) {
    if (b <= 0 || s_q <= 0 || h_q <= 0 || num_blocks <= 0 || max_blocks <= 0 || num_sm_parts <= 0) return 1;
    if (!q || !kcache || !block_table || !seqlens_k || !sched || !num_splits || !out || !lse ||
        !lse_accum || !o_accum) return 1;
    const int rows = s_q * h_q;  // q_seq_per_hk
    DenseAttnDecodeParams p{};
    p.b = b;
    p.s_q = s_q;
    p.q_seq_per_hk = rows;
    p.seqlens_k_ptr = seqlens_k;
    p.h_q = h_q;
    p.h_k = 1;
    p.num_blocks = num_blocks;
    p.q_head_per_hk = h_q;
    p.is_causal = s_q > 1;
    p.d = kHeadDimK;
    p.d_v = kHeadDimV;
    p.scale_softmax = scale;
    p.scale_softmax_log2 = float(scale * M_LOG2E);
    p.q_ptr = q;
    p.k_ptr = kcache;
    p.o_ptr = out;
    p.softmax_lse_ptr = lse;
    p.q_batch_stride = int64_t(rows) * kHeadDimK;
    p.k_batch_stride = int64_t(kPage) * kHeadDimK;
    p.o_batch_stride = int64_t(rows) * kHeadDimV;
    p.q_row_stride = kHeadDimK;
    p.k_row_stride = kHeadDimK;
    p.o_row_stride = kHeadDimV;
    p.q_head_stride = kHeadDimK;
    p.k_head_stride = kHeadDimK;
    p.o_head_stride = int64_t(rows) * kHeadDimV;
    p.block_table = block_table;
    p.block_table_batch_stride = max_blocks;
    p.page_block_size = kPage;
    p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(sched);
    p.num_sm_parts = num_sm_parts;
    p.num_splits_ptr = num_splits;
    p.total_num_splits = b + num_sm_parts;
    p.softmax_lseaccum_ptr = lse_accum;
    p.oaccum_ptr = o_accum;
    p.stream = static_cast<cudaStream_t>(stream);
    sm90::run_flash_splitkv_mla_kernel<cutlass::bfloat16_t>(p);

    CombineParams c = {
        b, s_q,
        h_q, kHeadDimV,
        lse,
        out,
        rows, h_q,
        h_q * s_q * kHeadDimV, h_q * kHeadDimV, kHeadDimV,
        lse_accum,
        o_accum,
        rows, h_q,
        h_q * s_q * kHeadDimV, h_q * kHeadDimV, kHeadDimV,
        reinterpret_cast<DecodingSchedMeta*>(sched),
        num_splits,
        num_sm_parts,
        nullptr,
        static_cast<cudaStream_t>(stream),
    };
    smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
    return cudaGetLastError() == cudaSuccess ? 0 : 2;
}

}  // extern "C"
