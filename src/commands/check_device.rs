//! `tandem check-device`: runs the same prompt through the CPU f32 path and the selected device
//! (CUDA bf16) and reports how far logits and every tap point differ, plus both greedy
//! continuations. This is the cross-device half of the parity story.

use clap::Args;
use tandem_model::backend::CpuBackend;
use tandem_model::burn::prelude::*;
use tandem_model::testing::rel_err;
use tandem_model::{GenerateOptions, LogitsFor, SamplingParams, TapRequest, TargetTokenizer};

use super::ModelArgs;
use crate::with_backend;

#[derive(Args, Debug)]
pub struct CheckDeviceArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value = "The capital of France is")]
    pub prompt: String,
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
}

struct Reference {
    logits: Vec<f32>,
    taps: Vec<Vec<f32>>,
    continuation: Vec<u32>,
}

fn run_reference<B: Backend>(
    args: &CheckDeviceArgs,
    device: &B::Device,
    prompt: &[u32],
) -> anyhow::Result<Reference> {
    let model = args.model.load::<B>(device)?;
    let mut cache = model.new_cache(1, prompt.len());
    let step = cache.prefill_step(&[prompt])?;
    let out = model.forward(
        &step,
        &mut cache,
        &TapRequest::all(model.spec.num_layers),
        LogitsFor::Last,
    )?;
    let to_f32 = |t: Tensor<B, 3>| {
        t.into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("floats")
    };
    let logits = to_f32(out.logits.expect("logits"));
    let taps = out.taps.tensors.into_iter().map(to_f32).collect();
    let options = GenerateOptions {
        max_new_tokens: args.max_tokens,
        sampling: SamplingParams::greedy(),
        stop_ids: Vec::new(),
        seed: 0,
    };
    let continuation = tandem_model::generate(&model, prompt, &options)?.tokens;
    Ok(Reference {
        logits,
        taps,
        continuation,
    })
}

pub fn run(args: CheckDeviceArgs) -> anyhow::Result<()> {
    let tokenizer = TargetTokenizer::load(&args.model.model)?;
    let prompt = tokenizer.encode(&args.prompt, true)?;
    let cpu = run_reference::<CpuBackend>(&args, &Default::default(), &prompt)?;
    let dev = with_backend!(args.model.device, |B, device| run_reference::<B>(
        &args, &device, &prompt
    ))?;
    let argmax = |v: &[f32]| tandem_model::sampling::argmax(v);
    println!("prompt: {:?}", args.prompt);
    println!(
        "cpu f32 continuation: {:?}",
        tokenizer.decode(&cpu.continuation, false)?
    );
    println!(
        "{} continuation: {:?}",
        args.model.device,
        tokenizer.decode(&dev.continuation, false)?
    );
    println!(
        "| quantity | max rel error ({} vs cpu f32) |",
        args.model.device
    );
    println!("|---|---|");
    println!(
        "| last-position logits | {:.2e} |",
        rel_err(&dev.logits, &cpu.logits)
    );
    let names: Vec<String> = TapRequest::all(cpu.taps.len() - 2)
        .taps
        .iter()
        .map(|t| t.to_string())
        .collect();
    let mut worst = 0f32;
    for ((name, d), c) in names.iter().zip(&dev.taps).zip(&cpu.taps) {
        let e = rel_err(d, c);
        worst = worst.max(e);
        if matches!(
            name.as_str(),
            "embed" | "block 0" | "block 14" | "block 29" | "final"
        ) {
            println!("| tap {name} | {e:.2e} |");
        }
    }
    println!("| worst tap | {worst:.2e} |");
    println!(
        "| argmax agrees | {} |",
        argmax(&dev.logits) == argmax(&cpu.logits)
    );
    let same = cpu
        .continuation
        .iter()
        .zip(&dev.continuation)
        .take_while(|(a, b)| a == b)
        .count();
    println!(
        "| greedy tokens identical | {same} of {} |",
        cpu.continuation.len()
    );
    Ok(())
}
