//! Dequantisation of ggml blocks to f32.
//!
//! Block layouts and arithmetic follow ggml's `dequantize_row_*` and gguf-py's `quants.py`,
//! including the order of f32 operations (e.g. `(d * scale) * q - dmin * m` for Q4_K), so results
//! match gguf-py (and therefore Hugging Face transformers' GGUF loader) bit for bit.

use half::{bf16, f16};

use crate::GgmlType;
use crate::ggml_type::QK_K;

/// Why a byte buffer could not be dequantised.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    #[error("ggml type {0} cannot be dequantised yet")]
    Unsupported(GgmlType),

    #[error("{ggml_type}: {elements} elements is not a whole number of {block_len}-element blocks")]
    PartialBlock {
        ggml_type: GgmlType,
        elements: usize,
        block_len: usize,
    },

    #[error("{ggml_type}: {elements} elements need {expected} bytes, got {actual}")]
    LengthMismatch {
        ggml_type: GgmlType,
        elements: usize,
        expected: usize,
        actual: usize,
    },
}

/// Dequantises `bytes` (whole blocks of `ggml_type`) into `out`, whose length is the element
/// count; `bytes.len()` must be exactly `out.len() / block_len * block_bytes`.
pub fn dequantize_into(
    ggml_type: GgmlType,
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), DequantError> {
    let block_len = ggml_type.block_len();
    if !out.len().is_multiple_of(block_len) {
        return Err(DequantError::PartialBlock {
            ggml_type,
            elements: out.len(),
            block_len,
        });
    }
    let expected = out.len() / block_len * ggml_type.block_bytes();
    if bytes.len() != expected {
        return Err(DequantError::LengthMismatch {
            ggml_type,
            elements: out.len(),
            expected,
            actual: bytes.len(),
        });
    }
    let block_fn: fn(&[u8], &mut [f32]) = match ggml_type {
        GgmlType::F32 => f32_block,
        GgmlType::F16 => f16_block,
        GgmlType::BF16 => bf16_block,
        GgmlType::Q8_0 => q8_0_block,
        GgmlType::Q4_0 => q4_0_block,
        GgmlType::Q4_1 => q4_1_block,
        GgmlType::Q4_K => q4_k_block,
        GgmlType::Q6_K => q6_k_block,
        other => return Err(DequantError::Unsupported(other)),
    };
    for (block, out_block) in bytes
        .chunks_exact(ggml_type.block_bytes())
        .zip(out.chunks_exact_mut(block_len))
    {
        block_fn(block, out_block);
    }
    Ok(())
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

fn f32_block(block: &[u8], out: &mut [f32]) {
    out[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
}

fn f16_block(block: &[u8], out: &mut [f32]) {
    out[0] = f16_at(block, 0);
}

fn bf16_block(block: &[u8], out: &mut [f32]) {
    out[0] = bf16::from_le_bytes([block[0], block[1]]).to_f32();
}

/// Q8_0, 34 bytes: f16 scale `d`, then 32 signed bytes `q`; `x = d * q`.
fn q8_0_block(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    for (x, &q) in out.iter_mut().zip(&block[2..34]) {
        *x = d * f32::from(q as i8);
    }
}

/// Q4_0, 18 bytes: f16 `d`, then 16 bytes of nibbles. Byte `j`'s low nibble is element `j`, its
/// high nibble element `j + 16`; `x = (q - 8) * d`.
fn q4_0_block(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let (low, high) = out.split_at_mut(16);
    for (j, &packed) in block[2..18].iter().enumerate() {
        low[j] = f32::from(i16::from(packed & 0x0F) - 8) * d;
        high[j] = f32::from(i16::from(packed >> 4) - 8) * d;
    }
}

/// Q4_1, 20 bytes: f16 `d`, f16 min `m`, then 16 bytes of nibbles laid out as in Q4_0;
/// `x = d * q + m`.
fn q4_1_block(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let m = f16_at(block, 2);
    let (low, high) = out.split_at_mut(16);
    for (j, &packed) in block[4..20].iter().enumerate() {
        low[j] = d * f32::from(packed & 0x0F) + m;
        high[j] = d * f32::from(packed >> 4) + m;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) from Q4_K's 12 packed bytes
/// (`get_scale_min_k4` in ggml): sub-blocks 0..4 use the low 6 bits of bytes `j` and `j + 4`;
/// sub-blocks 4..8 combine a nibble of byte `j + 4` with the top 2 bits of bytes `j - 4` / `j`.
fn q4_k_scale_min(j: usize, scales: &[u8]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// Q4_K, 144 bytes for 256 elements: f16 `d`, f16 `dmin`, 12 bytes of packed 6-bit scales and
/// mins for 8 sub-blocks of 32, then 128 bytes of nibbles. Each 32-byte run of nibbles holds two
/// sub-blocks: low nibbles first, then high nibbles. `x = (d * scale) * q - dmin * min`.
fn q4_k_block(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let scales = &block[4..16];
    let quants = &block[16..144];
    for (pair, (nibbles, out_pair)) in quants
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (scale_low, min_low) = q4_k_scale_min(2 * pair, scales);
        let (scale_high, min_high) = q4_k_scale_min(2 * pair + 1, scales);
        let (d_low, m_low) = (d * f32::from(scale_low), dmin * f32::from(min_low));
        let (d_high, m_high) = (d * f32::from(scale_high), dmin * f32::from(min_high));
        let (low, high) = out_pair.split_at_mut(32);
        for (l, &packed) in nibbles.iter().enumerate() {
            low[l] = d_low * f32::from(packed & 0x0F) - m_low;
            high[l] = d_high * f32::from(packed >> 4) - m_high;
        }
    }
}

/// Q6_K, 210 bytes for 256 elements: 128 bytes `ql` (low 4 bits), 64 bytes `qh` (high 2 bits),
/// 16 signed 8-bit scales (one per 16 elements), then f16 `d`. Each 128-element half uses 64
/// bytes of `ql` and 32 of `qh`: element `l + 32k` (k = 0..4) takes the low (k = 0, 1) or high
/// (k = 2, 3) nibble of `ql[l + 32 * (k % 2)]` and bits `2k..2k+2` of `qh[l]`.
/// `x = (d * scale) * (q - 32)`.
fn q6_k_block(block: &[u8], out: &mut [f32]) {
    let ql = &block[0..128];
    let qh = &block[128..192];
    let scales = &block[192..208];
    let d = f16_at(block, 208);
    for half in 0..2 {
        let ql = &ql[64 * half..64 * (half + 1)];
        let qh = &qh[32 * half..32 * (half + 1)];
        let out = &mut out[128 * half..128 * (half + 1)];
        let scales = &scales[8 * half..8 * (half + 1)];
        for l in 0..32 {
            let quants = [
                (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, q) in quants.into_iter().enumerate() {
                let element = l + 32 * k;
                let scale = f32::from(scales[element / 16] as i8);
                out[element] = (d * scale) * f32::from(i16::from(q) - 32);
            }
        }
    }
}

const _: () = assert!(
    QK_K == 256,
    "the k-quant block functions assume 256-element super-blocks"
);

#[cfg(test)]
mod tests {
    use super::*;

    const F16_ONE: [u8; 2] = 0x3C00u16.to_le_bytes();
    const F16_HALF: [u8; 2] = 0x3800u16.to_le_bytes();
    const F16_QUARTER: [u8; 2] = 0x3400u16.to_le_bytes();
    const F16_TWO: [u8; 2] = 0x4000u16.to_le_bytes();
    const F16_MINUS_ONE: [u8; 2] = 0xBC00u16.to_le_bytes();

    fn dequantize(ggml_type: GgmlType, bytes: &[u8]) -> Vec<f32> {
        let elements = bytes.len() / ggml_type.block_bytes() * ggml_type.block_len();
        let mut out = vec![f32::NAN; elements];
        dequantize_into(ggml_type, bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn f32_f16_bf16_are_plain_conversions() {
        let f32_bytes: Vec<u8> = [1.5f32, -0.0, 3.25e-7]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(dequantize(GgmlType::F32, &f32_bytes), [1.5, -0.0, 3.25e-7]);

        // f16: 0x3C00 = 1.0, 0xC000 = -2.0, 0x0001 = smallest subnormal 2^-24.
        let f16_bytes = [0x00, 0x3C, 0x00, 0xC0, 0x01, 0x00];
        assert_eq!(
            dequantize(GgmlType::F16, &f16_bytes),
            [1.0, -2.0, 2f32.powi(-24)]
        );

        // bf16 is the top half of an f32: 0x3FC0 = 1.5, 0xC2F7 = -123.5.
        let bf16_bytes = [0xC0, 0x3F, 0xF7, 0xC2];
        assert_eq!(dequantize(GgmlType::BF16, &bf16_bytes), [1.5, -123.5]);
    }

    #[test]
    fn q8_0_scales_signed_bytes() {
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&F16_HALF);
        block[2] = (-128i8) as u8;
        block[3] = (-1i8) as u8;
        block[5] = 1;
        block[33] = 127;
        let out = dequantize(GgmlType::Q8_0, &block);
        assert_eq!(&out[..4], [-64.0, -0.5, 0.0, 0.5]);
        assert_eq!(out[31], 63.5);
        assert!(out[4..31].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn q4_0_low_nibbles_first_then_high_nibbles_minus_eight() {
        let mut block = vec![0x88u8; 18]; // nibble 8 decodes to 0
        block[..2].copy_from_slice(&F16_TWO);
        block[2] = 0x1F; // element 0: (15 - 8) * 2 = 14; element 16: (1 - 8) * 2 = -14
        block[3] = 0x80; // element 1: (0 - 8) * 2 = -16; element 17: (8 - 8) * 2 = 0
        block[17] = 0x3C; // element 15: (12 - 8) * 2 = 8; element 31: (3 - 8) * 2 = -10
        let out = dequantize(GgmlType::Q4_0, &block);
        let mut expected = [0.0f32; 32];
        expected[0] = 14.0;
        expected[16] = -14.0;
        expected[1] = -16.0;
        expected[15] = 8.0;
        expected[31] = -10.0;
        assert_eq!(out, expected);
    }

    #[test]
    fn q4_1_is_scale_times_nibble_plus_min() {
        let mut block = vec![0u8; 20];
        block[..2].copy_from_slice(&F16_QUARTER);
        block[2..4].copy_from_slice(&F16_MINUS_ONE);
        block[4] = 0xA3; // element 0: 0.25 * 3 - 1 = -0.25; element 16: 0.25 * 10 - 1 = 1.5
        block[19] = 0xF0; // element 15: 0.25 * 0 - 1 = -1; element 31: 0.25 * 15 - 1 = 2.75
        let out = dequantize(GgmlType::Q4_1, &block);
        let mut expected = [-1.0f32; 32];
        expected[0] = -0.25;
        expected[16] = 1.5;
        expected[31] = 2.75;
        assert_eq!(out, expected);
    }

    /// Scales `[1, 2, 3, 4, 17, 33, 5, 63]` and mins `[0, 1, 2, 3, 20, 48, 7, 63]` packed by hand:
    /// bytes 0..4 hold scales 0..4 plus the top 2 bits of scales 4..8, bytes 4..8 the same for
    /// mins, bytes 8..12 the low nibbles of scale (low half) and min (high half) 4..8.
    const Q4_K_SCALES: [u8; 12] = [
        0x41, 0x82, 0x03, 0xC4, 0x40, 0xC1, 0x02, 0xC3, 0x41, 0x01, 0x75, 0xFF,
    ];
    const Q4_K_SUB_SCALES: [u8; 8] = [1, 2, 3, 4, 17, 33, 5, 63];
    const Q4_K_SUB_MINS: [u8; 8] = [0, 1, 2, 3, 20, 48, 7, 63];

    #[test]
    fn q4_k_unpacks_six_bit_scales_and_mins() {
        for j in 0..8 {
            assert_eq!(
                q4_k_scale_min(j, &Q4_K_SCALES),
                (Q4_K_SUB_SCALES[j], Q4_K_SUB_MINS[j]),
                "sub-block {j}"
            );
        }
    }

    #[test]
    fn q4_k_super_block() {
        let mut block = vec![0u8; 144];
        block[..2].copy_from_slice(&F16_ONE);
        block[2..4].copy_from_slice(&F16_HALF);
        block[4..16].copy_from_slice(&Q4_K_SCALES);
        block[16..].fill(0x5A); // even sub-blocks read 0xA = 10, odd sub-blocks read 5
        block[16] = 0xF0; // element 0 (sub-block 0) reads 0, element 32 (sub-block 1) reads 15
        block[16 + 127] = 0x3E; // element 223 (sub-block 6) reads 14, element 255 (sub-block 7) 3
        let out = dequantize(GgmlType::Q4_K, &block);

        // x = 1.0 * scale * q - 0.5 * min
        assert_eq!(out[0], 0.0);
        assert_eq!(out[32], 2.0 * 15.0 - 0.5);
        assert_eq!(out[223], 5.0 * 14.0 - 3.5);
        assert_eq!(out[255], 63.0 * 3.0 - 31.5);
        assert_eq!(out[1], 10.0); // sub-block 0: 1 * 10 - 0
        assert_eq!(out[40], 2.0 * 5.0 - 0.5); // sub-block 1
        assert_eq!(out[64], 3.0 * 10.0 - 1.0); // sub-block 2
        assert_eq!(out[127], 4.0 * 5.0 - 1.5); // sub-block 3
        assert_eq!(out[128], 17.0 * 10.0 - 10.0); // sub-block 4
        assert_eq!(out[191], 33.0 * 5.0 - 24.0); // sub-block 5
        assert_eq!(out[192], 5.0 * 10.0 - 3.5); // sub-block 6
        assert_eq!(out[224], 63.0 * 5.0 - 31.5); // sub-block 7
    }

    #[test]
    fn q6_k_super_block() {
        let mut block = vec![0u8; 210];
        let scales: [i8; 16] = [1, -2, 3, 4, 5, 6, 7, 8, -1, 2, 3, 4, 5, 6, 7, -128];
        for (byte, scale) in block[192..208].iter_mut().zip(scales) {
            *byte = scale as u8;
        }
        block[208..210].copy_from_slice(&F16_HALF);
        block[0] = 0x21; // ql[0]: low 1 -> element 0, high 2 -> element 64
        block[32] = 0x7F; // ql[32]: low 15 -> element 32, high 7 -> element 96
        block[128] = 0b11_10_01_00; // qh[0]: high bits 0, 1, 2, 3 for elements 0, 32, 64, 96
        block[127] = 0xF0; // ql[127]: high 15 -> element 255
        block[128 + 63] = 0xC0; // qh[63]: bits 6..8 = 3 -> element 255
        let out = dequantize(GgmlType::Q6_K, &block);

        // x = 0.5 * scale * (q - 32)
        assert_eq!(out[0], 0.5 * 1.0 * (1.0 - 32.0));
        assert_eq!(out[32], 0.5 * 3.0 * (31.0 - 32.0)); // q = 15 | 1 << 4
        assert_eq!(out[64], 0.5 * 5.0 * (34.0 - 32.0)); // q = 2 | 2 << 4
        assert_eq!(out[96], 0.5 * 7.0 * (55.0 - 32.0)); // q = 7 | 3 << 4
        assert_eq!(out[17], 0.5 * -2.0 * -32.0);
        assert_eq!(out[128], -0.5 * -32.0); // second half: 0.5 * scale -1 * (0 - 32)
        assert_eq!(out[255], 0.5 * -128.0 * (63.0 - 32.0));
        assert_eq!(out[254], 0.5 * -128.0 * -32.0);
    }

    #[test]
    fn multiple_blocks_fill_consecutive_output() {
        let mut bytes = vec![0u8; 2 * 34];
        bytes[..2].copy_from_slice(&F16_ONE);
        bytes[2] = 3;
        bytes[34..36].copy_from_slice(&F16_TWO);
        bytes[36] = 3;
        let out = dequantize(GgmlType::Q8_0, &bytes);
        assert_eq!((out.len(), out[0], out[32]), (64, 3.0, 6.0));
    }

    #[test]
    fn refuses_unsupported_types_and_wrong_lengths() {
        let mut out = vec![0.0; 256];
        assert_eq!(
            dequantize_into(GgmlType::Q5_K, &[0; 176], &mut out),
            Err(DequantError::Unsupported(GgmlType::Q5_K))
        );
        assert_eq!(
            dequantize_into(GgmlType::Q8_0, &[0; 33], &mut out[..32]),
            Err(DequantError::LengthMismatch {
                ggml_type: GgmlType::Q8_0,
                elements: 32,
                expected: 34,
                actual: 33
            })
        );
        assert!(matches!(
            dequantize_into(GgmlType::Q4_K, &[0; 144], &mut out[..100]),
            Err(DequantError::PartialBlock { .. })
        ));
    }
}
