// Attention of wide steps (prefills, wide tree verifications) on tensor cores.
//
// `attention` in llama.cu runs one block per (query row, head) and streams that row's keys and
// values from memory: a step of n rows reads every visible key row n x (query heads) times.
// That is right for decode and narrow verification (a few rows, launch bound), and it is what
// made wide steps slow on the H200: a batch-32 prefill of 512-token prompts took 196.6 ms,
// verifying 32 tokens at batch 32 on an 8B-shaped model 121.7 ms against HF sdpa's 40.7
// (BENCHMARKS.md, session 16 and the 8B table). Session 16's grouped kernel, which shared
// column reads across a tile's queries on CUDA cores, made each warp's serial work longer and
// lost; the work has to move onto the tensor cores.
//
// Here a block takes 64 query rows of one sequence and one KV head (4 warps, 16 rows each; a
// row is a slot under one of the query heads that share the KV head) and walks the cache in
// tiles of 64 columns, FlashAttention-2 style:
// - the tile's key and value rows go to shared memory once for the block;
// - S = Q K^T for the warp's 16 rows with mma.sync m16n8k16 (bf16 in, f32 accumulate);
// - the step's mask (`[rows, total]`, 0 visible, -inf hidden, as `attention` reads it; the
//   masks the engines build hold nothing else, and this kernel reads a column as shown or
//   hidden rather than adding its value) hides scores, and an online softmax keeps each row's
//   running maximum and sum;
// - P (rounded to bf16, as FlashAttention and torch's bf16 sdpa do) times V, again on the
//   tensor cores, into f32 accumulators that are rescaled when the maximum moves;
// - a tile whose mask hides every column from all of the block's rows is skipped (the upper
//   half of a causal prefill); the mask is read once, into one bit a score.
// The query is scaled and rounded to bf16 once. Output bf16 `[rows, heads, head_dim]`, as
// `attention` writes it; a row with no visible column gets zeros.
//
// Fragment layouts are those of the PTX ISA for mma.m16n8k16 with .bf16 (groupID = lane / 4,
// tig = lane % 4): A (16x16, row-major) registers {row g, cols 2tig..+1}, {row g+8, same},
// {row g, cols 2tig+8..+9}, {row g+8, same}; B (16x8, k x n) registers {k 2tig..+1, n g},
// {k 2tig+8..+9, n g}; C/D (16x8) {row g, cols 2tig, 2tig+1}, {row g+8, same}. The S
// accumulator of two neighbouring 8-column tiles is exactly the A fragment of P for a
// 16-column k step, so P never leaves registers.
//
// Needs sm_80 or later: `tandem_cuda` compiles this source on its own (for compute_80) and
// loads it only on such GPUs; with `TANDEM_EMULATE` defined, `mma_bf16_16816` comes from the
// CPU emulator of tests/emulated_kernels (the test that checks this kernel's indexing against a
// plain attention on the CPU).

#define MMA_TILE_ROWS 64
#define MMA_TILE_KEYS 64
#define MMA_WARPS 4

// pack_bf16x2 and mma_bf16_16816 come from mma.cuh.

// The kernel for head_dim HD (64 or 128). A block's 64 query rows are (slot, head) pairs of
// one sequence and one KV head: virtual row v is slot v / group and query head
// kvh * group + v % group (group = heads / kv_heads), so the heads that share a KV head share
// its tiles in shared memory, and a narrow step (a verification of 8 tokens at GQA 3 is 24
// rows) fills a block instead of a sixteenth of one. Grid: batch * kv_heads *
// ceil(width * group / 64) blocks, block ((b * kv_heads + kvh) * row_tiles + t). Block: 128
// threads. Dynamic shared: 2 * 64 * (HD + 8) bf16 (key and value tiles; rows padded by 16 bytes
// so that the eight row groups of a fragment load fall in different banks). `step_scalars`
// (when not null) overrides `total` with step_scalars[1], as in `attention`.
template <int HD>
__device__ void attention_mma_body(const float* __restrict__ q,
                                   const unsigned short* __restrict__ k_cache,
                                   const unsigned short* __restrict__ v_cache,
                                   const float* __restrict__ mask, unsigned short* out,
                                   int width, int heads, int kv_heads, int capacity, int total,
                                   float scale, const int* step_scalars,
                                   unsigned short* tiles) {
    PDL_WAIT();
    if (step_scalars != nullptr) {
        total = step_scalars[1];
    }
    constexpr int STRIDE = HD + 8;  // bf16 per shared tile row
    constexpr int KSTEPS = HD / 16;
    constexpr int DTILES = HD / 8;
    const int group = heads / kv_heads;
    const int virtual_rows = width * group;
    const int row_tiles = (virtual_rows + MMA_TILE_ROWS - 1) / MMA_TILE_ROWS;
    const int t = blockIdx.x % row_tiles;
    const int kvh = (blockIdx.x / row_tiles) % kv_heads;
    const int b = blockIdx.x / (row_tiles * kv_heads);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int tig = lane & 3;
    unsigned short* ks = tiles;
    unsigned short* vs = tiles + MMA_TILE_KEYS * STRIDE;

    // This thread's two query rows (g and g + 8 of the warp's 16): virtual rows v0 and v1, i.e.
    // slots i0, i1 of the sequence (step rows r0, r1) under query heads h0, h1.
    const int v0 = t * MMA_TILE_ROWS + warp * 16 + g;
    const int v1 = v0 + 8;
    const bool valid0 = v0 < virtual_rows;
    const bool valid1 = v1 < virtual_rows;
    const int i0 = v0 / group, i1 = v1 / group;
    const int h0 = kvh * group + v0 % group, h1 = kvh * group + v1 % group;
    const size_t r0 = (size_t)b * width + i0;
    const size_t r1 = (size_t)b * width + i1;
    // Q as A fragments, scaled and rounded to bf16 once.
    unsigned int qa[KSTEPS][4];
    {
        const float* q0 = q + (r0 * heads + h0) * HD;
        const float* q1 = q + (r1 * heads + h1) * HD;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            const int d = kk * 16 + 2 * tig;
            qa[kk][0] = valid0 ? pack_bf16x2(q0[d] * scale, q0[d + 1] * scale) : 0u;
            qa[kk][1] = valid1 ? pack_bf16x2(q1[d] * scale, q1[d + 1] * scale) : 0u;
            qa[kk][2] = valid0 ? pack_bf16x2(q0[d + 8] * scale, q0[d + 9] * scale) : 0u;
            qa[kk][3] = valid1 ? pack_bf16x2(q1[d + 8] * scale, q1[d + 9] * scale) : 0u;
        }
    }
    const float* mask0 = mask + r0 * total;
    const float* mask1 = mask + r1 * total;
    const size_t base = ((size_t)b * kv_heads + kvh) * capacity * HD;

    float m0 = NEG_INF, m1 = NEG_INF;  // running maxima of rows g and g + 8
    float l0 = 0.0f, l1 = 0.0f;        // this thread's share of their running sums
    float o[DTILES][4];
#pragma unroll
    for (int nd = 0; nd < DTILES; ++nd) {
        o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
    }

    for (int c0 = 0; c0 < total; c0 += MMA_TILE_KEYS) {
        const int cols = min(MMA_TILE_KEYS, total - c0);
        // Which of this thread's 32 scores (rows g and g + 8, columns n * 8 + 2 tig + e) the
        // mask shows: bit n * 4 + e for row g, n * 4 + 2 + e for row g + 8. The threads of the
        // block cover its 64 rows x 64 columns between them, so the tile is skipped when no bit
        // is set anywhere; the barrier also keeps the previous tile in shared memory until
        // every warp is done with it.
        unsigned int shown = 0u;
#pragma unroll
        for (int n = 0; n < MMA_TILE_KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = n * 8 + 2 * tig + e;
                if (c < cols) {
                    if (valid0 && mask0[c0 + c] != NEG_INF) {
                        shown |= 1u << (n * 4 + e);
                    }
                    if (valid1 && mask1[c0 + c] != NEG_INF) {
                        shown |= 1u << (n * 4 + 2 + e);
                    }
                }
            }
        }
        if (!__syncthreads_or(shown != 0u)) {
            continue;
        }
        // The tile's key and value rows, 16 bytes at a time (zeros past `total`: a finite
        // product with a zero probability stays zero, a stale NaN would not).
        for (int idx = threadIdx.x; idx < MMA_TILE_KEYS * (HD / 8); idx += blockDim.x) {
            const int key = idx / (HD / 8);
            const int chunk = idx - key * (HD / 8);
            uint4 kv4 = make_uint4(0u, 0u, 0u, 0u);
            uint4 vv4 = make_uint4(0u, 0u, 0u, 0u);
            if (key < cols) {
                const size_t at = base + (size_t)(c0 + key) * HD + chunk * 8;
                kv4 = *reinterpret_cast<const uint4*>(k_cache + at);
                vv4 = *reinterpret_cast<const uint4*>(v_cache + at);
            }
            *reinterpret_cast<uint4*>(ks + key * STRIDE + chunk * 8) = kv4;
            *reinterpret_cast<uint4*>(vs + key * STRIDE + chunk * 8) = vv4;
        }
        __syncthreads();

        // S = Q K^T over the tile: 8 column tiles of 8.
        float s[MMA_TILE_KEYS / 8][4];
#pragma unroll
        for (int n = 0; n < MMA_TILE_KEYS / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            const unsigned short* krow = ks + (n * 8 + g) * STRIDE + 2 * tig;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                unsigned int kb[2];
                kb[0] = *reinterpret_cast<const unsigned int*>(krow + kk * 16);
                kb[1] = *reinterpret_cast<const unsigned int*>(krow + kk * 16 + 8);
                mma_bf16_16816(s[n], qa[kk], kb);
            }
        }
        // The mask (hidden scores to -inf), then the online softmax of rows g and g + 8 (the
        // four threads of a group hold a row between them).
        float tile_max0 = NEG_INF, tile_max1 = NEG_INF;
#pragma unroll
        for (int n = 0; n < MMA_TILE_KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                if (!((shown >> (n * 4 + e)) & 1u)) {
                    s[n][e] = NEG_INF;
                }
                if (!((shown >> (n * 4 + 2 + e)) & 1u)) {
                    s[n][2 + e] = NEG_INF;
                }
                tile_max0 = fmaxf(tile_max0, s[n][e]);
                tile_max1 = fmaxf(tile_max1, s[n][2 + e]);
            }
        }
        tile_max0 = fmaxf(tile_max0, __shfl_xor_sync(0xffffffffu, tile_max0, 1));
        tile_max0 = fmaxf(tile_max0, __shfl_xor_sync(0xffffffffu, tile_max0, 2));
        tile_max1 = fmaxf(tile_max1, __shfl_xor_sync(0xffffffffu, tile_max1, 1));
        tile_max1 = fmaxf(tile_max1, __shfl_xor_sync(0xffffffffu, tile_max1, 2));
        const float new0 = fmaxf(m0, tile_max0);
        const float new1 = fmaxf(m1, tile_max1);
        // A row that has seen nothing yet keeps its (empty) state: exp(-inf - -inf) is NaN.
        const float keep0 = new0 == NEG_INF ? 1.0f : expf(m0 - new0);
        const float keep1 = new1 == NEG_INF ? 1.0f : expf(m1 - new1);
        m0 = new0;
        m1 = new1;
        l0 *= keep0;
        l1 *= keep1;
#pragma unroll
        for (int n = 0; n < MMA_TILE_KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[n][e] = s[n][e] == NEG_INF ? 0.0f : expf(s[n][e] - m0);
                s[n][2 + e] = s[n][2 + e] == NEG_INF ? 0.0f : expf(s[n][2 + e] - m1);
                l0 += s[n][e];
                l1 += s[n][2 + e];
            }
        }
#pragma unroll
        for (int nd = 0; nd < DTILES; ++nd) {
            o[nd][0] *= keep0;
            o[nd][1] *= keep0;
            o[nd][2] *= keep1;
            o[nd][3] *= keep1;
        }
        // O += P V: four k steps of 16 columns; P's A fragment is two S tiles.
#pragma unroll
        for (int kt = 0; kt < MMA_TILE_KEYS / 16; ++kt) {
            unsigned int pa[4];
            pa[0] = pack_bf16x2(s[2 * kt][0], s[2 * kt][1]);
            pa[1] = pack_bf16x2(s[2 * kt][2], s[2 * kt][3]);
            pa[2] = pack_bf16x2(s[2 * kt + 1][0], s[2 * kt + 1][1]);
            pa[3] = pack_bf16x2(s[2 * kt + 1][2], s[2 * kt + 1][3]);
            const unsigned short* v0 = vs + (kt * 16 + 2 * tig) * STRIDE + g;
#pragma unroll
            for (int nd = 0; nd < DTILES; ++nd) {
                const unsigned short* vcol = v0 + nd * 8;
                unsigned int vb[2];
                vb[0] = (unsigned int)vcol[0] | ((unsigned int)vcol[STRIDE] << 16);
                vb[1] = (unsigned int)vcol[8 * STRIDE] | ((unsigned int)vcol[9 * STRIDE] << 16);
                mma_bf16_16816(o[nd], pa, vb);
            }
        }
    }

    // The four threads' shares of each row's sum, then the normalised rows.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f;
    const float inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int nd = 0; nd < DTILES; ++nd) {
        const int d = nd * 8 + 2 * tig;
        if (valid0) {
            *reinterpret_cast<unsigned int*>(out + (r0 * heads + h0) * HD + d) =
                pack_bf16x2(o[nd][0] * inv0, o[nd][1] * inv0);
        }
        if (valid1) {
            *reinterpret_cast<unsigned int*>(out + (r1 * heads + h1) * HD + d) =
                pack_bf16x2(o[nd][2] * inv1, o[nd][3] * inv1);
        }
    }
}

#define ATTENTION_MMA_KERNEL(HD)                                                              \
    extern "C" __global__ void attention_mma_##HD(                                            \
        const float* q, const unsigned short* k_cache, const unsigned short* v_cache,         \
        const float* mask, unsigned short* out, int width, int heads, int kv_heads,           \
        int capacity, int total, float scale, const int* step_scalars) {                      \
        DYNAMIC_SHARED(uint4, attention_mma_tiles);                                           \
        attention_mma_body<HD>(q, k_cache, v_cache, mask, out, width, heads, kv_heads,        \
                               capacity, total, scale, step_scalars,                          \
                               reinterpret_cast<unsigned short*>(attention_mma_tiles));       \
    }

ATTENTION_MMA_KERNEL(64)
ATTENTION_MMA_KERNEL(128)
