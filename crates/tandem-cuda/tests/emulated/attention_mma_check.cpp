// kernels/attention_mma.cu on the CPU emulator (cuda_emu.h), against a plain attention in
// double precision over the same bf16 keys and values and the same mask. Prints one line per
// case and exits non-zero when a case is off by more than the tolerance.
//
// Tolerance: the kernel rounds the scaled query and the softmax probabilities to bf16 (8 bits
// of mantissa, relative error <= 2^-9 each), as FlashAttention and torch's bf16 sdpa do; the
// reference rounds neither. With values in [-1, 1] an output is off by at most a few 1e-3 that
// way; a wrong fragment, column, row or rescale puts outputs off by O(0.1-1).
#define TANDEM_EMULATE 1
#include "cuda_emu.h"

#include "common.cuh"
#include "mma.cuh"
#include "attention_mma.cu"
#include "host_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>


struct Case {
    std::string name;
    int head_dim, heads, kv_heads, batch, width, capacity, used;
    // visible(b, i, j): whether row i of sequence b sees cache column j (j < used + width).
    std::function<bool(int, int, int)> visible;
    float q_scale;  // spread of the query (larger: sharper softmax, maxima that move)
};

static bool run(const Case& c, std::mt19937& rng) {
    const int rows = c.batch * c.width;
    const int total = c.used + c.width;
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(rows) * c.heads * c.head_dim);
    for (auto& v : q) v = uni(rng) * c.q_scale;
    const size_t cache = static_cast<size_t>(c.batch) * c.kv_heads * c.capacity * c.head_dim;
    std::vector<unsigned short> k(cache), v(cache);
    for (auto& x : k) x = to_bf16(uni(rng));
    for (auto& x : v) x = to_bf16(uni(rng));
    std::vector<float> mask(static_cast<size_t>(rows) * total);
    for (int b = 0; b < c.batch; ++b)
        for (int i = 0; i < c.width; ++i)
            for (int j = 0; j < total; ++j)
                mask[(static_cast<size_t>(b) * c.width + i) * total + j] =
                    c.visible(b, i, j) ? 0.0f : NEG_INF;
    std::vector<unsigned short> out(q.size(), 0xffff);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    const int row_tiles = (c.width * (c.heads / c.kv_heads) + MMA_TILE_ROWS - 1) / MMA_TILE_ROWS;
    const EmuDim3 grid{static_cast<unsigned int>(c.batch * c.kv_heads * row_tiles), 1, 1};
    const EmuDim3 block{MMA_WARPS * 32, 1, 1};
    // The launch the Rust side makes (device/mma_attention.rs): 2 * 64 * (head_dim + 8) bf16.
    const std::size_t shared = 2 * MMA_TILE_KEYS * (c.head_dim + 8) * 2;
    emu_launch(grid, block, shared, [&] {
        auto kernel = c.head_dim == 64 ? attention_mma_64 : attention_mma_128;
        kernel(q.data(), k.data(), v.data(), mask.data(), out.data(), c.width, c.heads,
               c.kv_heads, c.capacity, total, scale, nullptr);
    });
    double worst = 0.0;
    int hidden_rows = 0;
    for (int b = 0; b < c.batch; ++b) {
        for (int i = 0; i < c.width; ++i) {
            const size_t r = static_cast<size_t>(b) * c.width + i;
            for (int h = 0; h < c.heads; ++h) {
                const int kvh = h / (c.heads / c.kv_heads);
                const size_t base = (static_cast<size_t>(b) * c.kv_heads + kvh) * c.capacity * c.head_dim;
                const auto seen = [&](int j) { return mask[r * total + j] == 0.0f; };
                bool any = false;
                for (int j = 0; j < total && !any; ++j) any = seen(j);
                if (!any) ++hidden_rows;
                const auto want = plain_attention(&q[(r * c.heads + h) * c.head_dim], &k[base],
                                                  &v[base], c.head_dim, total, scale, seen);
                for (int d = 0; d < c.head_dim; ++d) {
                    const double got = from_bf16(out[(r * c.heads + h) * c.head_dim + d]);
                    const double err = std::fabs(got - want[d]);
                    if (!(err <= worst)) worst = std::isnan(err) ? INFINITY : std::max(worst, err);
                }
            }
        }
    }
    const double tolerance = 2e-2;
    const bool ok = worst <= tolerance;
    std::printf("%-44s head_dim %3d rows %4d total %4d: max |error| %.2e (tolerance %.0e, %d fully hidden row-heads) %s\n",
                c.name.c_str(), c.head_dim, rows, total, worst, tolerance, hidden_rows, ok ? "ok" : "FAILED");
    return ok;
}

int main() {
    std::mt19937 rng(20261205);
    std::vector<Case> cases;
    // A ragged prefill into empty caches, SmolLM2's heads: sequence 1's prompt is 50 of the
    // step's 70 slots; its padding slots see only their own column (as ColumnLayout masks them).
    const int lens[2] = {70, 50};
    cases.push_back({"ragged causal prefill (GQA 9/3)", 64, 9, 3, 2, 70, 96, 0,
                     [lens](int b, int i, int j) { return i < lens[b] ? j <= i : j == i; }, 3.0f});
    // A wide step after a cached prefix with hidden (rejected) columns, then a random tree among
    // the new slots: every node sees its ancestors and itself. Three column tiles, one partial.
    std::vector<int> parent(40);
    for (int i = 0; i < 40; ++i) parent[i] = i == 0 ? -1 : static_cast<int>(rng() % i);
    std::vector<bool> hidden_prefix(130);
    for (auto&& hcol : hidden_prefix) hcol = rng() % 5 == 0;
    cases.push_back({"tree after a prefix with hidden columns", 128, 4, 2, 1, 40, 200, 130,
                     [parent, hidden_prefix](int, int i, int j) {
                         if (j < 130) return !hidden_prefix[j];
                         for (int a = i; a >= 0; a = parent[a])
                             if (j - 130 == a) return true;
                         return false;
                     },
                     4.0f});
    // Long causal rows whose maxima move from tile to tile (a sharp softmax), 3 row tiles.
    cases.push_back({"long causal, sharp softmax (MHA)", 64, 2, 2, 1, 150, 160, 0,
                     [](int, int i, int j) { return j <= i; }, 12.0f});
    // A verification of 8 tokens at batch 3 after a 100-column prefix (SmolLM2's heads: 24
    // rows a KV head, one block): each sequence hides different prefix columns and its chain
    // sees itself causally.
    cases.push_back({"narrow chain verification, batch 3 (GQA 9/3)", 64, 9, 3, 3, 8, 128, 100,
                     [](int b, int i, int j) {
                         if (j < 100) return (j * 7 + b * 3) % 11 != 0;
                         return j - 100 <= i;
                     },
                     3.0f});
    // Rows that see nothing (zeros out) next to rows that see one column.
    cases.push_back({"empty and single-column rows", 128, 2, 1, 1, 18, 64, 10,
                     [](int, int i, int j) { return i % 3 == 0 ? false : j == (i * 7) % 28; },
                     2.0f});
    bool all = true;
    for (const auto& c : cases) all = run(c, rng) && all;
    return all ? 0 : 1;
}
