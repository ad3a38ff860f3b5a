// A row and head's attention by one block over the row's visible keys, in chunks of 32 folded
// in chunk order: what the persistent step and `attention_invariant` (kernels/llama.cu) and
// `attention_o_proj_mma` (kernels/rows_mma.cu) compute, so the three give an attention output
// the same bits. Put in front of both sources (after common.cuh) by the Rust side; the
// emulator's harnesses include it before them.
#ifndef TANDEM_ATTENTION_BLOCK
#define TANDEM_ATTENTION_BLOCK

#define ATTENTION_MAX_DIMS 8  // head_dim <= 256: a lane's output values

// One warp's attention over one chunk of up to 32 of a row's visible keys for one head:
// `j` the lane's key's cache column (lanes past the chunk's n keys, 1 <= n <= 32, pass the
// last one's). Writes out = [m, l, o[head_dim]]: the
// chunk's largest score m, l = sum exp(s - m) and the unnormalised output o = sum exp(s - m) v
// (lane owns output dims lane * DIMS ..). The value rows are loaded before the scores are known
// (they do not depend on them), GROUP rows at a time (all 32 at head_dim <= 64), so a chunk
// waits for about two trips to memory (its columns, then keys and values together).
// `q_warp` holds the scaled query (shared).
template <int DIMS>
__device__ __forceinline__ void persist_attend(const float* q_warp, const unsigned short* k_cache,
                                               const unsigned short* v_cache, size_t base,
                                               int j, int n, const float* mask_row,
                                               int head_dim, float* out) {
    constexpr int VW = DIMS >= 2 ? DIMS / 2 : 1;  // 32-bit words of a lane's values per row
    constexpr int GROUP = 32 / VW;                 // value rows loaded at once
    const int lane = threadIdx.x & 31;
    unsigned int vv[GROUP][VW];
    auto load_values = [&](int g) {
#pragma unroll
        for (int u = 0; u < GROUP; ++u) {
            const int col = __shfl_sync(0xffffffffu, j, min(g + u, n - 1));
            const unsigned short* vj = v_cache + base + (size_t)col * head_dim + lane * DIMS;
            if (DIMS == 1) {
                vv[u][0] = __ldcg(vj);
            } else if (DIMS == 2) {
                vv[u][0] = __ldcg(reinterpret_cast<const unsigned int*>(vj));
            } else if (DIMS == 4) {
                const uint2 x = __ldcg(reinterpret_cast<const uint2*>(vj));
                vv[u][0] = x.x;
                vv[u][VW - 1] = x.y;
            } else {
                const uint4 x = __ldcg(reinterpret_cast<const uint4*>(vj));
                vv[u][0] = x.x;
                vv[u][1 % VW] = x.y;
                vv[u][2 % VW] = x.z;
                vv[u][3 % VW] = x.w;
            }
        }
    };
    load_values(0);
    float s = NEG_INF;
    if (lane < n) {
        const uint4* kj = reinterpret_cast<const uint4*>(k_cache + base + (size_t)j * head_dim);
        float dot = 0.0f;
#pragma unroll 8
        for (int v8 = 0; v8 < (head_dim >> 3); ++v8) {
            const uint4 w = __ldcg(kj + v8);
            const float* qq = q_warp + v8 * 8;
            dot += qq[0] * __uint_as_float(w.x << 16) + qq[1] * __uint_as_float(w.x & 0xffff0000u);
            dot += qq[2] * __uint_as_float(w.y << 16) + qq[3] * __uint_as_float(w.y & 0xffff0000u);
            dot += qq[4] * __uint_as_float(w.z << 16) + qq[5] * __uint_as_float(w.z & 0xffff0000u);
            dot += qq[6] * __uint_as_float(w.w << 16) + qq[7] * __uint_as_float(w.w & 0xffff0000u);
        }
        s = dot + mask_row[j];
    }
    float m = s;
    for (int offset = 16; offset > 0; offset >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    const float p = s == NEG_INF ? 0.0f : expf(s - m);
    const float l = warp_sum(p);
    float acc[DIMS];
#pragma unroll
    for (int t = 0; t < DIMS; ++t) {
        acc[t] = 0.0f;
    }
    for (int g = 0; g < 32; g += GROUP) {
        if (g >= n) {
            break;  // warp-uniform
        }
        if (g > 0) {
            load_values(g);
        }
#pragma unroll
        for (int u = 0; u < GROUP; ++u) {
            const float pj = __shfl_sync(0xffffffffu, p, g + u);
#pragma unroll
            for (int t = 0; t < DIMS; ++t) {
                const unsigned int word = vv[u][t / 2 % VW];
                const float v = DIMS == 1 ? bf16_to_f32((unsigned short)word)
                                          : (t % 2 == 0 ? __uint_as_float(word << 16)
                                                        : __uint_as_float(word & 0xffff0000u));
                acc[t] += pj * v;
            }
        }
    }
    if (lane == 0) {
        out[0] = m;
        out[1] = l;
    }
#pragma unroll
    for (int t = 0; t < DIMS; ++t) {
        out[2 + lane * DIMS + t] = acc[t];
    }
}

// Folds one chunk's partial [m, l, o[head_dim]] (persist_attend) into a running maximum, sum
// and output (lane's dims lane * dims ..), in the caller's chunk order. Hidden chunks (m = -inf)
// change nothing. The persistent step and attention_invariant fold the same way, so the two
// give an attention output the same bits.
__device__ __forceinline__ void attention_fold(const float* part, int dims, float& m_run,
                                               float& l_run, float (&o)[ATTENTION_MAX_DIMS]) {
    const int lane = threadIdx.x & 31;
    const float mc = part[0];
    if (mc == NEG_INF) {
        return;
    }
    const float m_new = fmaxf(m_run, mc);
    const float keep = expf(m_run - m_new);
    const float take = expf(mc - m_new);
    l_run = l_run * keep + part[1] * take;
#pragma unroll
    for (int t = 0; t < ATTENTION_MAX_DIMS; ++t) {
        if (t < dims) {
            o[t] = o[t] * keep + part[2 + lane * dims + t] * take;
        }
    }
    m_run = m_new;
}

// One (row, head)'s attention by a whole block: its warps take chunks of 32 of the row's
// visible keys (`list`, `count`), PERSIST-style, a group of one chunk per warp at a time, and
// warp 0 folds each group's partials in chunk order; warp 0 writes the bf16 output to `dst`.
// `q` the row and head's query (read through L2), `shared_partials` warps * (head_dim + 2)
// f32 and `q_shared` head_dim f32 in shared memory.
__device__ void attention_block(const float* q, float scale, const unsigned short* k_cache,
                                const unsigned short* v_cache, size_t base, const int* list,
                                int count, const float* mask_row, int head_dim,
                                float* shared_partials, float* q_shared, unsigned short* dst) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int dims = head_dim >> 5;
    const int partial_width = head_dim + 2;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        q_shared[d] = __ldcg(q + d) * scale;
    }
    __syncthreads();
    const int chunks = (count + 31) / 32;
    float m_run = NEG_INF;
    float l_run = 0.0f;
    float o[ATTENTION_MAX_DIMS];
#pragma unroll
    for (int t = 0; t < ATTENTION_MAX_DIMS; ++t) {
        o[t] = 0.0f;
    }
    for (int g = 0; g < chunks; g += warps) {
        const int c = g + warp;
        if (c < chunks) {
            const int n = min(32, count - c * 32);
            const int j = __ldcg(list + c * 32 + min(lane, n - 1));
            float* part = shared_partials + warp * partial_width;
            switch (dims) {
            case 1:
                persist_attend<1>(q_shared, k_cache, v_cache, base, j, n, mask_row, head_dim, part);
                break;
            case 2:
                persist_attend<2>(q_shared, k_cache, v_cache, base, j, n, mask_row, head_dim, part);
                break;
            case 4:
                persist_attend<4>(q_shared, k_cache, v_cache, base, j, n, mask_row, head_dim, part);
                break;
            default:
                persist_attend<8>(q_shared, k_cache, v_cache, base, j, n, mask_row, head_dim, part);
                break;
            }
        }
        __syncthreads();
        if (warp == 0) {
            for (int w = 0; w < warps && g + w < chunks; ++w) {
                attention_fold(shared_partials + w * partial_width, dims, m_run, l_run, o);
            }
        }
        __syncthreads();
    }
    if (warp == 0) {
#pragma unroll
        for (int t = 0; t < ATTENTION_MAX_DIMS; ++t) {
            if (t < dims) {
                dst[lane * dims + t] = f32_to_bf16(o[t] / l_run);
            }
        }
    }
}

#endif  // TANDEM_ATTENTION_BLOCK
