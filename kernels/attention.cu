// Grouped-query attention, one block per (sequence, tile of the step's slots, KV head): the
// block scores every query head of that KV head's group for TILE consecutive slots of one
// sequence, so each key and value row is read once for up to ATTN_GROUP_MAX queries instead of
// once per (slot, head) as `attention` does. That is what wide steps need: verifying 4 tokens
// at batch 32 over 512 columns cost 1.97 decode steps with `attention` (every slot and every
// head of a group re-read the same columns), and a 512-token prefill re-read each column once
// per query row. Each warp takes chunks of 32 columns (warps stride over the chunks): lane l
// scores column c0 + l against every query (held in shared memory), the chunk updates each
// query's online softmax, the weights go through shared memory, then the warp adds the chunk's
// value rows with lane l holding dims l, l + 32, ... of every query. Warps are merged at the
// end in a fixed order (deterministic output).
// GROUP (query heads per KV head) and ATTN_GROUPED_DIMS (head_dim / 32) are compile-time
// (`-DATTN_GROUP=3 -DATTN_DIMS=2`; `Gpu` compiles this file once per model shape on first use)
// so that every per-query array is indexed at compile time and lives in registers: one build
// for every group size made NVRTC's start-up compile 8x slower.
// Grid: (batch * ceil(width / TILE), kv_heads), TILE = ATTN_GROUP_MAX / GROUP. Block: any
// number of warps. Dynamic shared: (2 * ATTN_GROUP_MAX * head_dim + warps * ATTN_GROUP_MAX *
// 34) floats. head_dim == 32 * ATTN_GROUPED_DIMS. `step_scalars` (when not null) overrides
// total with step_scalars[1], as in `attention` (kernels/llama.cu).
#ifndef ATTN_GROUP
#define ATTN_GROUP 3
#endif
#ifndef ATTN_DIMS
#define ATTN_DIMS 2
#endif
#define ATTN_GROUP_MAX 16
#define ATTN_GROUPED_DIMS ATTN_DIMS
extern "C" __global__ void attention_grouped(const float* q, const unsigned short* k_cache,
                                             const unsigned short* v_cache, const float* mask,
                                             unsigned short* out, int width, int heads,
                                             int kv_heads, int head_dim, int capacity, int total,
                                             float scale, const int* step_scalars) {
    constexpr int GROUP = ATTN_GROUP;
    constexpr int TILE = ATTN_GROUP_MAX / GROUP;
    constexpr int NQ = TILE * GROUP;
    if (step_scalars != nullptr) {
        total = step_scalars[1];
    }
    const int tiles = (width + TILE - 1) / TILE;
    const int b = blockIdx.x / tiles;
    const int i0 = (blockIdx.x % tiles) * TILE;
    const int slots = min(TILE, width - i0);
    const int nq = slots * GROUP;
    const int kvh = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
        extern __shared__ float shared_grouped[];
    // Query qi = slot * GROUP + g is head kvh * GROUP + g of row b * width + i0 + slot.
    float* q_shared = shared_grouped;                        // [ATTN_GROUP_MAX][head_dim]
    float* merged = q_shared + ATTN_GROUP_MAX * head_dim;    // [ATTN_GROUP_MAX][head_dim]
    float* p_shared = merged + ATTN_GROUP_MAX * head_dim;    // [warps][ATTN_GROUP_MAX][32]
    float* warp_m = p_shared + warps * ATTN_GROUP_MAX * 32;  // [warps][ATTN_GROUP_MAX]
    float* warp_l = warp_m + warps * ATTN_GROUP_MAX;         // [warps][ATTN_GROUP_MAX]

    for (int x = threadIdx.x; x < nq * head_dim; x += blockDim.x) {
        const int qi = x / head_dim;
        const int d = x % head_dim;
        const int row = b * width + i0 + qi / GROUP;
        const int h = kvh * GROUP + qi % GROUP;
        q_shared[x] = q[((size_t)row * heads + h) * head_dim + d] * scale;
    }
    for (int x = threadIdx.x; x < ATTN_GROUP_MAX * head_dim; x += blockDim.x) {
        merged[x] = 0.0f;
    }
    __syncthreads();

    float acc[NQ][ATTN_GROUPED_DIMS];
    float m[NQ];
    float l[NQ];
#pragma unroll
    for (int qi = 0; qi < NQ; ++qi) {
        m[qi] = NEG_INF;
        l[qi] = 0.0f;
#pragma unroll
        for (int t = 0; t < ATTN_GROUPED_DIMS; ++t) {
            acc[qi][t] = 0.0f;
        }
    }
    const size_t base = ((size_t)b * kv_heads + kvh) * capacity * head_dim;
    const float* mask_rows = mask + (size_t)(b * width + i0) * total;
    float* p_warp = p_shared + warp * ATTN_GROUP_MAX * 32;
    for (int c0 = warp * 32; c0 < total; c0 += warps * 32) {
        const int j = c0 + lane;
        float s[NQ];
        bool any = false;
#pragma unroll
        for (int qi = 0; qi < NQ; ++qi) {
            s[qi] = NEG_INF;
        }
        if (j < total) {
            float bias[TILE];
#pragma unroll
            for (int slot = 0; slot < TILE; ++slot) {
                bias[slot] = slot < slots ? mask_rows[(size_t)slot * total + j] : NEG_INF;
                any = any || bias[slot] != NEG_INF;
            }
            if (any) {
                float dot[NQ];
#pragma unroll
                for (int qi = 0; qi < NQ; ++qi) {
                    dot[qi] = 0.0f;
                }
                const uint4* kj = reinterpret_cast<const uint4*>(k_cache + base + (size_t)j * head_dim);
#pragma unroll 4
                for (int v8 = 0; v8 < (head_dim >> 3); ++v8) {
                    const uint4 w = kj[v8];
                    const float k0 = __uint_as_float(w.x << 16), k1 = __uint_as_float(w.x & 0xffff0000u);
                    const float k2 = __uint_as_float(w.y << 16), k3 = __uint_as_float(w.y & 0xffff0000u);
                    const float k4 = __uint_as_float(w.z << 16), k5 = __uint_as_float(w.z & 0xffff0000u);
                    const float k6 = __uint_as_float(w.w << 16), k7 = __uint_as_float(w.w & 0xffff0000u);
#pragma unroll
                    for (int qi = 0; qi < NQ; ++qi) {
                        const float* qq = q_shared + qi * head_dim + v8 * 8;
                        dot[qi] += qq[0] * k0 + qq[1] * k1 + qq[2] * k2 + qq[3] * k3 +
                                   qq[4] * k4 + qq[5] * k5 + qq[6] * k6 + qq[7] * k7;
                    }
                }
#pragma unroll
                for (int qi = 0; qi < NQ; ++qi) {
                    if (bias[qi / GROUP] != NEG_INF) {
                        s[qi] = dot[qi] + bias[qi / GROUP];
                    }
                }
            }
        }
        if (!__any_sync(0xffffffffu, any)) {
            continue;  // the whole chunk is hidden from every query (warp-uniform)
        }
#pragma unroll
        for (int qi = 0; qi < NQ; ++qi) {
            if (qi < nq) {
                float chunk_max = s[qi];
                for (int offset = 16; offset > 0; offset >>= 1) {
                    chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, offset));
                }
                float p = 0.0f;
                if (chunk_max != NEG_INF) {  // warp-uniform
                    const float m_new = fmaxf(m[qi], chunk_max);
                    const float correction = expf(m[qi] - m_new);
                    p = s[qi] == NEG_INF ? 0.0f : expf(s[qi] - m_new);
                    l[qi] = l[qi] * correction + warp_sum(p);
#pragma unroll
                    for (int t = 0; t < ATTN_GROUPED_DIMS; ++t) {
                        acc[qi][t] *= correction;
                    }
                    m[qi] = m_new;
                }
                p_warp[qi * 32 + lane] = p;
            }
        }
        __syncwarp();
        const int n = min(32, total - c0);
        // Value rows 8 columns at a time, all loads issued before any is used (as in
        // `attention`); columns past `n` re-read column n - 1 with weight 0.
        for (int g = 0; g < n; g += 8) {
            unsigned short vals[8][ATTN_GROUPED_DIMS];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const unsigned short* vj =
                    v_cache + base + (size_t)(c0 + min(g + u, n - 1)) * head_dim;
#pragma unroll
                for (int t = 0; t < ATTN_GROUPED_DIMS; ++t) {
                    vals[u][t] = vj[lane + 32 * t];
                }
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                float v[ATTN_GROUPED_DIMS];
#pragma unroll
                for (int t = 0; t < ATTN_GROUPED_DIMS; ++t) {
                    v[t] = bf16_to_f32(vals[u][t]);
                }
                const bool real = g + u < n;
#pragma unroll
                for (int qi = 0; qi < NQ; ++qi) {
                    if (qi < nq) {
                        const float pj = real ? p_warp[qi * 32 + g + u] : 0.0f;
#pragma unroll
                        for (int t = 0; t < ATTN_GROUPED_DIMS; ++t) {
                            acc[qi][t] += pj * v[t];
                        }
                    }
                }
            }
        }
        __syncwarp();
    }
    if (lane == 0) {
#pragma unroll
        for (int qi = 0; qi < NQ; ++qi) {
            warp_m[warp * ATTN_GROUP_MAX + qi] = m[qi];
            warp_l[warp * ATTN_GROUP_MAX + qi] = l[qi];
        }
    }
    __syncthreads();
    // Each warp rescales its partial sums to the block's maximum and adds them, warp after warp.
    for (int w = 0; w < warps; ++w) {
        if (warp == w) {
#pragma unroll
            for (int qi = 0; qi < NQ; ++qi) {
                if (qi < nq && m[qi] != NEG_INF) {
                    float m_all = NEG_INF;
                    for (int x = 0; x < warps; ++x) {
                        m_all = fmaxf(m_all, warp_m[x * ATTN_GROUP_MAX + qi]);
                    }
                    const float f = expf(m[qi] - m_all);
#pragma unroll
                    for (int t = 0; t < ATTN_GROUPED_DIMS; ++t) {
                        merged[qi * head_dim + lane + 32 * t] += acc[qi][t] * f;
                    }
                }
            }
        }
        __syncthreads();
    }
    for (int x = threadIdx.x; x < nq * head_dim; x += blockDim.x) {
        const int qi = x / head_dim;
        const int d = x % head_dim;
        float m_all = NEG_INF;
        for (int w = 0; w < warps; ++w) {
            m_all = fmaxf(m_all, warp_m[w * ATTN_GROUP_MAX + qi]);
        }
        float l_all = 0.0f;
        for (int w = 0; w < warps; ++w) {
            const float mw = warp_m[w * ATTN_GROUP_MAX + qi];
            if (mw != NEG_INF) {
                l_all += warp_l[w * ATTN_GROUP_MAX + qi] * expf(mw - m_all);
            }
        }
        const int row = b * width + i0 + qi / GROUP;
        const int h = kvh * GROUP + qi % GROUP;
        out[((size_t)row * heads + h) * head_dim + d] = f32_to_bf16(merged[x] / l_all);
    }
}
