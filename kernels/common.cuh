// Helpers shared by the CUDA kernel sources (`llama.cu`, `train.cu`). NVRTC gets no include
// path, so `tandem_cuda` puts this text in front of each source before compiling it
// (`compile_source` in crates/tandem-cuda/src/device.rs, which also resets the line numbers so
// that compiler messages point into the source itself).
//
// - bf16 values travel as `unsigned short` bit patterns (no cuda_bf16.h), converted with
//   round-to-nearest-even like torch's `.to(torch.bfloat16)`.
// - Block reductions give every thread the result and may be called back to back: each one
//   reads its result before its last barrier.

#define NEG_INF __int_as_float(0xff800000)

// A kernel's dynamic shared memory (sized at launch): `DYNAMIC_SHARED(float, name);` declares
// `name` as the block's array of `type`. A macro so that the CPU emulator of the kernel tests
// (crates/tandem-cuda/tests/emulated/cuda_emu.h) can give each launch its own buffer.
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

// Programmatic dependent launch (sm_90+, with TANDEM_CUDA_PDL=1, or TANDEM_CUDA_PDL_ROWS=N for
// launches of at most N rows: `tandem_cuda` then defines TANDEM_PDL 1 and launches the
// small-step kernels and attention with the programmatic-serialization attribute; by default
// for every fused step where the tensor-core small steps run, since session 41: 11-15% faster
// at 1 to 8 rows; with the CUDA-core kernels it was faster at 1-2 rows and slower at 4-8):
// PDL_LAUNCH_DEPENDENTS lets the next kernel of the stream start while this one runs,
// and PDL_WAIT blocks until the previous kernel has finished and its writes are visible. A
// kernel may do anything that does not read its predecessor's outputs (load weights) before
// PDL_WAIT. Without the attribute or the define both are no-ops.
//
// TANDEM_PDL_LATE (the default since session 47; TANDEM_CUDA_PDL_LATE=0 for the early trigger):
// a kernel lets the next one launch only once it has passed its own wait (the trigger moves
// into PDL_WAIT), so at most one kernel runs ahead of the one at work, loading its weights
// during that one's product. With the trigger at the start, a kernel's start launches the
// next, whose start launches the next: every launch up to the first without the attribute is
// resident and loading its weights at once, competing with the reads the kernel at work waits
// for, which is why the attention in the chain measured slower in session 42. With the late
// trigger it joins the chain by default and pays (session 47: a batch-8 decode 5% less device
// time, an 8-token verification 6-7%; BENCHMARKS.md).
#if defined(TANDEM_PDL) && TANDEM_PDL && defined(TANDEM_PDL_LATE) && TANDEM_PDL_LATE
#define PDL_WAIT() \
    asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#define PDL_LAUNCH_DEPENDENTS()
#elif defined(TANDEM_PDL) && TANDEM_PDL
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define PDL_WAIT()
#define PDL_LAUNCH_DEPENDENTS()
#endif

__device__ __forceinline__ float bf16_to_f32(unsigned short v) {
    return __uint_as_float(((unsigned int)v) << 16);
}

__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fc0;  // NaN stays NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds >= 32 floats.
__device__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        float w = lane < warps ? scratch[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) {
            scratch[0] = w;
        }
    }
    __syncthreads();
    const float total = scratch[0];
    __syncthreads();
    return total;
}

// Largest value over the block and its index, the first index among equal maxima (like
// torch.argmax); each thread passes its own candidate (NEG_INF and 0x7fffffff when it saw
// none). Every thread gets the index, and the value in `*max_value`. `best_value` and
// `best_index` hold >= 32 entries each.
__device__ int block_argmax(float best, int index, float* best_value, int* best_index,
                            float* max_value) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, offset);
        const int oi = __shfl_xor_sync(0xffffffffu, index, offset);
        if (ov > best || (ov == best && oi < index)) {
            best = ov;
            index = oi;
        }
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_value[warp] = best;
        best_index[warp] = index;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        for (int w = 1; w < warps; ++w) {
            if (best_value[w] > best_value[0] ||
                (best_value[w] == best_value[0] && best_index[w] < best_index[0])) {
                best_value[0] = best_value[w];
                best_index[0] = best_index[w];
            }
        }
    }
    __syncthreads();
    *max_value = best_value[0];
    const int result = best_index[0];
    __syncthreads();
    return result;
}

// Calls f(row[i], i) for this thread's share of a row (i = threadIdx.x, + blockDim.x, ..) in
// rising i, with U loads in flight before the calls that use them: one load per step made a
// 49,152-token row 48 dependent trips to memory per thread (argmax_rows 22 us at one row, ncu,
// session 26). The calls and their order are what the plain loop makes, so results keep their
// bits.
template <int U, typename F>
__device__ __forceinline__ void scan_row(const float* row, int n, F f) {
    const int stride = blockDim.x;
    int i = threadIdx.x;
    for (; i + (U - 1) * stride < n; i += U * stride) {
        float v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            v[u] = row[i + u * stride];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            f(v[u], i + u * stride);
        }
    }
    for (; i < n; i += stride) {
        f(row[i], i);
    }
}

// Largest entry of a row of `n` floats, scanned by the whole block: block_argmax over each
// thread's strided share (the first index on ties). A row with no maximum (all NaN) gives
// 0x7fffffff. Every thread gets the index, and the value in `*max_value`. `U`: loads in flight a
// thread (scan_row; 8 where a block's share is 8 values a thread).
template <int U = 16>
__device__ int row_argmax(const float* row, int n, float* best_value, int* best_index,
                          float* max_value) {
    float best = NEG_INF;
    int index = 0x7fffffff;
    scan_row<U>(row, n, [&](float v, int i) {
        if (v > best) {
            best = v;
            index = i;
        }
    });
    return block_argmax(best, index, best_value, best_index, max_value);
}

// ---- The fused small steps' normed inputs (kernels/llama.cu and kernels/rows_mma.cu) ----

// Four consecutive values (vector i) of row r of a step's f32 rows [rows, n].
struct F32Rows {
    const float* __restrict__ x;
    __device__ __forceinline__ float4 at(int r, int n, int i) const {
        return reinterpret_cast<const float4*>(x + (size_t)r * n)[i];
    }
};

// The same, of the embedding rows of the step's tokens (bf16, exact in f32): what embed_rows
// writes, read where it is needed instead of through an f32 copy.
struct EmbedRows {
    const unsigned short* __restrict__ table;
    const unsigned int* __restrict__ tokens;
    __device__ __forceinline__ float4 at(int r, int n, int i) const {
        const uint2 v = reinterpret_cast<const uint2*>(table + (size_t)tokens[r] * n)[i];
        return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                           __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
    }
};

// xs[r * n + i] = bf16(rms_norm(x[r]) * w[i]) for r < rows, as add_rms_norm computes it (one
// warp per row), into shared memory for the block's matrix-vector products. (Spreading every
// row over the whole block, all rows' loads in flight at once, measured slower at 1 to 8 rows:
// BENCHMARKS.md, session 18.) `Rows` gives x's values: F32Rows or EmbedRows, the same
// arithmetic on the same values.
// `stage_rms_normed_row` is one warp's share: row r.
template <typename Rows>
__device__ __forceinline__ void stage_rms_normed_row(const Rows& x,
                                                     const unsigned short* __restrict__ w,
                                                     unsigned short* xs, int r, int n, float eps) {
    const int lane = threadIdx.x & 31;
    const uint2* w4 = reinterpret_cast<const uint2*>(w);
    const int nv = n >> 2;
    // The norm weight's first NORM_PREFETCH vectors of this lane are loaded with the row, not
    // after its sum: otherwise the weight (evicted from L2 by the step's other weights) is one
    // more trip to memory on every fused step's critical path. The arithmetic is unchanged.
    constexpr int NORM_PREFETCH = 8;
    uint2 wpre[NORM_PREFETCH];
#pragma unroll
    for (int it = 0; it < NORM_PREFETCH; ++it) {
        const int i = lane + 32 * it;
        wpre[it] = i < nv ? w4[i] : make_uint2(0, 0);
    }
    {
        float squares = 0.0f;
#pragma unroll 4
        for (int i = lane; i < nv; i += 32) {
            const float4 v = x.at(r, n, i);
            squares += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        const float inv = 1.0f / sqrtf(warp_sum(squares) / (float)n + eps);
        uint2* out = reinterpret_cast<uint2*>(xs + (size_t)r * n);
        auto put = [&](int i, const uint2& wv) {
            const float4 v = x.at(r, n, i);
            const unsigned int lo = f32_to_bf16(v.x * inv * __uint_as_float(wv.x << 16)) |
                                    ((unsigned int)f32_to_bf16(v.y * inv * __uint_as_float(wv.x & 0xffff0000u)) << 16);
            const unsigned int hi = f32_to_bf16(v.z * inv * __uint_as_float(wv.y << 16)) |
                                    ((unsigned int)f32_to_bf16(v.w * inv * __uint_as_float(wv.y & 0xffff0000u)) << 16);
            out[i] = make_uint2(lo, hi);
        };
#pragma unroll
        for (int it = 0; it < NORM_PREFETCH; ++it) {
            const int i = lane + 32 * it;
            if (i < nv) {
                put(i, wpre[it]);
            }
        }
#pragma unroll 4
        for (int i = lane + 32 * NORM_PREFETCH; i < nv; i += 32) {
            put(i, w4[i]);
        }
    }
}

template <typename Rows>
__device__ void stage_rms_normed_rows(const Rows& x, const unsigned short* __restrict__ w,
                                      unsigned short* xs, int rows, int n, float eps) {
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    for (int r = warp; r < rows; r += warps) {
        stage_rms_normed_row(x, w, xs, r, n, eps);
    }
    __syncthreads();
}

__device__ void stage_rms_normed(const float* __restrict__ x, const unsigned short* __restrict__ w,
                                 unsigned short* xs, int rows, int n, float eps) {
    stage_rms_normed_rows(F32Rows{x}, w, xs, rows, n, eps);
}

// The end of a fused q|k|v projection (norm_qkv_rope in llama.cu, norm_qkv_rope_mma in
// rows_mma.cu): the rotation pair (row1, row1 + head_dim / 2) of head h, j its index in the
// head, of step row r, whose projections are x1 and x2v: the bias, then RoPE at the row's
// position into q (query heads, f32 [rows, heads * head_dim]) or the layer's key cache, or
// unrotated into the value cache, at column col0 + r % width of sequence r / width.
// The pair's operands read ahead of its product (norm_qkv_rope_mma loads them while the product
// runs): the bias pair (when there is a bias), the rotation's frequency and the row's position.
struct QkvPairInputs {
    float bias1, bias2;
    bool has_bias;
    float inv_freq;
    int position;
};

__device__ __forceinline__ QkvPairInputs qkv_pair_inputs(const float* __restrict__ bias, int row1,
                                                         int j, int r, int head_dim,
                                                         const int* __restrict__ positions,
                                                         const float* __restrict__ inv_freq) {
    QkvPairInputs in;
    in.has_bias = bias != nullptr;
    in.bias1 = in.has_bias ? bias[row1] : 0.0f;
    in.bias2 = in.has_bias ? bias[row1 + head_dim / 2] : 0.0f;
    in.inv_freq = inv_freq[j];
    in.position = positions[r];
    return in;
}

__device__ __forceinline__ void qkv_pair_out_with(float x1, float x2v, const QkvPairInputs& in,
                                                  int h, int j, int r, float* __restrict__ q_out,
                                                  unsigned short* k_cache,
                                                  unsigned short* v_cache, int width, int heads,
                                                  int kv_heads, int head_dim, int capacity,
                                                  int col0) {
    const int half = head_dim / 2;
    if (in.has_bias) {
        x1 += in.bias1;
        x2v += in.bias2;
    }
    const int b = r / width;
    const int col = col0 + r % width;
    if (h < heads + kv_heads) {
        const float angle = in.inv_freq * (float)in.position;
        const float c = cosf(angle);
        const float s = sinf(angle);
        const float y1 = x1 * c - x2v * s;
        const float y2 = x2v * c + x1 * s;
        if (h < heads) {
            float* q = q_out + (size_t)r * heads * head_dim + h * head_dim;
            q[j] = y1;
            q[j + half] = y2;
        } else {
            unsigned short* k =
                k_cache + (((size_t)b * kv_heads + (h - heads)) * capacity + col) * head_dim;
            k[j] = f32_to_bf16(y1);
            k[j + half] = f32_to_bf16(y2);
        }
    } else {
        unsigned short* v =
            v_cache + (((size_t)b * kv_heads + (h - heads - kv_heads)) * capacity + col) * head_dim;
        v[j] = f32_to_bf16(x1);
        v[j + half] = f32_to_bf16(x2v);
    }
}

__device__ __forceinline__ void qkv_pair_out(float x1, float x2v, const float* __restrict__ bias,
                                             int row1, int h, int j, int r,
                                             const int* __restrict__ positions,
                                             const float* __restrict__ inv_freq,
                                             float* __restrict__ q_out, unsigned short* k_cache,
                                             unsigned short* v_cache, int width, int heads,
                                             int kv_heads, int head_dim, int capacity,
                                             int col0) {
    qkv_pair_out_with(x1, x2v, qkv_pair_inputs(bias, row1, j, r, head_dim, positions, inv_freq),
                      h, j, r, q_out, k_cache, v_cache, width, heads, kv_heads, head_dim,
                      capacity, col0);
}

// ---- Batch-invariant attention of one (row, head) (llama.cu and rows_mma.cu) ----
//
// The persistent step, attention_invariant (llama.cu) and qkv_attention_mma (rows_mma.cu) take a
// row's keys through these three, so a row gets the same attention bits from each.

#define PERSIST_MAX_DIMS 8   // head_dim <= 256

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
                                               float& l_run, float (&o)[PERSIST_MAX_DIMS]) {
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
    for (int t = 0; t < PERSIST_MAX_DIMS; ++t) {
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
    float o[PERSIST_MAX_DIMS];
#pragma unroll
    for (int t = 0; t < PERSIST_MAX_DIMS; ++t) {
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
        for (int t = 0; t < PERSIST_MAX_DIMS; ++t) {
            if (t < dims) {
                dst[lane * dims + t] = f32_to_bf16(o[t] / l_run);
            }
        }
    }
}
