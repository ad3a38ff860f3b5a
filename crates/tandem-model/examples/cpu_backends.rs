//! The CPU backends on the real model: SmolLM2-135M-Instruct, f32, target-only greedy
//! generation of the same chat prompt on burn-flex (`CpuBackend`, what `--device cpu` runs) and
//! on burn-ndarray (the CPU backend until session 39, the baseline), in the same run. Prints the
//! load time, the median prefill time and decode tokens/s over `REPEATS` generations each, and
//! whether both backends produced the same greedy tokens.
//!
//! ```sh
//! scripts/fetch_smollm2.sh
//! cargo run --release -p tandem-model --example cpu_backends -- [MODEL_DIR] [NEW_TOKENS] [REPEATS]
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::backend::Backend;
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

fn measure<B: Backend>(dir: &Path, prompt: &[u32], new_tokens: usize, repeats: usize) -> Measured {
    let start = Instant::now();
    let model = TargetModel::<B>::load(dir, &Default::default()).expect("the model loads");
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
    let flex = measure::<tandem_model::backend::CpuBackend>(&dir, &prompt, new_tokens, repeats);
    let ndarray = measure::<burn::backend::NdArray<f32>>(&dir, &prompt, new_tokens, repeats);
    println!("| backend | load s | prefill ms | decode tok/s |");
    println!("|---|---|---|---|");
    for (name, m) in [
        ("burn-flex (CpuBackend)", &flex),
        ("burn-ndarray", &ndarray),
    ] {
        println!(
            "| {name} | {:.2} | {:.1} | {:.2} |",
            m.load_seconds, m.prefill_ms, m.decode_tokens_per_second
        );
    }
    println!(
        "decode speed-up {:.2}x, prefill speed-up {:.2}x; same greedy tokens: {}",
        flex.decode_tokens_per_second / ndarray.decode_tokens_per_second,
        ndarray.prefill_ms / flex.prefill_ms,
        flex.tokens == ndarray.tokens
    );
}
