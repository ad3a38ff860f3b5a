// The tensor-core helpers of the kernels that use mma.sync (attention_mma.cu, rows_mma.cu):
// `tandem_cuda` puts this text after common.cuh in front of those sources (`mma_source` in
// crates/tandem-cuda/src/device.rs); the CPU emulator's harnesses include it, with
// `mma_bf16_16816` from the emulator instead (TANDEM_EMULATE). Needs sm_80 or later.

// Two floats as a bf16x2 register, `lo` in the low half (the element with the smaller index).
__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    return (unsigned int)f32_to_bf16(lo) | ((unsigned int)f32_to_bf16(hi) << 16);
}

#ifndef TANDEM_EMULATE
// d += a * b for one 16x8x16 tile (a: 4 registers of A, b: 2 of B, d: 4 f32 of C/D).
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned int* a,
                                               const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
