// The fused small steps' matrix products on the tensor cores: `gemv_rows`, `gemv_norm_rows`,
// `norm_gate_up_silu` and `norm_qkv_rope` of llama.cu with the same inputs, outputs and
// epilogues, for steps of at most MMA_MAX_ROWS = 32 rows in row groups of GEMV_MAX_ROWS = 8
// (grid y: one block row a group; see "Row groups" below).
//
// Why: the CUDA-core kernels of llama.cu read each weight once but multiply it into every row
// on the CUDA cores, one FMA per value and row, with a row's inputs loaded once per output
// group; from one row to eight a layer's kernels cost ~13 us more and the 49,152-wide logits
// go from 18 to ~45 us (BENCHMARKS.md, session 26), so verifying an 8-token tree costs 1.3-1.6
// decode steps. On the tensor cores a step of 1 to 8 rows is one mma.m16n8k16 per 16 weight
// rows and 16 input values, whatever the row count: eight rows cost what one does.
//
// The product is "swapped": a warp's tile is 16 weight rows (A, 16 x 16 per mma) times the
// step's rows as the 8 columns of B (k x n), so a small step fills B's n = 8 and no rows are
// padded to 16. A lane loads 16 bytes of each of its two weight rows (g and g + 8, g = lane / 4)
// and 16 bytes of input row g at the same 8 positions k0 + 8 (lane % 4) .. + 8 of a 32-value
// chunk; that is two mmas' fragments at once, under a fixed permutation of k that A and B share
// (the products summed are the same; mma_pair below spells it out). Rows past the step's
// (g >= rows) load zeros.
//
// Batch invariance (what greedy speculative output equal to target-only output rests on): each
// entry of an mma's result is the dot product of its A row and its B column, so a step row's
// outputs do not depend on the other rows, and the k order (the chunk order within a warp's
// slice, the slices added in slice order) depends on the weight's shape only. Every step of 1
// to 8 rows gives a row the same bits (the GPU test
// `tensor_core_small_steps_keep_a_rows_bits_at_every_width` checks it). The bits differ from
// the CUDA-core kernels', so a process uses one family for all its fused steps
// (`TANDEM_CUDA_MMA_ROWS`, read once when the GPU is opened).
//
// Row groups: a step of more than 8 rows (a 3/1/4 verification at batch 8 is 32) runs each
// group of 8 rows as its own block (MMA_GROUP), every block exactly what an 8-row step's
// block does for those rows: a row's bits are the same at every step width up to 32 (what
// greedy speculative output equal to target-only output needs at batch 8 too), and the
// shared memory of a block stays that of 8 rows. The blocks of a tile load the same weights:
// the group is the grid's x (the fastest index), so the blocks of one tile are launched one
// after another and all but the first find its weights in L2. With the group as y (the
// order before session 45, `MMA_GROUPS_IN_Y`), group 0 went through every tile before group
// 1 began, and the logits' 56 MB of weights (SmolLM2), more than an H100's L2, came from
// memory once per group; a step of 32 rows on the unfused kernels cost ~1.8 plain 8-row
// rounds (session 42), which is what kept drafting at c=8 at break-even.
//
// Block: `split` warps (blockDim.x = 32 * split) share one tile's k range, each over its own
// contiguous slice of at most MMA_ROWS_CHUNKS chunks of 32 values (loaded at once: one trip to
// memory), summed in slice order through shared memory; warp 0 writes. Grid: one block a tile
// and row group.
// Needs sm_80 (mma.sync with bf16): compiled on its own for compute_80 (compute_90 with
// programmatic dependent launch), like attention_mma.cu. Weight and input widths: multiples of
// 32. Fragment layouts: see attention_mma.cu's header.

#define MMA_ROWS_CHUNKS 4
#define MMA_ROWS_MAX_SPLIT 16
// Rows of a row group (an mma's n = 8): a block's rows.
#define GROUP_ROWS 8

// A block's tile and row group (see "Row groups" above; `mma_rows::config` makes the grid).
#ifdef MMA_GROUPS_IN_Y
#define MMA_TILE blockIdx.x
#define MMA_GROUP blockIdx.y
#else
#define MMA_TILE blockIdx.y
#define MMA_GROUP blockIdx.x
#endif

// pack_bf16x2 and mma_bf16_16816 come from mma.cuh.

// One operand pair of a product: a weight matrix ([*, 32 * chunks] bf16, row-major) and the
// step's input rows of the same width (bf16 [rows, 32 * chunks], shared or global memory).
struct MmaOperand {
    const unsigned short* w;
    const unsigned short* x;
    int chunks;
};

// c += the 16 x 8 tile of one 32-value chunk: lo and hi are 16 bytes of weight rows g and
// g + 8, x 16 bytes of input row g, all at the chunk's values 8t .. 8t + 7 (t = lane % 4). The
// first mma takes the values 8t + {0, 1} as its k = {2t, 2t + 1} and 8t + {2, 3} as k =
// {2t + 8, 2t + 9} (the .x and .y words), the second the .z and .w words: over the four lanes
// of a row that is every value of the chunk once, the same pairing in A and B.
__device__ __forceinline__ void mma_pair(float (&c)[4], const uint4& lo, const uint4& hi,
                                         const uint4& x) {
    const unsigned int a0[4] = {lo.x, hi.x, lo.y, hi.y};
    const unsigned int b0[2] = {x.x, x.y};
    mma_bf16_16816(c, a0, b0);
    const unsigned int a1[4] = {lo.z, hi.z, lo.w, hi.w};
    const unsigned int b1[2] = {x.z, x.w};
    mma_bf16_16816(c, a1, b1);
}

// The block's tile: weight rows row_lo (as A row g) and row_hi (A row g + 8) of each operand
// (the same rows of both), times the step's `rows` input rows, over the k range of `first`
// then `second` (second.chunks may be 0). Each warp loads its slice's weights, calls `stage`
// (every thread of the block, once: PDL_WAIT and whatever the inputs need, ending in a
// barrier when it writes shared memory), then its inputs, and multiplies. Returns true in warp
// 0, whose c then holds the tile: c[0], c[1] = A row g at step rows 2t, 2t + 1; c[2], c[3] = A
// row g + 8 at the same rows.
// `slice` and `split`: this warp's slice and the warps sharing the tile (the block's warps in
// mma_rows_tile; a group of them in qkv_attention_mma, each group a tile), `partial` shared
// room for `split` warps' partial tiles. Every warp of the block calls it once (it ends in a
// barrier when `split` > 1).
template <typename Stage>
__device__ __forceinline__ bool mma_rows_tile_of(const MmaOperand& first,
                                                 const MmaOperand& second, size_t row_lo,
                                                 size_t row_hi, int rows, Stage stage,
                                                 float (&c)[4], int slice, int split,
                                                 float (*partial)[4][32]) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int chunks = first.chunks + second.chunks;
    const int per_slice = (chunks + split - 1) / split;
    const int begin = min(chunks, slice * per_slice);
    const int end = min(chunks, begin + per_slice);
    // Chunk cc of the k range: its operand's weight and input, their width, and the offset of
    // this lane's 8 values in a row (selected by value: no operand's address is taken).
    auto locate = [&](int cc, const unsigned short*& w, const unsigned short*& x, int& width,
                      int& k) {
        const bool in_second = cc >= first.chunks;
        w = in_second ? second.w : first.w;
        x = in_second ? second.x : first.x;
        width = (in_second ? second.chunks : first.chunks) * 32;
        k = (in_second ? cc - first.chunks : cc) * 32 + 8 * t;
    };
    uint4 lo[MMA_ROWS_CHUNKS], hi[MMA_ROWS_CHUNKS];
    auto load_weights = [&](int base) {
#pragma unroll
        for (int u = 0; u < MMA_ROWS_CHUNKS; ++u) {
            if (base + u < end) {
                const unsigned short* w;
                const unsigned short* x;
                int width, k;
                locate(base + u, w, x, width, k);
                lo[u] = __ldg(reinterpret_cast<const uint4*>(w + row_lo * width + k));
                hi[u] = __ldg(reinterpret_cast<const uint4*>(w + row_hi * width + k));
            }
        }
    };
    PDL_LAUNCH_DEPENDENTS();
    load_weights(begin);
    stage();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        c[i] = 0.0f;
    }
    for (int base = begin; base < end; base += MMA_ROWS_CHUNKS) {
        uint4 xv[MMA_ROWS_CHUNKS];
#pragma unroll
        for (int u = 0; u < MMA_ROWS_CHUNKS; ++u) {
            xv[u] = make_uint4(0, 0, 0, 0);
            if (base + u < end && g < rows) {
                const unsigned short* w;
                const unsigned short* x;
                int width, k;
                locate(base + u, w, x, width, k);
                xv[u] = *reinterpret_cast<const uint4*>(x + (size_t)g * width + k);
            }
        }
#pragma unroll
        for (int u = 0; u < MMA_ROWS_CHUNKS; ++u) {
            if (base + u < end) {  // warp-uniform: every lane takes part in the mma
                mma_pair(c, lo[u], hi[u], xv[u]);
            }
        }
        if (base + MMA_ROWS_CHUNKS < end) {
            load_weights(base + MMA_ROWS_CHUNKS);
        }
    }
    if (split > 1) {
        if (slice > 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                partial[slice][i][lane] = c[i];
            }
        }
        __syncthreads();
        if (slice != 0) {
            return false;
        }
        for (int s = 1; s < split; ++s) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                c[i] += partial[s][i][lane];
            }
        }
    }
    return slice == 0;
}

template <typename Stage>
__device__ __forceinline__ bool mma_rows_tile(const MmaOperand& first, const MmaOperand& second,
                                              size_t row_lo, size_t row_hi, int rows,
                                              Stage stage, float (&c)[4]) {
    __shared__ float partial[MMA_ROWS_MAX_SPLIT][4][32];
    return mma_rows_tile_of(first, second, row_lo, row_hi, rows, stage, c, threadIdx.x >> 5,
                            blockDim.x >> 5, partial);
}

// No input to stage (it is in global memory, written by an earlier launch): wait for it.
struct WaitOnly {
    __device__ __forceinline__ void operator()() const { PDL_WAIT(); }
};

// y[r, o] = x[r, :] . w[o, :] (or y +=, `accumulate`), as gemv_rows. Grid: ceil(out / 16).
// `tap` (null: none) gets a copy of what y gets: a block's output written into a capture slot
// by the launch that computes it, so a step with taps has no copy nodes between its launches
// (a memcpy node costs a launch and ends the chain of programmatic dependent launches).
extern "C" __global__ void gemv_rows_mma(const unsigned short* __restrict__ x,
                                         const unsigned short* __restrict__ w,
                                         float* __restrict__ y, float* __restrict__ tap,
                                         int rows, int inp, int out, int accumulate) {
    const int r0 = MMA_GROUP * GROUP_ROWS;  // this block's row group
    rows = min(rows - r0, GROUP_ROWS);
    x += (size_t)r0 * inp;
    y += (size_t)r0 * out;
    if (tap != nullptr) {
        tap += (size_t)r0 * out;
    }
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int o0 = MMA_TILE * 16;
    const size_t lo = min(o0 + g, out - 1);  // rows past the end load a valid row, write nothing
    const size_t hi = min(o0 + g + 8, out - 1);
    const MmaOperand a{w, x, inp >> 5};
    const MmaOperand none{w, x, 0};
    float c[4];
    // With `accumulate`, warp 0 reads the outputs it will add to right after the wait, so the
    // read is in flight during the product instead of one more trip to memory after it
    // (prev + c and c + prev are the same float).
    float prev[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    auto stage = [&]() {
        PDL_WAIT();
        if (accumulate && threadIdx.x < 32) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int o = o0 + g + (i >= 2 ? 8 : 0);
                const int r = 2 * t + (i & 1);
                if (o < out && r < rows) {
                    prev[i] = y[(size_t)r * out + o];
                }
            }
        }
    };
    if (!mma_rows_tile(a, none, lo, hi, rows, stage, c)) {
        return;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int o = o0 + g + (i >= 2 ? 8 : 0);
        const int r = 2 * t + (i & 1);
        if (o < out && r < rows) {
            const float value = accumulate ? prev[i] + c[i] : c[i];
            y[(size_t)r * out + o] = value;
            if (tap != nullptr) {
                tap[(size_t)r * out + o] = value;
            }
        }
    }
}

// y[r, o] = bf16(rms_norm(xf[r]) * norm_w) . w[o, :], as gemv_norm_rows. Grid: ceil(out / 16);
// dynamic shared: rows * inp bf16.
extern "C" __global__ void gemv_norm_rows_mma(const float* __restrict__ xf,
                                              const unsigned short* __restrict__ norm_w,
                                              const unsigned short* __restrict__ w,
                                              float* __restrict__ y, int rows, int inp, int out,
                                              float eps) {
    const int r0 = MMA_GROUP * GROUP_ROWS;
    rows = min(rows - r0, GROUP_ROWS);
    xf += (size_t)r0 * inp;
    y += (size_t)r0 * out;
    DYNAMIC_SHARED(uint4, mma_shared);
    unsigned short* xs = reinterpret_cast<unsigned short*>(mma_shared);
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int o0 = MMA_TILE * 16;
    const size_t lo = min(o0 + g, out - 1);
    const size_t hi = min(o0 + g + 8, out - 1);
    const MmaOperand a{w, xs, inp >> 5};
    const MmaOperand none{w, xs, 0};
    float c[4];
    auto stage = [&]() {
        PDL_WAIT();
        stage_rms_normed(xf, norm_w, xs, rows, inp, eps);
    };
    if (!mma_rows_tile(a, none, lo, hi, rows, stage, c)) {
        return;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int o = o0 + g + (i >= 2 ? 8 : 0);
        const int r = 2 * t + (i & 1);
        if (o < out && r < rows) {
            y[(size_t)r * out + o] = c[i];
        }
    }
}

// act[r, j] = bf16(silu(gate) * up), as norm_gate_up_silu: a tile is gate rows j0 .. j0 + 7
// (A rows 0-7) and their up rows inter + j0 .. (A rows 8-15), so a lane holds both of an
// output. Grid: ceil(inter / 8); dynamic shared: rows * hidden bf16.
extern "C" __global__ void norm_gate_up_silu_mma(const float* __restrict__ x,
                                                 const unsigned short* __restrict__ norm_w,
                                                 const unsigned short* __restrict__ w,
                                                 unsigned short* __restrict__ act, int rows,
                                                 int hidden, int inter, float eps) {
    const int r0 = MMA_GROUP * GROUP_ROWS;
    rows = min(rows - r0, GROUP_ROWS);
    x += (size_t)r0 * hidden;
    act += (size_t)r0 * inter;
    DYNAMIC_SHARED(uint4, mma_shared);
    unsigned short* xs = reinterpret_cast<unsigned short*>(mma_shared);
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int j = MMA_TILE * 8 + g;
    const int jw = min(j, inter - 1);
    const MmaOperand a{w, xs, hidden >> 5};
    const MmaOperand none{w, xs, 0};
    float c[4];
    auto stage = [&]() {
        PDL_WAIT();
        stage_rms_normed(x, norm_w, xs, rows, hidden, eps);
    };
    if (!mma_rows_tile(a, none, (size_t)jw, (size_t)(inter + jw), rows, stage, c)) {
        return;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 2 * t + i;
        if (j < inter && r < rows) {
            const float gate = c[i];
            act[(size_t)r * inter + j] = f32_to_bf16(gate / (1.0f + expf(-gate)) * c[2 + i]);
        }
    }
}

// q|k|v of the normed input, the bias, RoPE and the cache write, as norm_qkv_rope (same
// arguments): a tile is 8 rotation pairs p0 .. p0 + 7, the first rows of the pairs as A rows
// 0-7 and the second (+ head_dim / 2) as A rows 8-15, so a lane holds both values of a pair.
// With x2 (the EAGLE-3 head) the second input's weight continues the k range. The inputs are
// staged a row per warp, both inputs' rows at once. Grid: ceil(pairs / 8); dynamic shared:
// rows * hidden bf16, twice with x2.
extern "C" __global__ void norm_qkv_rope_mma(const float* __restrict__ x,
                                             const unsigned short* __restrict__ norm_w,
                                             const unsigned short* __restrict__ w,
                                             const float* __restrict__ x2,
                                             const unsigned short* __restrict__ norm_w2,
                                             const unsigned short* __restrict__ w2,
                                             const float* __restrict__ bias,
                                             const int* __restrict__ positions,
                                             const float* __restrict__ inv_freq,
                                             float* __restrict__ q_out, unsigned short* k_cache,
                                             unsigned short* v_cache, int rows, int hidden,
                                             int width, int heads, int kv_heads, int head_dim,
                                             int capacity, int col0, const int* step_scalars,
                                             float eps,
                                             const unsigned short* __restrict__ embed_table,
                                             const unsigned int* __restrict__ tokens) {
    // The group's rows are staged and multiplied as rows 0 .. 7; their positions, q rows and
    // cache columns are those of step rows r0 + r.
    const int r0 = MMA_GROUP * GROUP_ROWS;
    rows = min(rows - r0, GROUP_ROWS);
    if (x != nullptr) {
        x += (size_t)r0 * hidden;
    }
    if (x2 != nullptr) {
        x2 += (size_t)r0 * hidden;
    }
    if (tokens != nullptr) {
        tokens += r0;
    }
    DYNAMIC_SHARED(uint4, mma_shared);
    unsigned short* xs = reinterpret_cast<unsigned short*>(mma_shared);
    unsigned short* xs2 = xs + (size_t)rows * hidden;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int half = head_dim / 2;
    const int pairs = (heads + 2 * kv_heads) * half;
    const int p = MMA_TILE * 8 + g;
    const int pw = min(p, pairs - 1);
    const int h = pw / half;
    const int jj = pw % half;
    const size_t row1 = (size_t)h * head_dim + jj;
    const MmaOperand a{w, xs, hidden >> 5};
    const MmaOperand b{w2, xs2, x2 != nullptr ? hidden >> 5 : 0};
    float c[4];
    // Warp 0 writes the pairs: it reads their bias, frequency, positions and first cache
    // column right after the wait, so they arrive during the product instead of after it.
    QkvPairInputs pair_in[2];
    auto stage = [&]() {
        PDL_WAIT();
        const int warp = threadIdx.x >> 5;
        const int warps = blockDim.x >> 5;
        if (warp == 0) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = r0 + min(2 * t + i, rows - 1);
                pair_in[i] = qkv_pair_inputs(bias, (int)row1, jj, r, head_dim, positions, inv_freq);
            }
            if (step_scalars != nullptr) {
                col0 = step_scalars[0];
            }
        }
        const int inputs = x2 != nullptr ? 2 : 1;
        for (int task = warp; task < inputs * rows; task += warps) {
            if (task >= rows) {
                stage_rms_normed_row(F32Rows{x2}, norm_w2, xs2, task - rows, hidden, eps);
            } else if (embed_table != nullptr) {
                stage_rms_normed_row(EmbedRows{embed_table, tokens}, norm_w, xs, task, hidden,
                                     eps);
            } else {
                stage_rms_normed_row(F32Rows{x}, norm_w, xs, task, hidden, eps);
            }
        }
        __syncthreads();
    };
    if (!mma_rows_tile(a, b, row1, row1 + half, rows, stage, c)) {
        return;
    }
    if (p >= pairs) {
        return;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 2 * t + i;
        if (r < rows) {
            qkv_pair_out_with(c[i], c[2 + i], pair_in[i], h, jj, r0 + r, q_out, k_cache, v_cache,
                              width, heads, kv_heads, head_dim, capacity, col0);
        }
    }
}

// ---- A step's q|k|v and attention in one launch (decode steps and small verifications) ----
//
// Why: at batch 1 a fused layer is five dependent launches (norm_qkv_rope_mma, attention, o_proj,
// gate|up, down), ~19 us a layer on an H100 against ~2 us of weights. In a decode step (one new
// token a sequence) a row's attention needs no other row's keys, only its cache and its own new
// key and value, so the blocks of one (row, query head) can compute that head's q, its
// key-value head's k and v (4 + 4 + 4 tiles of 8 rotation pairs at head_dim 64), write them
// where norm_qkv_rope_mma does, and attend: four launches a layer.
//
// A cluster a (row, head): session 47 measured this kernel with one block a (row, head)
// (`cluster` 1): a head's 221 KB of q|k|v weights through one block in four passes, the later
// ones after the wait, cost more than the launch saved (batch-1 decode 0.717 ms of device time
// against 0.580). With a cluster of `cluster` blocks (sm_90 thread-block clusters) block rank c
// takes passes c, c + cluster, ...: with as many ranks as passes every block loads its one
// pass's weights before the wait, as norm_qkv_rope_mma's blocks do, and the head's tiles are
// spread over as many blocks (SmolLM2 in clusters of 6, the default: 54 blocks of 2 tiles at
// batch 1, against 60 of one). The cluster's barrier (release / acquire at cluster scope) then
// makes every rank's q, k and v writes visible to the last rank, which attends; the others
// leave. Session 48 (H100): a batch-1 decode 0.533 ms of device time against 0.580 with the two
// launches (clusters of 4: 0.544); from two rows on each row's blocks load the head's weights
// again and it loses (eight rows 1.10 ms against 0.70), so only one-row decode steps take it.
//
// Verifications (`width` > 1 tokens a sequence, at most 8: one mma's columns): a cluster a
// (sequence, head) computes the q|k|v of all the sequence's tokens (the tile's mma takes them as
// its columns, as norm_qkv_rope_mma takes a row group's rows), writes every token's k and v to
// its cache column col0 + token, and after the cluster barrier token j is attended by rank
// cluster - 1 - j (j + cluster, ... by the same rank): a token's attention reads the keys its
// earlier tokens wrote in this launch, which the barrier makes visible. The weights are loaded
// once for the sequence's tokens, so a one-sequence verification costs what a decode step does
// plus its tokens' attention.
//
// Bits: each tile is mma_rows_tile_of over the same k slices, summed in the same order, of the
// same staged row as norm_qkv_rope_mma's tile (the row alone as the mma's only column: an entry
// of the product does not depend on the other columns), and the epilogue is the same
// qkv_pair_out_with; the attention is attention_block over the row's visible keys, whose fold
// order does not depend on the block's warps. So a decode row gets the bits it gets from the
// two launches (and from a verification step of any width): greedy speculative output stays
// equal to target-only output, whichever rank computes a tile. The query heads of one key-value
// head each write that head's key and value (the same bits) before reading them back.
//
// Block: `groups` groups of split(hidden) warps (at most QKV_ATTENTION_MAX_THREADS threads), one
// tile a group per pass, 3 * head_dim / 16 tiles in ceil(tiles / groups) passes; a block's later
// passes' weights are fetched into L2 before the wait. Grid: sequences * heads * cluster (blocks
// (b * heads + h) * cluster + rank, as attention_invariant's with each block a cluster).
// Dynamic shared: each pass's pair inputs (a token each), the staged rows (width * hidden bf16),
// the groups' partial tiles (512 bytes a warp), then the attention's warps * (head_dim + 2) +
// head_dim f32. One
// input only (the EAGLE-3 head's two-input q|k|v keeps the two launches), and no q/k norm
// (Qwen3 keeps them too). A rank takes at most mma_rows::QKV_ATTENTION_MAX_PASSES passes (the
// launcher's limit; the kernel itself takes any number).
// Threads a block may have (defined by the compiling code: mma_rows::QKV_ATTENTION_THREADS):
// 512 leave each thread 128 registers; the products hold four chunks of two weight rows and of
// the input in flight, as norm_qkv_rope_mma does with ~108.
#ifndef QKV_ATTENTION_MAX_THREADS
#define QKV_ATTENTION_MAX_THREADS 512
#endif

// The barrier of a thread-block cluster, with release / acquire at cluster scope: every
// rank's writes before it (global memory included) are visible to every rank after it. sm_90
// only, which is what TANDEM_PDL compiles for (compute_90); launches without it use clusters of
// one block, where a block barrier is the same. The emulator runs a cluster's blocks one after
// another in rank order, so the last rank, the one that reads, runs after every writer.
__device__ __forceinline__ void cluster_barrier(int cluster) {
#if defined(TANDEM_EMULATE)
    (void)cluster;
    __syncthreads();
#elif defined(TANDEM_PDL) && TANDEM_PDL
    if (cluster > 1) {
        asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                     "barrier.cluster.wait.acquire.aligned;" ::: "memory");
    } else {
        __syncthreads();
    }
#else
    (void)cluster;
    __syncthreads();
#endif
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef TANDEM_EMULATE
    (void)p;
#else
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// The layer's output from its residual and the MLP's cluster sums (what mlp_partials_mma
// wrote), one float4 of row r at i: x + (((s_0 + s_1) + s_2) + ...), the clusters in order.
// Every reader of a layer's output takes it from here, so it has the same bits everywhere.
__device__ __forceinline__ float4 sum_mlp_partials(const float* __restrict__ x,
                                                   const float* __restrict__ sums, int parts,
                                                   int step_rows, int r, int hidden, int i) {
    const float4* s = reinterpret_cast<const float4*>(sums) + ((size_t)r * hidden >> 2) + i;
    const size_t stride = (size_t)step_rows * hidden >> 2;
    float4 acc = s[0];
    for (int p = 1; p < parts; ++p) {
        const float4 v = s[p * stride];
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
    }
    const float4 v = reinterpret_cast<const float4*>(x + (size_t)r * hidden)[i];
    return make_float4(v.x + acc.x, v.y + acc.y, v.z + acc.z, v.w + acc.w);
}

// Where qkv_attention_mma keeps the summed input rows (width * hidden f32) when it adds the
// MLP's partial sums: after the attention's partials and query, at a 16-byte boundary
// (`qkv_attention_shared_bytes` with the sums in Rust).
__device__ __forceinline__ float* qkv_attention_sum_rows(float (*all_partials)[4][32],
                                                         int partial_warps, int warps,
                                                         int head_dim) {
    float* end = reinterpret_cast<float*>(all_partials + partial_warps) +
                 warps * (head_dim + 2) + head_dim;
    return reinterpret_cast<float*>((reinterpret_cast<size_t>(end) + 15) & ~(size_t)15);
}

// The block's share of a one-launch q|k|v and attention's input when it is the previous
// layer's output as mlp_partials_mma left it: rows r .. r + width - 1 summed
// (sum_mlp_partials) into `sum_rows` (shared), and into `x_out` and `tap` (null: not this
// block's to write). A call of its own, as qkv_attention_attend: inlined, its loads beside the
// products' weights spilled at 128 registers (sm_80).
__device__ __noinline__ void qkv_attention_sum_input(const float* x_rows, const float* mlp_sums,
                                                     int mlp_parts, int step_rows, int r,
                                                     int width, int hidden, float* sum_rows,
                                                     float* x_out, float* tap) {
    const int n4 = hidden >> 2;
    for (int i = threadIdx.x; i < width * n4; i += blockDim.x) {
        const int tok = i / n4;
        const int k4 = i % n4;
        const float4 v =
            sum_mlp_partials(x_rows, mlp_sums, mlp_parts, step_rows, r + tok, hidden, k4);
        reinterpret_cast<float4*>(sum_rows + (size_t)tok * hidden)[k4] = v;
        if (x_out != nullptr) {
            reinterpret_cast<float4*>(x_out + (size_t)(r + tok) * hidden)[k4] = v;
            if (tap != nullptr) {
                reinterpret_cast<float4*>(tap + (size_t)(r + tok) * hidden)[k4] = v;
            }
        }
    }
}

// attention_block as a call of its own: inlined, its value loads and the products' live values
// together spilled a few bytes a thread at 128 registers (sm_90).
__device__ __noinline__ void qkv_attention_attend(const float* q, float scale,
                                                 const unsigned short* k_cache,
                                                 const unsigned short* v_cache, size_t base,
                                                 const int* list, int count, const float* mask_row,
                                                 int head_dim, float* shared_partials,
                                                 float* q_shared, unsigned short* dst) {
    attention_block(q, scale, k_cache, v_cache, base, list, count, mask_row, head_dim,
                    shared_partials, q_shared, dst);
}

extern "C" __global__ void __launch_bounds__(QKV_ATTENTION_MAX_THREADS)
    qkv_attention_mma(const float* __restrict__ x, const unsigned short* __restrict__ norm_w,
                      const unsigned short* __restrict__ w, const float* __restrict__ bias,
                      const int* __restrict__ positions, const float* __restrict__ inv_freq,
                      float* q_out, unsigned short* k_cache, unsigned short* v_cache,
                      const float* __restrict__ mask, const int* __restrict__ list,
                      const int* __restrict__ counts, unsigned short* __restrict__ out,
                      int hidden, int heads, int kv_heads, int head_dim, int capacity, int col0,
                      int total, float scale, const int* step_scalars, float eps, int groups,
                      int cluster, int width, const float* __restrict__ mlp_sums, int mlp_parts,
                      float* __restrict__ x_out, float* __restrict__ tap) {
    const int rank = blockIdx.x % cluster;
    const int b = blockIdx.x / cluster / heads;  // the sequence; its tokens are step rows
    const int r = b * width;                     // b * width .. + width - 1
    const int h = blockIdx.x / cluster % heads;
    const int kvh = h / (heads / kv_heads);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int split = warps / groups;
    const int group = warp / split;
    const int slice = warp % split;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int half = head_dim / 2;
    const int head_tiles = half / 8;
    const int tiles = 3 * head_tiles;
    const int passes = (tiles + groups - 1) / groups;
    const float* x_rows = x;  // the step's rows (mlp_sums: the previous layer's residual)
    x += (size_t)r * hidden;
    // Dynamic shared memory: each pass's pair inputs (8 a group, a token each), the staged
    // rows, the groups' partial tiles, the attention's partials and query (sizes:
    // qkv_attention_shared_bytes).
    DYNAMIC_SHARED(uint4, mma_shared);
    QkvPairInputs* pair_shared = reinterpret_cast<QkvPairInputs*>(mma_shared);
    unsigned short* xs = reinterpret_cast<unsigned short*>(
        mma_shared + (passes * groups * 8 * width * sizeof(QkvPairInputs) + 15) / 16);
    float(*all_partials)[4][32] =
        reinterpret_cast<float(*)[4][32]>(xs + (((size_t)width * hidden + 7) & ~7));
    float(*partials)[4][32] = all_partials + group * split;
    // Tile i of this block (clamped: a group without a tile in the last pass repeats the last
    // one and writes nothing): its first pair's (q|k|v) head and index in that head.
    auto tile_head = [&](int i, int& ph, int& jj0) {
        i = min(i, tiles - 1);
        const int section = i / head_tiles;
        ph = section == 0 ? h : (section == 1 ? heads + kvh : heads + kv_heads + kvh);
        jj0 = (i % head_tiles) * 8;
    };
    // This rank's later passes' weight rows (two runs of 8 rows of `hidden` values) into L2 now.
    for (int pass = rank + cluster; pass < passes; pass += cluster) {
        int ph, jj0;
        tile_head(pass * groups + group, ph, jj0);
        const int lines = hidden * 2 * 8 / 128;  // 128-byte lines of a run of 8 rows
        for (int i = slice * 32 + lane; i < 2 * lines; i += split * 32) {
            const size_t row = (size_t)ph * head_dim + jj0 + (i >= lines ? half : 0);
            prefetch_l2(reinterpret_cast<const char*>(w + row * hidden) + (i % lines) * 128);
        }
    }
    const MmaOperand a{w, xs, hidden >> 5};
    const MmaOperand none{w, xs, 0};
#pragma unroll 1
    for (int pass = rank; pass < passes; pass += cluster) {
        int ph, jj0;
        tile_head(pass * groups + group, ph, jj0);
        const size_t row1 = (size_t)ph * head_dim + jj0 + g;
        auto stage = [&]() {
            if (pass > rank) {
                return;
            }
            PDL_WAIT();
            if (step_scalars != nullptr) {
                col0 = step_scalars[0];
                total = step_scalars[1];
            }
            // This rank's passes' pair inputs (each token's), by the first warp of each group.
            if (slice == 0) {
                for (int p = rank; p < passes; p += cluster) {
                    int php, jjp;
                    tile_head(p * groups + group, php, jjp);
                    for (int tok = t; tok < width; tok += 4) {
                        pair_shared[((p * groups + group) * 8 + g) * width + tok] =
                            qkv_pair_inputs(bias, php * head_dim + jjp + g, jjp + g, r + tok,
                                            head_dim, positions, inv_freq);
                    }
                }
            }
            if (mlp_sums != nullptr) {
                // The input is the previous layer's output, its residual plus its MLP's
                // cluster sums (mlp_partials_mma), added here by every block of the
                // sequence in the one order (sum_mlp_partials); the (head 0, rank 0) block
                // also writes it as the new residual and into the previous layer's tap.
                float* sum_rows = qkv_attention_sum_rows(all_partials, groups * split, warps,
                                                         head_dim);
                qkv_attention_sum_input(x_rows, mlp_sums, mlp_parts,
                                        (int)(gridDim.x / cluster / heads) * width, r, width,
                                        hidden, sum_rows, h == 0 && rank == 0 ? x_out : nullptr,
                                        tap);
                __syncthreads();
                for (int tok = warp; tok < width; tok += warps) {
                    stage_rms_normed_row(F32Rows{sum_rows}, norm_w, xs, tok, hidden, eps);
                }
            } else {
                for (int tok = warp; tok < width; tok += warps) {
                    stage_rms_normed_row(F32Rows{x}, norm_w, xs, tok, hidden, eps);
                }
            }
            __syncthreads();
        };
        float c[4];
        const bool leader = mma_rows_tile_of(a, none, row1, row1 + half, width, stage, c,
                                             slice, split, partials);
        if (leader && pass * groups + group < tiles) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int tok = 2 * t + i;  // c[i], c[2 + i]: this lane's step rows
                if (tok < width) {
                    qkv_pair_out_with(
                        c[i], c[2 + i],
                        pair_shared[((pass * groups + group) * 8 + g) * width + tok], ph,
                        jj0 + g, r + tok, q_out, k_cache, v_cache, width, heads, kv_heads,
                        head_dim, capacity, col0);
                }
            }
        }
        // The partial tiles are reused by the next pass; q, k and v are read back below.
        __syncthreads();
    }
    // A rank without a pass (more ranks than passes) still waits for its predecessor before
    // the barrier: the last rank reads step_scalars and the caches after it.
    if (rank >= passes) {
        PDL_WAIT();
        if (step_scalars != nullptr) {
            total = step_scalars[1];
        }
    }
    cluster_barrier(cluster);
    // Token j is attended by rank cluster - 1 - j (then j + cluster, ...): the tokens of a
    // verification in parallel, a decode's one token by the last rank. The emulator runs a
    // cluster's ranks one after another, so there the last rank, which runs after every
    // writer, attends every token (the same bits: attention_block does not depend on which
    // block runs it).
#ifdef TANDEM_EMULATE
    const int first = rank == cluster - 1 ? 0 : width;
    const int stride = 1;
#else
    const int first = cluster - 1 - rank;
    const int stride = cluster;
#endif
    float* attention_partials = reinterpret_cast<float*>(all_partials + groups * split);
    float* q_shared = attention_partials + warps * (head_dim + 2);
    for (int tok = first; tok < width; tok += stride) {
        if (tok > first) {
            __syncthreads();  // the previous token's partials and query are read
        }
        const int row = r + tok;
        qkv_attention_attend(q_out + ((size_t)row * heads + h) * head_dim, scale, k_cache,
                             v_cache, ((size_t)b * kv_heads + kvh) * capacity * head_dim,
                             list + (size_t)row * capacity, counts[row],
                             mask + (size_t)row * total, head_dim, attention_partials, q_shared,
                             out + ((size_t)row * heads + h) * head_dim);
    }
}

// ---- A fused layer's MLP in one launch: gate|up, SwiGLU and down_proj's partial sums ----
//
// Why: at batch 1 a fused layer's MLP is two dependent launches (norm_gate_up_silu_mma, then
// down_proj's gemv_rows_mma adding into the residual), and every launch boundary of the chain
// is a grid's completion, a flush and the next grid's first trip to L2 (~4 us a launch at
// batch 1 on an H100 against ~2 us of a layer's weights). Here the blocks that compute a slice
// of the SwiGLU activations multiply that slice into down_proj's columns at once (split-k):
// block s holds act[:, 16 s .. 16 s + 15] in shared memory and computes
// down[:, 16 s ..] . act[:, 16 s ..]^T for every output, so no block needs another's
// activations. The slices' products are summed in two fixed orders: inside a cluster of
// `cluster` blocks after the cluster barrier (rank q sums outputs q * hidden / cluster ..
// over the ranks in rank order), then across the clusters by whoever reads the layer's output
// (`sum_mlp_partials`: the next layer's one-launch q|k|v and attention, or add_mlp_partials).
//
// Measured (session 51, H100): slower than the two launches (a batch-1 decode 0.639 ms of
// device time against 0.555; a 32-row verification 1.633 against 1.092): the launch boundary
// it removes costs less than the trips to L2 it adds (the slices' products, the cluster sums,
// the reader's sum). Off by default (`TANDEM_CUDA_MLP_CLUSTER=8` in Rust turns it on).
//
// Bits: act is computed exactly as norm_gate_up_silu_mma computes it (the same tiles, the same
// k slices over split(hidden) warps, the same epilogue), and the rest depends on the weights'
// shapes only, never on the step's rows: a row gets the same bits in every step of 1 to 32
// rows (row groups of 8 as the grid's y, each block exactly what an 8-row step's block does).
//
// Grid: (inter / 16, row groups); clusters of `cluster` blocks along x (inter / 16 a multiple
// of it). Block: two groups of split(hidden) warps, one gate|up tile (8 gate rows and their up
// rows) each. Dynamic shared: GROUP_ROWS * hidden bf16 (the normed rows), the groups' partial
// tiles (512 bytes a warp), GROUP_ROWS * 16 bf16 (the activations).
// `scratch`: [inter / 16][rows][hidden] f32, each block's products; `sums`: [inter / 16 /
// cluster][rows][hidden] f32, each cluster's. With `act_out` (tests), the activations too.
#define MLP_SLICE 16
extern "C" __global__ void mlp_partials_mma(const float* __restrict__ x,
                                            const unsigned short* __restrict__ norm_w,
                                            const unsigned short* __restrict__ gate_up_w,
                                            const unsigned short* __restrict__ down_w,
                                            float* __restrict__ scratch, float* __restrict__ sums,
                                            unsigned short* __restrict__ act_out, int rows,
                                            int hidden, int inter, float eps, int cluster) {
    const int step_rows = rows;
    const int r0 = blockIdx.y * GROUP_ROWS;
    rows = min(rows - r0, GROUP_ROWS);
    x += (size_t)r0 * hidden;
    const int slice_block = blockIdx.x;
    const int j0 = slice_block * MLP_SLICE;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int split = warps / 2;
    const int group = warp / split;
    const int slice = warp % split;
    const int g = lane >> 2;
    const int t = lane & 3;
    DYNAMIC_SHARED(uint4, mma_shared);
    unsigned short* xs = reinterpret_cast<unsigned short*>(mma_shared);
    float(*all_partials)[4][32] =
        reinterpret_cast<float(*)[4][32]>(xs + (((size_t)GROUP_ROWS * hidden + 7) & ~7));
    unsigned short* act_s = reinterpret_cast<unsigned short*>(all_partials + warps);
    // down_proj's tiles of this warp (16 outputs each, warp w takes w, w + warps, ...), their
    // weights for this block's 16 activations loaded before the wait: 4 values a lane of rows
    // g and g + 8 at k = 4t .. 4t + 3 (the same permutation of k as mma_pair, in one mma).
    constexpr int MLP_DOWN_TILES = 4;
    const int down_tiles = hidden / 16;
    uint2 dlo[MLP_DOWN_TILES], dhi[MLP_DOWN_TILES];
#pragma unroll
    for (int u = 0; u < MLP_DOWN_TILES; ++u) {
        const int tile = warp + u * warps;
        if (tile < down_tiles) {
            const size_t o = (size_t)tile * 16 + g;
            dlo[u] = __ldg(reinterpret_cast<const uint2*>(down_w + o * inter + j0 + 4 * t));
            dhi[u] = __ldg(reinterpret_cast<const uint2*>(down_w + (o + 8) * inter + j0 + 4 * t));
        }
    }
    // gate|up: the tile of norm_gate_up_silu_mma for activations j0 + 8 group .. + 7.
    const int j = j0 + group * 8 + g;
    const int jw = min(j, inter - 1);
    const MmaOperand a{gate_up_w, xs, hidden >> 5};
    const MmaOperand none{gate_up_w, xs, 0};
    float c[4];
    auto stage = [&]() {
        PDL_WAIT();
        stage_rms_normed_rows(F32Rows{x}, norm_w, xs, rows, hidden, eps);
    };
    const bool leader = mma_rows_tile_of(a, none, (size_t)jw, (size_t)(inter + jw), rows, stage,
                                         c, slice, split, all_partials + group * split);
    if (leader) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = 2 * t + i;
            const float gate = c[i];
            // Rows past the step's are zeros (their products are never written).
            const unsigned short v =
                r < rows ? f32_to_bf16(gate / (1.0f + expf(-gate)) * c[2 + i]) : 0;
            act_s[r * MLP_SLICE + group * 8 + g] = v;
            if (act_out != nullptr && r < rows && j < inter) {
                act_out[(size_t)(r0 + r) * inter + j] = v;
            }
        }
    }
    __syncthreads();
    // down_proj's products of this block's activations: c = W[o, j0 ..] . act[r, j0 ..].
    const uint2 xv = *reinterpret_cast<const uint2*>(act_s + g * MLP_SLICE + 4 * t);
    const unsigned int b[2] = {xv.x, xv.y};
    float* own = scratch + ((size_t)slice_block * step_rows + r0) * hidden;
#pragma unroll
    for (int u = 0; u < MLP_DOWN_TILES; ++u) {
        const int tile = warp + u * warps;
        if (tile < down_tiles) {  // warp-uniform
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const unsigned int aw[4] = {dlo[u].x, dhi[u].x, dlo[u].y, dhi[u].y};
            mma_bf16_16816(d, aw, b);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int o = tile * 16 + g + (i >= 2 ? 8 : 0);
                const int r = 2 * t + (i & 1);
                if (r < rows) {
                    own[(size_t)r * hidden + o] = d[i];
                }
            }
        }
    }
    // Every rank's products written and visible to the cluster: rank q adds its share of the
    // outputs over the ranks in rank order (the emulator runs the ranks one after another, so
    // there the last rank adds every output: the same sums).
    cluster_barrier(cluster);
    const int rank = slice_block % cluster;
    const int first_block = slice_block - rank;
#ifdef TANDEM_EMULATE
    const int o_begin = rank == cluster - 1 ? 0 : hidden;
    const int o_end = hidden;
#else
    const int share = (hidden + cluster - 1) / cluster;
    const int o_begin = min(hidden, rank * share);
    const int o_end = min(hidden, o_begin + share);
#endif
    const int span = o_end - o_begin;
    float* out = sums + ((size_t)(slice_block / cluster) * step_rows + r0) * hidden;
    for (int i = threadIdx.x; i < rows * span; i += blockDim.x) {
        const int r = i / span;
        const int o = o_begin + i % span;
        const float* p = scratch + ((size_t)first_block * step_rows + r0 + r) * hidden + o;
        float acc = p[0];
        for (int k = 1; k < cluster; ++k) {
            acc += p[(size_t)k * step_rows * hidden];
        }
        out[(size_t)r * hidden + o] = acc;
    }
}

// out[r] = the layer's output (sum_mlp_partials), and tap[r] the same (null: none): for steps
// whose next reader is not the one-launch q|k|v and attention (and after the last layer).
// `out` may be `x` (each value is read and written by one thread). Grid: ceil(rows * hidden /
// 4 / 256) blocks of 256 threads.
extern "C" __global__ void add_mlp_partials(const float* x, const float* __restrict__ sums,
                                            int parts, float* out, float* __restrict__ tap,
                                            int rows, int hidden) {
    PDL_LAUNCH_DEPENDENTS();
    PDL_WAIT();
    const int n = rows * (hidden >> 2);
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) {
        return;
    }
    const int r = idx / (hidden >> 2);
    const int i = idx % (hidden >> 2);
    const float4 v = sum_mlp_partials(x, sums, parts, rows, r, hidden, i);
    reinterpret_cast<float4*>(out + (size_t)r * hidden)[i] = v;
    if (tap != nullptr) {
        reinterpret_cast<float4*>(tap + (size_t)r * hidden)[i] = v;
    }
}
