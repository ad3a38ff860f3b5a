//! The CPU backends on the real model: SmolLM2-135M-Instruct, f32, target-only greedy
//! generation of the same chat prompt on burn-flex (`CpuBackend`, what `--device cpu` runs) with
//! the weights as loaded (HF's `[out, in]` layout, seen transposed), on burn-flex with every
//! weight copied to `[in, out]` (the layout until session 40), and on burn-ndarray (the CPU
//! backend until session 39), in the same run. Prints the load time, the median prefill time
//! and decode tokens/s over `REPEATS` generations each, and whether all three produced the same
//! greedy tokens.
//!
//! ```sh
//! scripts/fetch_smollm2.sh
//! cargo run --release -p tandem-model --example cpu_backends -- [MODEL_DIR] [NEW_TOKENS] [REPEATS]
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use tandem_model::model::{FeedForward, Linear, SelfAttention};
use tandem_model::{
    ChatMessage, GenerateOptions, SamplingParams, TargetModel, TargetTokenizer, generate,
};

struct Measured {
    load_seconds: f64,
    prefill_ms: f64,
    decode_tokens_per_second: f64,
    tokens: Vec<u32>,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A contiguous `[rows, cols]` copy of a (possibly transposed) matrix.
fn contiguous<B: Backend>(t: &Tensor<B, 2>) -> Tensor<B, 2> {
    Tensor::from_data(t.to_data(), &t.device())
}

/// Every product's weight (and the lm_head) copied to a contiguous `[in, out]` matrix, as the
/// loader kept them until session 40: the baseline of the layout change.
fn copy_weights_in_out<B: Backend>(model: &mut TargetModel<B>) {
    let copy = |l: &mut Linear<B>| l.weight_t = contiguous(&l.weight_t);
    for layer in &mut model.layers {
        match &mut layer.self_attn {
            SelfAttention::Grouped(a) => {
                for l in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj] {
                    copy(l);
                }
            }
            SelfAttention::Latent(_) => panic!("the example copies grouped attention only"),
        }
        match &mut layer.mlp {
            FeedForward::Dense(m) => {
                for l in [&mut m.gate_proj, &mut m.up_proj, &mut m.down_proj] {
                    copy(l);
                }
            }
            FeedForward::Experts(_) => panic!("the example copies dense MLPs only"),
        }
    }
    model.lm_head_t = contiguous(&model.lm_head_t);
}

fn measure<B: Backend>(
    dir: &Path,
    prompt: &[u32],
    new_tokens: usize,
    repeats: usize,
    in_out_copies: bool,
) -> Measured {
    let start = Instant::now();
    let mut model = TargetModel::<B>::load(dir, &Default::default()).expect("the model loads");
    if in_out_copies {
        copy_weights_in_out(&mut model);
    }
    let load_seconds = start.elapsed().as_secs_f64();
    let options = GenerateOptions {
        max_new_tokens: new_tokens,
        sampling: SamplingParams::greedy(),
        stop_ids: Vec::new(),
        seed: 0,
    };
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut tokens = Vec::new();
    for _ in 0..repeats {
        let generation = generate(&model, prompt, &options).expect("generation runs");
        prefill.push(generation.time_to_first_token * 1e3);
        decode.push(generation.decode_tokens_per_second());
        tokens = generation.tokens;
    }
    Measured {
        load_seconds,
        prefill_ms: median(prefill),
        decode_tokens_per_second: median(decode),
        tokens,
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .unwrap_or_else(|| "models/SmolLM2-135M-Instruct".into()),
    );
    let new_tokens: usize = args.next().map_or(64, |a| a.parse().expect("NEW_TOKENS"));
    let repeats: usize = args.next().map_or(3, |a| a.parse().expect("REPEATS"));
    let tokenizer = TargetTokenizer::load(&dir).expect("the tokenizer loads");
    let prompt = tokenizer
        .encode_chat(
            &[ChatMessage::new(
                "user",
                "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting \
                 cultural experiences and must-see attractions.",
            )],
            true,
        )
        .expect("the chat template renders");
    println!(
        "SmolLM2 at {}: prompt {} tokens, {new_tokens} new tokens, greedy, median of {repeats}",
        dir.display(),
        prompt.len()
    );
    type Flex = tandem_model::backend::CpuBackend;
    let flex = measure::<Flex>(&dir, &prompt, new_tokens, repeats, false);
    let flex_copies = measure::<Flex>(&dir, &prompt, new_tokens, repeats, true);
    let ndarray = measure::<burn::backend::NdArray<f32>>(&dir, &prompt, new_tokens, repeats, false);
    println!("| backend | load s | prefill ms | decode tok/s |");
    println!("|---|---|---|---|");
    for (name, m) in [
        ("burn-flex (CpuBackend), HF layout", &flex),
        ("burn-flex, [in, out] copies", &flex_copies),
        ("burn-ndarray", &ndarray),
    ] {
        println!(
            "| {name} | {:.2} | {:.1} | {:.2} |",
            m.load_seconds, m.prefill_ms, m.decode_tokens_per_second
        );
    }
    println!(
        "decode speed-up {:.2}x over ndarray and {:.2}x over the [in, out] copies, prefill \
         speed-up {:.2}x and {:.2}x; same greedy tokens: {}",
        flex.decode_tokens_per_second / ndarray.decode_tokens_per_second,
        flex.decode_tokens_per_second / flex_copies.decode_tokens_per_second,
        ndarray.prefill_ms / flex.prefill_ms,
        flex_copies.prefill_ms / flex.prefill_ms,
        flex.tokens == ndarray.tokens && flex.tokens == flex_copies.tokens
    );
}
