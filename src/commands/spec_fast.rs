//! `tandem bench --device cuda`: the speculative loop on the CUDA fast path (target and head in
//! `tandem-cuda`, host logic shared with the burn engine) next to fast-path target-only
//! decoding of the same prompts, batch for batch, in the same process.

use std::time::Instant;

use anyhow::Context;
use tandem_cuda::{CudaDraft, CudaTarget, Gpu};
use tandem_infer::{FastSpecEngine, fast_target_generate};
use tandem_model::{LogitsFor, TapRequest, TargetTokenizer};

use super::ModelArgs;
use super::spec::{
    BenchArgs, SpecArgs, SpecRequest, chat_prompts, checked_taps, generate_and_report,
    measure_bench,
};

/// The fast path's target and head, loaded and wiring-checked.
struct FastLoaded {
    gpu: std::sync::Arc<Gpu>,
    target: CudaTarget,
    draft: CudaDraft,
    taps: TapRequest,
}

fn load(model: &ModelArgs, spec: &SpecArgs) -> anyhow::Result<FastLoaded> {
    let (gpu, target) = load_target(model)?;
    let head = tandem_eagle::load_host(&spec.draft)
        .with_context(|| format!("loading the head {}", spec.draft.display()))?;
    let taps = checked_taps(
        &model.model,
        spec,
        &head.config,
        &target.spec.architecture,
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

/// The fast path's target: on GPU 0, or with `--tp N` split over GPUs 0..N (one thread a rank,
/// NCCL all-reduces; `TANDEM_CUDA_TP_SIMULATE=1` puts every rank on GPU 0 with host sums, for
/// tests). Returns rank 0's GPU, where the head, the taps and the logits live.
pub fn load_target(model: &ModelArgs) -> anyhow::Result<(std::sync::Arc<Gpu>, CudaTarget)> {
    let target =
        CudaTarget::load_ranks(&model.model, model.tp).with_context(|| match model.tp {
            1 => format!("loading {} on the fast path", model.model.display()),
            n => format!(
                "loading {} on the fast path over {n} tensor-parallel ranks (GPUs 0..{n})",
                model.model.display()
            ),
        })?;
    Ok((target.gpu().clone(), target))
}

/// `tandem serve --device cuda`: the fast path's decoder, speculative or (`no_draft`) the
/// target alone, with continuous batching of up to `max_batch` sequences. `adaptive`: the
/// shapes the speculation policy chooses among (its start-up cost table is measured at the
/// CUDA graphs' batch sizes up to `max_batch`).
pub fn serve_decoder(
    model: &ModelArgs,
    spec: &SpecArgs,
    no_draft: bool,
    context: usize,
    max_batch: usize,
    adaptive: Option<Vec<tandem_infer::Shape>>,
) -> anyhow::Result<tandem_serve::FastDecoder> {
    // Sampling and seed are per request; the engine's own are unused by the server.
    let config = spec.config(tandem_model::SamplingParams::greedy(), 0);
    if no_draft {
        let (_, target) = load_target(model)?;
        return Ok(tandem_serve::FastDecoder::new(
            target,
            None,
            TapRequest::none(),
            config,
            context,
            None,
            max_batch,
        )?);
    }
    let FastLoaded {
        target,
        draft,
        taps,
        ..
    } = load(model, spec)?;
    let Some(shapes) = adaptive else {
        return Ok(tandem_serve::FastDecoder::new(
            target,
            Some(draft),
            taps,
            config,
            context,
            None,
            max_batch,
        )?);
    };
    let gpu = target.gpu().clone();
    // Rounds are plain until the costs are measured on the decoder's own caches.
    let forced =
        tandem_infer::SpeculationPolicy::forced(shapes.clone(), tandem_infer::Choice::Plain);
    let mut decoder = tandem_serve::FastDecoder::new(
        target,
        Some(draft),
        taps,
        config,
        context,
        Some(forced),
        max_batch,
    )?;
    // Every batch size the CUDA graphs are captured for (so they are all captured now, on the
    // decoder's own caches), and the largest batch.
    let mut batches: Vec<usize> = tandem_cuda::GRAPH_BATCHES
        .iter()
        .copied()
        .filter(|&b| b < max_batch)
        .collect();
    batches.push(max_batch.max(1));
    super::serve::calibrate_policy(&mut decoder, &batches, &shapes)?;
    let (before, after) = gpu.release_unused_memory()?;
    eprintln!(
        "speculation policy: the measurement's scratch memory released ({:.2} GiB of the memory \
         pool kept, {:.2} GiB before)",
        after as f64 / (1u64 << 30) as f64,
        before as f64 / (1u64 << 30) as f64
    );
    Ok(decoder)
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
        draft: Some(&loaded.draft),
        taps: loaded.taps,
        config: spec.config(request.sampling, request.seed),
    };
    let label = format!("speculative (fast path on {})", loaded.gpu.name());
    generate_and_report(&engine, request, &label)
}

/// `tandem generate --device cuda` without `--draft`: the target alone on the CUDA fast path,
/// which every build has (burn-cuda, the other `--device cuda` backend, needs `--features
/// cuda`).
pub fn generate_target_only(model: &ModelArgs, request: &SpecRequest) -> anyhow::Result<Vec<u32>> {
    let (gpu, target) = load_target(model)?;
    let start = Instant::now();
    let out = fast_target_generate(
        &target,
        std::slice::from_ref(&request.prompt),
        request.max_tokens,
        &request.stop_ids,
        request.sampling,
        request.seed,
    )?;
    let seconds = start.elapsed().as_secs_f64();
    let seq = out.into_iter().next().expect("one prompt, one output");
    eprintln!(
        "target only (fast path on {}): {} tokens in {:.2}s ({:.1} tok/s), finish {:?}",
        gpu.name(),
        seq.tokens.len(),
        seconds,
        seq.tokens.len() as f64 / seconds,
        seq.finish
    );
    Ok(seq.tokens)
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
    let sampling = args.sampling();
    let config = args.spec.config(sampling, args.seed);
    let stop = tokenizer.eos_ids.clone();
    let engine = FastSpecEngine {
        target: &target,
        draft: Some(&draft),
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

    let seed_of = |first: usize| args.seed.wrapping_add(first as u64);
    let report = measure_bench(
        args,
        &prompts,
        config,
        "cuda fast path",
        |chunk, first| {
            let out = fast_target_generate(
                &target,
                chunk,
                args.max_new_tokens,
                &stop,
                sampling,
                seed_of(first),
            )?;
            Ok(out.into_iter().map(|seq| seq.tokens).collect())
        },
        |chunk, first| {
            let engine = FastSpecEngine {
                target: engine.target,
                draft: engine.draft,
                taps: engine.taps.clone(),
                config: tandem_infer::SpecConfig {
                    seed: seed_of(first),
                    ..config
                },
            };
            Ok(engine.generate_with(chunk, args.max_new_tokens, &stop, args.phase_timing)?)
        },
        |context| {
            let mut cache = target.new_cache(1, context.len() + 1)?;
            let step = cache.layout().prefill_step(&[context])?;
            let out = target.forward(&step, &mut cache, &TapRequest::none(), LogitsFor::Last)?;
            Ok(out.logits.expect("asked for logits").to_host()?)
        },
    );
    // Graphs captured against replays: each prompt's caches reuse the pooled buffers of the
    // one before, so captures should stay at a handful while replays grow with the rounds.
    eprintln!(
        "graphs: target {:?}, head {:?}; idle KV buffer sets {}",
        target.graph_stats(),
        draft.graph_stats(),
        gpu.idle_kv_sets()
    );
    report
}
