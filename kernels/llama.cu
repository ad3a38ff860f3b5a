// CUDA kernels of the Llama-family fast path (crate `tandem-cuda`), compiled at run time by
// NVRTC. Each kernel has a plain Rust reference in `crates/tandem-cuda/src/reference.rs`; the
// GPU test (`tandem fast-check`, `cargo test -p tandem-cuda` on a GPU machine) compares them.
//
// Conventions:
// - bf16 values travel as `unsigned short` bit patterns (no cuda_bf16.h: NVRTC then needs no
//   include path), converted with round-to-nearest-even like torch's `.to(torch.bfloat16)`.
// - The residual stream and every matmul output are f32 (cuBLAS writes f32 from bf16
//   operands); only matmul inputs, weights and the KV cache are bf16.
// - Rows are `batch * width` slots laid out sequence-major (row = b * width + i), as in
//   `tandem_model::StepInput`.

// NEG_INF, the bf16 conversions, warp_sum / block_sum, block_argmax and row_argmax:
// kernels/common.cuh.

// out[r, :] = embed[tokens[r], :] (the `embed` tap point). Grid: rows.
extern "C" __global__ void embed_rows(const unsigned short* table, const unsigned int* tokens,
                                      float* out, int hidden) {
    const int r = blockIdx.x;
    const unsigned short* src = table + (size_t)tokens[r] * hidden;
    float* dst = out + (size_t)r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = bf16_to_f32(src[i]);
    }
}

// HF LlamaRMSNorm: out = w * (x * rsqrt(mean(x^2) + eps)). If `delta` is not null the residual
// is updated first (x += delta, written back), which fuses the block's residual add with the
// next norm. `out_f32` (optional) keeps the normed rows in f32 (the `final` tap). Grid: rows.
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ delta,
                                        const unsigned short* __restrict__ w,
                                        unsigned short* __restrict__ out,
                                        float* __restrict__ out_f32, int hidden, float eps) {
    __shared__ float scratch[32];
    // Programmatic dependent launch for small steps (the fused steps' final norm).
    PDL_LAUNCH_DEPENDENTS();
    PDL_WAIT();
    const int r = blockIdx.x;
    float* xr = x + (size_t)r * hidden;
    float squares = 0.0f;
    // Unrolled (and the pointers restrict) so a thread's loads are in flight together.
#pragma unroll 4
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = xr[i];
        if (delta != nullptr) {
            v += delta[(size_t)r * hidden + i];
            xr[i] = v;
        }
        squares += v * v;
    }
    const float total = block_sum(squares, scratch);
    const float inv = 1.0f / sqrtf(total / (float)hidden + eps);
#pragma unroll 4
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = xr[i] * inv * bf16_to_f32(w[i]);
        out[(size_t)r * hidden + i] = f32_to_bf16(v);
        if (out_f32 != nullptr) {
            out_f32[(size_t)r * hidden + i] = v;
        }
    }
}

// Qwen3's per-head RMSNorm of q and k, in place in the fused q|k|v rows (f32), before RoPE:
// head h < heads is a query head (weight q_norm), the next kv_heads are key heads (k_norm);
// values are left alone. HF Qwen3RMSNorm: w * (x * rsqrt(mean(x^2) + eps)) over head_dim.
// Grid: (rows, heads + kv_heads). Block: head_dim threads (a multiple of 32, at most 256).
extern "C" __global__ void head_rms_norm(float* qkv, const unsigned short* q_norm,
                                         const unsigned short* k_norm, int heads, int kv_heads,
                                         int head_dim, float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const int h = blockIdx.y;
    const int d = threadIdx.x;
    const size_t row = (size_t)(heads + 2 * kv_heads) * head_dim;
    float* x = qkv + (size_t)r * row + (size_t)h * head_dim;
    const float v = x[d];
    const float total = block_sum(v * v, scratch);
    const float inv = 1.0f / sqrtf(total / (float)head_dim + eps);
    const unsigned short* w = h < heads ? q_norm : k_norm;
    x[d] = v * inv * bf16_to_f32(w[d]);
}

// Splits the fused q|k|v projection of each row, adds the optional bias, applies HF's RoPE
// (rotate_half layout: pairs (j, j + head_dim/2), angle = inv_freq[j] * position in f32),
// writes q (f32, [rows, heads * head_dim]) and the new keys/values (bf16) into the layer's
// cache `[batch, kv_heads, capacity, head_dim]` at column col0 + i. Grid: rows.
// `step_scalars` (when not null) overrides col0 with step_scalars[0]: a CUDA graph replays its
// launches with the arguments they were captured with, so the step-dependent column comes from
// device memory that each step rewrites before the replay.
extern "C" __global__ void rope_qkv(const float* qkv, const float* bias, const int* positions,
                                    const float* inv_freq, float* q_out,
                                    unsigned short* k_cache, unsigned short* v_cache, int width,
                                    int heads, int kv_heads, int head_dim, int capacity,
                                    int col0, const int* step_scalars) {
    if (step_scalars != nullptr) {
        col0 = step_scalars[0];
    }
    const int r = blockIdx.x;
    const int b = r / width;
    const int col = col0 + r % width;
    const int half = head_dim / 2;
    const int q_dim = heads * head_dim;
    const int kv_dim = kv_heads * head_dim;
    const float* row = qkv + (size_t)r * (q_dim + 2 * kv_dim);
    const float pos = (float)positions[r];
    for (int t = threadIdx.x; t < (heads + kv_heads) * half; t += blockDim.x) {
        const bool is_q = t < heads * half;
        const int u = is_q ? t : t - heads * half;
        const int h = u / half;
        const int j = u % half;
        const int base = (is_q ? 0 : q_dim) + h * head_dim;
        float x1 = row[base + j];
        float x2 = row[base + j + half];
        if (bias != nullptr) {
            x1 += bias[base + j];
            x2 += bias[base + j + half];
        }
        const float angle = inv_freq[j] * pos;
        const float c = cosf(angle);
        const float s = sinf(angle);
        const float y1 = x1 * c - x2 * s;
        const float y2 = x2 * c + x1 * s;
        if (is_q) {
            float* q = q_out + (size_t)r * q_dim + h * head_dim;
            q[j] = y1;
            q[j + half] = y2;
        } else {
            unsigned short* k =
                k_cache + (((size_t)b * kv_heads + h) * capacity + col) * head_dim;
            k[j] = f32_to_bf16(y1);
            k[j + half] = f32_to_bf16(y2);
        }
    }
    for (int t = threadIdx.x; t < kv_dim; t += blockDim.x) {
        const int h = t / head_dim;
        const int d = t % head_dim;
        float v = row[q_dim + kv_dim + t];
        if (bias != nullptr) {
            v += bias[q_dim + kv_dim + t];
        }
        v_cache[(((size_t)b * kv_heads + h) * capacity + col) * head_dim + d] = f32_to_bf16(v);
    }
}

// The additive attention mask `[rows, total]` (0 visible, -inf hidden) of a step, expanded on
// the GPU from its compact parts (`tandem_model::MaskParts`, whose `expand` is the reference):
// `valid [batch, used]` (cached columns each sequence owns), `sees [rows, width]` (the step's own
// columns each slot sees), `real [rows]` (padding sees only its own column). Grid: rows.
// `step_scalars` (when not null) overrides used and total with the step's [col0, total] (col0 is
// the used columns), as the graphed steps' launches read them: a graph then expands each
// replay's mask itself instead of an eager launch before it.
extern "C" __global__ void build_mask(const unsigned char* __restrict__ valid,
                                      const unsigned char* __restrict__ sees,
                                      const unsigned char* __restrict__ real,
                                      float* __restrict__ mask, int width, int used, int total,
                                      const int* __restrict__ step_scalars) {
    if (step_scalars != nullptr) {
        used = step_scalars[0];
        total = step_scalars[1];
    }
    const int r = blockIdx.x;
    const int b = r / width;
    const int i = r % width;
    const bool is_real = real[r] != 0;
    float* row = mask + (size_t)r * total;
    for (int j = threadIdx.x; j < total; j += blockDim.x) {
        bool visible;
        if (!is_real) {
            visible = j == used + i;
        } else if (j < used) {
            visible = valid[(size_t)b * used + j] != 0;
        } else {
            visible = sees[(size_t)r * width + (j - used)] != 0;
        }
        row[j] = visible ? 0.0f : NEG_INF;
    }
}

// Grouped-query attention of one query row and head over the cache columns its mask allows
// (mask `[rows, total]`: 0 visible, -inf hidden; built by `ColumnLayout::attention_mask`).
// Each warp takes chunks of 32 columns (warps stride over the chunks): lane l scores column
// c0 + l against the query held in shared memory (its key row read as 16-byte vectors), the
// chunk updates the warp's online softmax, then the warp adds the chunk's value rows with
// lane l holding dims l, l + 32, ... (head_dim a multiple of 32, at most 256). Warps are
// merged at the end. One lane per column keeps many independent loads in flight: a warp walks
// `total / (32 * warps)` chunks instead of `total / warps` dependent column steps, which is
// what made long-context decode (dump --regenerate at 1,000+ columns) slow.
// Grid: (rows * heads) blocks, block r * heads + h for row r and query head h, so the
// heads that share a KV head run as neighbouring blocks and read its key and value rows while
// they are still in L2 (with the rows on grid x and the heads on grid y, the heads of one row
// were `rows` blocks apart: at 256 rows x 1,000 columns each KV row came from DRAM once per
// query head, 6x for Qwen2.5-1.5B). Each block computes what it did before, bit for bit.
// Block: a multiple of 32 threads. Dynamic shared: (warps + 1) * head_dim
// floats (the scaled query, then one accumulator row per warp). `step_scalars` (when not
// null) overrides total with step_scalars[1] (see rope_qkv): the mask's row stride follows it.
extern "C" __global__ void attention(const float* q, const unsigned short* k_cache,
                                     const unsigned short* v_cache, const float* mask,
                                     unsigned short* out, int width, int heads, int kv_heads,
                                     int head_dim, int capacity, int total, float scale,
                                     const int* step_scalars) {
    PDL_LAUNCH_DEPENDENTS();
    PDL_WAIT();
    if (step_scalars != nullptr) {
        total = step_scalars[1];
    }
    const int MAX_DIMS_PER_LANE = 8;
    __shared__ float warp_max[32];
    __shared__ float warp_sum_exp[32];
    DYNAMIC_SHARED(float, shared_attention);
    // One grid dimension (up to 2^31 - 1 blocks): a ragged prefill of 64 prompts of 2,048
    // tokens has 131,072 rows, past grid y's 65,535 (the launch then fails with
    // CUDA_ERROR_INVALID_VALUE); times 32 heads it is 4.2M blocks.
    const int r = blockIdx.x / heads;
    const int h = blockIdx.x % heads;
    const int b = r / width;
    const int kvh = h / (heads / kv_heads);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int dims = head_dim >> 5;
    float* q_shared = shared_attention;
    float* warp_acc = shared_attention + head_dim;

    const float* qr = q + ((size_t)r * heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        q_shared[d] = qr[d] * scale;
    }
    __syncthreads();
    float acc[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int t = 0; t < MAX_DIMS_PER_LANE; ++t) {
        acc[t] = 0.0f;
    }
    const float* mask_row = mask + (size_t)r * total;
    const size_t base = ((size_t)b * kv_heads + kvh) * capacity * head_dim;
    float m = NEG_INF;
    float l = 0.0f;
    for (int c0 = warp * 32; c0 < total; c0 += warps * 32) {
        const int j = c0 + lane;
        float s = NEG_INF;
        if (j < total) {
            const float bias = mask_row[j];
            if (bias != NEG_INF) {
                // head_dim is a multiple of 32, so every key row starts on a 16-byte boundary.
                const uint4* kj = reinterpret_cast<const uint4*>(k_cache + base + (size_t)j * head_dim);
                float dot = 0.0f;
                // Unrolled so the key row's loads are all in flight at once (a rolled loop
                // waits one memory round trip per 16 bytes).
#pragma unroll 8
                for (int v8 = 0; v8 < (head_dim >> 3); ++v8) {
                    const uint4 w = kj[v8];
                    const float* qq = q_shared + v8 * 8;
                    dot += qq[0] * __uint_as_float(w.x << 16) + qq[1] * __uint_as_float(w.x & 0xffff0000u);
                    dot += qq[2] * __uint_as_float(w.y << 16) + qq[3] * __uint_as_float(w.y & 0xffff0000u);
                    dot += qq[4] * __uint_as_float(w.z << 16) + qq[5] * __uint_as_float(w.z & 0xffff0000u);
                    dot += qq[6] * __uint_as_float(w.w << 16) + qq[7] * __uint_as_float(w.w & 0xffff0000u);
                }
                s = dot + bias;
            }
        }
        float chunk_max = s;
        for (int offset = 16; offset > 0; offset >>= 1) {
            chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, offset));
        }
        if (chunk_max == NEG_INF) {
            continue;  // the whole chunk is hidden; chunk_max is warp-uniform
        }
        const float m_new = fmaxf(m, chunk_max);
        const float correction = expf(m - m_new);
        const float p = s == NEG_INF ? 0.0f : expf(s - m_new);
        l = l * correction + warp_sum(p);
#pragma unroll
        for (int t = 0; t < MAX_DIMS_PER_LANE; ++t) {
            acc[t] *= correction;
        }
        const int n = min(32, total - c0);
        // The chunk's value rows in groups of 8 columns whose loads are all issued before any
        // is used (no branch between them), so a chunk waits on 4 memory round trips instead
        // of one per column (which made decode attention latency bound: ~21 us per layer at
        // batch 1 on the H200). Columns past `n` re-read column n - 1 with weight 0; hidden
        // columns have p = 0 and add nothing.
#pragma unroll
        for (int g = 0; g < 32; g += 8) {
            if (g >= n) {
                break;  // warp-uniform
            }
            unsigned short vals[8][MAX_DIMS_PER_LANE];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const unsigned short* vj =
                    v_cache + base + (size_t)(c0 + min(g + u, n - 1)) * head_dim;
#pragma unroll
                for (int t = 0; t < MAX_DIMS_PER_LANE; ++t) {
                    vals[u][t] = t < dims ? vj[lane + 32 * t] : (unsigned short)0;
                }
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const float pj = __shfl_sync(0xffffffffu, p, g + u);
#pragma unroll
                for (int t = 0; t < MAX_DIMS_PER_LANE; ++t) {
                    if (t < dims) {
                        acc[t] += pj * bf16_to_f32(vals[u][t]);
                    }
                }
            }
        }
        m = m_new;
    }
    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum_exp[warp] = l;
    }
#pragma unroll
    for (int t = 0; t < MAX_DIMS_PER_LANE; ++t) {
        if (t < dims) {
            warp_acc[warp * head_dim + lane + 32 * t] = acc[t];
        }
    }
    __syncthreads();
    float m_all = NEG_INF;
    for (int w = 0; w < warps; ++w) {
        m_all = fmaxf(m_all, warp_max[w]);
    }
    float l_all = 0.0f;
    for (int w = 0; w < warps; ++w) {
        if (warp_max[w] != NEG_INF) {
            l_all += warp_sum_exp[w] * expf(warp_max[w] - m_all);
        }
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < warps; ++w) {
            if (warp_max[w] != NEG_INF) {
                o += warp_acc[w * head_dim + d] * expf(warp_max[w] - m_all);
            }
        }
        out[((size_t)r * heads + h) * head_dim + d] = f32_to_bf16(o / l_all);
    }
}

// SwiGLU on the fused gate|up projection: out = silu(gate) * up, `[rows, inter]` bf16.
extern "C" __global__ void silu_mul(const float* gate_up, unsigned short* out, int inter,
                                    int rows) {
    const size_t n = (size_t)rows * inter;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        const size_t r = idx / inter;
        const size_t i = idx % inter;
        const float g = gate_up[r * 2 * inter + i];
        const float u = gate_up[r * 2 * inter + inter + i];
        out[idx] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
    }
}

// dst[k, :] = src[rows[k], :] for bf16 rows of `hidden` values. Grid: selected rows.
extern "C" __global__ void gather_rows(const unsigned short* src, const int* rows,
                                       unsigned short* dst, int hidden) {
    const unsigned short* s = src + (size_t)rows[blockIdx.x] * hidden;
    unsigned short* d = dst + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        d[i] = s[i];
    }
}

// Greedy token of each logits row (first index among equal maxima, like torch.argmax), mapped
// through `map` when given (a draft head's draft id -> target id table, so a chain drafted on
// the device feeds its next step without the host). Grid: rows. Block: 1024.
extern "C" __global__ void argmax_rows(const float* logits, int vocab, const unsigned int* map,
                                       unsigned int* out) {
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float max_value;
    const int index = row_argmax(row, vocab, best_value, best_index, &max_value);
    if (threadIdx.x == 0) {
        // A row of NaNs has no maximum: token 0 rather than an out-of-vocabulary id.
        const unsigned int id = (unsigned int)(index == 0x7fffffff ? 0 : index);
        out[blockIdx.x] = map != nullptr ? map[id] : id;
    }
}

// argmax_rows for a few rows of a large vocabulary: a block a row leaves most SMs idle and
// reads a 32,000- or 49,152-token row through one SM (argmax 5-6 us at batch 1 under ncu,
// session 55). Grid: parts x rows; block: 256. Block (p, r) scans values
// [p * span, (p + 1) * span) of row r and puts its best (value, index) in part_value /
// part_index [rows, parts]; the block of the row that finishes last (an atomic count a row in
// `done`, which that block sets back to 0 for the next launch or graph replay) reduces the
// parts and writes the row's id. The result is argmax_rows': the first index among equal maxima
// whatever the split, token 0 for a row with no maximum (all NaN), mapped through `map` when
// given.
extern "C" __global__ void argmax_rows_split(const float* logits, int vocab, int span,
                                             const unsigned int* map, unsigned int* out,
                                             float* part_value, int* part_index,
                                             unsigned int* done) {
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    __shared__ int finishes_row;
    const int parts = gridDim.x;
    const int r = blockIdx.y;
    const int begin = blockIdx.x * span;
    const int n = max(0, min(vocab, begin + span) - begin);
    float max_value;
    int index = row_argmax<8>(logits + (size_t)r * vocab + begin, n, best_value, best_index,
                              &max_value);
    if (index != 0x7fffffff) {
        index += begin;
    }
    if (threadIdx.x == 0) {
        part_value[r * parts + blockIdx.x] = max_value;
        part_index[r * parts + blockIdx.x] = index;
        // The part is visible to every block before the count says it is there.
        __threadfence();
        finishes_row = atomicAdd(&done[r], 1u) == (unsigned int)parts - 1;
    }
    __syncthreads();
    if (!finishes_row) {
        return;
    }
    __threadfence();
    // Volatile: the other blocks' parts, never cached here.
    const volatile float* values = part_value + r * parts;
    const volatile int* indices = part_index + r * parts;
    float best = NEG_INF;
    index = 0x7fffffff;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        const float v = values[p];
        const int i = indices[p];
        if (v > best || (v == best && i < index)) {
            best = v;
            index = i;
        }
    }
    index = block_argmax(best, index, best_value, best_index, &max_value);
    if (threadIdx.x == 0) {
        const unsigned int id = (unsigned int)(index == 0x7fffffff ? 0 : index);
        out[r] = map != nullptr ? map[id] : id;
        done[r] = 0;
    }
}

// The drafted tokens of greedy chains into a verification step's tokens: ids [steps, batch]
// (step s of sequence b at s * batch + b, as the device chain drafts them) to tokens[b * width
// + first + s]: first = 1, after each sequence's root. The verification then starts without
// the host having seen the drafts (one wait a round, for the verification's own results).
// With first = 0 and one step, the roots of a decode step: the previous step's greedy ids (a
// plain round's lookahead). Grid: ceil(batch * steps / 256).
extern "C" __global__ void scatter_chain_tokens(const unsigned int* __restrict__ ids, int batch,
                                                int steps, int first,
                                                unsigned int* __restrict__ tokens, int width) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < batch * steps) {
        const int s = i / batch;
        const int b = i % batch;
        tokens[(size_t)b * width + first + s] = ids[i];
    }
}

// The roots the next greedy chains draft from, chosen on the device right after the head's
// extend over every verified slot (queued before the host reads the verification): for sequence
// b (blockIdx.x), its accepted length k, the leading drafts equal to the target's greedy id at
// the slot before them (chain[s * batch + b] == ids[b * width + s], as verify_greedy walks a
// chain), then row b * width + k of the extend's hidden [rows, h] and logits [rows, vocab] (f32)
// into row b of `out_hidden` and `out_logits`. Grid: batch x parts; block: 256. Part p
// (blockIdx.y) copies its share of the logits row (and part 0 the hidden row): one block a
// sequence copied a 32,000-token row through one SM (9.0 us at batch 1 under ncu, session 55).
extern "C" __global__ void gather_accepted_roots(const unsigned int* __restrict__ ids,
                                                 const unsigned int* __restrict__ chain,
                                                 int batch, int steps, int width,
                                                 const float* __restrict__ hidden, int h,
                                                 const float* __restrict__ logits, int vocab,
                                                 float* __restrict__ out_hidden,
                                                 float* __restrict__ out_logits) {
    const int b = blockIdx.x;
    int k = 0;
    while (k < steps && chain[(size_t)k * batch + b] == ids[(size_t)b * width + k]) {
        ++k;
    }
    const size_t row = (size_t)b * width + k;
    if (blockIdx.y == 0) {
        for (int i = threadIdx.x; i < h; i += blockDim.x) {
            out_hidden[(size_t)b * h + i] = hidden[row * h + i];
        }
    }
    const int span = (vocab + gridDim.y - 1) / gridDim.y;
    const int begin = blockIdx.y * span;
    const int end = min(vocab, begin + span);
    for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
        out_logits[(size_t)b * vocab + i] = logits[row * vocab + i];
    }
}

// Uniform in (0, 1) from a row's seed and a token id (splitmix64; 24 bits are plenty for a
// Gumbel draw and keep u away from 0 and 1).
__device__ __forceinline__ float seeded_uniform(unsigned long long seed, int token) {
    unsigned long long x = seed + 0x9E3779B97F4A7C15ull * (unsigned long long)(token + 1);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return ((float)(x >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// Probability mass of the tokens whose scaled logit is at least `cut` (softmax with the row's
// max `mx` and normaliser `z`); every thread gets it.
__device__ float mass_at_least(const float* row, int vocab, float inv_temperature, float mx,
                               float z, float cut, float* scratch) {
    float m = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float s = row[i] * inv_temperature;
        if (s >= cut) {
            m += expf(s - mx);
        }
    }
    return block_sum(m, scratch) / z;
}

// The order f32::total_cmp gives (what the host's beam search sorts scores by): larger keys
// sort later.
__device__ __forceinline__ int total_order_key(float f) {
    const int v = __float_as_int(f);
    return v ^ (int)(((unsigned int)(v >> 31)) >> 1);
}

// One draft step's beam choice for tree drafting on the device (`CudaDraft::draft_beams`): what
// the host's BeamSearch::push (TreeBuilder::push) does, one warp per sequence (block b; topk
// k <= 8, so at most 64 candidates, two a lane).
// - topk: the step's top-k as topk_softmax writes it, [rows * k] probabilities (f32 bits) then
//   [rows * k] draft ids; rows = batch at step 0 (the roots), batch * k after (row b * k + j:
//   beam j of sequence b). d2t maps a draft id to its target id.
// - Step 0: the k candidates are the root's top-k and become the beams in that order, scored by
//   their probabilities. Step s >= 1: candidate i = j * k + c scores score_in[b * k + j] times
//   its probability, and the k best (by total_cmp, then the lower index) become the beams,
//   best first.
// - Beam state (read from *_in, written to *_out): score [batch * k]; path and hrow
//   [batch * k * steps]: each beam's target ids by depth, and the row of the hidden bank each
//   path node takes as its hidden input (the root's row b at depth 0; a node made at step s
//   reads its parent's output, the kept output row out_row0 + b * k + j of beam j).
// - record: the step's part of the one read-back: scores [batch * n] (f32 bits), target ids
//   [batch * n], and for s >= 1 the chosen candidates [batch * k] as flat indices over every
//   step's candidates (SGLang's parents: k + (s - 1) * k * k + i); n = k at step 0, k * k after.
// - next_tokens, next_hrows (s + 1 < steps): the next step's slots, each beam's path, slot
//   (b, j, d) at (b * k + j) * (s + 1) + d: its token and the bank row of its hidden input.
extern "C" __global__ void beam_select(const unsigned int* __restrict__ topk, int rows,
                                       const unsigned int* __restrict__ d2t, int k, int s,
                                       int steps, const float* __restrict__ score_in,
                                       const unsigned int* __restrict__ path_in,
                                       const int* __restrict__ hrow_in,
                                       float* __restrict__ score_out,
                                       unsigned int* __restrict__ path_out,
                                       int* __restrict__ hrow_out, unsigned int* __restrict__ record,
                                       unsigned int* __restrict__ next_tokens,
                                       int* __restrict__ next_hrows, int out_row0) {
    __shared__ int keys[64];
    const int b = blockIdx.x;
    const int batch = gridDim.x;
    const int lane = threadIdx.x & 31;
    const int n = s == 0 ? k : k * k;
    const unsigned int* ids = topk + (size_t)rows * k;
    unsigned int* rec_scores = record;
    unsigned int* rec_tokens = record + (size_t)batch * n;
    unsigned int* rec_parents = record + 2 * (size_t)batch * n;
    float score[2];
    unsigned int token[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const int i = lane + 32 * t;
        score[t] = 0.0f;
        token[t] = 0;
        if (i < n) {
            const int row = s == 0 ? b : b * k + i / k;
            const int c = s == 0 ? i : i % k;
            const float p = __uint_as_float(topk[(size_t)row * k + c]);
            score[t] = s == 0 ? p : score_in[b * k + i / k] * p;
            token[t] = d2t[ids[(size_t)row * k + c]];
            keys[i] = total_order_key(score[t]);
            rec_scores[(size_t)b * n + i] = __float_as_uint(score[t]);
            rec_tokens[(size_t)b * n + i] = token[t];
        }
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const int i = lane + 32 * t;
        if (i >= n) {
            continue;
        }
        int rank = i;
        if (s > 0) {
            rank = 0;
            for (int m = 0; m < n; ++m) {
                rank += keys[m] > keys[i] || (keys[m] == keys[i] && m < i);
            }
        }
        if (rank >= k) {
            continue;
        }
        const int from = s == 0 ? 0 : i / k;  // the beam it extends (step 0: the root)
        const size_t src = ((size_t)b * k + from) * steps;
        const size_t dst = ((size_t)b * k + rank) * steps;
        for (int d = 0; d < s; ++d) {
            path_out[dst + d] = path_in[src + d];
            hrow_out[dst + d] = hrow_in[src + d];
        }
        const int input_row = s == 0 ? b : out_row0 + b * k + from;
        path_out[dst + s] = token[t];
        hrow_out[dst + s] = input_row;
        score_out[b * k + rank] = score[t];
        if (s > 0) {
            rec_parents[(size_t)b * k + rank] = (unsigned int)(k + (s - 1) * k * k + i);
        }
        if (s + 1 < steps) {
            const size_t slot = ((size_t)b * k + rank) * (s + 1);
            for (int d = 0; d < s; ++d) {
                next_tokens[slot + d] = path_in[src + d];
                next_hrows[slot + d] = hrow_in[src + d];
            }
            next_tokens[slot + s] = token[t];
            next_hrows[slot + s] = input_row;
        }
    }
}

// Draws one token per logits row from softmax(logits / temperature), restricted to the nucleus
// (the most likely tokens whose mass reaches top_p; top_p >= 1 keeps all), on the GPU: the
// nucleus cut is found by bisection on the scaled logit (mass is monotone in the cut), then the
// Gumbel-max trick picks the token (argmax of s_i - log(-log u_i) is a draw from softmax(s)
// over the kept tokens), with u_i from the row's seed. `dump --regenerate` samples 256 rows of
// 49,152 logits per step this way instead of reading 50 MB back and sorting each row on the
// host. A NaN row yields token 0. Grid: rows. Block: 1024.
extern "C" __global__ void sample_rows(const float* logits, int vocab, float inv_temperature,
                                       float top_p, const unsigned long long* seeds,
                                       unsigned int* out) {
    __shared__ float scratch[32];
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float max_value;
    int index = row_argmax(row, vocab, best_value, best_index, &max_value);
    if (index == 0x7fffffff) {
        if (threadIdx.x == 0) {
            out[blockIdx.x] = 0;
        }
        return;  // uniform over the block: every thread read the same index
    }
    const float mx = max_value * inv_temperature;
    float cut = NEG_INF;
    if (top_p < 1.0f) {
        float z = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            z += expf(row[i] * inv_temperature - mx);
        }
        z = block_sum(z, scratch);
        // Largest cut whose mass still reaches top_p: the most likely token alone (cut = mx)
        // or a bisection between mx - 40 (mass ~1) and mx; 30 halvings leave < 4e-8 of slack.
        if (mass_at_least(row, vocab, inv_temperature, mx, z, mx, scratch) >= top_p) {
            cut = mx;
        } else {
            float lo = mx - 40.0f;
            float hi = mx;
            for (int it = 0; it < 30; ++it) {
                const float mid = 0.5f * (lo + hi);
                if (mass_at_least(row, vocab, inv_temperature, mx, z, mid, scratch) >= top_p) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            cut = lo;
        }
    }
    const unsigned long long seed = seeds[blockIdx.x];
    float best = NEG_INF;
    index = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float s = row[i] * inv_temperature;
        if (s >= cut) {
            const float key = s - logf(-logf(seeded_uniform(seed, i)));
            if (key > best) {
                best = key;
                index = i;
            }
        }
    }
    index = block_argmax(best, index, best_value, best_index, &max_value);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = (unsigned int)(index == 0x7fffffff ? 0 : index);
    }
}

// Moves f32 rows between buffers: dst[dst_rows[k], :] = src[src_rows[k], :]. The draft head's
// tree drafting assembles each step's hidden inputs (roots and evaluated beams) with it.
// Grid: count.
extern "C" __global__ void copy_rows(const float* src, const int* src_rows, float* dst,
                                     const int* dst_rows, int hidden) {
    const float* s = src + (size_t)src_rows[blockIdx.x] * hidden;
    float* d = dst + (size_t)dst_rows[blockIdx.x] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        d[i] = s[i];
    }
}

// The same for bf16 (u16) rows: dst[dst_rows[k]] = src[src_rows[k]], `width` values each. Moves
// KV-cache columns (one row = one head's key or value at one column) when sequences join or
// leave a running batch and when the cache is compacted. Grid: count.
extern "C" __global__ void copy_rows_u16(const unsigned short* src, const int* src_rows,
                                         unsigned short* dst, const int* dst_rows, int width) {
    const unsigned short* s = src + (size_t)src_rows[blockIdx.x] * width;
    unsigned short* d = dst + (size_t)dst_rows[blockIdx.x] * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        d[i] = s[i];
    }
}

// The same moves for every buffer of a KV cache at once (each layer's keys and values, all of
// one shape; buffer addresses in `sources` and `destinations`, which may be the same buffers):
// phase 0 gathers staging[buffer][k] = sources[buffer][src_rows[k]], phase 1 scatters
// destinations[buffer][dst_rows[k]] = staging[buffer][k], so a row that is both a source and a
// destination is read before it is overwritten. Two launches per move instead of one or two
// per buffer: a retirement at c=32 launched 120 copies (~0.5 ms) for SmolLM2's 30 layers.
// Grid: (count, buffers).
extern "C" __global__ void move_rows_u16(const unsigned long long* sources,
                                         const unsigned long long* destinations,
                                         const int* src_rows, const int* dst_rows,
                                         unsigned short* staging, int count, int width,
                                         int phase) {
    unsigned short* stage = staging + ((size_t)blockIdx.y * count + blockIdx.x) * width;
    if (phase == 0) {
        const unsigned short* s = reinterpret_cast<const unsigned short*>(sources[blockIdx.y]) +
                                  (size_t)src_rows[blockIdx.x] * width;
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            stage[i] = s[i];
        }
    } else {
        unsigned short* d = reinterpret_cast<unsigned short*>(destinations[blockIdx.y]) +
                            (size_t)dst_rows[blockIdx.x] * width;
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            d[i] = stage[i];
        }
    }
}

// dst_y[i] = src_y[i] for i < n and each of up to four (source, destination) pairs y =
// blockIdx.y: a plain round's taps appended to the head's backlog in one launch instead of one
// copy each (a copy is a launch too, and the next round waits behind them). Grid: (blocks, pairs).
extern "C" __global__ void copy_f32_pairs(const float* src0, const float* src1, const float* src2,
                                          const float* src3, float* dst0, float* dst1,
                                          float* dst2, float* dst3, long long n) {
    const int y = blockIdx.y;
    const float* src = y == 0 ? src0 : (y == 1 ? src1 : (y == 2 ? src2 : src3));
    float* dst = y == 0 ? dst0 : (y == 1 ? dst1 : (y == 2 ? dst2 : dst3));
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}

// Gathers f32 rows of up to four taps into a bf16 matrix, each tap at its own columns:
// dst[k * dst_stride + (first + y) * hidden + i] = bf16(src_y[rows[k] * hidden + i]) for source
// y = blockIdx.y. Concatenates the target's taps into the `fc` input of the draft head, taking
// only the rows of accepted tokens; an EAGLE-3 head's three taps are one launch. Grid: (count,
// sources).
extern "C" __global__ void taps_to_bf16(const float* src0, const float* src1, const float* src2,
                                        const float* src3, const int* rows, unsigned short* dst,
                                        int hidden, int dst_stride, int first) {
    const int y = blockIdx.y;
    const float* src = y == 0 ? src0 : (y == 1 ? src1 : (y == 2 ? src2 : src3));
    const float* s = src + (size_t)rows[blockIdx.x] * hidden;
    unsigned short* d = dst + (size_t)blockIdx.x * dst_stride + (size_t)(first + y) * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        d[i] = f32_to_bf16(s[i]);
    }
}

// The k most likely entries of each row of draft logits with their softmax probabilities
// (descending; ties: lower index first), what tree drafting keeps of every draft step:
// probs[r, j] = exp(logits[r, ids[r, j]] - max) / sum(exp(logits[r, :] - max)). k <= 32.
// Written to one buffer so the host reads it back with one copy: `out[r * k + j]` holds the
// bits of probs[r, j] and `out[rows * k + r * k + j]` ids[r, j] (rows = gridDim.x).
//
// One pass for the max, one for the sum: both exactly as they always were (a thread's strided
// share in index order, then the same shuffles), so the denominator is the same float to the
// last bit. Entries are ordered by `topk_better` below (NaNs are never chosen, -inf entries
// can be; a row with fewer than k choosable entries repeats id 0 to fill its k).
// For k <= TOPK_LIST (the drafting k) the first pass also keeps each thread's own top entries
// in registers, and the block merges those lists in k rounds of shuffles: every entry of the
// row's top k is in the top k of its own thread's share, so the merge picks the same entries
// in the same order as k argmax passes over the whole row, which larger k still makes (each
// pass skipping the entries already chosen). Grid: rows. Block: 1024.
#define TOPK_LIST 8

__device__ __forceinline__ bool topk_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

extern "C" __global__ void topk_softmax(const float* logits, int vocab, int k,
                                        unsigned int* out) {
    __shared__ float scratch[32];
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    __shared__ int chosen[32];
    __shared__ int winner;
    const float* row = logits + (size_t)blockIdx.x * vocab;
    unsigned int* probs = out + (size_t)blockIdx.x * k;
    unsigned int* ids = out + (size_t)gridDim.x * k + (size_t)blockIdx.x * k;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    const bool listed = k <= TOPK_LIST;

    // This thread's best entries, descending (`topk_better`), padded with (NEG_INF, 0x7fffffff),
    // which every real entry beats. Static indices only, so the list stays in registers.
    float list_value[TOPK_LIST];
    int list_index[TOPK_LIST];
#pragma unroll
    for (int t = 0; t < TOPK_LIST; ++t) {
        list_value[t] = NEG_INF;
        list_index[t] = 0x7fffffff;
    }
    float m = NEG_INF;
    scan_row<8>(row, vocab, [&](float v, int i) {
        m = fmaxf(m, v);
        if (listed && topk_better(v, i, list_value[TOPK_LIST - 1], list_index[TOPK_LIST - 1])) {
            // Indices rise along the share, so an equal value already listed stays ahead.
            list_value[TOPK_LIST - 1] = v;
            list_index[TOPK_LIST - 1] = i;
#pragma unroll
            for (int t = TOPK_LIST - 1; t > 0; --t) {
                if (topk_better(list_value[t], list_index[t], list_value[t - 1],
                                list_index[t - 1])) {
                    const float sv = list_value[t];
                    const int si = list_index[t];
                    list_value[t] = list_value[t - 1];
                    list_index[t] = list_index[t - 1];
                    list_value[t - 1] = sv;
                    list_index[t - 1] = si;
                }
            }
        }
    });
    for (int offset = 16; offset > 0; offset >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    if (lane == 0) {
        best_value[warp] = m;
    }
    __syncthreads();
    m = NEG_INF;
    for (int w = 0; w < warps; ++w) {
        m = fmaxf(m, best_value[w]);
    }
    __syncthreads();
    float s = 0.0f;
    scan_row<8>(row, vocab, [&](float v, int) { s += expf(v - m); });
    const float total = block_sum(s, scratch);

    for (int j = 0; j < k; ++j) {
        float best = NEG_INF;
        int index = 0x7fffffff;
        if (listed) {
            best = list_value[0];
            index = list_index[0];
        } else {
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float v = row[i];
                bool taken = false;
                for (int c = 0; c < j; ++c) {
                    taken |= chosen[c] == i;
                }
                if (!taken && topk_better(v, i, best, index)) {
                    best = v;
                    index = i;
                }
            }
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, offset);
            const int oi = __shfl_xor_sync(0xffffffffu, index, offset);
            if (topk_better(ov, oi, best, index)) {
                best = ov;
                index = oi;
            }
        }
        if (lane == 0) {
            best_value[warp] = best;
            best_index[warp] = index;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < warps; ++w) {
                if (topk_better(best_value[w], best_index[w], best, index)) {
                    best = best_value[w];
                    index = best_index[w];
                }
            }
            // The winner before id 0 stands in for "nothing left": its owner pops it below.
            winner = index;
            if (index == 0x7fffffff) {
                index = 0;
            }
            chosen[j] = index;
            probs[j] = __float_as_uint(expf(row[index] - m) / total);
            ids[j] = (unsigned int)index;
        }
        __syncthreads();
        if (listed && winner != 0x7fffffff && list_index[0] == winner) {
#pragma unroll
            for (int t = 0; t < TOPK_LIST - 1; ++t) {
                list_value[t] = list_value[t + 1];
                list_index[t] = list_index[t + 1];
            }
            list_value[TOPK_LIST - 1] = NEG_INF;
            list_index[TOPK_LIST - 1] = 0x7fffffff;
        }
    }
}

// ---- Small steps: fused matrix-vector products (decode and verification at small batch) ----
//
// At one to GEMV_MAX_ROWS rows a projection is a matrix-vector product bound by launch latency
// and the weight read, not by arithmetic: at batch 1 each cuBLAS GEMM took ~5 us and a decoder
// layer took nine launches (four GEMMs, two norms, RoPE, SwiGLU, attention). These kernels give
// one warp to one output row (or a pair of rows) of the weight, streamed as 16-byte vectors and
// multiplied with every input row, and run what surrounded each matmul inside it: the RMSNorm
// of the input (recomputed by every block from the f32 residual, which it only reads), the
// bias, RoPE and the KV-cache write after q|k|v, SwiGLU after gate|up, the residual add after
// o and down (each output element is owned by one warp, so `y += x . w^T` needs no atomics). A
// layer is then five launches. Every kernel is checked against the unfused path (cuBLAS and the
// kernels above) by the GPU tests. Block: GEMV_WARPS warps. `inp` (and `hidden`) multiples of 8.

// GEMV_MAX_ROWS (the most rows of a fused step) and GEMV_BLOCK_WARPS (warps a block of the
// fused kernels) come from the launcher (`compile_source_for` in device.rs).
#if !defined(GEMV_MAX_ROWS) || !defined(GEMV_BLOCK_WARPS)
#error "GEMV_MAX_ROWS and GEMV_BLOCK_WARPS are defined by the launcher"
#endif

// The eight bf16 values of a 16-byte vector, widened to f32.
__device__ __forceinline__ void unpack8_bf16(const uint4 v, float (&f)[8]) {
    f[0] = __uint_as_float(v.x << 16);
    f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16);
    f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16);
    f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16);
    f[7] = __uint_as_float(v.w & 0xffff0000u);
}

// Weight chunks (16-byte vectors) each lane loads before the block stages its normed input, so
// the first trip to memory for the weight overlaps the norm instead of following it.
#define GEMV_PRELOAD 3

// Sums each of the eight values v[0..8) over the warp in 9 shuffles (not 8 x 5): each step
// halves the values a lane keeps and trades the other half with its partner. Afterwards lane
// l with (l & 3) == 0 holds the sum of value l >> 2 (in v[0]).
__device__ __forceinline__ float warp_sum8(float (&v)[GEMV_MAX_ROWS]) {
    const int lane = threadIdx.x & 31;
    {
        const bool upper = (lane & 16) != 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float send = upper ? v[i] : v[i + 4];
            const float keep = upper ? v[i + 4] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
        }
    }
    {
        const bool upper = (lane & 8) != 0;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float send = upper ? v[i] : v[i + 2];
            const float keep = upper ? v[i + 2] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
        }
    }
    {
        const bool upper = (lane & 4) != 0;
        const float send = upper ? v[0] : v[1];
        const float keep = upper ? v[1] : v[0];
        v[0] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
    }
    v[0] += __shfl_xor_sync(0xffffffffu, v[0], 2);
    v[0] += __shfl_xor_sync(0xffffffffu, v[0], 1);
    return v[0];
}

// The weight rows w0 (and w1) of one warp: the lane's first P chunks, loaded at once.
template <int NW, int P = GEMV_PRELOAD>
struct WarpWeights {
    const uint4* rows[NW];
    uint4 first[NW][P];
    int chunks;

    // `load` false: nothing is read (a second input the step does not have).
    __device__ __forceinline__ WarpWeights(const unsigned short* w0, const unsigned short* w1,
                                           int inp, bool load = true) {
        const int lane = threadIdx.x & 31;
        chunks = load ? inp >> 3 : 0;
        rows[0] = reinterpret_cast<const uint4*>(w0);
        if (NW > 1) {
            rows[NW - 1] = reinterpret_cast<const uint4*>(w1);
        }
#pragma unroll
        for (int k = 0; k < P; ++k) {
            const int c = lane + 32 * k;
#pragma unroll
            for (int n = 0; n < NW; ++n) {
                first[n][k] = c < chunks ? __ldg(rows[n] + c) : make_uint4(0, 0, 0, 0);
            }
        }
    }
};

// One 16-byte vector of an input row: through L1 (shared memory, or inputs of earlier
// launches), or from L2 only (`GLOBAL_X`: rows another block wrote in this launch, which this
// SM's L1 may hold stale; see the persistent step below).
template <bool GLOBAL_X>
__device__ __forceinline__ uint4 load_x(const uint4* p) {
    return GLOBAL_X ? __ldcg(p) : *p;
}

template <int NW>
__device__ __forceinline__ void zero_acc(float (&acc)[NW][GEMV_MAX_ROWS]) {
#pragma unroll
    for (int n = 0; n < NW; ++n) {
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
            acc[n][r] = 0.0f;
        }
    }
}

// acc[n][r] += w_n[chunk c] . x[r][chunk c] for the input rows r < rows.
// ROWS: the most rows the caller's kernel takes (fewer registers for small steps); a row's
// arithmetic does not depend on it.
template <int NW, bool GLOBAL_X = false, int ROWS = GEMV_MAX_ROWS>
__device__ __forceinline__ void dot_chunk(const uint4 (&wv)[NW], const uint4* xv, int chunks,
                                          int c, int rows, float (&acc)[NW][GEMV_MAX_ROWS]) {
    float wf[NW][8];
#pragma unroll
    for (int n = 0; n < NW; ++n) {
        unpack8_bf16(wv[n], wf[n]);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (r < rows) {
            float xf[8];
            unpack8_bf16(load_x<GLOBAL_X>(xv + (size_t)r * chunks + c), xf);
#pragma unroll
            for (int n = 0; n < NW; ++n) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    acc[n][r] += wf[n][e] * xf[e];
                }
            }
        }
    }
}

// sums[n] = the warp's sum of w_n . x[r] for r = lane >> 2 (meaningful in lanes with
// (lane & 3) == 0 and r < rows; see warp_sum8). `x` may be shared or global memory.
// The chunks go in the same order (lane, lane + 32, ..) whatever P is, so the sums are too.
template <int NW, bool GLOBAL_X = false, int P = GEMV_PRELOAD>
__device__ __forceinline__ void warp_dots(const WarpWeights<NW, P>& w, const unsigned short* x,
                                          int rows, float (&sums)[NW]) {
    const int lane = threadIdx.x & 31;
    float acc[NW][GEMV_MAX_ROWS];
    zero_acc<NW>(acc);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const int chunks = w.chunks;
#pragma unroll
    for (int k = 0; k < P; ++k) {
        const int c = lane + 32 * k;
        if (c < chunks) {
            uint4 wv[NW];
#pragma unroll
            for (int n = 0; n < NW; ++n) {
                wv[n] = w.first[n][k];
            }
            dot_chunk<NW, GLOBAL_X>(wv, xv, chunks, c, rows, acc);
        }
    }
    // The rest of a wide row (hidden > 768 values), unrolled so the loads are in flight
    // together.
#pragma unroll 4
    for (int c = lane + 32 * P; c < chunks; c += 32) {
        uint4 wv[NW];
#pragma unroll
        for (int n = 0; n < NW; ++n) {
            wv[n] = __ldg(w.rows[n] + c);
        }
        dot_chunk<NW, GLOBAL_X>(wv, xv, chunks, c, rows, acc);
    }
#pragma unroll
    for (int n = 0; n < NW; ++n) {
        sums[n] = warp_sum8(acc[n]);
    }
}

// F32Rows, EmbedRows and stage_rms_normed (the normed input rows of a fused step, staged in
// shared memory) are in common.cuh: kernels/rows_mma.cu stages its inputs the same way.

// y[r, o] (f32) = x[r, :] (bf16) . w[o, :] (bf16), or y[r, o] += that when `accumulate` (the
// residual add of o_proj and down_proj; the logits). Session 26's ncu profile (BENCHMARKS.md)
// had the one-warp-per-output form at 5.7 us for SmolLM2's o_proj and down_proj at one row and
// 13.0 us at eight: 576 warps, about four an SM, each walking its whole row as a chain of
// dependent trips to memory, 8x the input loads at eight rows. Here `split` warps share an
// output's dot product, each over its own contiguous slice of the 16-byte chunks, their sums
// added in slice order through shared memory, and each warp computes NW outputs so that one
// load of an input chunk serves NW weight rows. An output's arithmetic (its chunk order within
// each slice, the shuffle tree, the slice order) depends on `inp` and `split` only, never on
// `rows`, NW or ROWS (the most rows the kernel takes): the launcher picks the kernel by row
// count and `split` by the shape, and a row's bits stay the same at every step width (batch
// invariance). Block: GEMV_BLOCK_WARPS warps (GEMV_THREADS in device.rs), `split`
// in {1, 2, 4}; 4 / split groups of NW outputs a block. Grid: ceil(out / (4 / split * NW)).
// NORM (`gemv_norm_rows`): x is staged in shared memory as bf16(rms_norm(xf[r]) * norm_w) by
// stage_rms_normed (a one-warp sum of squares, so a value may land on the neighbouring bf16 of
// add_rms_norm's), and a final norm and the logits are one launch; the dot products are the same.
template <int NW, int ROWS, bool NORM = false>
__device__ __forceinline__ void gemv_split(const unsigned short* __restrict__ x,
                                           const unsigned short* __restrict__ w,
                                           float* __restrict__ y, int rows, int inp, int out,
                                           int accumulate, int split,
                                           const float* __restrict__ xf = nullptr,
                                           const unsigned short* __restrict__ norm_w = nullptr,
                                           float eps = 0.0f) {
    __shared__ float partial[GEMV_BLOCK_WARPS][NW][GEMV_MAX_ROWS];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int slice = warp % split;
    const int group = warp / split;
    const int o0 = (blockIdx.x * (GEMV_BLOCK_WARPS / split) + group) * NW;
    const int chunks = inp >> 3;
    const int per_slice = (chunks + split - 1) / split;
    const int begin = slice * per_slice;
    const int end = min(chunks, begin + per_slice);
    const uint4* rows_w[NW];
#pragma unroll
    for (int n = 0; n < NW; ++n) {
        // Outputs past the end read a valid row and write nothing.
        rows_w[n] = reinterpret_cast<const uint4*>(w + (size_t)min(o0 + n, out - 1) * inp);
    }
    PDL_LAUNCH_DEPENDENTS();
    // The slice's weight chunks go in flight before the inputs are waited for: U chunks a lane
    // (U * NW 16-byte loads), the rest in further passes of the same order.
    constexpr int U = NW >= 4 ? 1 : (NW == 2 ? 2 : GEMV_PRELOAD);
    uint4 wv[U][NW];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = begin + lane + 32 * u;
#pragma unroll
        for (int n = 0; n < NW; ++n) {
            wv[u][n] = c < end ? __ldg(rows_w[n] + c) : make_uint4(0, 0, 0, 0);
        }
    }
    PDL_WAIT();
    if (NORM) {
        DYNAMIC_SHARED(uint4, gemv_shared);
        unsigned short* xs = reinterpret_cast<unsigned short*>(gemv_shared);
        stage_rms_normed(xf, norm_w, xs, rows, inp, eps);
        x = xs;
    }
    float acc[NW][GEMV_MAX_ROWS];
    zero_acc<NW>(acc);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (int base = begin + lane;; base += 32 * U) {
        // Each row's input is loaded just before its products. Requesting every row's and
        // chunk's input first (session 28) measured slower: 4.70 us against 4.30 for a four-row
        // o_proj or down_proj under ncu (77 registers against 64), and a batch-1 verification
        // 0.918 ms against 0.870-0.875 (BENCHMARKS.md, session 28 run 3).
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + 32 * u;
            if (c < end) {
                dot_chunk<NW, false, ROWS>(wv[u], xv, chunks, c, rows, acc);
            }
        }
        if (base + 32 * U >= end) {
            break;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + 32 * U + 32 * u;
#pragma unroll
            for (int n = 0; n < NW; ++n) {
                wv[u][n] = c < end ? __ldg(rows_w[n] + c) : make_uint4(0, 0, 0, 0);
            }
        }
    }
    float sums[NW];
#pragma unroll
    for (int n = 0; n < NW; ++n) {
        sums[n] = warp_sum8(acc[n]);
    }
    const int r = lane >> 2;
    const bool holder = (lane & 3) == 0 && r < rows;
    if (split > 1) {
        if (holder) {
#pragma unroll
            for (int n = 0; n < NW; ++n) {
                partial[warp][n][r] = sums[n];
            }
        }
        __syncthreads();
        if (slice != 0) {
            return;
        }
        if (holder) {
#pragma unroll
            for (int n = 0; n < NW; ++n) {
                float total = partial[warp][n][r];
                for (int s = 1; s < split; ++s) {
                    total += partial[warp + s][n][r];
                }
                sums[n] = total;
            }
        }
    }
    if (holder) {
#pragma unroll
        for (int n = 0; n < NW; ++n) {
            if (o0 + n < out) {
                float* dst = y + (size_t)r * out + o0 + n;
                *dst = accumulate ? *dst + sums[n] : sums[n];
            }
        }
    }
}

// One kernel per row bucket (steps of up to 1, 2, 4 and 8 rows) and outputs a warp (1, 2, 4):
// the launcher takes the bucket that holds the step and the outputs its table gives the bucket
// (at one row the extra registers of more outputs or of eight rows' accumulators cost the
// 49,152-row logits a third of their occupancy; more outputs pay once the rows multiply the
// input loads). Every kernel gives a row the same bits.
#define GEMV_ROWS_KERNEL(ROWS, NW)                                                              \
    extern "C" __global__ void gemv_rows_r##ROWS##_o##NW(                                       \
        const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,             \
        float* __restrict__ y, int rows, int inp, int out, int accumulate, int split) {         \
        gemv_split<NW, ROWS>(x, w, y, rows, inp, out, accumulate, split);                      \
    }
#define GEMV_ROWS_KERNELS(ROWS) \
    GEMV_ROWS_KERNEL(ROWS, 1)   \
    GEMV_ROWS_KERNEL(ROWS, 2)   \
    GEMV_ROWS_KERNEL(ROWS, 4)
GEMV_ROWS_KERNELS(1)
GEMV_ROWS_KERNELS(2)
GEMV_ROWS_KERNELS(4)
GEMV_ROWS_KERNELS(8)

// y[r, o] = bf16(rms_norm(xf[r]) * norm_w) . w[o, :]: the final norm and the logits of a fused
// step in one launch (the EAGLE-3 head's draft logits), the same kernels otherwise. Dynamic
// shared: rows * inp bf16.
#define GEMV_NORM_ROWS_KERNEL(ROWS, NW)                                                         \
    extern "C" __global__ void gemv_norm_rows_r##ROWS##_o##NW(                                  \
        const float* __restrict__ xf, const unsigned short* __restrict__ norm_w,                \
        const unsigned short* __restrict__ w, float* __restrict__ y, int rows, int inp,         \
        int out, int split, float eps) {                                                        \
        gemv_split<NW, ROWS, true>(nullptr, w, y, rows, inp, out, 0, split, xf, norm_w, eps);   \
    }
#define GEMV_NORM_ROWS_KERNELS(ROWS) \
    GEMV_NORM_ROWS_KERNEL(ROWS, 1)   \
    GEMV_NORM_ROWS_KERNEL(ROWS, 2)   \
    GEMV_NORM_ROWS_KERNEL(ROWS, 4)
GEMV_NORM_ROWS_KERNELS(1)
GEMV_NORM_ROWS_KERNELS(2)
GEMV_NORM_ROWS_KERNELS(4)
GEMV_NORM_ROWS_KERNELS(8)

// act[r, j] = bf16(silu(g) * u) with g, u the gate and up projections (rows j and inter + j of
// the fused gate|up weight) of rms_norm(x[r]) * norm_w. Grid: ceil(inter / warps). Dynamic
// shared: rows * hidden bf16.
extern "C" __global__ void norm_gate_up_silu(const float* __restrict__ x,
                                             const unsigned short* __restrict__ norm_w,
                                             const unsigned short* __restrict__ w,
                                             unsigned short* __restrict__ act, int rows,
                                             int hidden, int inter, float eps) {
    DYNAMIC_SHARED(uint4, gemv_shared);
    unsigned short* xs = reinterpret_cast<unsigned short*>(gemv_shared);
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int jw = min(j, inter - 1);  // spare warps load a valid row and leave after staging
    PDL_LAUNCH_DEPENDENTS();
    const WarpWeights<2> weights(w + (size_t)jw * hidden, w + (size_t)(inter + jw) * hidden,
                                 hidden);
    PDL_WAIT();
    stage_rms_normed(x, norm_w, xs, rows, hidden, eps);
    if (j >= inter) {
        return;
    }
    float sums[2];
    warp_dots<2>(weights, xs, rows, sums);
    const int r = lane >> 2;
    if ((lane & 3) == 0 && r < rows) {
        const float g = sums[0];
        act[(size_t)r * inter + j] = f32_to_bf16(g / (1.0f + expf(-g)) * sums[1]);
    }
}

// The q|k|v projection of rms_norm(x[r]) * norm_w, the optional bias, RoPE and the cache write
// of rope_qkv, one warp per rotation pair: output rows (h * head_dim + j, h * head_dim + j +
// head_dim / 2) of head h (query heads, then key heads, then value heads, which are copied
// unrotated). q goes to q_out (f32, [rows, heads * head_dim]); keys and values to the layer's
// cache at column col0 + r % width (`step_scalars[0]` when given, as in rope_qkv). With `x2`
// (the EAGLE-3 head, whose attention input is [norm(embed), norm(hidden)]) the projection adds
// a second input's rms_norm(x2[r]) * norm_w2 through its own weight w2 (same shape as w). Grid:
// ceil((heads + 2 * kv_heads) * head_dim / 2 / warps). Dynamic shared: rows * hidden bf16, twice
// with `x2`.
extern "C" __global__ void norm_qkv_rope(const float* __restrict__ x,
                                         const unsigned short* __restrict__ norm_w,
                                         const unsigned short* __restrict__ w,
                                         const float* __restrict__ x2,
                                         const unsigned short* __restrict__ norm_w2,
                                         const unsigned short* __restrict__ w2,
                                         const float* __restrict__ bias,
                                         const int* __restrict__ positions,
                                         const float* __restrict__ inv_freq,
                                         float* __restrict__ q_out, unsigned short* k_cache,
                                         unsigned short* v_cache, int rows, int hidden, int width,
                                         int heads, int kv_heads, int head_dim, int capacity,
                                         int col0, const int* step_scalars, float eps,
                                         const unsigned short* __restrict__ embed_table,
                                         const unsigned int* __restrict__ tokens) {
    PDL_LAUNCH_DEPENDENTS();
    DYNAMIC_SHARED(uint4, gemv_shared);
    unsigned short* xs = reinterpret_cast<unsigned short*>(gemv_shared);
    unsigned short* xs2 = xs + (size_t)rows * hidden;
    const int lane = threadIdx.x & 31;
    const int half = head_dim / 2;
    const int pairs = (heads + 2 * kv_heads) * half;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int tw = min(t, pairs - 1);  // spare warps load a valid pair and leave after staging
    const int h = tw / half;
    const int j = tw % half;
    const int row1 = h * head_dim + j;
    const int row2 = row1 + half;
    const WarpWeights<2> weights(w + (size_t)row1 * hidden, w + (size_t)row2 * hidden, hidden);
    const WarpWeights<2> weights2(w2 + (size_t)row1 * hidden, w2 + (size_t)row2 * hidden, hidden,
                                  x2 != nullptr);
    PDL_WAIT();
    if (step_scalars != nullptr) {
        col0 = step_scalars[0];
    }
    if (embed_table != nullptr) {
        stage_rms_normed_rows(EmbedRows{embed_table, tokens}, norm_w, xs, rows, hidden, eps);
    } else {
        stage_rms_normed(x, norm_w, xs, rows, hidden, eps);
    }
    if (x2 != nullptr) {
        stage_rms_normed(x2, norm_w2, xs2, rows, hidden, eps);
    }
    if (t >= pairs) {
        return;
    }
    float sums[2];
    warp_dots<2>(weights, xs, rows, sums);
    if (x2 != nullptr) {
        float sums2[2];
        warp_dots<2>(weights2, xs2, rows, sums2);
        sums[0] += sums2[0];
        sums[1] += sums2[1];
    }
    const int r = lane >> 2;
    if ((lane & 3) == 0 && r < rows) {
        qkv_pair_out(sums[0], sums[1], bias, row1, h, j, r, positions, inv_freq, q_out, k_cache,
                     v_cache, width, heads, kv_heads, head_dim, capacity, col0);
    }
}

// One row's visible cache columns (mask entry not -inf), in column order, into `list`, and
// their number into `*count`, by one warp (a ballot per 32 columns). The persistent step and
// the fused steps' `visible_columns` both build their lists here.
__device__ __forceinline__ void warp_visible_columns(const float* mask_row, int total, int* list,
                                                     int* count_out) {
    const int lane = threadIdx.x & 31;
    int count = 0;
    for (int c0 = 0; c0 < total; c0 += 32) {
        const int j = c0 + lane;
        const bool seen = j < total && mask_row[j] != NEG_INF;
        const unsigned int ballot = __ballot_sync(0xffffffffu, seen);
        if (seen) {
            list[count + __popc(ballot & ((1u << lane) - 1u))] = j;
        }
        count += __popc(ballot);
    }
    if (lane == 0) {
        *count_out = count;
    }
}

// ---- Persistent steps: a whole small step in one launch ----
//
// A fused batch-1 decode step is still ~150 launches (five a layer) of ~5 us each, each of
// which waits for a cold trip to memory before it can use its weights, while all of SmolLM2's
// weights stream in ~60 us at the H200's bandwidth. `persistent_step` runs the whole step (the
// embedding, every phase of every layer, the final norm and the logits) in one launch of one
// block per SM, the phases separated by grid barriers, and has each warp issue its first weight
// loads of the next phase *before* the barrier in front of it (weights do not depend on the
// step), so the memory latency overlaps the barrier instead of following it. The taps are
// written where the capture hook says (the tap table), at the same points as the block loop.
//
// Batch invariance: a row's results do not depend on how many rows the step has (1 to
// GEMV_MAX_ROWS) nor on what else is in it. Every matrix-vector sum runs in the same order for
// every row count (one warp per output, fixed chunk order, warp_sum8's fixed tree; the same
// sums as the fused kernels above), an RMSNorm is one warp per row, and attention takes a
// row's visible keys in their order, in chunks of 32 whose partial softmaxes fold in chunk
// order (a block per row and head; the same arithmetic as attention_invariant), so neither the
// step's other rows nor hidden columns (rejected drafts a speculative cache keeps between
// accepted tokens) change a bit. So a decode step and a verification whose first token is the
// decoded one give that token bit-identical logits, and greedy speculative output equals
// target-only output when every step of both runs here (80/80 MT-Bench replies, BENCHMARKS.md).
// Measured slower than the fused kernels so far (each phase is a chain of dependent trips to
// memory; BENCHMARKS.md has the phase profile); off by default.

#ifndef PERSIST_THREADS  // TANDEM_CUDA_PERSISTENT_WARPS=8 compiles it with 256
#define PERSIST_THREADS 512
#endif
#define PERSIST_WARPS (PERSIST_THREADS / 32)
#define PERSIST_MAX_TAPS 8
#define PERSIST_MAX_LAYERS 128

// One layer of the step's table (9 device addresses; built by crates/tandem-cuda/src/model.rs,
// `persistent_table`), then PERSIST tap slots of two words each: the tap point (0 the
// embedding, 1 + k block k, layers + 1 the final norm) and the slot's `[rows, hidden]` f32 rows.
struct PersistLayer {
    const unsigned short* input_norm;
    const unsigned short* qkv;
    const float* qkv_bias;  // null without biases
    const unsigned short* o;
    const unsigned short* post_norm;
    const unsigned short* gate_up;
    const unsigned short* down;
    unsigned short* k_cache;
    unsigned short* v_cache;
};

// Grid-wide barrier over a counter that never needs resetting (the scheme of cooperative
// groups' grid sync): block 0 adds 2^31 - (blocks - 1), the others 1, so the top bit flips once
// per barrier and the low bits come back to where they were; each block waits for the flip.
// Every block must be resident (one block per SM, launched cooperatively).
__device__ __forceinline__ void grid_barrier(unsigned int* arrived, unsigned long long* profile,
                                             int& slot) {
    __syncthreads();
    if (threadIdx.x == 0) {
        // Profiling (TANDEM_CUDA_PERSISTENT_PROFILE=1): block 0's clock when it arrives and
        // when it leaves each barrier, so the host can tell phases' work from their waits.
        if (profile != nullptr && blockIdx.x == 0) {
            profile[2 * slot] = clock64();
        }
        const unsigned int add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        __threadfence();
        const unsigned int old = atomicAdd(arrived, add);
        while (((old ^ *(volatile unsigned int*)arrived) & 0x80000000u) == 0) {
        }
        __threadfence();
        if (profile != nullptr && blockIdx.x == 0) {
            profile[2 * slot + 1] = clock64();
        }
    }
    ++slot;
    __syncthreads();
}

// stage_rms_normed for rows another block wrote in this launch: read through L2 (__ldcg).
// `src_rows` (optional) picks the rows (logit rows); `out_f32` (optional, block 0 only) also
// keeps the normed values in f32 (the final tap), row r of the stage at src row r's place.
__device__ void persist_stage_normed(const float* x, const unsigned short* __restrict__ w,
                                     unsigned short* xs, int rows, int n, float eps,
                                     const int* src_rows) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const uint2* w4 = reinterpret_cast<const uint2*>(w);
    const int n4 = n >> 2;
    for (int r = warp; r < rows; r += PERSIST_WARPS) {
        const int src = src_rows != nullptr ? src_rows[r] : r;
        const float4* xr = reinterpret_cast<const float4*>(x + (size_t)src * n);
        // Rows of up to 1,024 values are read once, all loads in flight together (one trip to
        // L2, not one per pass); the sums run in the same order either way.
        constexpr int HELD = 8;
        float4 held[HELD];
        const bool in_registers = n4 <= 32 * HELD;
        float squares = 0.0f;
        if (in_registers) {
#pragma unroll
            for (int k = 0; k < HELD; ++k) {
                const int i = lane + 32 * k;
                held[k] = i < n4 ? __ldcg(xr + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int k = 0; k < HELD; ++k) {
                if (lane + 32 * k < n4) {
                    const float4 v = held[k];
                    squares += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                }
            }
        } else {
#pragma unroll 4
            for (int i = lane; i < n4; i += 32) {
                const float4 v = __ldcg(xr + i);
                squares += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
        }
        const float inv = 1.0f / sqrtf(warp_sum(squares) / (float)n + eps);
        uint2* out = reinterpret_cast<uint2*>(xs + (size_t)r * n);
        auto emit = [&](int i, const float4 v) {
            const uint2 wv = w4[i];
            const unsigned int lo = f32_to_bf16(v.x * inv * __uint_as_float(wv.x << 16)) |
                                    ((unsigned int)f32_to_bf16(v.y * inv * __uint_as_float(wv.x & 0xffff0000u)) << 16);
            const unsigned int hi = f32_to_bf16(v.z * inv * __uint_as_float(wv.y << 16)) |
                                    ((unsigned int)f32_to_bf16(v.w * inv * __uint_as_float(wv.y & 0xffff0000u)) << 16);
            out[i] = make_uint2(lo, hi);
        };
        if (in_registers) {
#pragma unroll
            for (int k = 0; k < HELD; ++k) {
                if (lane + 32 * k < n4) {
                    emit(lane + 32 * k, held[k]);
                }
            }
        } else {
#pragma unroll 4
            for (int i = lane; i < n4; i += 32) {
                emit(i, __ldcg(xr + i));
            }
        }
    }
    __syncthreads();
}

// The normed rows in f32 as add_rms_norm computes them (`final` tap): dst[r, i] for every row.
// Spread over the whole grid, one warp per row and chunk of 128 values.
__device__ void persist_final_normed(const float* x, const unsigned short* __restrict__ w,
                                     float* dst, int rows, int n, float eps, int gwarp,
                                     int nwarps) {
    const int lane = threadIdx.x & 31;
    for (int r = gwarp; r < rows; r += nwarps) {
        const float* xr = x + (size_t)r * n;
        float squares = 0.0f;
        for (int i = lane; i < n; i += 32) {
            const float v = __ldcg(xr + i);
            squares += v * v;
        }
        const float inv = 1.0f / sqrtf(warp_sum(squares) / (float)n + eps);
        for (int i = lane; i < n; i += 32) {
            dst[(size_t)r * n + i] = __ldcg(xr + i) * inv * bf16_to_f32(w[i]);
        }
    }
}

// Copies the residual (complete after a barrier) to every tap slot of `point`.
__device__ __forceinline__ void persist_tap(const float* hidden, int point, int n,
                                            const int* tap_point, float* const* tap_dst,
                                            int tap_slots, int gthread, int nthreads) {
    for (int s = 0; s < tap_slots; ++s) {
        if (tap_point[s] != point) {
            continue;
        }
        float* dst = tap_dst[s];
        for (int i = gthread; i < n; i += nthreads) {
            dst[i] = __ldcg(hidden + i);
        }
    }
}

// One step of at most GEMV_MAX_ROWS rows (`rows` = batch * width, sequence-major) through
// every layer: tokens -> `hidden` (the f32 residual, [rows, hidden]) -> logits of the rows in
// `logit_rows` (null: rows 0 .. n_logit_rows - 1) into `logits` ([n_logit_rows, vocab] f32).
// Scratch: `q` [rows, heads * head_dim] f32; `visible` [rows, capacity] i32 then [rows] i32
// (each row's visible columns in order, then their count); `attn` [rows, heads * head_dim]
// bf16; `act` [rows, inter] bf16; `arrived` one u32 (zero before the first launch and left so
// after each); `profile` (optional) [2 * (5 * layers + 1) + 1] u64. Cache columns, mask and
// `step_scalars` as in rope_qkv / attention. Grid: one block per SM (cooperative launch); block
// PERSIST_THREADS; dynamic shared memory: rows * hidden bf16 (the normed rows), then
// PERSIST_WARPS * (head_dim + 2) f32 (attention partials) and head_dim f32 (a query).
extern "C" __global__ void __launch_bounds__(PERSIST_THREADS, 1)
persistent_step(const unsigned long long* __restrict__ table, int tap_slots,
                const unsigned short* __restrict__ embed, const unsigned int* __restrict__ tokens,
                const int* __restrict__ positions, const float* __restrict__ inv_freq,
                const float* __restrict__ mask, const int* __restrict__ step_scalars,
                const unsigned short* __restrict__ final_norm,
                const unsigned short* __restrict__ lm_head, const int* __restrict__ logit_rows,
                int n_logit_rows, float* hidden, float* q, int* visible,
                unsigned short* attn, unsigned short* act,
                float* __restrict__ logits, unsigned int* arrived,
                unsigned long long* profile, int layers, int rows,
                int width, int hidden_size, int heads, int kv_heads, int head_dim, int inter,
                int capacity, int col0, int total, int vocab, float eps, float scale) {
    DYNAMIC_SHARED(uint4, persist_shared);
    __shared__ int tap_point[PERSIST_MAX_TAPS];
    __shared__ float* tap_dst[PERSIST_MAX_TAPS];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int gwarp = blockIdx.x * PERSIST_WARPS + warp;
    const int nwarps = gridDim.x * PERSIST_WARPS;
    const int gthread = blockIdx.x * blockDim.x + threadIdx.x;
    const int nthreads = gridDim.x * blockDim.x;
    int slot = 0;  // barriers passed (the profile's index)
    if (step_scalars != nullptr) {
        col0 = step_scalars[0];
        total = step_scalars[1];
    }
    const PersistLayer* table_layers = reinterpret_cast<const PersistLayer*>(table);
    // The layer table in shared memory: each layer's addresses without a trip to memory.
    __shared__ PersistLayer layer_table[PERSIST_MAX_LAYERS];
    for (int i = threadIdx.x; i < layers * 9; i += blockDim.x) {
        reinterpret_cast<unsigned long long*>(layer_table)[i] = table[i];
    }
    if (threadIdx.x < tap_slots) {
        const unsigned long long* slot = table + (size_t)layers * 9 + 2 * threadIdx.x;
        tap_point[threadIdx.x] = (int)slot[0];
        tap_dst[threadIdx.x] = reinterpret_cast<float*>(slot[1]);
    }
    const int hidden_n = rows * hidden_size;
    const int q_dim = heads * head_dim;
    const int half = head_dim / 2;
    const int pairs = (heads + 2 * kv_heads) * half;
    const int stage_width = hidden_size;
    unsigned short* stage = reinterpret_cast<unsigned short*>(persist_shared);
    float* attention_partials = reinterpret_cast<float*>(stage + (size_t)rows * stage_width);
    float* q_shared = attention_partials + PERSIST_WARPS * (head_dim + 2);

    // The embedding rows: the residual entering block 0.
    for (int i = gthread; i < hidden_n; i += nthreads) {
        const int r = i / hidden_size;
        hidden[i] = bf16_to_f32(embed[(size_t)tokens[r] * hidden_size + i % hidden_size]);
    }
    // Each row's visible columns, in order. Attention chunks count a row's visible keys, not
    // cache columns, so its sums do not depend on where the keys sit in the cache: a
    // speculative cache keeps rejected drafts as hidden columns between accepted ones, a
    // target-only cache has none, and both must give a token the same bits.
    int* counts = visible + (size_t)rows * capacity;
    for (int r = gwarp; r < rows; r += nwarps) {
        warp_visible_columns(mask + (size_t)r * total, total, visible + (size_t)r * capacity,
                             counts + r);
    }
    // This warp's first q|k|v pair, loaded before the barrier.
    auto qkv_weights = [&](const PersistLayer& layer, int t, bool load) {
        const int tw = min(t, pairs - 1);
        const int row1 = (tw / half) * head_dim + tw % half;
        return WarpWeights<2>(layer.qkv + (size_t)row1 * hidden_size,
                              layer.qkv + (size_t)(row1 + half) * hidden_size, hidden_size,
                              load);
    };
    WarpWeights<2> first_qkv = qkv_weights(table_layers[0], gwarp, gwarp < pairs);
    grid_barrier(arrived, profile, slot);
    persist_tap(hidden, 0, hidden_n, tap_point, tap_dst, tap_slots, gthread, nthreads);

    for (int k = 0; k < layers; ++k) {
        const PersistLayer layer = layer_table[k];
        if (k > 0) {
            persist_tap(hidden, k, hidden_n, tap_point, tap_dst, tap_slots, gthread, nthreads);
        }
        // ---- input norm, q|k|v, bias, RoPE, cache write (norm_qkv_rope) ----
        persist_stage_normed(hidden, layer.input_norm, stage, rows, hidden_size, eps, nullptr);
        {
            WarpWeights<2> cur = first_qkv;
            for (int t = gwarp; t < pairs; t += nwarps) {
                const WarpWeights<2> next = qkv_weights(layer, t + nwarps, t + nwarps < pairs);
                float sums[2];
                warp_dots<2>(cur, stage, rows, sums);
                const int h = t / half;
                const int j = t % half;
                const int row1 = h * head_dim + j;
                const int r = lane >> 2;
                if ((lane & 3) == 0 && r < rows) {
                    qkv_pair_out(sums[0], sums[1], layer.qkv_bias, row1, h, j, r, positions,
                                 inv_freq, q, layer.k_cache, layer.v_cache, width, heads,
                                 kv_heads, head_dim, capacity, col0);
                }
                cur = next;
            }
        }
        grid_barrier(arrived, profile, slot);

        // ---- attention: a block per (row, head), over the row's visible keys ----
        for (int rh = blockIdx.x; rh < rows * heads; rh += gridDim.x) {
            const int r = rh / heads;
            const int h = rh % heads;
            const int b = r / width;
            const int kvh = h / (heads / kv_heads);
            attention_block(q + (size_t)rh * head_dim, scale, layer.k_cache, layer.v_cache,
                            ((size_t)b * kv_heads + kvh) * capacity * head_dim,
                            visible + (size_t)r * capacity, __ldcg(counts + r),
                            mask + (size_t)r * total, head_dim, attention_partials, q_shared,
                            attn + (size_t)r * q_dim + h * head_dim);
        }
        WarpWeights<1> first_o(layer.o + (size_t)min(gwarp, hidden_size - 1) * q_dim, nullptr,
                               q_dim, gwarp < hidden_size);
        grid_barrier(arrived, profile, slot);

        // ---- o_proj into the residual (attn read from L2: other blocks wrote it) ----
        {
            WarpWeights<1> cur = first_o;
            for (int o = gwarp; o < hidden_size; o += nwarps) {
                const int on = o + nwarps;
                const WarpWeights<1> next(layer.o + (size_t)min(on, hidden_size - 1) * q_dim,
                                          nullptr, q_dim, on < hidden_size);
                float sums[1];
                warp_dots<1, true>(cur, attn, rows, sums);
                const int r = lane >> 2;
                if ((lane & 3) == 0 && r < rows) {
                    float* dst = hidden + (size_t)r * hidden_size + o;
                    *dst = __ldcg(dst) + sums[0];
                }
                cur = next;
            }
        }
        auto gate_up_weights = [&](int j, bool load) {
            const int jw = min(j, inter - 1);
            return WarpWeights<2>(layer.gate_up + (size_t)jw * hidden_size,
                                  layer.gate_up + (size_t)(inter + jw) * hidden_size,
                                  hidden_size, load);
        };
        WarpWeights<2> first_gate_up = gate_up_weights(gwarp, gwarp < inter);
        grid_barrier(arrived, profile, slot);

        // ---- post-attention norm, gate|up, SwiGLU (norm_gate_up_silu) ----
        persist_stage_normed(hidden, layer.post_norm, stage, rows, hidden_size, eps, nullptr);
        {
            WarpWeights<2> cur = first_gate_up;
            for (int j = gwarp; j < inter; j += nwarps) {
                const WarpWeights<2> next = gate_up_weights(j + nwarps, j + nwarps < inter);
                float sums[2];
                warp_dots<2>(cur, stage, rows, sums);
                const int r = lane >> 2;
                if ((lane & 3) == 0 && r < rows) {
                    const float g = sums[0];
                    act[(size_t)r * inter + j] = f32_to_bf16(g / (1.0f + expf(-g)) * sums[1]);
                }
                cur = next;
            }
        }
        // down_proj's rows are the widest (intermediate): twice the chunks loaded ahead.
        WarpWeights<1, 2 * GEMV_PRELOAD> first_down(
            layer.down + (size_t)min(gwarp, hidden_size - 1) * inter, nullptr, inter,
            gwarp < hidden_size);
        grid_barrier(arrived, profile, slot);

        // ---- down_proj into the residual (act read from L2: other blocks wrote it) ----
        {
            WarpWeights<1, 2 * GEMV_PRELOAD> cur = first_down;
            for (int o = gwarp; o < hidden_size; o += nwarps) {
                const int on = o + nwarps;
                const WarpWeights<1, 2 * GEMV_PRELOAD> next(
                    layer.down + (size_t)min(on, hidden_size - 1) * inter, nullptr, inter,
                    on < hidden_size);
                float sums[1];
                warp_dots<1, true, 2 * GEMV_PRELOAD>(cur, act, rows, sums);
                const int r = lane >> 2;
                if ((lane & 3) == 0 && r < rows) {
                    float* dst = hidden + (size_t)r * hidden_size + o;
                    *dst = __ldcg(dst) + sums[0];
                }
                cur = next;
            }
        }
        if (k + 1 < layers) {
            first_qkv = qkv_weights(layer_table[k + 1], gwarp, gwarp < pairs);
        }
        grid_barrier(arrived, profile, slot);
    }

    // ---- the last block's tap, the final norm (and its tap), the logits ----
    persist_tap(hidden, layers, hidden_n, tap_point, tap_dst, tap_slots, gthread, nthreads);
    for (int s = 0; s < tap_slots; ++s) {
        if (tap_point[s] == layers + 1) {
            persist_final_normed(hidden, final_norm, tap_dst[s], rows, hidden_size, eps, gwarp,
                                 nwarps);
        }
    }
    if (n_logit_rows == 0) {
        if (profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
            profile[2 * slot] = clock64();
        }
        return;
    }
    // Two vocabulary rows per warp and unit; the next unit's weights load while this one sums.
    const int units = (vocab + 1) / 2;
    auto lm_weights = [&](int u, bool load) {
        const int o1 = min(2 * u, vocab - 1);
        const int o2 = min(2 * u + 1, vocab - 1);
        return WarpWeights<2>(lm_head + (size_t)o1 * hidden_size,
                              lm_head + (size_t)o2 * hidden_size, hidden_size, load);
    };
    WarpWeights<2> cur = lm_weights(gwarp, gwarp < units);
    persist_stage_normed(hidden, final_norm, stage, n_logit_rows, hidden_size, eps, logit_rows);
    for (int u = gwarp; u < units; u += nwarps) {
        const WarpWeights<2> next = lm_weights(u + nwarps, u + nwarps < units);
        float sums[2];
        warp_dots<2>(cur, stage, n_logit_rows, sums);
        const int r = lane >> 2;
        if ((lane & 3) == 0 && r < n_logit_rows) {
            logits[(size_t)r * vocab + 2 * u] = sums[0];
            if (2 * u + 1 < vocab) {
                logits[(size_t)r * vocab + 2 * u + 1] = sums[1];
            }
        }
        cur = next;
    }
    if (profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
        profile[2 * slot] = clock64();
    }
}

// ---- Batch-invariant attention for the fused small steps ----
//
// The attention kernel above gives warp w the columns w * 32 + k * 256 of the cache, so a row's
// sums group its keys by where they sit: a speculative cache, which keeps rejected drafts as
// hidden columns between accepted ones, and a target-only cache give the same token different
// bits, and greedy speculative output leaves target-only output at near-ties. These two kernels
// group a row's keys by their order among its visible keys instead (chunks of 32, combined in
// chunk order), as the persistent step does, so with the fused kernels (whose matrix-vector sums
// already run in the same order at every row count) every step of up to GEMV_MAX_ROWS rows
// gives a token the same bits.

// Each row's visible columns in order, then their counts: `list` [rows, capacity], `counts`
// [rows]. Built once a step (the mask is the same for every layer). Grid: rows; block: 32.
extern "C" __global__ void visible_columns(const float* __restrict__ mask, int* list,
                                           int* counts, int total, int capacity,
                                           const int* step_scalars) {
    if (step_scalars != nullptr) {
        total = step_scalars[1];
    }
    const int r = blockIdx.x;
    warp_visible_columns(mask + (size_t)r * total, total, list + (size_t)r * capacity,
                         counts + r);
}

// Attention of row r, head h (block r * heads + h) over the row's visible keys (`list`,
// `counts` from visible_columns): 8 warps take chunks of 32 keys (persist_attend), eight at a
// time, and warp 0 folds each group's partials into a running maximum, sum and output in chunk
// order. Output bf16 [rows, heads, head_dim] as `attention` writes it. Shared: 8 * (head_dim + 2)
// f32 partials and head_dim f32 (the scaled query).
extern "C" __global__ void attention_invariant(const float* q, const unsigned short* k_cache,
                                               const unsigned short* v_cache,
                                               const float* mask, const int* list,
                                               const int* counts, unsigned short* out,
                                               int width, int heads, int kv_heads, int head_dim,
                                               int capacity, int total, float scale,
                                               const int* step_scalars) {
    // Launched with programmatic dependent launch in fused steps (unless
    // TANDEM_CUDA_PDL_ATTENTION=0): the next launch (o_proj) starts loading its weights while
    // this one runs; everything here is read after the wait (without the attribute both are
    // no-ops).
    PDL_LAUNCH_DEPENDENTS();
    PDL_WAIT();
    if (step_scalars != nullptr) {
        total = step_scalars[1];
    }
    DYNAMIC_SHARED(float, invariant_shared);
    const int warps = blockDim.x >> 5;
    const int r = blockIdx.x / heads;
    const int h = blockIdx.x % heads;
    const int b = r / width;
    const int kvh = h / (heads / kv_heads);
    attention_block(q + ((size_t)r * heads + h) * head_dim, scale, k_cache, v_cache,
                    ((size_t)b * kv_heads + kvh) * capacity * head_dim,
                    list + (size_t)r * capacity, counts[r], mask + (size_t)r * total, head_dim,
                    invariant_shared, invariant_shared + warps * (head_dim + 2),
                    out + ((size_t)r * heads + h) * head_dim);
}
