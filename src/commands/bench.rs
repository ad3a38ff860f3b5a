//! `tandem bench-target`: target-only decode speed (time to first token, per-step decode time,
//! tokens/s) at several batch sizes, with device synchronisation before every clock read (a
//! token id is read back each step, as a real decoder must).

use std::time::Instant;

use clap::Args;
use tandem_model::burn::prelude::*;
use tandem_model::{LogitsFor, TapRequest, TargetTokenizer};

use super::ModelArgs;
use crate::with_backend;

#[derive(Args, Debug)]
pub struct BenchTargetArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length in tokens (the prompt is real text repeated to this length).
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Decode steps measured per run.
    #[arg(long, default_value_t = 64)]
    pub new_tokens: usize,
    /// Batch sizes to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub batch: Vec<usize>,
    /// Timed repetitions per batch size (after one warm-up run).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Debug, serde::Serialize)]
pub struct BenchRow {
    pub device: String,
    pub batch: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub ttft_ms_median: f64,
    pub step_ms_median: f64,
    pub tokens_per_second: f64,
}

pub fn run(args: BenchTargetArgs) -> anyhow::Result<()> {
    with_backend!(args.model.device, |B, device| run_on::<B>(&args, &device))
}

/// Medians of a decode benchmark (seconds): `repeats` timed runs after one warm-up, each a
/// fresh cache (not timed), a prefill returning the first greedy tokens (its time is the TTFT),
/// then `new_tokens` decode steps, each returning the next greedy tokens (a token id read back
/// per step, as a real decoder must). Returns (TTFT, decode step).
pub fn time_decode<C>(
    repeats: usize,
    new_tokens: usize,
    mut new_cache: impl FnMut() -> anyhow::Result<C>,
    mut prefill: impl FnMut(&mut C) -> anyhow::Result<Vec<u32>>,
    mut decode: impl FnMut(&mut C, &[u32]) -> anyhow::Result<Vec<u32>>,
) -> anyhow::Result<(f64, f64)> {
    let (mut ttfts, mut steps) = (Vec::new(), Vec::new());
    for rep in 0..=repeats {
        let mut cache = new_cache()?;
        let t0 = Instant::now();
        let mut next = prefill(&mut cache)?;
        let ttft = t0.elapsed().as_secs_f64();
        let mut step_times = Vec::with_capacity(new_tokens);
        for _ in 0..new_tokens {
            let t = Instant::now();
            next = decode(&mut cache, &next)?;
            step_times.push(t.elapsed().as_secs_f64());
        }
        if rep > 0 {
            ttfts.push(ttft);
            steps.push(median(&mut step_times));
        }
    }
    Ok((median(&mut ttfts), median(&mut steps)))
}

pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn greedy_ids<B: Backend>(logits: Tensor<B, 3>) -> Vec<u32> {
    let ids = logits.argmax(2).into_data().convert::<i64>();
    ids.as_slice::<i64>()
        .expect("ints")
        .iter()
        .map(|&i| i as u32)
        .collect()
}

fn run_on<B: Backend>(args: &BenchTargetArgs, device: &B::Device) -> anyhow::Result<()> {
    let started = Instant::now();
    let tokenizer = TargetTokenizer::load(&args.model.model)?;
    let model = args.model.load::<B>(device)?;
    let seed_text = "The history of mathematics spans thousands of years, from counting and \
                     geometry in ancient civilisations to the abstract structures of today. ";
    let seed = tokenizer.encode(seed_text, false)?;
    let prompt: Vec<u32> = seed
        .iter()
        .copied()
        .cycle()
        .take(args.prompt_tokens)
        .collect();
    let mut rows = Vec::new();
    let mut first_token_s = None;
    for &batch in &args.batch {
        let prompts: Vec<&[u32]> = (0..batch).map(|_| prompt.as_slice()).collect();
        let (ttft, step) = time_decode(
            args.repeats,
            args.new_tokens,
            || Ok(model.new_cache(batch, args.prompt_tokens + args.new_tokens + 1)),
            |cache| {
                let step = cache.prefill_step(&prompts)?;
                let out = model.forward(&step, cache, &TapRequest::none(), LogitsFor::Last)?;
                first_token_s.get_or_insert(started.elapsed().as_secs_f64());
                Ok(greedy_ids(out.logits.expect("logits")))
            },
            |cache, next| {
                let step = cache.decode_step(next)?;
                let out = model.forward(&step, cache, &TapRequest::none(), LogitsFor::Last)?;
                Ok(greedy_ids(out.logits.expect("logits")))
            },
        )?;
        let row = BenchRow {
            device: args.model.device.to_string(),
            batch,
            prompt_tokens: args.prompt_tokens,
            new_tokens: args.new_tokens,
            ttft_ms_median: ttft * 1e3,
            step_ms_median: step * 1e3,
            tokens_per_second: batch as f64 / step,
        };
        eprintln!("{row:?}");
        rows.push(row);
    }
    println!(
        "cold start (process start to first token): {:.1} s",
        first_token_s.unwrap_or(0.0)
    );
    println!("| device | batch | prompt | TTFT ms (median) | decode step ms (median) | tokens/s |");
    println!("|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.1} | {:.2} | {:.1} |",
            r.device,
            r.batch,
            r.prompt_tokens,
            r.ttft_ms_median,
            r.step_ms_median,
            r.tokens_per_second
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
    }
    Ok(())
}
