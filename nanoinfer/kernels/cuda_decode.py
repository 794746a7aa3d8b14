"""Split-KV decode attention over an FP8 (e4m3) paged cache, in CUDA C++ compiled at run time by NVRTC
(the NVRTC library that PyTorch's CUDA wheels depend on; no CUDA toolkit needed). The compiled kernel is
loaded and launched through PyTorch's own NVRTC helpers (``torch.cuda._utils``).

Why not Triton: small GQA groups (Qwen3-0.6B: 2 query heads per KV head) pad to a 16-row ``tl.dot``,
and Triton's code for an FP8 tile spends about 180 instructions per KiB of KV (Nsight Compute, run 68:
V read byte by byte from shared memory to build the tensor cores' B operand, the query re-read every
tile, the 16-row accumulator rescaled, 64-bit addresses per key), which holds it at 2.2-2.9 TB/s. Here
one warp owns a (sequence, KV head, split), every load goes straight from global memory into registers
as the ``mma.sync.m16n8k16`` operands need them, and the roles are swapped so that the padding falls on
the MMA's 8-wide side:

* scores: S^T[16 keys, 8 queries] = K[16 keys, D] . Q^T; the K tile is the A operand, the query (scaled,
  float16) the B operand, loaded once. The dot product's order over D is free, so each lane loads whole
  16-byte runs of its two key rows and converts them in pairs (``cvt.rn.f16x2.e4m3x2``).
* output: O^T[D, 8 queries] += V^T[D, 16 keys] . P^T; V's bytes for 4 keys x 8 dims come in as 8-byte
  loads and are paired per dimension with ``prmt``. P^T reaches each lane's B operand in 4 shuffles.
* the online softmax runs on the lanes that hold the scores; each lane rescales 32 accumulator values.

Key order inside a 16-key tile is a permutation shared by both products (lane rows of S^T are keys 2g
and 2g+1, the P^T operand's rows are keys 4c..4c+3), so no data is moved to match them.

The tiles in flight wait in registers (the default: one tile ahead at 152 registers, 12 warps per SM)
or, with ``DecodeConfig.stage_in_shared``, in shared memory: cp.async copies each lane's bytes of the
next tiles into stages it reads back itself, which leaves 125 registers (16 warps per SM) and holds
several tiles in flight per warp (ptxas figures for sm_90, bf16 queries, head_dim 128).

The kernel splits as ``triton_attention``'s balanced mode does (split lengths in 16-key tiles from the
batch's longest sequence; a sequence using one split writes its output, the others write normalised
partials and log2-sum-exps), and up to ``MERGE_IN_KERNEL_MAX_SPLITS`` splits the last split of a
(sequence, KV head) to finish merges them, so no merge kernel runs after it. ``attention_ref`` is its
reference; the GPU tests (``tests/kernels/test_cuda_decode.py``) compare them.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from nanoinfer.kernels.attention_ref import FP8_DTYPE

logger = logging.getLogger(__name__)

TILE_KEYS = 16
# Split counts the kernel merges itself (the last split of a (sequence, KV head) does it). With more,
# each split holds few tiles and the merge on the grid's last warps costs more than the merge kernel
# (H100, the bench workload's mixed lengths, us per layer: 4 splits at batch 256 138.9 against 145.6
# with the merge kernel, 8 at 128 117.2 against 118.3, 16 at 64 78.6 against 76.6; docs/benchmarks.md,
# run 77).
MERGE_IN_KERNEL_MAX_SPLITS = 8
_LOG2E = 1.4426950408889634
_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CUfunction_attribute, the driver API's
# The float types the kernel reads queries in and writes outputs in (its QT / OT template arguments).
_FLOAT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# How FP8 becomes float16 (its CONVERT template argument: bit 0 K, bit 1 V by bit moves, else cvt).
FP8_CONVERTS = {"cvt": 0, "bits_keys": 1, "bits_values": 2, "bits": 3}

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u16 v) {
    u32 r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
    return r;
}

// The same pair by bit moves on the integer pipes, 2^-8 times its value: e4m3's sign, exponent and
// mantissa bits placed at float16's sign, low exponent and high mantissa bits (float16's exponent bias is
// 8 more than e4m3's, subnormals included; no e4m3 code becomes a float16 NaN). The caller multiplies the
// results by 256. A 32-bit word's bytes 0 and 1 (HIGH = 0) or 2 and 3 (HIGH = 1) as float16x2.
template <int HIGH> __device__ __forceinline__ u32 e4m3x2_bits_to_f16x2(u32 word) {
    u32 spread;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(spread) : "r"(word), "r"(0u), "r"(HIGH ? 0x3424u : 0x1404u));
    return (spread & 0x80008000u) | ((spread >> 1) & 0x3F803F80u);
}

// Bytes 0-1 (HIGH = 0) or 2-3 (HIGH = 1) of ``word`` as float16x2: by ``cvt`` (BITS = 0), or by bit
// moves at 2^-8 of the value (BITS = 1).
template <int BITS, int HIGH> __device__ __forceinline__ u32 fp8_pair(u32 word) {
    if constexpr (BITS) {
        return e4m3x2_bits_to_f16x2<HIGH>(word);
    } else {
        return e4m3x2_to_f16x2((u16)(HIGH ? word >> 16 : word));
    }
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 byte_pairs(u32 a, u32 b, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 load_16(const unsigned char* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ uint2 load_8(const unsigned char* p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// Float types by code: 0 bfloat16, 1 float16, 2 float32.
template <int T> __device__ __forceinline__ float load_float(const void* p, long long i);
template <> __device__ __forceinline__ float load_float<0>(const void* p, long long i) {
    return __uint_as_float(((u32)((const u16*)p)[i]) << 16);
}
template <> __device__ __forceinline__ float load_float<1>(const void* p, long long i) {
    float r;
    u16 h = ((const u16*)p)[i];
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}
template <> __device__ __forceinline__ float load_float<2>(const void* p, long long i) {
    return ((const float*)p)[i];
}
template <int T> __device__ __forceinline__ void store_float(void* p, long long i, float v);
template <> __device__ __forceinline__ void store_float<0>(void* p, long long i, float v) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    ((u16*)p)[i] = h;
}
template <> __device__ __forceinline__ void store_float<1>(void* p, long long i, float v) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    ((u16*)p)[i] = h;
}
template <> __device__ __forceinline__ void store_float<2>(void* p, long long i, float v) {
    ((float*)p)[i] = v;
}

// One 16-key tile's bytes, as this lane loads them. K: key rows 2g and 2g+1 (the A operand's rows g
// and g+8), CHUNKS 16-byte runs each at dims 16c + 64i. V: keys 4c..4c+3, CHUNKS 8-byte runs each at
// dims 8g + 64i.
template <int CHUNKS> struct Tile {
    uint4 k_even[CHUNKS];
    uint4 k_odd[CHUNKS];
    uint2 v[4][CHUNKS];
};

// The global addresses of one 16-key tile's runs as this lane loads them (layout: ``Tile``): ``k_run(i,
// odd, p)`` for K's run i of key row 2g (odd = 0) or 2g + 1 (odd = 1), ``v_run(j, i, p)`` for V's run i of
// key 4c + j.
template <int HD, int BS, typename KRun, typename VRun>
__device__ __forceinline__ void for_tile_runs(const unsigned char* k_head, const unsigned char* v_head,
                                              const int* table, int tile_start, long long kcb, int kcs,
                                              long long vcb, int vcs, int g, int c, KRun k_run, VRun v_run) {
    constexpr int CHUNKS = HD / 64;
    const long long block = table[tile_start / BS];
    const int slot0 = tile_start % BS;
    const unsigned char* k_rows = k_head + block * kcb + (long long)(slot0 + 2 * g) * kcs + 16 * c;
    #pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        k_run(i, 0, k_rows + 64 * i);
        k_run(i, 1, k_rows + kcs + 64 * i);
    }
    const unsigned char* v_rows = v_head + block * vcb + (long long)(slot0 + 4 * c) * vcs + 8 * g;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        #pragma unroll
        for (int i = 0; i < CHUNKS; ++i) v_run(j, i, v_rows + (long long)j * vcs + 64 * i);
    }
}

template <int HD, int BS>
__device__ __forceinline__ void load_tile(Tile<HD / 64>& t, const unsigned char* k_head,
                                          const unsigned char* v_head, const int* table, int tile_start,
                                          long long kcb, int kcs, long long vcb, int vcs, int g, int c) {
    for_tile_runs<HD, BS>(
        k_head, v_head, table, tile_start, kcb, kcs, vcb, vcs, g, c,
        [&](int i, int odd, const unsigned char* p) { (odd ? t.k_odd : t.k_even)[i] = load_16(p); },
        [&](int j, int i, const unsigned char* p) { t.v[j][i] = load_8(p); });
}

// Tiles staged in shared memory (the kernel's STAGED mode): cp.async copies each lane's runs of a tile into
// one of DEPTH stages, so the loads in flight hold no registers and DEPTH - 1 tiles are in flight while
// one is attended (the register tiles hold one at the occupancy their registers allow). Each lane reads
// back only the bytes it copied itself, so cp.async.wait_group orders them without a barrier; a stage is
// refilled only after the tile read from it has been attended, its values consumed by the MMAs. Runs
// are laid out [run][lane]: a warp's reads of one run are consecutive, free of bank conflicts.
template <int CHUNKS> struct TileStage {
    uint4 k[CHUNKS][2][32];
    uint2 v[4][CHUNKS][32];
};

__device__ __forceinline__ void copy_async_16(void* dst, const unsigned char* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void copy_async_8(void* dst, const unsigned char* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;"
                 :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}

// Programmatic dependent launch (sm_90 and up): wait until the previous kernel has finished and its
// writes are visible (at once where the launch did not ask for it).
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int PENDING> __device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory");
}

template <int HD, int BS>
__device__ __forceinline__ void stage_tile(TileStage<HD / 64>& s, const unsigned char* k_head,
                                           const unsigned char* v_head, const int* table, int tile_start,
                                           long long kcb, int kcs, long long vcb, int vcs, int g, int c,
                                           int lane) {
    for_tile_runs<HD, BS>(
        k_head, v_head, table, tile_start, kcb, kcs, vcb, vcs, g, c,
        [&](int i, int odd, const unsigned char* p) { copy_async_16(&s.k[i][odd][lane], p); },
        [&](int j, int i, const unsigned char* p) { copy_async_8(&s.v[j][i][lane], p); });
}

template <int CHUNKS>
__device__ __forceinline__ void read_stage(const TileStage<CHUNKS>& s, Tile<CHUNKS>& t, int lane) {
    #pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        t.k_even[i] = s.k[i][0][lane];
        t.k_odd[i] = s.k[i][1][lane];
        #pragma unroll
        for (int j = 0; j < 4; ++j) t.v[j][i] = s.v[j][i][lane];
    }
}

// With lazy rescaling the running max moves only when a tile's scores pass it by more than this (log2
// units): a weight 2^(s - m) is then at most 2^8, well inside float16's range for the P operand.
constexpr float LAZY_RESCALE_LOG2 = 8.f;

// Per lane (g = lane / 4, c = lane % 4): scores of keys 2g, 2g+1 for queries 2c, 2c+1; the running max
// m and partial sum l of queries 2c, 2c+1 (l summed over the lanes at the end); O^T rows of dims
// 8g + 64i + 2t' (+1) for queries 2c, 2c+1, in acc[4i + t']. CONVERT: bit 0 converts K, bit 1 V by bit
// moves (else cvt). LAZY: the accumulators are rescaled only when the max moves (see LAZY_RESCALE_LOG2),
// which past a sequence's first tiles few tiles make it do; the final normalisation and log2-sum-exp use
// the same max, so the result is the same up to rounding.
template <int HD, int CONVERT, int LAZY>
__device__ __forceinline__ void attend_tile(Tile<HD / 64>& t, const u32 (&q)[HD / 8],
                                            float (&acc)[HD / 16][4], float (&m)[2], float (&l)[2],
                                            int tile_start, int end, int g, int c) {
    constexpr int CHUNKS = HD / 64;
    constexpr int KEY_BITS = CONVERT & 1;
    constexpr int VALUE_BITS = (CONVERT >> 1) & 1;
    const float neg_inf = __int_as_float(0xff800000);
    // Only a sequence's last tile (the branch is the same for the whole warp) reaches past its end.
    const bool partial = tile_start + 16 > end;
    if (partial) {
        // Past the end a slot holds stale bytes (maybe NaN codes): zeroed, since 0 * NaN would reach
        // the accumulator.
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            #pragma unroll
            for (int i = 0; i < CHUNKS; ++i) {
                if (tile_start + 4 * c + j >= end) t.v[j][i] = make_uint2(0u, 0u);
            }
        }
    }
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    #pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const u32 ke[4] = {t.k_even[i].x, t.k_even[i].y, t.k_even[i].z, t.k_even[i].w};
        const u32 ko[4] = {t.k_odd[i].x, t.k_odd[i].y, t.k_odd[i].z, t.k_odd[i].w};
        #pragma unroll
        for (int w = 0; w < 4; ++w) {
            const int step = 4 * i + w;
            mma_16816(s, fp8_pair<KEY_BITS, 0>(ke[w]), fp8_pair<KEY_BITS, 0>(ko[w]),
                      fp8_pair<KEY_BITS, 1>(ke[w]), fp8_pair<KEY_BITS, 1>(ko[w]), q[2 * step],
                      q[2 * step + 1]);
        }
    }
    if constexpr (KEY_BITS) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) s[e] *= 256.f;
    }
    if (partial) {
        if (tile_start + 2 * g >= end) s[0] = s[1] = neg_inf;
        if (tile_start + 2 * g + 1 >= end) s[2] = s[3] = neg_inf;
    }
    float tile_max[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
    #pragma unroll
    for (int mask = 4; mask < 32; mask <<= 1) {
        tile_max[0] = fmaxf(tile_max[0], __shfl_xor_sync(0xffffffffu, tile_max[0], mask));
        tile_max[1] = fmaxf(tile_max[1], __shfl_xor_sync(0xffffffffu, tile_max[1], mask));
    }
    bool rescale = true;
    if constexpr (LAZY) {
        // Warp-uniform: the first tile always rescales (m is -inf).
        const bool grows = tile_max[0] > m[0] + LAZY_RESCALE_LOG2 || tile_max[1] > m[1] + LAZY_RESCALE_LOG2;
        rescale = __any_sync(0xffffffffu, grows);
    }
    if (rescale) {
        // Every tile holds a valid key, so the new max is finite and exp2(-inf - max) = 0 on the first.
        const float m_new[2] = {fmaxf(m[0], tile_max[0]), fmaxf(m[1], tile_max[1])};
        const float alpha[2] = {fast_exp2(m[0] - m_new[0]), fast_exp2(m[1] - m_new[1])};
        l[0] *= alpha[0];
        l[1] *= alpha[1];
        #pragma unroll
        for (int r = 0; r < HD / 16; ++r) {
            acc[r][0] *= alpha[0];
            acc[r][1] *= alpha[1];
            acc[r][2] *= alpha[0];
            acc[r][3] *= alpha[1];
        }
        m[0] = m_new[0];
        m[1] = m_new[1];
    }
    const float p0 = fast_exp2(s[0] - m[0]);
    const float p1 = fast_exp2(s[1] - m[1]);
    const float p2 = fast_exp2(s[2] - m[0]);
    const float p3 = fast_exp2(s[3] - m[1]);
    l[0] += p0 + p2;
    l[1] += p1 + p3;
    // P^T's B operand: lane (g, c) needs query g's p of keys 4c, 4c+1 (held by lane 8c + g/2) and of
    // keys 4c+2, 4c+3 (lane 8c + 4 + g/2), of that lane's query parity g % 2.
    const u32 p_even_query = pack_f16x2(p0, p2);
    const u32 p_odd_query = pack_f16x2(p1, p3);
    const int src = 8 * c + (g >> 1);
    const u32 e0 = __shfl_sync(0xffffffffu, p_even_query, src);
    const u32 o0 = __shfl_sync(0xffffffffu, p_odd_query, src);
    const u32 e1 = __shfl_sync(0xffffffffu, p_even_query, src + 4);
    const u32 o1 = __shfl_sync(0xffffffffu, p_odd_query, src + 4);
    const u32 b0 = (g & 1) ? o0 : e0;
    const u32 b1 = (g & 1) ? o1 : e1;
    #pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        #pragma unroll
        for (int tt = 0; tt < 4; ++tt) {
            const int r = 4 * i + tt;
            // Dims 2tt', 2tt'+1 of this lane's 8-byte run: bytes of word tt / 2.
            const u32 selector = (tt & 1) ? 0x7362u : 0x5140u;
            const u32 v0 = (tt < 2) ? t.v[0][i].x : t.v[0][i].y;
            const u32 v1 = (tt < 2) ? t.v[1][i].x : t.v[1][i].y;
            const u32 v2 = (tt < 2) ? t.v[2][i].x : t.v[2][i].y;
            const u32 v3 = (tt < 2) ? t.v[3][i].x : t.v[3][i].y;
            const u32 w01 = byte_pairs(v0, v1, selector);
            const u32 w23 = byte_pairs(v2, v3, selector);
            mma_16816(acc[r], fp8_pair<VALUE_BITS, 0>(w01), fp8_pair<VALUE_BITS, 1>(w01),
                      fp8_pair<VALUE_BITS, 0>(w23), fp8_pair<VALUE_BITS, 1>(w23), b0, b1);
        }
    }
}

// The split that finishes last for its (sequence, KV head) merges the group's partials: the log2-sum-exp
// weighted sum of every used split's normalised output, as ``_decode_merge_kernel`` does, so no second
// kernel runs. The counter (zero before the call) counts the splits done and is zero again after it.
// The merge is on the kernel's critical path (the last split of the grid runs it after its own tiles),
// so each query head's partials are read MERGE_SPLITS at a time with all their loads in flight at once.
constexpr int MERGE_SPLITS = 16;

// DIMS (2 or 4) consecutive floats in one vector load from L2: the partials are written by other warps of
// this grid, so never read through L1.
template <int DIMS> __device__ __forceinline__ void load_dims_cg(const float* p, float (&v)[DIMS]);
template <> __device__ __forceinline__ void load_dims_cg<2>(const float* p, float (&v)[2]) {
    const float2 r = __ldcg((const float2*)p);
    v[0] = r.x;
    v[1] = r.y;
}
template <> __device__ __forceinline__ void load_dims_cg<4>(const float* p, float (&v)[4]) {
    const float4 r = __ldcg((const float4*)p);
    v[0] = r.x;
    v[1] = r.y;
    v[2] = r.z;
    v[3] = r.w;
}

// Release (before a split counts itself done) and acquire (before the last one reads the others'
// partials); acq_rel is all this pattern needs, cheaper than __threadfence's sequentially consistent
// fence.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

template <int HD, int OT>
__device__ __forceinline__ void merge_if_last(void* out, const float* partial_out, const float* partial_lse,
                                              int* counters, int seq, int kv_head, int num_kv_heads,
                                              int group, int num_splits, int used_splits, int stride_ob,
                                              int stride_oh, int lane) {
    const int num_heads = num_kv_heads * group;
    constexpr int DIMS = HD / 32;  // per lane: dims DIMS * lane ... DIMS * lane + DIMS - 1
    // Release: this warp's partials are visible to whichever split merges before it counts itself.
    fence_acq_rel_gpu();
    __syncwarp();
    int* counter = counters + (long long)seq * num_kv_heads + kv_head;
    int done = 0;
    if (lane == 0) done = atomicAdd(counter, 1);
    done = __shfl_sync(0xffffffffu, done, 0);
    if (done != used_splits - 1) return;
    fence_acq_rel_gpu();  // acquire: the other splits' partials
    const float neg_inf = __int_as_float(0xff800000);
    for (int query_row = 0; query_row < group; ++query_row) {
        const int head = kv_head * group + query_row;
        const long long first = ((long long)seq * num_heads + head) * num_splits;
        float running_max = neg_inf, total = 0.f, sum[DIMS];
        #pragma unroll
        for (int e = 0; e < DIMS; ++e) sum[e] = 0.f;
        for (int base = 0; base < used_splits; base += MERGE_SPLITS) {
            float lse[MERGE_SPLITS], part[MERGE_SPLITS][DIMS];
            #pragma unroll
            for (int s = 0; s < MERGE_SPLITS; ++s) {
                const bool used = base + s < used_splits;
                lse[s] = used ? __ldcg(partial_lse + first + base + s) : neg_inf;
                const float* row = partial_out + (first + base + s) * HD + DIMS * lane;
                if (used) {
                    load_dims_cg<DIMS>(row, part[s]);
                } else {
                    #pragma unroll
                    for (int e = 0; e < DIMS; ++e) part[s][e] = 0.f;
                }
            }
            float chunk_max = running_max;
            #pragma unroll
            for (int s = 0; s < MERGE_SPLITS; ++s) chunk_max = fmaxf(chunk_max, lse[s]);
            // An empty split's -inf (or every split's) weighs 0: exp2 of -inf, never of NaN.
            const float shift = chunk_max == neg_inf ? 0.f : chunk_max;
            const float rescale = fast_exp2(running_max - shift);
            total *= rescale;
            #pragma unroll
            for (int e = 0; e < DIMS; ++e) sum[e] *= rescale;
            #pragma unroll
            for (int s = 0; s < MERGE_SPLITS; ++s) {
                const float weight = fast_exp2(lse[s] - shift);
                total += weight;
                #pragma unroll
                for (int e = 0; e < DIMS; ++e) sum[e] += weight * part[s][e];
            }
            running_max = chunk_max;
        }
        const float norm = 1.f / (total > 0.f ? total : 1.f);
        const long long o = (long long)seq * stride_ob + (long long)head * stride_oh + DIMS * lane;
        #pragma unroll
        for (int e = 0; e < DIMS; ++e) store_float<OT>(out, o + e, sum[e] * norm);
    }
    if (lane == 0) *counter = 0;
}

// Grid (batch, num_kv_heads, num_splits), or (num_kv_heads, batch, num_splits) with HEADS_FIRST (the
// programs launched together then read the KV heads of one block, a contiguous run of a head-major
// cache), one warp per block. Balanced splits: one split length for the
// batch, its longest sequence over num_splits in whole 16-key tiles. merge_splits: the splits are merged
// here (else _decode_merge_kernel merges them). DEPTH tiles in flight: in registers (STAGED = 0) each
// tile's loads are issued DEPTH - 1 tiles before its arithmetic; staged in shared memory (STAGED = 1, the
// launch gives DEPTH TileStages of dynamic shared memory) DEPTH - 1 tiles are in flight while one is
// attended, and the first ones are issued before the query is read. MIN_BLOCKS: warps per SM the
// registers must leave room for (ptxas spills what does not fit). CONVERT and LAZY: attend_tile's.
template <int HD, int BS, int QT, int OT, int DEPTH, int MIN_BLOCKS, int STAGED, int HEADS_FIRST,
          int CONVERT, int LAZY>
__global__ void __launch_bounds__(32, MIN_BLOCKS) fp8_paged_decode(
    const void* query, const unsigned char* k_cache, const unsigned char* v_cache, const int* block_tables,
    const int* seq_lens, void* out, float* partial_out, float* partial_lse, int* counters,
    const float* k_scale, const float* v_scale, double scale_log2, int group, int num_splits, int batch,
    int stride_qb, int stride_qh, int stride_kcb, int stride_kcs, int stride_kch, int stride_vcb,
    int stride_vcs, int stride_vch, int stride_bt, int stride_ob, int stride_oh, int has_k_scale,
    int has_v_scale, int merge_splits) {
    constexpr int CHUNKS = HD / 64;
    const int seq = HEADS_FIRST ? blockIdx.y : blockIdx.x;
    const int kv_head = HEADS_FIRST ? blockIdx.x : blockIdx.y;
    const int num_kv_heads = HEADS_FIRST ? gridDim.x : gridDim.y;
    const int split = blockIdx.z;
    const int lane = threadIdx.x;
    const int g = lane >> 2;
    const int c = lane & 3;
    const int seq_len = seq_lens[seq];

    int longest = 0;
    for (int b = lane; b < batch; b += 32) longest = max(longest, seq_lens[b]);
    #pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) {
        longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, mask));
    }
    const int split_tiles = max((((longest + num_splits - 1) / num_splits) + 15) / 16, 1);
    const int split_len = split_tiles * 16;
    const int used_splits = max((seq_len + split_len - 1) / split_len, 1);
    if (split >= used_splits) {
        grid_dependency_wait();  // every program waits, so the grid never finishes before its predecessor
        return;
    }
    const int start = split * split_len;
    const int end = min(start + split_len, seq_len);

    const unsigned char* k_head = k_cache + (long long)kv_head * stride_kch;
    const unsigned char* v_head = v_cache + (long long)kv_head * stride_vch;
    const int* table = block_tables + (long long)seq * stride_bt;
    const long long kcb = stride_kcb, vcb = stride_vcb;
    const int kcs = stride_kcs, vcs = stride_vcs;
    extern __shared__ __align__(16) unsigned char stage_memory[];
    TileStage<CHUNKS>* stages = reinterpret_cast<TileStage<CHUNKS>*>(stage_memory);
    const int num_tiles = (end - start + 15) / 16;
    // Tile p of this split into stage p % DEPTH; one commit group per call, empty past the last tile, so
    // that the group of tile p is always the (p + 1)-th.
    auto stage = [&](int p) {
        if (p < num_tiles) {
            stage_tile<HD, BS>(stages[p % DEPTH], k_head, v_head, table, start + 16 * p, kcb, kcs, vcb, vcs,
                               g, c, lane);
        }
        commit_copies();
    };
    // Launched with programmatic dependent launch, this grid may start while the previous kernel (this
    // step's K/V store, which also writes the query) still runs: until grid_dependency_wait only the
    // lengths, the tables and tiles wholly before the newest key (cached by earlier steps) are read.
    const int newest = seq_len - 1;
    auto before_newest = [&](int p) { return start + 16 * p + 16 <= newest; };
    auto load = [&](Tile<CHUNKS>& t, int at) {
        load_tile<HD, BS>(t, k_head, v_head, table, at, kcb, kcs, vcb, vcs, g, c);
    };
    Tile<CHUNKS> tiles[STAGED ? 1 : DEPTH];
    int staged_early = 0;
    if constexpr (STAGED) {
        while (staged_early < DEPTH && (staged_early >= num_tiles || before_newest(staged_early))) {
            stage(staged_early++);
        }
    } else {
        #pragma unroll
        for (int p = 0; p < DEPTH - 1; ++p) {
            if (p < num_tiles && before_newest(p)) load(tiles[p], start + 16 * p);
        }
    }
    grid_dependency_wait();
    if constexpr (STAGED) {
        for (int p = staged_early; p < DEPTH; ++p) stage(p);
    } else {
        #pragma unroll
        for (int p = 0; p < DEPTH - 1; ++p) {
            if (p < num_tiles && !before_newest(p)) load(tiles[p], start + 16 * p);
        }
    }

    // The query rows (scaled into log2 units, K's scale folded in) as this lane's B operands: query g,
    // dims 16c + 64i + 4w + {0,1} and {2,3} for k-step 4i + w.
    const float qk_scale = (float)scale_log2 * (has_k_scale ? k_scale[0] : 1.0f);
    u32 q[HD / 8];
    const long long q_row = (long long)seq * stride_qb + (long long)(kv_head * group + g) * stride_qh;
    #pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        #pragma unroll
        for (int w = 0; w < 4; ++w) {
            const int d = 16 * c + 64 * i + 4 * w;
            float x[4] = {0.f, 0.f, 0.f, 0.f};
            if (g < group) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) x[e] = load_float<QT>(query, q_row + d + e) * qk_scale;
            }
            q[2 * (4 * i + w)] = pack_f16x2(x[0], x[1]);
            q[2 * (4 * i + w) + 1] = pack_f16x2(x[2], x[3]);
        }
    }

    float acc[HD / 16][4];
    #pragma unroll
    for (int r = 0; r < HD / 16; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;
    const float neg_inf = __int_as_float(0xff800000);
    float m[2] = {neg_inf, neg_inf};
    float l[2] = {0.f, 0.f};

    if constexpr (STAGED) {
        for (int p = 0; p < num_tiles; ++p) {
            wait_copies<DEPTH - 1>();
            Tile<CHUNKS> t;
            read_stage(stages[p % DEPTH], t, lane);
            attend_tile<HD, CONVERT, LAZY>(t, q, acc, m, l, start + 16 * p, end, g, c);
            stage(p + DEPTH);
        }
    } else {
        for (int tile = start; tile < end; tile += 16 * DEPTH) {
            #pragma unroll
            for (int p = 0; p < DEPTH; ++p) {
                const int here = tile + 16 * p;
                if (here >= end) break;
                const int ahead = here + 16 * (DEPTH - 1);
                if (ahead < end) load(tiles[(p + DEPTH - 1) % DEPTH], ahead);
                attend_tile<HD, CONVERT, LAZY>(tiles[p], q, acc, m, l, here, end, g, c);
            }
        }
    }

    #pragma unroll
    for (int mask = 4; mask < 32; mask <<= 1) {
        l[0] += __shfl_xor_sync(0xffffffffu, l[0], mask);
        l[1] += __shfl_xor_sync(0xffffffffu, l[1], mask);
    }
    const float v_mult = (has_v_scale ? v_scale[0] : 1.0f) * ((CONVERT & 2) ? 256.f : 1.f);
    const int num_heads = num_kv_heads * group;
    #pragma unroll
    for (int parity = 0; parity < 2; ++parity) {
        const int query_row = 2 * c + parity;
        if (query_row >= group) continue;
        const int head = kv_head * group + query_row;
        const bool has_keys = l[parity] > 0.f;
        const float norm = v_mult / (has_keys ? l[parity] : 1.0f);
        if (used_splits == 1) {
            const long long o = (long long)seq * stride_ob + (long long)head * stride_oh;
            #pragma unroll
            for (int i = 0; i < CHUNKS; ++i) {
                #pragma unroll
                for (int tt = 0; tt < 4; ++tt) {
                    const int d = 8 * g + 64 * i + 2 * tt;
                    store_float<OT>(out, o + d, acc[4 * i + tt][parity] * norm);
                    store_float<OT>(out, o + d + 1, acc[4 * i + tt][2 + parity] * norm);
                }
            }
        } else {
            const long long row = ((long long)seq * num_heads + head) * num_splits + split;
            #pragma unroll
            for (int i = 0; i < CHUNKS; ++i) {
                #pragma unroll
                for (int tt = 0; tt < 4; ++tt) {
                    const int d = 8 * g + 64 * i + 2 * tt;
                    *(float2*)(partial_out + row * HD + d) =
                        make_float2(acc[4 * i + tt][parity] * norm, acc[4 * i + tt][2 + parity] * norm);
                }
            }
            if (g == 0) partial_lse[row] = has_keys ? m[parity] + __log2f(l[parity]) : neg_inf;
        }
    }
    if (used_splits > 1 && merge_splits) {
        merge_if_last<HD, OT>(out, partial_out, partial_lse, counters, seq, kv_head, num_kv_heads, group,
                              num_splits, used_splits, stride_ob, stride_oh, lane);
    }
}
"""


@dataclass(frozen=True)
class DecodeKernel:
    """A compiled instantiation of the kernel, the dynamic shared memory each launch gives it (its
    stages in STAGED mode, else none), and whether its device has programmatic dependent launch."""

    function: Any
    shared_mem: int
    heads_first: bool
    has_pdl: bool


def kernel_for(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    tiling: tuple = (2, None, False, False, "cvt", False),
) -> DecodeKernel | None:
    """The compiled kernel for this call, or None where it does not take it: it takes an FP8 cache on
    CUDA (sm_89 and up: the e4m3 conversions) whose blocks hold whole 16-key tiles, head_dim 64 or 128,
    at most 8 query heads per KV head, 16-byte aligned rows, int32 tables and lengths. ``tiling``: (tiles
    in flight, register cap or None, whether they are staged in shared memory, whether the grid's first
    axis is the KV head, how FP8 becomes float16 (a key of ``FP8_CONVERTS``), whether the accumulators
    are rescaled lazily)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    supported = (
        query.is_cuda
        and k_cache.dtype == FP8_DTYPE
        and head_dim in (64, 128)
        and block_size % TILE_KEYS == 0
        and 1 <= group <= 8
        and query.dtype in _FLOAT_CODES
        and block_tables.dtype == torch.int32
        and seq_lens.dtype == torch.int32
        and out.dtype in _FLOAT_CODES
        and all(stride % 16 == 0 for stride in strides)
        and k_cache.data_ptr() % 16 == 0
        and v_cache.data_ptr() % 16 == 0
    )
    if not supported:
        return None
    major, minor = torch.cuda.get_device_capability(query.device)
    if (major, minor) < (8, 9):
        return None
    depth, max_registers, staged, heads_first, convert, lazy = tiling
    min_blocks = 65536 // (32 * max_registers) if max_registers else 1
    codes = (_FLOAT_CODES[query.dtype], _FLOAT_CODES[out.dtype])
    variant = (depth, min_blocks, int(staged), int(heads_first), FP8_CONVERTS[convert], int(lazy))
    return _kernel(head_dim, block_size, *codes, *variant, 10 * major + minor)


def stage_bytes(head_dim: int) -> int:
    """Shared memory of one ``TileStage``: a 16-key tile of FP8 K and V (``TILE_KEYS`` x head_dim each)."""
    return 2 * TILE_KEYS * head_dim


@functools.cache
def _kernel(
    head_dim: int,
    block_size: int,
    query_code: int,
    out_code: int,
    depth: int,
    min_blocks: int,
    staged: int,
    heads_first: int,
    convert: int,
    lazy: int,
    arch: int,
) -> DecodeKernel | None:
    """The compiled kernel for these template arguments, or None where NVRTC or the driver fails (the
    caller then runs the Triton kernel; the reason is logged once)."""
    arguments = (
        head_dim, block_size, query_code, out_code, depth, min_blocks, staged, heads_first, convert, lazy
    )  # fmt: skip
    name = f"fp8_paged_decode<{', '.join(map(str, arguments))}>"
    try:
        from torch.cuda._utils import (
            _check_cuda,
            _cuda_load_module,
            _get_gpu_rtc_library,
            _get_gpu_runtime_library,
        )

        nvrtc = _get_gpu_rtc_library()
        cubin, lowered = _nvrtc_compile(nvrtc, name, arch)
        function = _cuda_load_module(cubin, [lowered])[lowered]
        shared_mem = depth * stage_bytes(head_dim) if staged else 0
        if staged:
            # Stages take shared memory from L1: ask for the largest carve-out, so that the blocks the
            # registers allow also fit the stages (through L1 go only the lengths, the tables and V's
            # 8-byte copies, which stream and are not read again).
            _check_cuda(
                _get_gpu_runtime_library().cuFuncSetAttribute(
                    function.func, _CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100
                )
            )
        return DecodeKernel(function, shared_mem, bool(heads_first), has_pdl=arch >= 90)
    except (ImportError, OSError, RuntimeError) as exc:
        logger.warning("CUDA FP8 decode kernel unavailable (%s); using the Triton kernel", exc)
        return None


def _nvrtc_compile(nvrtc, name: str, arch: int) -> tuple[bytes, str]:
    """CUBIN of ``_SOURCE`` for ``sm_<arch>`` and the lowered name of its instantiation ``name``. The
    source includes no header, so no CUDA toolkit is needed beside NVRTC."""
    program = ctypes.c_void_p()

    def check(status: int, what: str) -> None:
        if status != 0:
            log_size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(log_size))
            log = ctypes.create_string_buffer(log_size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC {what} failed ({status}): {log.value.decode(errors='replace')[:2000]}")

    check(
        nvrtc.nvrtcCreateProgram(ctypes.byref(program), _SOURCE.encode(), b"cuda_decode.cu", 0, None, None),
        "create",
    )
    try:
        check(nvrtc.nvrtcAddNameExpression(program, name.encode()), "name")
        options = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17"]
        check(
            nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options)),
            "compile",
        )
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "cubin")
        lowered = ctypes.c_char_p()
        check(nvrtc.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(lowered)), "lowered name")
        return cubin.raw, lowered.value.decode()
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def launch(
    kernel: DecodeKernel,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    counters: torch.Tensor,
    num_splits: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    pdl: bool = False,
) -> bool:
    """Balanced-mode decode with the ``kernel`` that :func:`kernel_for` gave for this call. Up to
    ``MERGE_IN_KERNEL_MAX_SPLITS`` splits are merged in the same launch (``counters``: int32 zeros, one per
    (sequence, KV head), zeros again after the call); returns False where the caller must still merge
    them (``_decode_merge_kernel``). With ``pdl`` the launch asks for programmatic dependent launch: the
    grid may start while the previous kernel runs (it waits for it before reading the query or any tile
    that holds a sequence's newest key, which that kernel may be writing). Capturable in a CUDA graph."""
    batch, num_heads, _ = query.shape
    num_kv_heads = k_cache.shape[2]
    merges = num_splits <= MERGE_IN_KERNEL_MAX_SPLITS
    args = [
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        counters,
        k_scale if k_scale is not None else partial_lse,
        v_scale if v_scale is not None else partial_lse,
        scale * _LOG2E,
        num_heads // num_kv_heads,
        num_splits,
        batch,
        query.stride(0),
        query.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        int(k_scale is not None),
        int(v_scale is not None),
        int(merges),
    ]
    grid = (num_kv_heads, batch, num_splits) if kernel.heads_first else (batch, num_kv_heads, num_splits)
    _launch(kernel, grid, args, torch.cuda.current_stream(query.device).cuda_stream, pdl and kernel.has_pdl)
    return merges


class _LaunchAttribute(ctypes.Structure):
    """The driver API's CUlaunchAttribute: an id, then a 64-byte union of values."""

    _fields_ = [("id", ctypes.c_int), ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):
    """The driver API's CUlaunchConfig."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


@functools.cache
def _launch_kernel_ex() -> Any:
    """The driver's cuLaunchKernelEx, looked up once: loading the library and finding the symbol took
    about as long again as the rest of a launch's host work, on every launch outside a graph."""
    from torch.cuda._utils import _get_gpu_runtime_library

    return _get_gpu_runtime_library().cuLaunchKernelEx


def _launch(kernel: DecodeKernel, grid: tuple[int, int, int], args: list, stream: int, pdl: bool) -> None:
    """One warp per block, through cuLaunchKernelEx (PyTorch's launcher has no launch attributes): with
    ``pdl`` the programmatic-stream-serialization attribute. Tensors pass as device pointers, ints as C
    ints, floats as doubles (the kernel's parameter types)."""
    from torch.cuda._utils import _check_cuda

    values = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            values.append(ctypes.c_void_p(arg.data_ptr()))
        elif isinstance(arg, int):
            values.append(ctypes.c_int(arg))
        else:
            values.append(ctypes.c_double(arg))
    params = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values))
    attribute = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value[0] = 1  # programmaticStreamSerializationAllowed
    config = _LaunchConfig(
        grid=(ctypes.c_uint * 3)(*grid),
        block=(ctypes.c_uint * 3)(32, 1, 1),
        shared_mem_bytes=kernel.shared_mem,
        stream=ctypes.c_void_p(stream),
        attrs=ctypes.pointer(attribute) if pdl else None,
        num_attrs=1 if pdl else 0,
    )
    _check_cuda(_launch_kernel_ex()(ctypes.byref(config), kernel.function.func, params, None))
