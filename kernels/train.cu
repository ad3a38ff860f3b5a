// CUDA kernels of the EAGLE-3 head trainer (crate `tandem-cuda`, `train.rs`), compiled at run
// time by NVRTC. The matmuls of the forward and backward passes run on cuBLAS (bf16 operands,
// f32 results); these kernels are everything between them. The forward computes exactly
// `tandem_eagle::Eagle3Draft::forward_ttt` (the layer serving runs) and the loss of
// `tandem_train::objective`; the GPU test `cuda_trainer_matches_burn_autodiff` compares the
// loss and every gradient with burn's autodiff on the CPU.
//
// Layouts (N = batch * width rows, sequence-major: row = b * width + t):
// - row tensors `[N, dim]` (f32 residual stream and matmul outputs, bf16 matmul inputs);
// - attention tensors per head `[batch, heads, width, head_dim]` (queries, head h = kv *
//   groups + g as HF `repeat_kv`), keys/values `[batch, kv_heads, width, head_dim]`, so for one
//   (sequence, kv head) the `groups` query heads form one `[groups * width, head_dim]` matrix
//   and step 0's scores one `[groups * width, width]` block: strided-batched cuBLAS over
//   (sequence, kv head).
// - bf16 values are `unsigned short` bit patterns, rounded to nearest even (as torch).

// NEG_INF, the bf16 conversions, warp_sum / block_sum, block_argmax and row_argmax:
// kernels/common.cuh.

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

__device__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        float w = lane < warps ? scratch[lane] : NEG_INF;
        w = warp_max(w);
        if (lane == 0) {
            scratch[0] = w;
        }
    }
    __syncthreads();
    const float total = scratch[0];
    __syncthreads();
    return total;
}

// dst[r, :] = src[index[r], :] (bf16 rows of `cols`), zero where index[r] < 0 (padding).
// Grid: rows.
extern "C" __global__ void gather_rows_bf16(const unsigned short* src, const long long* index,
                                            unsigned short* dst, int cols) {
    const long long from = index[blockIdx.x];
    unsigned short* out = dst + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        out[i] = from < 0 ? (unsigned short)0 : src[(size_t)from * cols + i];
    }
}

// dst[r] = src[index[r]] (u32), 0 where index[r] < 0. Grid: ceil(rows / 256) x 256.
extern "C" __global__ void gather_u32(const unsigned int* src, const long long* index,
                                      unsigned int* dst, int rows) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows) {
        const long long from = index[r];
        dst[r] = from < 0 ? 0u : src[from];
    }
}

// HF LlamaRMSNorm of one row: out = w * x * rsqrt(mean(x^2) + eps), written as bf16 with a row
// stride (so two norms can fill the two halves of the attention input), rstd kept for the
// backward. The input is f32 rows (`x`, stride `hidden`), bf16 rows (`xb`), or bf16 embedding
// rows `table[tokens[r]]`: exactly one of them is given. Grid: rows.
extern "C" __global__ void rms_norm_fwd(const float* x, const unsigned short* xb,
                                        const unsigned short* table, const unsigned int* tokens,
                                        const float* w, unsigned short* out, int out_stride,
                                        float* rstd, int hidden, float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const unsigned short* brow =
        table != nullptr ? table + (size_t)tokens[r] * hidden
                         : (xb != nullptr ? xb + (size_t)r * hidden : nullptr);
    const float* frow = x != nullptr ? x + (size_t)r * hidden : nullptr;
    float squares = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = frow != nullptr ? frow[i] : bf16_to_f32(brow[i]);
        squares += v * v;
    }
    const float total = block_sum(squares, scratch);
    const float inv = 1.0f / sqrtf(total / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = frow != nullptr ? frow[i] : bf16_to_f32(brow[i]);
        out[(size_t)r * out_stride + i] = f32_to_bf16(v * inv * w[i]);
    }
    if (threadIdx.x == 0 && rstd != nullptr) {
        rstd[r] = inv;
    }
}

// Backward of rms_norm_fwd for the input (f32 rows x): with g = w * dy,
// dx = rstd * g - x * rstd^3 / hidden * sum(g * x). dx is added to (`accumulate`) or written.
// dy has a row stride. Grid: rows.
extern "C" __global__ void rms_norm_bwd(const float* dy, int dy_stride, const float* x,
                                        const float* w, const float* rstd, float* dx,
                                        int accumulate, int hidden) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const float* dyr = dy + (size_t)r * dy_stride;
    const float* xr = x + (size_t)r * hidden;
    float* dxr = dx + (size_t)r * hidden;
    const float s = rstd[r];
    float dot = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dot += w[i] * dyr[i] * xr[i];
    }
    const float total = block_sum(dot, scratch);
    const float c = s * s * s * total / (float)hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = s * w[i] * dyr[i] - xr[i] * c;
        dxr[i] = accumulate ? dxr[i] + v : v;
    }
}

// Weight gradient of an RMSNorm: dw[j] += sum_r dy[r, j] * x[r, j] * rstd[r], x from f32 rows
// or from embedding rows table[tokens[r]]. Each block sums `rows_per_block` rows per column,
// then adds atomically. Grid: ceil(rows / rows_per_block).
extern "C" __global__ void rms_norm_weight_grad(const float* dy, int dy_stride, const float* x,
                                                const unsigned short* table,
                                                const unsigned int* tokens, const float* rstd,
                                                float* dw, int rows, int rows_per_block,
                                                int hidden) {
    const int r0 = blockIdx.x * rows_per_block;
    const int r1 = min(rows, r0 + rows_per_block);
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        float acc = 0.0f;
        for (int r = r0; r < r1; ++r) {
            const float xv = table != nullptr ? bf16_to_f32(table[(size_t)tokens[r] * hidden + j])
                                              : x[(size_t)r * hidden + j];
            acc += dy[(size_t)r * dy_stride + j] * xv * rstd[r];
        }
        atomicAdd(&dw[j], acc);
    }
}

// Splits the fused q|k|v rows, applies HF RoPE (rotate_half pairs (j, j + head_dim/2), angle =
// inv_freq[j] * (t + pos_offset) in f32) to q and k, writes q [B, heads, W, hd], k and v
// [B, kv_heads, W, hd] in bf16. Grid: rows.
extern "C" __global__ void rope_scatter(const float* qkv, const float* inv_freq, int pos_offset,
                                        unsigned short* q, unsigned short* k, unsigned short* v,
                                        int width, int heads, int kv_heads, int head_dim) {
    const int r = blockIdx.x;
    const int b = r / width;
    const int t = r % width;
    const int half = head_dim / 2;
    const int q_dim = heads * head_dim;
    const int kv_dim = kv_heads * head_dim;
    const float* row = qkv + (size_t)r * (q_dim + 2 * kv_dim);
    const float pos = (float)(t + pos_offset);
    for (int u = threadIdx.x; u < (heads + kv_heads) * half; u += blockDim.x) {
        const bool is_q = u < heads * half;
        const int hu = is_q ? u : u - heads * half;
        const int h = hu / half;
        const int j = hu % half;
        const int base = (is_q ? 0 : q_dim) + h * head_dim;
        const float x1 = row[base + j];
        const float x2 = row[base + j + half];
        const float angle = inv_freq[j] * pos;
        const float c = cosf(angle);
        const float s = sinf(angle);
        unsigned short* dst = is_q ? q + (((size_t)b * heads + h) * width + t) * head_dim
                                   : k + (((size_t)b * kv_heads + h) * width + t) * head_dim;
        dst[j] = f32_to_bf16(x1 * c - x2 * s);
        dst[j + half] = f32_to_bf16(x2 * c + x1 * s);
    }
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        const int h = i / head_dim;
        const int d = i % head_dim;
        v[(((size_t)b * kv_heads + h) * width + t) * head_dim + d] =
            f32_to_bf16(row[q_dim + kv_dim + i]);
    }
}

// Backward of rope_scatter: gathers dq [B, heads, W, hd], dk, dv [B, kv_heads, W, hd] (f32)
// into fused rows [N, (heads + 2 kv_heads) hd] (bf16), undoing the rotation of dq and dk
// (dx1 = d1 c + d2 s, dx2 = d2 c - d1 s). Grid: rows.
extern "C" __global__ void rope_gather_bwd(const float* dq, const float* dk, const float* dv,
                                           const float* inv_freq, int pos_offset,
                                           unsigned short* dqkv, int width, int heads,
                                           int kv_heads, int head_dim) {
    const int r = blockIdx.x;
    const int b = r / width;
    const int t = r % width;
    const int half = head_dim / 2;
    const int q_dim = heads * head_dim;
    const int kv_dim = kv_heads * head_dim;
    unsigned short* row = dqkv + (size_t)r * (q_dim + 2 * kv_dim);
    const float pos = (float)(t + pos_offset);
    for (int u = threadIdx.x; u < (heads + kv_heads) * half; u += blockDim.x) {
        const bool is_q = u < heads * half;
        const int hu = is_q ? u : u - heads * half;
        const int h = hu / half;
        const int j = hu % half;
        const float* src = is_q ? dq + (((size_t)b * heads + h) * width + t) * head_dim
                                : dk + (((size_t)b * kv_heads + h) * width + t) * head_dim;
        const float d1 = src[j];
        const float d2 = src[j + half];
        const float angle = inv_freq[j] * pos;
        const float c = cosf(angle);
        const float s = sinf(angle);
        const int base = (is_q ? 0 : q_dim) + h * head_dim;
        row[base + j] = f32_to_bf16(d1 * c + d2 * s);
        row[base + j + half] = f32_to_bf16(d2 * c - d1 * s);
    }
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        const int h = i / head_dim;
        const int d = i % head_dim;
        row[q_dim + kv_dim + i] =
            f32_to_bf16(dv[(((size_t)b * kv_heads + h) * width + t) * head_dim + d]);
    }
}

// The softmax of TTT step `step` (>= 0) for query (b, h, t): over step 0's keys s <= t (scaled
// scores in `scores` [B, heads, W, W], from cuBLAS) and the keys of steps 1..step at index t
// (k_steps[j] = keys + j * step_stride), one softmax over all. Writes the step-0 probabilities
// to p0 (bf16, zeros past t), the diagonal ones to pd [B, heads, W, 8] (entry j-1), and
// out[b, h, t, :] = sum_j pd_j * v_j[b, kv, t, :] (f32; cuBLAS then adds p0 . v0).
// Grid: (W, heads, B); block 128 threads.
extern "C" __global__ void ttt_softmax_fwd(const float* scores, const unsigned short* q,
                                           const unsigned short* keys,
                                           const unsigned short* values, long long step_stride,
                                           int step, float scale, unsigned short* p0, float* pd,
                                           float* out, int width, int heads, int kv_heads,
                                           int head_dim) {
    __shared__ float scratch[32];
    __shared__ float diag[8];
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int groups = heads / kv_heads;
    const int kv = h / groups;
    const size_t row = ((size_t)b * heads + h) * width + t;
    const float* s = scores + row * width;
    const unsigned short* qr = q + row * head_dim;
    const size_t kv_row = (((size_t)b * kv_heads + kv) * width + t) * head_dim;
    // Diagonal scores: one warp per step.
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    for (int j = 1 + warp; j <= step; j += blockDim.x >> 5) {
        const unsigned short* kr = keys + j * step_stride + kv_row;
        float dot = 0.0f;
        for (int d = lane; d < head_dim; d += 32) {
            dot += bf16_to_f32(qr[d]) * bf16_to_f32(kr[d]);
        }
        dot = warp_sum(dot);
        if (lane == 0) {
            diag[j - 1] = dot * scale;
        }
    }
    __syncthreads();
    float m = NEG_INF;
    for (int i = threadIdx.x; i <= t; i += blockDim.x) {
        m = fmaxf(m, s[i]);
    }
    for (int j = 0; j < step; ++j) {
        m = fmaxf(m, diag[j]);
    }
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int i = threadIdx.x; i <= t; i += blockDim.x) {
        sum += expf(s[i] - m);
    }
    sum = block_sum(sum, scratch);
    for (int j = 0; j < step; ++j) {
        sum += expf(diag[j] - m);
    }
    const float inv = 1.0f / sum;
    unsigned short* p = p0 + row * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        p[i] = i <= t ? f32_to_bf16(expf(s[i] - m) * inv) : (unsigned short)0;
    }
    float* pdr = pd + row * 8;
    if (threadIdx.x < step) {
        pdr[threadIdx.x] = expf(diag[threadIdx.x] - m) * inv;
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 1; j <= step; ++j) {
            acc += expf(diag[j - 1] - m) * inv *
                   bf16_to_f32(values[j * step_stride + kv_row + d]);
        }
        out[row * head_dim + d] = acc;
    }
}

// Backward of ttt_softmax_fwd for the query rows (b, kv heads' group, t): one block per
// (t, kv, b) walks its `groups` query heads in turn, so the shared diagonal key/value rows are
// updated without atomics. With dp0 = dO . V0^T (cuBLAS, in `dp0`, overwritten by dS0):
//   dpd_j = dO . v_j;  D = sum p0 dp0 + sum pd_j dpd_j;
//   dS0 = p0 (dp0 - D) (bf16, in ds0);  dSd_j = pd_j (dpd_j - D);
//   dq[b, h, t] = scale * sum_j dSd_j k_j   (written; cuBLAS adds scale * dS0 . K0);
//   dk_j[b, kv, t] += scale * sum_h dSd_j q_h;  dv_j[b, kv, t] += sum_h pd_j dO_h   (j >= 1).
// Grid: (W, kv_heads, B); block 128 threads.
extern "C" __global__ void ttt_softmax_bwd(const float* dp0, const unsigned short* p0,
                                           const float* pd, const unsigned short* d_out,
                                           const unsigned short* q, const unsigned short* keys,
                                           const unsigned short* values, long long step_stride,
                                           float* dkeys, float* dvalues, long long dstep_stride,
                                           int step, float scale, unsigned short* ds0,
                                           float* dq, int width, int heads, int kv_heads,
                                           int head_dim) {
    __shared__ float scratch[32];
    __shared__ float dpd[8];
    __shared__ float dsd[8];
    const int t = blockIdx.x;
    const int kv = blockIdx.y;
    const int b = blockIdx.z;
    const int groups = heads / kv_heads;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const size_t kv_row = (((size_t)b * kv_heads + kv) * width + t) * head_dim;
    for (int g = 0; g < groups; ++g) {
        const int h = kv * groups + g;
        const size_t row = ((size_t)b * heads + h) * width + t;
        const unsigned short* dor = d_out + row * head_dim;
        const float* pdr = pd + row * 8;
        for (int j = 1 + warp; j <= step; j += blockDim.x >> 5) {
            const unsigned short* vr = values + j * step_stride + kv_row;
            float dot = 0.0f;
            for (int d = lane; d < head_dim; d += 32) {
                dot += bf16_to_f32(dor[d]) * bf16_to_f32(vr[d]);
            }
            dot = warp_sum(dot);
            if (lane == 0) {
                dpd[j - 1] = dot;
            }
        }
        __syncthreads();
        const float* dpr = dp0 + row * width;
        const unsigned short* pr = p0 + row * width;
        float acc = 0.0f;
        for (int i = threadIdx.x; i <= t; i += blockDim.x) {
            acc += bf16_to_f32(pr[i]) * dpr[i];
        }
        float D = block_sum(acc, scratch);
        for (int j = 0; j < step; ++j) {
            D += pdr[j] * dpd[j];
        }
        unsigned short* dsr = ds0 + row * width;
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            dsr[i] = i <= t ? f32_to_bf16(bf16_to_f32(pr[i]) * (dpr[i] - D)) : (unsigned short)0;
        }
        if (threadIdx.x < step) {
            dsd[threadIdx.x] = pdr[threadIdx.x] * (dpd[threadIdx.x] - D);
        }
        __syncthreads();
        const unsigned short* qr = q + row * head_dim;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float dqd = 0.0f;
            for (int j = 1; j <= step; ++j) {
                const size_t off = (size_t)j * step_stride + kv_row + d;
                const size_t doff = (size_t)j * dstep_stride + kv_row + d;
                dqd += dsd[j - 1] * bf16_to_f32(keys[off]);
                dkeys[doff] += scale * dsd[j - 1] * bf16_to_f32(qr[d]);
                dvalues[doff] += pdr[j - 1] * bf16_to_f32(dor[d]);
            }
            dq[row * head_dim + d] = scale * dqd;
        }
        __syncthreads();
    }
}

// [B, heads, W, hd] f32 -> rows [N, heads * hd] bf16. Grid: rows.
extern "C" __global__ void heads_to_rows(const float* x, unsigned short* out, int width,
                                         int heads, int head_dim) {
    const int r = blockIdx.x;
    const int b = r / width;
    const int t = r % width;
    for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x) {
        const int h = i / head_dim;
        const int d = i % head_dim;
        out[(size_t)r * heads * head_dim + i] =
            f32_to_bf16(x[(((size_t)b * heads + h) * width + t) * head_dim + d]);
    }
}

// rows [N, heads * hd] f32 -> [B, heads, W, hd] bf16. Grid: rows.
extern "C" __global__ void rows_to_heads(const float* x, unsigned short* out, int width,
                                         int heads, int head_dim) {
    const int r = blockIdx.x;
    const int b = r / width;
    const int t = r % width;
    for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x) {
        const int h = i / head_dim;
        const int d = i % head_dim;
        out[(((size_t)b * heads + h) * width + t) * head_dim + d] =
            f32_to_bf16(x[(size_t)r * heads * head_dim + i]);
    }
}

// SwiGLU on fused gate|up rows [N, 2I]: act = silu(gate) * up (bf16). Grid: rows.
extern "C" __global__ void swiglu_fwd(const float* gu, unsigned short* act, int inter) {
    const float* row = gu + (size_t)blockIdx.x * 2 * inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        const float g = row[i];
        const float silu = g / (1.0f + expf(-g));
        act[(size_t)blockIdx.x * inter + i] = f32_to_bf16(silu * row[inter + i]);
    }
}

// Backward of swiglu_fwd: d_gate = d_act * up * silu'(gate), d_up = d_act * silu(gate), as
// fused bf16 rows [N, 2I]. silu'(g) = sig(g) (1 + g (1 - sig(g))). Grid: rows.
extern "C" __global__ void swiglu_bwd(const float* gu, const float* d_act, unsigned short* dgu,
                                      int inter) {
    const float* row = gu + (size_t)blockIdx.x * 2 * inter;
    const float* da = d_act + (size_t)blockIdx.x * inter;
    unsigned short* out = dgu + (size_t)blockIdx.x * 2 * inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        const float g = row[i];
        const float u = row[inter + i];
        const float sig = 1.0f / (1.0f + expf(-g));
        out[i] = f32_to_bf16(da[i] * u * sig * (1.0f + g * (1.0f - sig)));
        out[inter + i] = f32_to_bf16(da[i] * g * sig);
    }
}

// y[i] = bf16(x[i]) (and y += when `accumulate_f32` is given: acc[i] += x[i]). Grid-stride.
extern "C" __global__ void f32_to_bf16_n(const float* x, unsigned short* y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = f32_to_bf16(x[i]);
    }
}

// y[i] += x[i]. Grid-stride.
extern "C" __global__ void add_f32(const float* x, float* y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] += x[i];
    }
}

// In-place softmax of f32 rows. Grid: rows.
extern "C" __global__ void softmax_rows(float* x, int cols) {
    __shared__ float scratch[32];
    float* row = x + (size_t)blockIdx.x * cols;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        m = fmaxf(m, row[i]);
    }
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        sum += expf(row[i] - m);
    }
    sum = block_sum(sum, scratch);
    const float inv = 1.0f / sum;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        row[i] = expf(row[i] - m) * inv;
    }
}

// Index of the largest entry of each f32 row (the first on ties). Grid: rows.
extern "C" __global__ void argmax_rows_u32(const float* x, int cols, unsigned int* out) {
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    const float* row = x + (size_t)blockIdx.x * cols;
    float max_value;
    const int index = row_argmax(row, cols, best_value, best_index, &max_value);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = (unsigned int)index;
    }
}

// Loss, accuracy and logit gradient of TTT step `step` for row r = (b, t) (tandem_train
// objective, SpecForge alignment): u = t + step; the row counts (denominator) when
// u + 1 < len[b] and loss_mask[b, u]; it is trained (position mask) when besides the target's
// argmax at u + 1 is in the draft vocabulary. Then with p = target probabilities at row
// (b, u + 1) (over the draft vocabulary) and z = the draft logits:
//   loss_r = sum(p) * logsumexp(z) - sum(p z)     (= -sum p log softmax(z))
//   dz = coef * (softmax(z) * sum(p) - p)          (coef = 0.8^step / (batch * width))
//   correct_r = d2t(argmax z) == target argmax at u + 1.
// stats[0] += loss_r, stats[1] += correct_r, stats[2] += counted (doubles). dz (bf16) is
// written for every row (zeros off the mask) when `dlogits` is given. Grid: rows.
extern "C" __global__ void draft_loss(const float* logits, const float* target_probs,
                                      const unsigned int* target_argmax,
                                      const unsigned char* in_draft,
                                      const unsigned int* draft_to_target,
                                      const unsigned char* loss_mask, const int* lengths,
                                      int width, int vocab, int step, float coef,
                                      unsigned short* dlogits, double* stats) {
    __shared__ float scratch[32];
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    const int r = blockIdx.x;
    const int b = r / width;
    const int t = r % width;
    const int u = t + step;
    const bool counted = u + 1 < lengths[b] && loss_mask[(size_t)b * width + u] != 0;
    const size_t target_row = (size_t)b * width + u + 1;
    const bool on = counted && in_draft[target_argmax[target_row]] != 0;
    unsigned short* dz = dlogits != nullptr ? dlogits + (size_t)r * vocab : nullptr;
    if (!on) {
        if (dz != nullptr) {
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                dz[i] = 0;
            }
        }
        if (threadIdx.x == 0 && counted) {
            atomicAdd(&stats[2], 1.0);
        }
        return;
    }
    const float* z = logits + (size_t)r * vocab;
    const float* p = target_probs + target_row * vocab;
    float m;
    const int arg = row_argmax(z, vocab, best_value, best_index, &m);
    float sum = 0.0f;
    float psum = 0.0f;
    float pz = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        sum += expf(z[i] - m);
        psum += p[i];
        pz += p[i] * z[i];
    }
    sum = block_sum(sum, scratch);
    psum = block_sum(psum, scratch);
    pz = block_sum(pz, scratch);
    const float lse = m + logf(sum);
    if (dz != nullptr) {
        const float inv = 1.0f / sum;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            dz[i] = f32_to_bf16(coef * (expf(z[i] - m) * inv * psum - p[i]));
        }
    }
    if (threadIdx.x == 0) {
        atomicAdd(&stats[0], (double)(psum * lse - pz));
        atomicAdd(&stats[1], draft_to_target[arg] == target_argmax[target_row] ? 1.0 : 0.0);
        atomicAdd(&stats[2], 1.0);
    }
}

// out[0] += sum of x[i]^2 (double). Grid-stride; block 256.
extern "C" __global__ void sum_squares(const float* x, long long n, double* out) {
    __shared__ float scratch[32];
    float acc = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        acc += x[i] * x[i];
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        atomicAdd(out, (double)acc);
    }
}

// AdamW (burn's / torch's decoupled form) over the flat parameter buffer, gradients scaled by
// `grad_scale` (global-norm clipping): m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= lr * wd * p; p -= lr * (m / bc1) / (sqrt(v / bc2) + eps); then the bf16 copy.
extern "C" __global__ void adamw(float* p, const float* g, float* m, float* v,
                                 unsigned short* p_bf16, long long n, float lr, float beta1,
                                 float beta2, float eps, float weight_decay, float bc1,
                                 float bc2, float grad_scale) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float gi = g[i] * grad_scale;
        const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float pi = p[i];
        pi -= lr * weight_decay * pi;
        pi -= lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
        p[i] = pi;
        p_bf16[i] = f32_to_bf16(pi);
    }
}
