// A CPU emulator of the few CUDA features a kernel of kernels/ uses, for checking a kernel's
// indexing and arithmetic without a GPU (tests/emulated_kernels.rs builds it with g++).
//
// Every CUDA thread of a block is an OS thread; blocks run one after another, so a kernel's
// `extern __shared__` array can be one global array (the harness defines it). __syncthreads is
// a barrier of the block's threads; __shfl_xor_sync and mma.sync are exchanges through
// per-warp memory between two barriers of the warp's 32 threads. The mma is computed from the
// fragments every lane holds, decoded by the PTX ISA's layout for mma.m16n8k16 with .bf16
// ("Matrix Fragments for mma.m16n8k16 with floating point type"): a kernel that assembles its
// fragments wrongly gets the wrong product here as on the GPU.
//
// What this does not check: timing, races that a real GPU would expose (the emulator's
// barriers are stricter than a warp's lockstep), kernels whose blocks wait for each other (the
// persistent step's grid barrier: blocks run one after another here), and PTX other than the
// mma it decodes. Static `__shared__` arrays become `static` (one per program, i.e. per block);
// dynamic ones come from `DYNAMIC_SHARED` (kernels/common.cuh), a buffer per launch.
#pragma once

#include <math.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct EmuDim3 {
    unsigned int x = 1, y = 1, z = 1;
};

struct uint4 {
    unsigned int x, y, z, w;
};

inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
    return uint4{x, y, z, w};
}

template <typename T>
inline T min(T a, T b) {
    return b < a ? b : a;
}

template <typename T>
inline T max(T a, T b) {
    return a < b ? b : a;
}

inline float __int_as_float(int v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline float __uint_as_float(unsigned int v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline int __float_as_int(float f) {
    int v;
    std::memcpy(&v, &f, 4);
    return v;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int v;
    std::memcpy(&v, &f, 4);
    return v;
}

// One block's synchronisation state.
struct EmuBlock {
    explicit EmuBlock(int threads) : block(threads), exchange((threads + 31) / 32) {
        for (int w = 0; w < (threads + 31) / 32; ++w) {
            warps.push_back(std::make_unique<std::barrier<>>(32));
        }
    }
    std::barrier<> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    // Per warp and lane: what the lane put out for an exchange (at most 6 words: an mma).
    std::vector<std::array<std::array<std::uint32_t, 6>, 32>> exchange;
    std::atomic<int> vote{0};
};

inline thread_local EmuDim3 threadIdx;
inline thread_local EmuDim3 blockIdx;
inline EmuDim3 blockDim;
inline EmuDim3 gridDim;
inline thread_local EmuBlock* emu_block = nullptr;

#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
// Static shared arrays: one per program, which is one per block since blocks run one at a time.
#define __shared__ static

// The launch's dynamic shared memory (emu_launch sizes it).
inline std::vector<uint4> emu_dynamic;
inline void* emu_dynamic_shared() { return emu_dynamic.data(); }
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu_dynamic_shared())

struct uint2 {
    unsigned int x, y;
};
struct float4 {
    float x, y, z, w;
};
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// Cached and L2-only loads are plain loads here.
template <typename T>
inline T __ldg(const T* p) {
    return *p;
}
template <typename T>
inline T __ldcg(const T* p) {
    return *p;
}
inline int __popc(unsigned int v) { return __builtin_popcount(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline long long clock64() {
    return std::chrono::steady_clock::now().time_since_epoch().count();
}
template <typename T>
inline T atomicAdd(T* address, T value) {
    return std::atomic_ref<T>(*address).fetch_add(value);
}

inline void __syncthreads() { emu_block->block.arrive_and_wait(); }

inline int __syncthreads_or(int predicate) {
    if (predicate) {
        emu_block->vote.fetch_or(1);
    }
    emu_block->block.arrive_and_wait();
    const int result = emu_block->vote.load();
    emu_block->block.arrive_and_wait();
    if (threadIdx.x == 0) {
        emu_block->vote.store(0);
    }
    emu_block->block.arrive_and_wait();
    return result;
}

inline void emu_warp_sync() { emu_block->warps[threadIdx.x >> 5]->arrive_and_wait(); }

// Every lane of the warp puts `value` out and takes lane `source(lane)`'s.
template <typename T, typename Source>
inline T emu_exchange(T value, Source source) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    const int lane = threadIdx.x & 31;
    auto& slots = emu_block->exchange[threadIdx.x >> 5];
    std::memcpy(&slots[lane][0], &value, 4);
    emu_warp_sync();
    T other;
    std::memcpy(&other, &slots[source(lane) & 31][0], 4);
    emu_warp_sync();
    return other;
}

template <typename T>
inline T __shfl_xor_sync(unsigned int, T value, int lane_mask) {
    return emu_exchange(value, [&](int lane) { return lane ^ lane_mask; });
}

template <typename T>
inline T __shfl_sync(unsigned int, T value, int source_lane) {
    return emu_exchange(value, [&](int) { return source_lane; });
}

inline unsigned int __ballot_sync(unsigned int, int predicate) {
    const int lane = threadIdx.x & 31;
    auto& slots = emu_block->exchange[threadIdx.x >> 5];
    slots[lane][0] = predicate ? 1u : 0u;
    emu_warp_sync();
    unsigned int bits = 0;
    for (int l = 0; l < 32; ++l) {
        bits |= slots[l][0] << l;
    }
    emu_warp_sync();
    return bits;
}

inline float emu_bf16(std::uint32_t bits16) { return __uint_as_float((bits16 & 0xffffu) << 16); }

// d += a * b, one 16x8x16 bf16 tile, f32 accumulate: every lane's fragments in, this lane's
// four results out.
inline void mma_bf16_16816(float* d, const unsigned int* a, const unsigned int* b) {
    const int lane = threadIdx.x & 31;
    auto& slots = emu_block->exchange[threadIdx.x >> 5];
    for (int i = 0; i < 4; ++i) {
        slots[lane][i] = a[i];
    }
    slots[lane][4] = b[0];
    slots[lane][5] = b[1];
    emu_warp_sync();
    float A[16][16];
    float B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2;
        const int t = l & 3;
        const auto& f = slots[l];
        // A: a0,a1 (row g) a2,a3 (row g+8) at cols 2t, 2t+1; a4..a7 the same at cols + 8.
        A[g][2 * t] = emu_bf16(f[0]);
        A[g][2 * t + 1] = emu_bf16(f[0] >> 16);
        A[g + 8][2 * t] = emu_bf16(f[1]);
        A[g + 8][2 * t + 1] = emu_bf16(f[1] >> 16);
        A[g][2 * t + 8] = emu_bf16(f[2]);
        A[g][2 * t + 9] = emu_bf16(f[2] >> 16);
        A[g + 8][2 * t + 8] = emu_bf16(f[3]);
        A[g + 8][2 * t + 9] = emu_bf16(f[3] >> 16);
        // B: b0,b1 at rows (k) 2t, 2t+1, b2,b3 at 2t+8, 2t+9; column (n) g.
        B[2 * t][g] = emu_bf16(f[4]);
        B[2 * t + 1][g] = emu_bf16(f[4] >> 16);
        B[2 * t + 8][g] = emu_bf16(f[5]);
        B[2 * t + 9][g] = emu_bf16(f[5] >> 16);
    }
    emu_warp_sync();
    const int g = lane >> 2;
    const int t = lane & 3;
    // C/D: c0,c1 at row g, cols 2t, 2t+1; c2,c3 at row g+8.
    const int rows[4] = {g, g, g + 8, g + 8};
    const int cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) {
            sum += A[rows[i]][k] * B[k][cols[i]];
        }
        d[i] += sum;
    }
}

// Runs `kernel` (a callable taking no arguments) over `grid` blocks (x and y) of `block`
// threads, one block at a time, with `shared_bytes` of dynamic shared memory.
template <typename Kernel>
void emu_launch(EmuDim3 grid, EmuDim3 block, std::size_t shared_bytes, Kernel kernel) {
    gridDim = grid;
    blockDim = block;
    emu_dynamic.assign(shared_bytes / sizeof(uint4) + 1, uint4{0, 0, 0, 0});
    for (unsigned int block_index = 0; block_index < grid.x * std::max(grid.y, 1u); ++block_index) {
        const unsigned int bx = block_index % grid.x;
        const unsigned int by = block_index / grid.x;
        EmuBlock state(static_cast<int>(block.x));
        std::vector<std::thread> threads;
        threads.reserve(block.x);
        for (unsigned int tx = 0; tx < block.x; ++tx) {
            threads.emplace_back([&, tx, bx, by] {
                threadIdx = EmuDim3{tx, 0, 0};
                blockIdx = EmuDim3{bx, by, 0};
                emu_block = &state;
                kernel();
                // A thread that is done (or returned early) no longer holds up the block's
                // barriers, as on the GPU.
                state.block.arrive_and_drop();
            });
        }
        for (auto& thread : threads) {
            thread.join();
        }
    }
}
