// Runs kernels/llama.cu's `beam_select` (the device tree drafting's beam choice) on the CPU
// emulator (crates/tandem-cuda/tests/emulated/cuda_emu.h) over a whole draft: `steps` steps of
// `batch` sequences with `topk` beams, each step's top-k made up by `made_up_topk` (which
// tests/beam_select_emulated.rs computes the same way), with the launch shape of
// `Gpu::beam_select` (one warp per sequence). Prints each step's record and next-step slots for
// the Rust test to compare with the host's BeamSearch:
//   rec S B scores(hex bits...) | tokens... | parents...
//   next S B tokens... | hrows...
// Usage: beam_select_run BATCH TOPK STEPS VOCAB
#define TANDEM_EMULATE 1
#include "cuda_emu.h"

#define GEMV_MAX_ROWS 8
#define GEMV_BLOCK_WARPS 4
#define PERSIST_THREADS 512
#include "common.cuh"
#include "llama.cu"

#include <cstdio>
#include <cstdlib>
#include <vector>

// Step s's top-k of row `row`: probabilities that are multiples of 1/256 (so products of two
// are exact and ties between beams happen), in descending order, with a tie between the second
// and third entries on every third row; draft ids from a formula.
static void made_up_topk(int s, int row, int k, int vocab, float* probs, unsigned int* ids) {
    std::vector<unsigned int> w(k);
    for (int c = 0; c < k; ++c) {
        const unsigned int h = static_cast<unsigned int>(s * 7 + row * 13 + c * 5) * 2654435761u;
        w[c] = 1 + (h >> 16) % 50;
    }
    for (int a = 0; a < k; ++a)
        for (int c = a + 1; c < k; ++c)
            if (w[c] > w[a]) std::swap(w[a], w[c]);
    if (k >= 3 && (row + s) % 3 == 0) w[2] = w[1];
    for (int c = 0; c < k; ++c) {
        probs[c] = static_cast<float>(w[c]) / 256.0f;
        ids[c] = static_cast<unsigned int>(s * 31 + row * 17 + c * 11) % static_cast<unsigned int>(vocab);
    }
}

int main(int argc, char** argv) {
    if (argc != 5) return 2;
    const int batch = std::atoi(argv[1]), k = std::atoi(argv[2]), steps = std::atoi(argv[3]);
    const int vocab = std::atoi(argv[4]);
    std::vector<unsigned int> d2t(vocab);
    for (int i = 0; i < vocab; ++i) d2t[i] = static_cast<unsigned int>(i) * 3 + 1000;
    std::vector<float> score[2] = {std::vector<float>(batch * k), std::vector<float>(batch * k)};
    std::vector<unsigned int> path[2] = {std::vector<unsigned int>(batch * k * steps),
                                         std::vector<unsigned int>(batch * k * steps)};
    std::vector<int> hrow[2] = {std::vector<int>(batch * k * steps), std::vector<int>(batch * k * steps)};
    std::vector<unsigned int> next_tokens(batch * k * steps), topk;
    std::vector<int> next_hrows(batch * k * steps);
    for (int s = 0; s < steps; ++s) {
        const int rows = s == 0 ? batch : batch * k;
        topk.assign(2 * rows * k, 0);
        for (int row = 0; row < rows; ++row) {
            std::vector<float> p(k);
            made_up_topk(s, row, k, vocab, p.data(), topk.data() + rows * k + row * k);
            for (int c = 0; c < k; ++c) std::memcpy(&topk[row * k + c], &p[c], 4);
        }
        const int n = s == 0 ? k : k * k;
        std::vector<unsigned int> record(2 * batch * n + (s > 0 ? batch * k : 0), 0xdeadbeef);
        const int in = s % 2, out = 1 - in;
        const int out_row0 = batch + (s - 1) * batch * k;
        emu_launch(EmuDim3{static_cast<unsigned int>(batch), 1, 1}, EmuDim3{32, 1, 1}, 0, [&] {
            beam_select(topk.data(), rows, d2t.data(), k, s, steps, score[in].data(),
                        path[in].data(), hrow[in].data(), score[out].data(), path[out].data(),
                        hrow[out].data(), record.data(), next_tokens.data(), next_hrows.data(),
                        out_row0);
        });
        for (int b = 0; b < batch; ++b) {
            std::printf("rec %d %d", s, b);
            for (int i = 0; i < n; ++i) std::printf(" %08x", record[b * n + i]);
            std::printf(" |");
            for (int i = 0; i < n; ++i) std::printf(" %u", record[batch * n + b * n + i]);
            std::printf(" |");
            if (s > 0)
                for (int j = 0; j < k; ++j) std::printf(" %u", record[2 * batch * n + b * k + j]);
            std::printf("\n");
            if (s + 1 < steps) {
                const int w = k * (s + 1);
                std::printf("next %d %d", s, b);
                for (int i = 0; i < w; ++i) std::printf(" %u", next_tokens[b * w + i]);
                std::printf(" |");
                for (int i = 0; i < w; ++i) std::printf(" %d", next_hrows[b * w + i]);
                std::printf("\n");
            }
        }
    }
    return 0;
}
