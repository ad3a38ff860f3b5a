// kernels/rows_mma.cu (the fused small steps' products on the tensor cores) on the CPU emulator
// (cuda_emu.h), with the launch shapes of crates/tandem-cuda/src/device/mma_rows.rs: a block of
// `split` = min(16, ceil(chunks / 4)) warps a tile. Each kernel against double precision or
// against its CUDA-core twin in llama.cu on the same inputs, and a row's bits at every step
// width (1-8 rows), and steps of up to 32 rows in row groups. The shapes make the k range split
// over several warps, end in a ragged slice, cross from the head's first input to its second
// inside a slice, and leave the last tile of outputs part-empty. Prints one line per check;
// exits non-zero when one fails.
#define TANDEM_EMULATE 1
#include "cuda_emu.h"

#define GEMV_MAX_ROWS 8
#define GEMV_BLOCK_WARPS 4
#define PERSIST_THREADS 512
#include "common.cuh"
#include "mma.cuh"
#include "llama.cu"
#include "rows_mma.cu"
#include "host_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <tuple>

static bool report(const char* what, bool ok, const char* detail) {
    std::printf("%-64s %s %s\n", what, detail, ok ? "ok" : "FAILED");
    return ok;
}

// Warps a tile's block has for a k range of `width` values (`mma_rows::split` in Rust).
static unsigned int split_for(int width) {
    const int chunks = width / 32;
    return static_cast<unsigned int>(std::min(16, (chunks + 3) / 4));
}

// The grid of a launch of `tiles` tiles for a step of `rows` rows (`MmaRows::config`): one
// block a row group of 8 as the grid's x, the tiles as its y.
static EmuDim3 mma_grid(int tiles, int rows) {
    return EmuDim3{static_cast<unsigned int>((rows + 7) / 8), static_cast<unsigned int>(tiles), 1};
}

static std::vector<unsigned short> random_bf16(std::mt19937& rng, size_t n, float scale = 1.0f) {
    std::uniform_real_distribution<float> uni(-scale, scale);
    std::vector<unsigned short> v(n);
    for (auto& x : v) x = to_bf16(uni(rng));
    return v;
}

static std::vector<float> random_f32(std::mt19937& rng, size_t n) {
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (auto& x : v) x = uni(rng);
    return v;
}

// The largest |y[r, o] - x[r, :] . w[o, :]| over the step's rows, the dot in double precision.
static double max_dot_error(const std::vector<unsigned short>& x, const std::vector<unsigned short>& w,
                            const std::vector<float>& y, int rows, int inp, int out) {
    double worst = 0.0;
    for (int r = 0; r < rows; ++r)
        for (int o = 0; o < out; ++o) {
            double dot = 0;
            for (int i = 0; i < inp; ++i)
                dot += static_cast<double>(from_bf16(x[r * inp + i])) * from_bf16(w[o * inp + i]);
            worst = std::max(worst, std::fabs(y[r * out + o] - dot));
        }
    return worst;
}

// gemv_rows_mma: y = x . w^T and y += x . w^T against double precision, and row r's bits the
// same in steps of r + 1 .. 8 rows.
static bool check_gemv(std::mt19937& rng) {
    const int inp = 320, out = 40;  // 10 chunks: 3 warps (4, 4, 2); 3 tiles, the last half-empty
    const auto w = random_bf16(rng, out * inp);
    const auto x = random_bf16(rng, 8 * inp);
    std::vector<std::vector<float>> by_rows(9);
    double worst = 0.0;
    for (int rows = 1; rows <= 8; ++rows) {
        std::vector<float> y(8 * out, NAN);
        emu_launch(mma_grid((out + 15) / 16, rows), EmuDim3{32 * split_for(inp), 1, 1}, 0,
                   [&] { gemv_rows_mma(x.data(), w.data(), y.data(), nullptr, rows, inp, out, 0); });
        worst = std::max(worst, max_dot_error(x, w, y, rows, inp, out));
        // Rows past the step's are not written.
        for (int i = rows * out; i < 8 * out; ++i) worst = std::isnan(y[i]) ? worst : 1e9;
        by_rows[rows] = y;
    }
    bool same_bits = true;
    for (int rows = 1; rows < 8; ++rows)
        same_bits &= std::memcmp(by_rows[rows].data(), by_rows[8].data(), rows * out * sizeof(float)) == 0;
    // Accumulate: y += x . w^T over what y held.
    const int rows = 5;
    auto y = random_f32(rng, rows * out);
    const auto before = y;
    // With a tap: the tap gets exactly what y gets, and nothing past the step's rows.
    std::vector<float> tap(8 * out, NAN);
    emu_launch(mma_grid((out + 15) / 16, rows), EmuDim3{32 * split_for(inp), 1, 1}, 0,
               [&] { gemv_rows_mma(x.data(), w.data(), y.data(), tap.data(), rows, inp, out, 1); });
    bool tap_is_y = std::memcmp(tap.data(), y.data(), rows * out * sizeof(float)) == 0;
    for (int i = rows * out; i < 8 * out; ++i) tap_is_y &= std::isnan(tap[i]);
    double worst_add = 0.0;
    for (int r = 0; r < rows; ++r)
        for (int o = 0; o < out; ++o)
            worst_add = std::max(worst_add, static_cast<double>(std::fabs(
                                                (y[r * out + o] - before[r * out + o]) -
                                                by_rows[8][r * out + o])));
    char detail[160];
    std::snprintf(detail, sizeof detail, "(1-8 rows; max |error| %.1e, tolerance 2e-4)", worst);
    bool ok = report("gemv_rows_mma: the dot products", worst <= 2e-4, detail);
    ok &= report("gemv_rows_mma: a row's bits the same at every step width", same_bits, "");
    std::snprintf(detail, sizeof detail, "(max |error| %.1e, tolerance 1e-5)", worst_add);
    ok &= report("gemv_rows_mma: accumulate adds the products", worst_add <= 1e-5, detail);
    ok &= report("gemv_rows_mma: the tap gets what y gets", tap_is_y, "(bit for bit, step rows only)");
    return ok;
}

// gemv_norm_rows_mma against gemv_norm_rows (the CUDA-core kernel, same staging).
static bool check_gemv_norm(std::mt19937& rng) {
    const int inp = 160, out = 24, rows = 5;  // 5 chunks: 2 warps (4, 1)
    const auto w = random_bf16(rng, out * inp);
    const auto norm_w = random_bf16(rng, inp);
    const auto xf = random_f32(rng, rows * inp);
    std::vector<float> want(rows * out, NAN), got(rows * out, NAN);
    emu_launch(EmuDim3{static_cast<unsigned int>(out), 1, 1}, EmuDim3{128, 1, 1}, rows * inp * 2, [&] {
        gemv_norm_rows_r8_o1(xf.data(), norm_w.data(), w.data(), want.data(), rows, inp, out, 4,
                             1e-5f);
    });
    emu_launch(mma_grid((out + 15) / 16, rows), EmuDim3{32 * split_for(inp), 1, 1}, rows * inp * 2,
               [&] {
                   gemv_norm_rows_mma(xf.data(), norm_w.data(), w.data(), got.data(), rows, inp,
                                      out, 1e-5f);
               });
    double worst = 0.0;
    for (int i = 0; i < rows * out; ++i) worst = std::max(worst, static_cast<double>(std::fabs(got[i] - want[i])));
    char detail[160];
    std::snprintf(detail, sizeof detail, "(max |difference| %.1e, tolerance 1e-4)", worst);
    return report("gemv_norm_rows_mma against gemv_norm_rows", worst <= 1e-4, detail);
}

// norm_gate_up_silu_mma against norm_gate_up_silu, and its rows' bits at 3 and 8 rows.
static bool check_gate_up(std::mt19937& rng) {
    const int hidden = 192, inter = 20;  // 6 chunks: 2 warps (3, 3); tiles of 8, the last half-empty
    const auto w = random_bf16(rng, 2 * inter * hidden);
    const auto norm_w = random_bf16(rng, hidden);
    const auto x = random_f32(rng, 8 * hidden);
    auto run_mma = [&](int rows) {
        std::vector<unsigned short> act(8 * inter, 0xffff);
        emu_launch(mma_grid((inter + 7) / 8, rows), EmuDim3{32 * split_for(hidden), 1, 1},
                   rows * hidden * 2, [&] {
                       norm_gate_up_silu_mma(x.data(), norm_w.data(), w.data(), act.data(), rows,
                                             hidden, inter, 1e-5f);
                   });
        return act;
    };
    const int rows = 3;
    std::vector<unsigned short> want(8 * inter, 0xffff);
    emu_launch(EmuDim3{static_cast<unsigned int>((inter + 3) / 4), 1, 1}, EmuDim3{128, 1, 1}, rows * hidden * 2, [&] {
        norm_gate_up_silu(x.data(), norm_w.data(), w.data(), want.data(), rows, hidden, inter,
                          1e-5f);
    });
    const auto got = run_mma(rows);
    const auto got8 = run_mma(8);
    double worst = 0.0;
    for (int i = 0; i < rows * inter; ++i) {
        const double a = from_bf16(got[i]), b = from_bf16(want[i]);
        worst = std::max(worst, std::fabs(a - b) / std::max(1.0, std::fabs(b)));
    }
    bool untouched = true;
    for (int i = rows * inter; i < 8 * inter; ++i) untouched &= got[i] == 0xffff;
    char detail[160];
    std::snprintf(detail, sizeof detail, "(max relative difference %.1e, tolerance 1e-2)", worst);
    bool ok = report("norm_gate_up_silu_mma against norm_gate_up_silu", worst <= 1e-2 && untouched, detail);
    ok &= report("norm_gate_up_silu_mma: the same bits at 3 and 8 rows",
                 std::memcmp(got.data(), got8.data(), rows * inter * 2) == 0, "");
    return ok;
}

// norm_qkv_rope_mma against norm_qkv_rope: the target's form (f32 rows, a bias) and the draft
// head's (embedding rows read from the table, a second input through its own weight).
static bool check_qkv_rope(std::mt19937& rng, bool head) {
    const int hidden = 160, heads = 2, kv_heads = 1, head_dim = 32, batch = 2, width = 2;
    const int rows = batch * width, capacity = 8, col0 = 3, vocab = 11;
    const int half = head_dim / 2, pairs = (heads + 2 * kv_heads) * half;
    const int qkv_dim = (heads + 2 * kv_heads) * head_dim, q_dim = heads * head_dim;
    const auto w = random_bf16(rng, qkv_dim * hidden, 0.2f);
    const auto w2 = random_bf16(rng, qkv_dim * hidden, 0.2f);
    const auto norm_w = random_bf16(rng, hidden);
    const auto norm_w2 = random_bf16(rng, hidden);
    const auto x = random_f32(rng, rows * hidden);
    const auto x2 = random_f32(rng, rows * hidden);
    const auto table = random_bf16(rng, vocab * hidden);
    const auto bias = random_f32(rng, qkv_dim);
    const std::vector<unsigned int> tokens = {4, 9, 0, 7};
    const std::vector<int> positions = {5, 6, 9, 10};
    std::vector<float> inv_freq(half);
    for (int j = 0; j < half; ++j) inv_freq[j] = std::pow(10000.0f, -2.0f * j / head_dim);
    const size_t cache = static_cast<size_t>(batch) * kv_heads * capacity * head_dim;
    const int inputs = head ? 2 : 1;
    const size_t shared = static_cast<size_t>(inputs) * rows * hidden * 2;
    struct Out {
        std::vector<float> q;
        std::vector<unsigned short> k, v;
    };
    auto run = [&](bool mma) {
        Out o{std::vector<float>(rows * q_dim, NAN), std::vector<unsigned short>(cache, 0),
              std::vector<unsigned short>(cache, 0)};
        auto kernel = [&] {
            auto f = mma ? norm_qkv_rope_mma : norm_qkv_rope;
            f(head ? nullptr : x.data(), norm_w.data(), w.data(), head ? x2.data() : nullptr,
              head ? norm_w2.data() : nullptr, head ? w2.data() : nullptr,
              head ? nullptr : bias.data(), positions.data(), inv_freq.data(), o.q.data(),
              o.k.data(), o.v.data(), rows, hidden, width, heads, kv_heads, head_dim, capacity,
              col0, nullptr, 1e-5f, head ? table.data() : nullptr, head ? tokens.data() : nullptr);
        };
        if (mma) {
            emu_launch(mma_grid((pairs + 7) / 8, rows), EmuDim3{32 * split_for(inputs * hidden), 1, 1},
                       shared, kernel);
        } else {
            emu_launch(EmuDim3{static_cast<unsigned int>((pairs + 3) / 4), 1, 1}, EmuDim3{128, 1, 1}, shared, kernel);
        }
        return o;
    };
    const Out want = run(false), got = run(true);
    double worst_q = 0.0, worst_kv = 0.0;
    for (int i = 0; i < rows * q_dim; ++i)
        worst_q = std::max(worst_q, static_cast<double>(std::fabs(got.q[i] - want.q[i])));
    bool written = true;
    for (size_t i = 0; i < cache; ++i) {
        for (const auto* pair : {&got.k, &got.v}) {
            const auto& want_side = pair == &got.k ? want.k : want.v;
            const double a = from_bf16((*pair)[i]), b = from_bf16(want_side[i]);
            worst_kv = std::max(worst_kv, std::fabs(a - b) / std::max(1.0, std::fabs(b)));
            written &= ((*pair)[i] == 0) == (want_side[i] == 0);
        }
    }
    char detail[160];
    std::snprintf(detail, sizeof detail, "(max |q difference| %.1e, tolerance 2e-4; k, v relative %.1e, 1e-2)",
                  worst_q, worst_kv);
    return report(head ? "norm_qkv_rope_mma against norm_qkv_rope: the head's two inputs"
                       : "norm_qkv_rope_mma against norm_qkv_rope: a target layer",
                  worst_q <= 2e-4 && worst_kv <= 1e-2 && written, detail);
}

// Steps of 9 to 32 rows in row groups of 8 (grid x: one block a group, `mma_grid`):
// each group's rows get exactly the bits of that group run as its own 8-row (or shorter) step,
// for every kernel, at 32 rows and at a ragged 20 (batch 5 x width 4: the q|k|v rows' positions,
// query rows and cache columns are those of the step's rows, not the group's).
static bool check_row_groups(std::mt19937& rng) {
    const int hidden = 160, inter = 96, out = 40, max_rows = 32;
    const auto x = random_f32(rng, max_rows * hidden);
    const auto xb = random_bf16(rng, max_rows * inter);
    const auto norm_w = random_bf16(rng, hidden);
    const auto w_out = random_bf16(rng, out * inter);
    const auto w_norm = random_bf16(rng, out * hidden);
    const auto w_gate_up = random_bf16(rng, 2 * inter * hidden);
    bool gemv_ok = true, norm_ok = true, gate_ok = true;
    double worst = 0.0;
    for (int rows : {20, 32}) {
        // gemv_rows_mma (with a tap) and gemv_norm_rows_mma, grouped, then group by group.
        std::vector<float> y(max_rows * out, NAN), tap(max_rows * out, NAN), yn(max_rows * out, NAN);
        std::vector<unsigned short> act(max_rows * inter, 0xffff);
        emu_launch(mma_grid((out + 15) / 16, rows), EmuDim3{32 * split_for(inter), 1, 1}, 0,
                   [&] { gemv_rows_mma(xb.data(), w_out.data(), y.data(), tap.data(), rows, inter, out, 0); });
        emu_launch(mma_grid((out + 15) / 16, rows), EmuDim3{32 * split_for(hidden), 1, 1}, 8 * hidden * 2,
                   [&] { gemv_norm_rows_mma(x.data(), norm_w.data(), w_norm.data(), yn.data(), rows, hidden, out, 1e-5f); });
        emu_launch(mma_grid((inter + 7) / 8, rows), EmuDim3{32 * split_for(hidden), 1, 1}, 8 * hidden * 2,
                   [&] { norm_gate_up_silu_mma(x.data(), norm_w.data(), w_gate_up.data(), act.data(), rows, hidden, inter, 1e-5f); });
        for (int r0 = 0; r0 < rows; r0 += 8) {
            const int n = std::min(8, rows - r0);
            std::vector<float> g(8 * out, NAN), gn(8 * out, NAN);
            std::vector<unsigned short> ga(8 * inter, 0xffff);
            emu_launch(mma_grid((out + 15) / 16, n), EmuDim3{32 * split_for(inter), 1, 1}, 0,
                       [&] { gemv_rows_mma(xb.data() + r0 * inter, w_out.data(), g.data(), nullptr, n, inter, out, 0); });
            emu_launch(mma_grid((out + 15) / 16, n), EmuDim3{32 * split_for(hidden), 1, 1}, n * hidden * 2,
                       [&] { gemv_norm_rows_mma(x.data() + r0 * hidden, norm_w.data(), w_norm.data(), gn.data(), n, hidden, out, 1e-5f); });
            emu_launch(mma_grid((inter + 7) / 8, n), EmuDim3{32 * split_for(hidden), 1, 1}, n * hidden * 2,
                       [&] { norm_gate_up_silu_mma(x.data() + r0 * hidden, norm_w.data(), w_gate_up.data(), ga.data(), n, hidden, inter, 1e-5f); });
            gemv_ok &= std::memcmp(g.data(), y.data() + r0 * out, n * out * sizeof(float)) == 0;
            gemv_ok &= std::memcmp(g.data(), tap.data() + r0 * out, n * out * sizeof(float)) == 0;
            norm_ok &= std::memcmp(gn.data(), yn.data() + r0 * out, n * out * sizeof(float)) == 0;
            gate_ok &= std::memcmp(ga.data(), act.data() + r0 * inter, n * inter * 2) == 0;
        }
        // Rows past the step's are left alone; the products themselves against double precision.
        for (int i = rows * out; i < max_rows * out; ++i) gemv_ok &= std::isnan(y[i]) && std::isnan(tap[i]);
        for (int i = rows * inter; i < max_rows * inter; ++i) gate_ok &= act[i] == 0xffff;
        worst = std::max(worst, max_dot_error(xb, w_out, y, rows, inter, out));
    }
    // norm_qkv_rope_mma: batch 5 x width 4 = 20 rows (three groups, the last of 4), against each
    // group run as its own step of two sequences (its cache rows and query rows offset).
    const int heads = 2, kv_heads = 1, head_dim = 32, batch = 5, width = 4, rows = batch * width;
    const int capacity = 8, col0 = 3, half = head_dim / 2, pairs = (heads + 2 * kv_heads) * half;
    const int qkv_dim = (heads + 2 * kv_heads) * head_dim, q_dim = heads * head_dim;
    const auto w = random_bf16(rng, qkv_dim * hidden, 0.2f);
    const auto bias = random_f32(rng, qkv_dim);
    std::vector<int> positions(rows);
    for (int r = 0; r < rows; ++r) positions[r] = 3 * (r / width) + r % width + 1;
    std::vector<float> inv_freq(half);
    for (int j = 0; j < half; ++j) inv_freq[j] = std::pow(10000.0f, -2.0f * j / head_dim);
    const size_t seq = static_cast<size_t>(kv_heads) * capacity * head_dim;
    auto qkv = [&](int r0, int n, float* q, unsigned short* k, unsigned short* v) {
        emu_launch(mma_grid((pairs + 7) / 8, n), EmuDim3{32 * split_for(hidden), 1, 1}, std::min(n, 8) * hidden * 2, [&] {
            norm_qkv_rope_mma(x.data() + r0 * hidden, norm_w.data(), w.data(), nullptr, nullptr, nullptr,
                              bias.data(), positions.data() + r0, inv_freq.data(), q, k, v, n, hidden,
                              width, heads, kv_heads, head_dim, capacity, col0, nullptr, 1e-5f, nullptr,
                              nullptr);
        });
    };
    std::vector<float> q(rows * q_dim, NAN);
    std::vector<unsigned short> k(batch * seq, 0), v(batch * seq, 0);
    qkv(0, rows, q.data(), k.data(), v.data());
    std::vector<float> q_groups(rows * q_dim, NAN);
    std::vector<unsigned short> k_groups(batch * seq, 0), v_groups(batch * seq, 0);
    for (int r0 = 0; r0 < rows; r0 += 8) {
        const int n = std::min(8, rows - r0);
        const size_t cache_at = static_cast<size_t>(r0 / width) * seq;
        qkv(r0, n, q_groups.data() + r0 * q_dim, k_groups.data() + cache_at, v_groups.data() + cache_at);
    }
    bool qkv_ok = std::memcmp(q.data(), q_groups.data(), q.size() * sizeof(float)) == 0 && k == k_groups &&
                  v == v_groups;
    // Every sequence's four columns were written (a zero would mean a row missed its column).
    for (int b = 0; b < batch; ++b)
        for (int c = col0; c < col0 + width; ++c) qkv_ok &= k[b * seq + c * head_dim] != 0 && v[b * seq + c * head_dim] != 0;
    char detail[160];
    std::snprintf(detail, sizeof detail, "(20 and 32 rows; max |error| %.1e, tolerance 2e-4)", worst);
    bool ok = report("gemv_rows_mma: row groups, each group's bits (and the tap's)", gemv_ok && worst <= 2e-4, detail);
    ok &= report("gemv_norm_rows_mma: row groups, each group's bits", norm_ok, "(20 and 32 rows)");
    ok &= report("norm_gate_up_silu_mma: row groups, each group's bits", gate_ok, "(20 and 32 rows)");
    ok &= report("norm_qkv_rope_mma: row groups, positions and cache columns of the step's rows", qkv_ok,
                 "(batch 5 x width 4)");
    return ok;
}

// qkv_attention_mma (a step's q|k|v and attention in one launch) against the two launches it
// replaces, norm_qkv_rope_mma then attention_invariant (after visible_columns), on the same
// step: q, the key and value caches and the attention output must be the same bits. Three
// sequences with different positions, rejected drafts hidden among their cached keys, a q|k|v
// bias; each shape splits the k range over several warps; `groups` tiles a pass: one pass,
// several with a ragged last one (groups idle), and head_dim 64 with GQA 3:1. With `width` > 1
// a verification: each sequence's `width` new tokens at consecutive positions and cache
// columns, token i seeing the new columns up to its own except a sibling's (token 2 does not
// see token 1, as in a tree), so a token reads keys other ranks wrote in the same launch.
// With `parts` > 0 the step's input is a layer's output as mlp_partials_mma leaves it (a
// residual and `parts` cluster sums): qkv_attention_mma adds them itself, and must give the bits
// of add_mlp_partials then the two launches, and write that output as the new residual and tap.
static bool check_qkv_attention(std::mt19937& rng, int hidden, int heads, int kv_heads, int head_dim,
                                int groups, int cluster, int width = 1, int parts = 0) {
    const int batch = 3, rows = batch * width, capacity = 48, col0 = 37, total = col0 + width;
    const int half = head_dim / 2, pairs = (heads + 2 * kv_heads) * half;
    const int qkv_dim = (heads + 2 * kv_heads) * head_dim, q_dim = heads * head_dim;
    const auto w = random_bf16(rng, qkv_dim * hidden, 0.2f);
    const auto norm_w = random_bf16(rng, hidden);
    const auto residual = random_f32(rng, rows * hidden);
    const auto sums = random_f32(rng, std::max(parts, 1) * rows * hidden);
    // The input the two launches see: the residual, or the layer's output summed on its own.
    std::vector<float> x = residual;
    if (parts > 0) {
        emu_launch(EmuDim3{static_cast<unsigned int>((rows * hidden / 4 + 255) / 256), 1, 1},
                   EmuDim3{256, 1, 1}, 0, [&] {
                       add_mlp_partials(residual.data(), sums.data(), parts, x.data(), nullptr,
                                        rows, hidden);
                   });
    }
    const auto bias = random_f32(rng, qkv_dim);
    const int first_position[batch] = {30, 12, 36 - width + 1};
    std::vector<int> positions(rows);
    for (int r = 0; r < rows; ++r) positions[r] = first_position[r / width] + r % width;
    std::vector<float> inv_freq(half);
    for (int j = 0; j < half; ++j) inv_freq[j] = std::pow(10000.0f, -2.0f * j / head_dim);
    const size_t cache = static_cast<size_t>(batch) * kv_heads * capacity * head_dim;
    const auto k0 = random_bf16(rng, cache), v0 = random_bf16(rng, cache);
    // Step row r (sequence b, token i) sees its sequence's first first_position[b] cached
    // columns in order, some columns between them hidden (rejected drafts), and new columns.
    std::vector<float> mask(rows * total, NEG_INF);
    for (int r = 0; r < rows; ++r) {
        const int b = r / width, i = r % width;
        int seen = 0;
        for (int j = 0; j < col0 && seen < first_position[b]; ++j) {
            if ((j * 7 + b) % 5 == 3) continue;
            mask[r * total + j] = 0.0f;
            ++seen;
        }
        for (int j = 0; j <= i; ++j) {
            if (!(i == 2 && j == 1)) mask[r * total + col0 + j] = 0.0f;
        }
    }
    std::vector<int> list(rows * capacity), counts(rows);
    emu_launch(EmuDim3{static_cast<unsigned int>(rows), 1, 1}, EmuDim3{32, 1, 1}, 0, [&] {
        visible_columns(mask.data(), list.data(), counts.data(), total, capacity, nullptr);
    });
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    struct Out {
        std::vector<float> q;
        std::vector<unsigned short> k, v, out;
    };
    auto fresh = [&] {
        return Out{std::vector<float>(rows * q_dim, NAN), k0, v0,
                   std::vector<unsigned short>(rows * q_dim, 0xffff)};
    };
    Out want = fresh(), got = fresh();
    emu_launch(mma_grid((pairs + 7) / 8, rows), EmuDim3{32 * split_for(hidden), 1, 1},
               rows * hidden * 2, [&] {
                   norm_qkv_rope_mma(x.data(), norm_w.data(), w.data(), nullptr, nullptr, nullptr,
                                     bias.data(), positions.data(), inv_freq.data(), want.q.data(),
                                     want.k.data(), want.v.data(), rows, hidden, width, heads,
                                     kv_heads, head_dim, capacity, col0, nullptr, 1e-5f, nullptr,
                                     nullptr);
               });
    const unsigned int attention_warps = 8;
    emu_launch(EmuDim3{static_cast<unsigned int>(rows * heads), 1, 1},
               EmuDim3{32 * attention_warps, 1, 1}, (attention_warps * (head_dim + 2) + head_dim) * 4,
               [&] {
                   attention_invariant(want.q.data(), want.k.data(), want.v.data(), mask.data(),
                                       list.data(), counts.data(), want.out.data(), width, heads,
                                       kv_heads, head_dim, capacity, total, scale, nullptr);
               });
    // Launched as Gpu::qkv_attention (qkv_attention_shared_bytes).
    const unsigned int split = split_for(hidden), warps = groups * split;
    const int passes = (3 * head_dim / 16 + groups - 1) / groups;
    size_t shared = (passes * groups * 8 * width * sizeof(QkvPairInputs) + 15) / 16 * 16 +
                    ((width * hidden + 7) / 8 * 8) * 2 + warps * 4 * 32 * 4 +
                    (warps * (head_dim + 2) + head_dim) * 4;
    if (parts > 0) shared = (shared + 15) / 16 * 16 + width * hidden * 4;
    std::vector<float> x_out(rows * hidden, NAN), tap(rows * hidden, NAN);
    // A cluster's blocks run one after another here, in rank order: the last rank attends after
    // every rank has written its tiles, as the cluster barrier orders them on the GPU.
    emu_launch(EmuDim3{static_cast<unsigned int>(batch * heads * cluster), 1, 1},
               EmuDim3{32 * warps, 1, 1}, shared, [&] {
                   qkv_attention_mma(parts > 0 ? residual.data() : x.data(), norm_w.data(),
                                     w.data(), bias.data(), positions.data(), inv_freq.data(),
                                     got.q.data(), got.k.data(), got.v.data(), mask.data(),
                                     list.data(), counts.data(), got.out.data(), hidden, heads,
                                     kv_heads, head_dim, capacity, col0, total, scale, nullptr,
                                     1e-5f, groups, cluster, width,
                                     parts > 0 ? sums.data() : nullptr, parts,
                                     parts > 0 ? x_out.data() : nullptr,
                                     parts > 0 ? tap.data() : nullptr);
               });
    // The summed input written as the new residual and the tap, bit for bit.
    const bool residual_same =
        parts == 0 || (std::memcmp(x_out.data(), x.data(), x.size() * 4) == 0 &&
                       std::memcmp(tap.data(), x.data(), x.size() * 4) == 0 && x != residual);
    const bool q_same = std::memcmp(got.q.data(), want.q.data(), got.q.size() * 4) == 0;
    const bool kv_same = got.k == want.k && got.v == want.v && got.k != k0 && got.v != v0;
    const bool out_same = got.out == want.out;
    // Not vacuous: every output was written (no 0xffff left) and the new columns changed.
    bool written = true;
    for (auto o : got.out) written &= o != 0xffff;
    const int tiles = 3 * head_dim / 16;
    char what[160], detail[160];
    std::snprintf(what, sizeof what,
                  "qkv_attention_mma against the two launches (hd %d, %d tiles, %d a pass, clusters of %d, %d token%s a sequence%s)",
                  head_dim, tiles, groups, cluster, width, width == 1 ? "" : "s",
                  parts > 0 ? ", MLP sums added" : "");
    std::snprintf(detail, sizeof detail, "(q %s, k|v %s, attention %s%s: bit for bit)",
                  q_same ? "same" : "DIFFER", kv_same ? "same" : "DIFFER", out_same ? "same" : "DIFFER",
                  parts == 0 ? "" : (residual_same ? ", residual same" : ", residual DIFFER"));
    return report(what, q_same && kv_same && out_same && written && residual_same, detail);
}

// mlp_partials_mma then add_mlp_partials (a fused layer's MLP in one launch, summed by the
// next reader) against the residual plus down . act in double precision, with act bit for bit
// what norm_gate_up_silu_mma computes; a row's bits the same in steps of 1 to 32 rows (row
// groups of 8 as the grid's y); the tap what the output gets. `inter / 16` slice blocks in
// clusters of `cluster`: inter / 16 / cluster cluster sums.
static bool check_mlp(std::mt19937& rng, int hidden, int inter, int cluster) {
    const auto gate_up = random_bf16(rng, 2 * inter * hidden, 0.2f);
    const auto down = random_bf16(rng, hidden * inter, 0.2f);
    const auto norm_w = random_bf16(rng, hidden);
    const auto x = random_f32(rng, 32 * hidden);
    const int blocks = inter / 16, parts = blocks / cluster;
    const unsigned int split = split_for(hidden), warps = 2 * split;
    const size_t shared = (8 * hidden + 7) / 8 * 8 * 2 + warps * 4 * 32 * 4 + 8 * 16 * 2;
    struct Out {
        std::vector<float> y, tap;
        std::vector<unsigned short> act;
    };
    auto run = [&](int rows) {
        std::vector<float> scratch(blocks * rows * hidden, NAN), sums(parts * rows * hidden, NAN);
        Out out{std::vector<float>(rows * hidden, NAN), std::vector<float>(rows * hidden, NAN),
                std::vector<unsigned short>(rows * inter, 0xffff)};
        emu_launch(EmuDim3{static_cast<unsigned int>(blocks), static_cast<unsigned int>((rows + 7) / 8), 1},
                   EmuDim3{32 * warps, 1, 1}, shared, [&] {
                       mlp_partials_mma(x.data(), norm_w.data(), gate_up.data(), down.data(),
                                        scratch.data(), sums.data(), out.act.data(), rows, hidden,
                                        inter, 1e-5f, cluster);
                   });
        emu_launch(EmuDim3{static_cast<unsigned int>((rows * hidden / 4 + 255) / 256), 1, 1},
                   EmuDim3{256, 1, 1}, 0, [&] {
                       add_mlp_partials(x.data(), sums.data(), parts, out.y.data(), out.tap.data(),
                                        rows, hidden);
                   });
        return out;
    };
    // act against norm_gate_up_silu_mma on the same 8 rows.
    std::vector<unsigned short> want_act(8 * inter, 0xffff);
    emu_launch(mma_grid((inter + 7) / 8, 8), EmuDim3{32 * split, 1, 1}, 8 * hidden * 2, [&] {
        norm_gate_up_silu_mma(x.data(), norm_w.data(), gate_up.data(), want_act.data(), 8, hidden,
                              inter, 1e-5f);
    });
    const int widths[] = {1, 3, 8, 13, 32};
    std::vector<Out> outs;
    for (int rows : widths) outs.push_back(run(rows));
    const bool act_same = std::memcmp(outs[2].act.data(), want_act.data(), 8 * inter * 2) == 0;
    // y = x + down . act in double precision (act as the kernel computed it).
    double worst = 0.0;
    const Out& wide = outs.back();
    for (int r = 0; r < 32; ++r)
        for (int o = 0; o < hidden; ++o) {
            double dot = x[r * hidden + o];
            for (int j = 0; j < inter; ++j)
                dot += static_cast<double>(from_bf16(down[o * inter + j])) * from_bf16(wide.act[r * inter + j]);
            worst = std::max(worst, std::fabs(wide.y[r * hidden + o] - dot));
        }
    bool same_bits = true, tap_is_y = true;
    for (size_t k = 0; k < outs.size(); ++k) {
        const int rows = widths[k];
        same_bits &= std::memcmp(outs[k].y.data(), wide.y.data(), rows * hidden * 4) == 0;
        same_bits &= std::memcmp(outs[k].act.data(), wide.act.data(), rows * inter * 2) == 0;
        tap_is_y &= std::memcmp(outs[k].tap.data(), outs[k].y.data(), rows * hidden * 4) == 0;
    }
    char what[160], detail[160];
    std::snprintf(what, sizeof what, "mlp_partials_mma + add_mlp_partials (hidden %d, inter %d, clusters of %d)",
                  hidden, inter, cluster);
    std::snprintf(detail, sizeof detail, "(max |error| %.1e, tolerance 1e-4)", worst);
    bool ok = report(what, worst <= 1e-4, detail);
    ok &= report("mlp_partials_mma: act is norm_gate_up_silu_mma's", act_same, "(bit for bit)");
    ok &= report("mlp_partials_mma: a row's bits the same in steps of 1 to 32 rows", same_bits, "");
    ok &= report("add_mlp_partials: the tap gets what the output gets", tap_is_y, "(bit for bit)");
    return ok;
}

// The norm-staging kernels at SmolLM2's width (576: 5 warps a block), where an 8-row step gives
// three warps two rows each and a 1-row step one: each row of the 8-row step must get the bits
// of that row run alone, for gemv_norm_rows_mma, norm_gate_up_silu_mma and the target's
// norm_qkv_rope_mma (f32 rows and embedding rows). (Staging a warp's two rows at once was
// measured no faster on an H100, session 55; this check guarded it and guards the loop.)
static bool check_staging_at_smollm2_width(std::mt19937& rng) {
    const int hidden = 576, out = 32, inter = 16, rows = 8, vocab = 13;
    const int heads = 2, kv_heads = 1, head_dim = 32, capacity = 16, half = head_dim / 2;
    const int pairs = (heads + 2 * kv_heads) * half, q_dim = heads * head_dim;
    const int qkv_dim = (heads + 2 * kv_heads) * head_dim;
    const auto x = random_f32(rng, rows * hidden);
    const auto norm_w = random_bf16(rng, hidden);
    const auto w_out = random_bf16(rng, out * hidden);
    const auto w_gate_up = random_bf16(rng, 2 * inter * hidden);
    const auto w_qkv = random_bf16(rng, qkv_dim * hidden, 0.2f);
    const auto table = random_bf16(rng, vocab * hidden);
    const std::vector<unsigned int> tokens = {3, 12, 0, 7, 7, 5, 9, 1};
    std::vector<int> positions(rows);
    for (int r = 0; r < rows; ++r) positions[r] = r + 2;
    std::vector<float> inv_freq(half);
    for (int j = 0; j < half; ++j) inv_freq[j] = std::pow(10000.0f, -2.0f * j / head_dim);
    const unsigned int warps = 32 * split_for(hidden);
    // Every kernel over rows r0 .. r0 + n (a step of its own, width n: one sequence).
    auto norm_rows = [&](int r0, int n) {
        std::vector<float> y(n * out, NAN);
        emu_launch(mma_grid((out + 15) / 16, n), EmuDim3{warps, 1, 1}, n * hidden * 2, [&] {
            gemv_norm_rows_mma(x.data() + r0 * hidden, norm_w.data(), w_out.data(), y.data(), n,
                               hidden, out, 1e-5f);
        });
        return y;
    };
    auto gate_up = [&](int r0, int n) {
        std::vector<unsigned short> act(n * inter, 0xffff);
        emu_launch(mma_grid((inter + 7) / 8, n), EmuDim3{warps, 1, 1}, n * hidden * 2, [&] {
            norm_gate_up_silu_mma(x.data() + r0 * hidden, norm_w.data(), w_gate_up.data(),
                                  act.data(), n, hidden, inter, 1e-5f);
        });
        return act;
    };
    auto qkv = [&](int r0, int n, bool embed) {
        std::vector<float> q(n * q_dim, NAN);
        std::vector<unsigned short> k(kv_heads * capacity * head_dim, 0), v = k;
        emu_launch(mma_grid((pairs + 7) / 8, n), EmuDim3{warps, 1, 1}, n * hidden * 2, [&] {
            norm_qkv_rope_mma(embed ? nullptr : x.data() + r0 * hidden, norm_w.data(),
                              w_qkv.data(), nullptr, nullptr, nullptr, nullptr,
                              positions.data() + r0, inv_freq.data(), q.data(), k.data(),
                              v.data(), n, hidden, n, heads, kv_heads, head_dim, capacity, r0,
                              nullptr, 1e-5f, embed ? table.data() : nullptr,
                              embed ? tokens.data() + r0 : nullptr);
        });
        return std::make_tuple(q, k, v);
    };
    const auto y8 = norm_rows(0, rows);
    const auto act8 = gate_up(0, rows);
    const auto qkv8 = qkv(0, rows, false), emb8 = qkv(0, rows, true);
    bool norm_ok = true, gate_ok = true, qkv_ok = true;
    for (int r = 0; r < rows; ++r) {
        norm_ok &= std::memcmp(norm_rows(r, 1).data(), y8.data() + r * out, out * 4) == 0;
        gate_ok &= std::memcmp(gate_up(r, 1).data(), act8.data() + r * inter, inter * 2) == 0;
        for (bool embed : {false, true}) {
            const auto& all = embed ? emb8 : qkv8;
            const auto [q, k, v] = qkv(r, 1, embed);
            qkv_ok &= std::memcmp(q.data(), std::get<0>(all).data() + r * q_dim, q_dim * 4) == 0;
            // Row r's key and value: cache column r (col0 = r0) of each key-value head.
            for (int h = 0; h < kv_heads; ++h) {
                const size_t at = (static_cast<size_t>(h) * capacity + r) * head_dim;
                qkv_ok &= std::memcmp(k.data() + at, std::get<1>(all).data() + at, head_dim * 2) == 0;
                qkv_ok &= std::memcmp(v.data() + at, std::get<2>(all).data() + at, head_dim * 2) == 0;
            }
        }
    }
    char detail[160];
    std::snprintf(detail, sizeof detail, "(gemv_norm_rows %s, gate|up %s, q|k|v %s: bit for bit)",
                  norm_ok ? "same" : "DIFFERENT", gate_ok ? "same" : "DIFFERENT",
                  qkv_ok ? "same" : "DIFFERENT");
    return report("norm staging at 576 wide: 8 rows over 5 warps give each row its bits alone",
                  norm_ok && gate_ok && qkv_ok, detail);
}

int main() {
    std::mt19937 rng(38);
    bool ok = check_gemv(rng);
    ok = check_gemv_norm(rng) && ok;
    ok = check_gate_up(rng) && ok;
    ok = check_qkv_rope(rng, false) && ok;
    ok = check_qkv_rope(rng, true) && ok;
    ok = check_row_groups(rng) && ok;
    ok = check_staging_at_smollm2_width(rng) && ok;
    ok = check_qkv_attention(rng, 160, 4, 2, 32, 6, 1) && ok;  // 6 tiles, split 2: one pass
    ok = check_qkv_attention(rng, 320, 4, 2, 32, 4, 1) && ok;  // two passes, the second half-empty
    ok = check_qkv_attention(rng, 160, 3, 1, 64, 5, 1) && ok;  // 12 tiles, split 2: three passes
    // Clusters: four ranks of one pass each (SmolLM2's layout), two ranks of two passes each,
    // and five ranks for four passes (the attending rank has no tile of its own).
    ok = check_qkv_attention(rng, 160, 3, 1, 64, 3, 4) && ok;
    ok = check_qkv_attention(rng, 160, 3, 1, 64, 3, 2) && ok;
    ok = check_qkv_attention(rng, 160, 3, 1, 64, 3, 5) && ok;
    // Verifications: a chain of four in clusters of 4 (SmolLM2's 3/1/4), eight tokens (the
    // mma's eight columns) in clusters of 2, three tokens with one pass a cluster.
    ok = check_qkv_attention(rng, 160, 3, 1, 64, 3, 4, 4) && ok;
    ok = check_qkv_attention(rng, 160, 3, 1, 64, 3, 2, 8) && ok;
    ok = check_qkv_attention(rng, 160, 4, 2, 32, 6, 1, 3) && ok;
    // A fused layer's MLP in one launch: SmolLM2's cluster sums (8 ranks), pairs, and one
    // cluster; then the one-launch q|k|v and attention adding the sums itself (a decode step
    // and a chain of four, three sums and one).
    ok = check_mlp(rng, 160, 128, 8) && ok;
    ok = check_mlp(rng, 160, 96, 2) && ok;
    ok = check_mlp(rng, 320, 64, 4) && ok;
    ok = check_qkv_attention(rng, 160, 3, 1, 64, 3, 4, 1, 3) && ok;
    ok = check_qkv_attention(rng, 160, 3, 1, 64, 3, 4, 4, 1) && ok;
    return ok ? 0 : 1;
}
