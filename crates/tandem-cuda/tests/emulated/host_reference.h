// What the emulated kernels are checked against (attention_mma_check.cpp,
// llama_kernels_check.cpp): bf16 bit conversions and a plain attention in double precision.
#pragma once

#include <cmath>
#include <cstring>
#include <vector>

// Round to nearest even, as the kernels' f32_to_bf16 and torch's `.to(torch.bfloat16)`.
inline unsigned short to_bf16(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<unsigned short>(u >> 16);
}

inline float from_bf16(unsigned short v) {
    const unsigned int u = static_cast<unsigned int>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Softmax attention of one query row (`hd` floats, times `scale`) over the columns j < total
// where `visible(j)`, key and value rows bf16 at `k + j * hd` and `v + j * hd`, in double
// precision; zeros when no column is visible (what the kernels write then).
template <typename Visible>
std::vector<double> plain_attention(const float* q, const unsigned short* k,
                                    const unsigned short* v, int hd, int total, float scale,
                                    Visible visible) {
    std::vector<double> score(total, -INFINITY);
    double top = -INFINITY;
    for (int j = 0; j < total; ++j) {
        if (!visible(j)) continue;
        double dot = 0.0;
        for (int d = 0; d < hd; ++d)
            dot += static_cast<double>(q[d]) * scale * from_bf16(k[static_cast<size_t>(j) * hd + d]);
        score[j] = dot;
        top = std::max(top, dot);
    }
    std::vector<double> out(hd, 0.0);
    if (top == -INFINITY) return out;
    double sum = 0.0;
    for (int j = 0; j < total; ++j) {
        if (score[j] == -INFINITY) continue;
        const double p = std::exp(score[j] - top);
        sum += p;
        for (int d = 0; d < hd; ++d) out[d] += p * from_bf16(v[static_cast<size_t>(j) * hd + d]);
    }
    for (auto& o : out) o /= sum;
    return out;
}
