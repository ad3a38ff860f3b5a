//! llama.cpp's rotary-embedding row permutation of q/k projections, and its inverse.
//!
//! Hugging Face Llama rotates dimension `i` of a head together with `i + head_dim / 2`
//! ("rotate_half"); llama.cpp rotates adjacent pairs `(2i, 2i + 1)`. `convert_hf_to_gguf.py`
//! therefore reorders the output rows of `q_proj` / `k_proj` (and their biases) with
//! `w.reshape(n_head, 2, head_dim / 2, in).swapaxes(1, 2).reshape(w.shape)`:
//! GGUF row `h * head_dim + 2 * i + j` holds HF row `h * head_dim + j * head_dim / 2 + i`.

/// Checks that `rows` rows split into `n_head` heads of an even size, returning the head size.
fn head_dim(len: usize, row_len: usize, n_head: usize) -> Result<usize, String> {
    if row_len == 0 || !len.is_multiple_of(row_len) {
        return Err(format!("{len} elements do not form rows of {row_len}"));
    }
    let rows = len / row_len;
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        return Err(format!(
            "{rows} rows cannot be split into {n_head} heads of an even size"
        ));
    }
    Ok(rows / n_head)
}

/// Applies `f(gguf_row, hf_row)` for every row pair of the permutation.
fn for_each_row_pair(head_dim: usize, n_head: usize, mut f: impl FnMut(usize, usize)) {
    let half = head_dim / 2;
    for head in 0..n_head {
        let base = head * head_dim;
        for i in 0..half {
            for j in 0..2 {
                f(base + 2 * i + j, base + j * half + i);
            }
        }
    }
}

/// Undoes llama.cpp's permutation: `gguf` is a row-major `[n_head * head_dim, row_len]` matrix
/// (a GGUF `attn_q` / `attn_k` weight, or a bias with `row_len == 1`) and the result is the
/// Hugging Face `q_proj` / `k_proj` matrix of the same shape. `n_head` is the number of query
/// heads for q and of key/value heads for k.
pub fn unpermute_rope_rows(
    gguf: &[f32],
    row_len: usize,
    n_head: usize,
) -> Result<Vec<f32>, String> {
    let head_dim = head_dim(gguf.len(), row_len, n_head)?;
    let mut hf = vec![0.0; gguf.len()];
    for_each_row_pair(head_dim, n_head, |gguf_row, hf_row| {
        hf[hf_row * row_len..(hf_row + 1) * row_len]
            .copy_from_slice(&gguf[gguf_row * row_len..(gguf_row + 1) * row_len]);
    });
    Ok(hf)
}

/// llama.cpp's permutation itself (Hugging Face rows to GGUF rows); the inverse of
/// [`unpermute_rope_rows`], for writing test files and checking round trips.
pub fn permute_rope_rows(hf: &[f32], row_len: usize, n_head: usize) -> Result<Vec<f32>, String> {
    let head_dim = head_dim(hf.len(), row_len, n_head)?;
    let mut gguf = vec![0.0; hf.len()];
    for_each_row_pair(head_dim, n_head, |gguf_row, hf_row| {
        gguf[gguf_row * row_len..(gguf_row + 1) * row_len]
            .copy_from_slice(&hf[hf_row * row_len..(hf_row + 1) * row_len]);
    });
    Ok(gguf)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// numpy's `reshape(n_head, 2, half, in).swapaxes(1, 2).reshape(...)` written out with
    /// explicit indices, independently of `for_each_row_pair`.
    fn numpy_permute(hf: &[f32], row_len: usize, n_head: usize) -> Vec<f32> {
        let rows = hf.len() / row_len;
        let half = rows / n_head / 2;
        let mut out = Vec::with_capacity(hf.len());
        for h in 0..n_head {
            for i in 0..half {
                for j in 0..2 {
                    let source_row = (h * 2 + j) * half + i;
                    out.extend_from_slice(&hf[source_row * row_len..(source_row + 1) * row_len]);
                }
            }
        }
        out
    }

    #[test]
    fn permutation_interleaves_the_two_halves_of_each_head() {
        // One head of 4 rows, each row holding its own index: GGUF order is rows 0, 2, 1, 3.
        let hf = [0.0, 1.0, 2.0, 3.0];
        assert_eq!(permute_rope_rows(&hf, 1, 1).unwrap(), [0.0, 2.0, 1.0, 3.0]);
        // Two heads of 4: each head is interleaved separately.
        let hf: Vec<f32> = (0..8).map(|r| r as f32).collect();
        assert_eq!(
            permute_rope_rows(&hf, 1, 2).unwrap(),
            [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]
        );
    }

    #[test]
    fn unpermute_inverts_the_numpy_permutation() {
        let (n_head, head_dim, row_len) = (3, 8, 5);
        let hf: Vec<f32> = (0..n_head * head_dim * row_len)
            .map(|v| v as f32 * 0.5 - 7.0)
            .collect();
        let gguf = numpy_permute(&hf, row_len, n_head);
        assert_eq!(permute_rope_rows(&hf, row_len, n_head).unwrap(), gguf);
        assert_ne!(gguf, hf);
        assert_eq!(unpermute_rope_rows(&gguf, row_len, n_head).unwrap(), hf);
    }

    #[test]
    fn rejects_shapes_that_do_not_split_into_heads() {
        assert!(unpermute_rope_rows(&[0.0; 12], 2, 4).is_err()); // 6 rows, 4 heads
        assert!(unpermute_rope_rows(&[0.0; 6], 1, 2).is_err()); // head size 3 is odd
        assert!(unpermute_rope_rows(&[0.0; 7], 2, 1).is_err()); // not whole rows
    }
}
