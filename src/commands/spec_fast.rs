//! `tandem bench --device cuda`: the speculative loop on the CUDA fast path (target and head in
//! `tandem-cuda`, host logic shared with the burn engine) next to fast-path target-only
//! decoding of the same prompts, batch for batch, in the same process.

use std::time::Instant;

use anyhow::Context;
use tandem_cuda::{CudaDraft, CudaTarget, Gpu};
use tandem_infer::{AcceptanceStats, FastSpecEngine, Timings, fast_target_generate};
use tandem_model::{LogitsFor, SamplingParams, TapRequest, TargetTokenizer};

use super::ModelArgs;
use super::spec::{
    BenchArgs, BenchReport, Comparison, SpecArgs, SpecRequest, chat_prompts, checked_taps,
    compare_outputs, print_acceptance, print_report, write_json,
};

/// The fast path's target and head, loaded and wiring-checked.
struct FastLoaded {
    gpu: std::sync::Arc<Gpu>,
    target: CudaTarget,
    draft: CudaDraft,
    taps: TapRequest,
}

fn load(model: &ModelArgs, spec: &SpecArgs) -> anyhow::Result<FastLoaded> {
    let gpu = Gpu::new(0)?;
    let target = CudaTarget::load(&model.model, gpu.clone())
        .with_context(|| format!("loading {} on the fast path", model.model.display()))?;
    let head = tandem_eagle::load_host(&spec.draft)
        .with_context(|| format!("loading the head {}", spec.draft.display()))?;
    let taps = checked_taps(
        &model.model,
        spec,
        &head.config,
        target.spec.num_layers,
        "bf16",
        "cuda",
    )?;
    let draft = CudaDraft::new(&target, head.spec, head.vocab, &head.weights)?;
    Ok(FastLoaded {
        gpu,
        target,
        draft,
        taps,
    })
}

/// `tandem generate --draft --device cuda`: one prompt through the fast path's speculative loop.
pub fn generate(
    model: &ModelArgs,
    spec: &SpecArgs,
    request: &SpecRequest,
) -> anyhow::Result<Vec<u32>> {
    let loaded = load(model, spec)?;
    let engine = FastSpecEngine {
        target: &loaded.target,
        draft: &loaded.draft,
        taps: loaded.taps,
        config: spec.config(request.sampling, request.seed),
    };
    let start = Instant::now();
    let out = engine.generate(
        std::slice::from_ref(&request.prompt),
        request.max_tokens,
        &request.stop_ids,
    )?;
    let seconds = start.elapsed().as_secs_f64();
    let seq = &out.sequences[0];
    eprintln!(
        "speculative (fast path on {}): {} tokens in {:.2}s ({:.1} tok/s), finish {:?}",
        loaded.gpu.name(),
        seq.tokens.len(),
        seconds,
        seq.tokens.len() as f64 / seconds,
        seq.finish
    );
    print_acceptance(&seq.stats);
    Ok(seq.tokens.clone())
}

pub fn bench(args: &BenchArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let FastLoaded {
        gpu,
        target,
        draft,
        taps,
    } = load(&args.model, &args.spec)?;
    let tokenizer = TargetTokenizer::load(&args.model.model)?;
    let prompts = chat_prompts(args, &tokenizer)?;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
    };
    let config = args.spec.config(sampling, args.seed);
    let stop = tokenizer.eos_ids.clone();
    let engine = FastSpecEngine {
        target: &target,
        draft: &draft,
        taps,
        config,
    };
    // Warm-up: cuBLAS picks its kernels on first use.
    engine.generate(&prompts[..1], 8, &stop)?;
    fast_target_generate(&target, &prompts[..1], 8, &stop, sampling, args.seed)?;
    eprintln!(
        "fast path on {}: loaded and warmed up in {:.2}s; {} prompts, batch {}",
        gpu.name(),
        started.elapsed().as_secs_f64(),
        prompts.len(),
        args.batch
    );

    let batch = args.batch.max(1);
    let mut baseline: Vec<Vec<u32>> = Vec::new();
    let (mut target_tokens, mut target_seconds) = (0usize, 0f64);
    if !args.no_baseline {
        for (c, chunk) in prompts.chunks(batch).enumerate() {
            let start = Instant::now();
            let out = fast_target_generate(
                &target,
                chunk,
                args.max_new_tokens,
                &stop,
                sampling,
                args.seed.wrapping_add((c * batch) as u64),
            )?;
            target_seconds += start.elapsed().as_secs_f64();
            for seq in out {
                target_tokens += seq.tokens.len();
                baseline.push(seq.tokens);
            }
        }
    }
    let mut stats = AcceptanceStats::new(config.num_steps);
    let mut timings = Timings::default();
    let (mut spec_tokens, mut spec_seconds) = (0usize, 0f64);
    let mut outputs = Vec::new();
    for (c, chunk) in prompts.chunks(batch).enumerate() {
        let engine = FastSpecEngine {
            config: tandem_infer::SpecConfig {
                seed: args.seed.wrapping_add((c * batch) as u64),
                ..config
            },
            taps: engine.taps.clone(),
            ..engine
        };
        let start = Instant::now();
        let out = engine.generate(chunk, args.max_new_tokens, &stop)?;
        spec_seconds += start.elapsed().as_secs_f64();
        timings += out.timings;
        for seq in out.sequences {
            spec_tokens += seq.tokens.len();
            stats.merge(&seq.stats);
            outputs.push(seq.tokens);
        }
    }
    let comparison = if sampling.is_greedy() && !baseline.is_empty() {
        compare_outputs(&outputs, &baseline, &prompts, |context| {
            let mut cache = target.new_cache(1, context.len() + 1)?;
            let step = cache.layout().prefill_step(&[context])?;
            let out = target.forward(&step, &mut cache, &TapRequest::none(), LogitsFor::Last)?;
            Ok(out.logits.expect("asked for logits").to_host()?)
        })?
    } else {
        Comparison::default()
    };
    let per_second = |tokens: usize, seconds: f64| tokens as f64 / seconds.max(1e-9);
    let report = BenchReport {
        prompts: prompts.len(),
        config,
        batch,
        target_tokens,
        target_seconds,
        target_tokens_per_second: per_second(target_tokens, target_seconds),
        spec_tokens,
        spec_seconds,
        spec_tokens_per_second: per_second(spec_tokens, spec_seconds),
        speedup: per_second(spec_tokens, spec_seconds) / per_second(target_tokens, target_seconds),
        accept_length: stats.accept_length(),
        per_position: stats.per_position(),
        identical_outputs: comparison.identical,
        compared_outputs: baseline.len().min(outputs.len()),
        first_mismatch: comparison.first_mismatch,
        mismatches: comparison.mismatches,
        timings,
    };
    print_report(&report, "cuda fast path");
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}
