//! `tandem generate --draft` and `tandem bench`: the speculative loop from the command line.
//! Loading a head checks its wiring manifest against what serving will tap and refuses to go
//! on when they differ (unless `--allow-wiring-mismatch`, for experiments).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use tandem_infer::wiring::{check_head, read_head_taps, serving_manifest};
use tandem_infer::{AcceptanceStats, SpecConfig, SpecEngine, SpecGenerate};
use tandem_model::burn::prelude::Backend;
use tandem_model::{ChatMessage, SamplingParams, TapRequest, TargetModel, TargetTokenizer};

use super::ModelArgs;
use crate::with_backend;

/// Where the committed SmolLM2 head lives.
pub const DEFAULT_HEAD_DIR: &str = "heads/smollm2-135m-eagle3";

/// SGLang's speculative knobs.
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// EAGLE-3 head directory (config.json + model.safetensors; Tandem, SpecForge or EAGLE).
    #[arg(long, default_value = DEFAULT_HEAD_DIR)]
    pub draft: PathBuf,
    /// Draft depth (SGLang --speculative-num-steps).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Branching (SGLang --speculative-eagle-topk); 1 = chain.
    #[arg(long, default_value_t = 1)]
    pub topk: usize,
    /// Tree size verified (SGLang --speculative-num-draft-tokens); default steps + 1 for a
    /// chain, 8 for a tree.
    #[arg(long)]
    pub num_draft_tokens: Option<usize>,
    /// Serve even when the head's wiring differs from the serving taps (experiments only).
    #[arg(long)]
    pub allow_wiring_mismatch: bool,
    /// For a head without a Tandem manifest: the convention its
    /// eagle_aux_hidden_state_layer_ids are written in (sglang-classic, sglang-heuristic, vllm,
    /// hf, eagle, specforge). Default: as the engine that reads the ids' place does
    /// (eagle_config: SGLang for the target's family; top level: vLLM).
    #[arg(long)]
    pub convention: Option<tandem_wiring::Convention>,
}

/// `--num-draft-tokens` when not given: the whole chain (steps + 1) for topk 1, SGLang's
/// default of 8 for a tree.
pub fn default_num_draft_tokens(steps: usize, topk: usize) -> usize {
    if topk == 1 { steps + 1 } else { 8 }
}

impl SpecArgs {
    pub fn config(&self, sampling: SamplingParams, seed: u64) -> SpecConfig {
        SpecConfig {
            num_steps: self.steps,
            topk: self.topk,
            num_draft_tokens: self
                .num_draft_tokens
                .unwrap_or(default_num_draft_tokens(self.steps, self.topk)),
            sampling,
            seed,
        }
    }
}

/// A target and head loaded and wiring-checked.
pub struct Loaded<B: Backend> {
    pub tokenizer: TargetTokenizer,
    pub target: TargetModel<B>,
    pub head: tandem_eagle::LoadedHead<B>,
    pub taps: TapRequest,
}

pub fn load<B: Backend>(
    model: &ModelArgs,
    spec: &SpecArgs,
    device: &B::Device,
) -> anyhow::Result<Loaded<B>> {
    let tokenizer = TargetTokenizer::load(&model.model)?;
    let target = model.load::<B>(device)?;
    let head = tandem_eagle::load_pretrained(&spec.draft, target.embed_tokens.clone(), device)
        .with_context(|| format!("loading the head {}", spec.draft.display()))?;
    let dtype = if model.device.to_string() == "cuda" {
        "bf16"
    } else {
        "f32"
    };
    let taps = checked_taps(
        &model.model,
        spec,
        &head.config,
        &target.spec.architecture,
        target.spec.num_layers,
        dtype,
        &model.device.to_string(),
    )?;
    Ok(Loaded {
        tokenizer,
        target,
        head,
        taps,
    })
}

/// The taps serving feeds the head, said out loud (where they came from, and for a foreign
/// head what every other convention would read), after checking the head's manifest against
/// them (and the target's fingerprints): a mismatch stops here unless `--allow-wiring-mismatch`.
pub fn checked_taps(
    model_dir: &Path,
    spec: &SpecArgs,
    config: &tandem_eagle::Eagle3Config,
    architecture: &str,
    num_layers: usize,
    dtype: &str,
    device: &str,
) -> anyhow::Result<TapRequest> {
    if spec.convention.is_some() && config.tandem_wiring.is_some() {
        eprintln!("wiring: --convention ignored: the head's Tandem manifest names its taps");
    }
    let reading = read_head_taps(config, architecture, num_layers, spec.convention)?;
    for line in reading.describe(num_layers) {
        eprintln!("wiring: {line}");
    }
    let taps = reading.taps;
    let serving = serving_manifest(model_dir, taps.clone(), dtype, device)?;
    let mismatches = check_head(config, &serving)?;
    let fatal: Vec<_> = mismatches.iter().filter(|m| m.is_fatal()).collect();
    for m in &mismatches {
        eprintln!("wiring: {m}");
    }
    if !fatal.is_empty() && !spec.allow_wiring_mismatch {
        anyhow::bail!(
            "the head {} was not trained on what serving would feed it ({} mismatch(es) above); \
             fix the wiring or pass --allow-wiring-mismatch to experiment",
            spec.draft.display(),
            fatal.len()
        );
    }
    Ok(TapRequest::new(taps))
}

pub fn print_acceptance(stats: &AcceptanceStats) {
    let per_position: Vec<String> = stats
        .per_position()
        .iter()
        .map(|p| format!("{p:.3}"))
        .collect();
    eprintln!(
        "accept length {:.3} over {} rounds; per-position acceptance [{}]",
        stats.accept_length(),
        stats.rounds,
        per_position.join(", ")
    );
}

/// One prompt for `tandem generate --draft`.
#[derive(Debug, Clone)]
pub struct SpecRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub seed: u64,
    pub max_tokens: usize,
    pub stop_ids: Vec<u32>,
}

/// `tandem generate --draft ...`: one prompt through the speculative loop.
pub fn generate<B: Backend>(
    model: &ModelArgs,
    spec: &SpecArgs,
    request: &SpecRequest,
    device: &B::Device,
) -> anyhow::Result<Vec<u32>> {
    let loaded = load::<B>(model, spec, device)?;
    let engine = SpecEngine {
        target: &loaded.target,
        draft: Some(&loaded.head.draft),
        taps: loaded.taps.clone(),
        config: spec.config(request.sampling, request.seed),
    };
    generate_and_report(&engine, request, "speculative")
}

/// Generates `request`'s prompt with `engine` (burn or the CUDA fast path), prints the speed
/// and acceptance under `label`, and returns the tokens.
pub fn generate_and_report(
    engine: &dyn SpecGenerate,
    request: &SpecRequest,
    label: &str,
) -> anyhow::Result<Vec<u32>> {
    let start = Instant::now();
    let out = engine.generate(
        std::slice::from_ref(&request.prompt),
        request.max_tokens,
        &request.stop_ids,
    )?;
    let seconds = start.elapsed().as_secs_f64();
    let seq = &out.sequences[0];
    eprintln!(
        "{label}: {} tokens in {:.2}s ({:.1} tok/s), finish {:?}",
        seq.tokens.len(),
        seconds,
        seq.tokens.len() as f64 / seconds,
        seq.finish
    );
    print_acceptance(&seq.stats);
    Ok(seq.tokens.clone())
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Prompt set: mtbench, humaneval (first turns, chat template), or a JSONL/JSON path.
    #[arg(long, default_value = "mtbench")]
    pub prompts: String,
    /// Where datasets were fetched (scripts/fetch_datasets.sh).
    #[arg(long, default_value = "data")]
    pub data_root: PathBuf,
    /// Use only the first N prompts.
    #[arg(long)]
    pub max_prompts: Option<usize>,
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Skip the target-only baseline.
    #[arg(long)]
    pub no_baseline: bool,
    /// Wait for the device after each phase of a speculative round (draft, verify, extend) so
    /// that the time split is each phase's device time. The waits slow the rounds down: measure
    /// throughput without this flag.
    #[arg(long)]
    pub phase_timing: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Alternate the two runs batch by batch (target-only, then speculative, on each batch of
    /// prompts) instead of all target-only batches first: a drift of the device's speed
    /// during the bench (clocks, another tenant) then falls on both sides alike.
    #[arg(long)]
    pub interleave: bool,
    /// auto (the CUDA fast path on --device cuda, burn on cpu), burn, or fast.
    #[arg(long, default_value = "auto")]
    pub engine: EngineKind,
}

impl BenchArgs {
    pub fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
        }
    }
}

/// Which implementation of the target and head runs the speculative loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineKind {
    Auto,
    Burn,
    Fast,
}

#[derive(Debug, serde::Serialize)]
pub struct BenchReport {
    pub prompts: usize,
    pub config: SpecConfig,
    pub batch: usize,
    pub target_tokens: usize,
    pub target_seconds: f64,
    /// `None` with `--no-baseline` (written as `null`).
    pub target_tokens_per_second: Option<f64>,
    pub spec_tokens: usize,
    pub spec_seconds: f64,
    pub spec_tokens_per_second: f64,
    /// Speculative over target-only tokens/s; `None` with `--no-baseline`.
    pub speedup: Option<f64>,
    /// Standard error of `speedup` over the batches of prompts, each timed both ways
    /// (`tandem_infer::speedup_se`); `None` without a baseline or below two batches.
    pub speedup_se: Option<f64>,
    /// Whether the two runs alternated batch by batch (`--interleave`).
    pub interleaved: bool,
    pub accept_length: f64,
    /// Standard error of the accept length: the larger of the per-round and the per-prompt
    /// estimate (`tandem_infer::accept_length_se`); `None` below two rounds.
    pub accept_length_se: Option<f64>,
    pub per_position: Vec<f64>,
    /// Standard error of each position's acceptance, the same way (`position_se`).
    pub per_position_se: Vec<Option<f64>>,
    pub identical_outputs: usize,
    pub compared_outputs: usize,
    pub first_mismatch: Option<String>,
    /// Every greedy mismatch, traced to the target's logits at the divergence.
    pub mismatches: Vec<MismatchTrace>,
    pub timings: tandem_infer::Timings,
    /// Whether each phase waited for its device work (`--phase-timing`): then `timings`
    /// splits rounds by device time, and the tok/s above include the waits.
    pub phase_timing: bool,
}

pub fn run_bench(args: BenchArgs) -> anyhow::Result<()> {
    let cuda = args.model.device.to_string() == "cuda";
    match args.engine {
        EngineKind::Fast | EngineKind::Auto if cuda => super::spec_fast::bench(&args),
        EngineKind::Fast => anyhow::bail!("--engine fast runs on the GPU: pass --device cuda"),
        _ => with_backend!(args.model.device, |B, device| bench_on::<B>(&args, &device)),
    }
}

pub fn chat_prompts(
    args: &BenchArgs,
    tokenizer: &TargetTokenizer,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let prompts = tandem_data::eval_prompts(&args.prompts, &args.data_root)
        .with_context(|| format!("reading prompts {}", args.prompts))?;
    let limit = args.max_prompts.unwrap_or(prompts.len());
    prompts
        .iter()
        .take(limit)
        .map(|p| {
            let first = p.turns.first().cloned().unwrap_or_default();
            Ok(tokenizer.encode_chat(&[ChatMessage::new("user", first)], true)?)
        })
        .collect()
}

fn bench_on<B: Backend>(args: &BenchArgs, device: &B::Device) -> anyhow::Result<()> {
    let loaded = load::<B>(&args.model, &args.spec, device)?;
    let prompts = chat_prompts(args, &loaded.tokenizer)?;
    let sampling = args.sampling();
    let config = args.spec.config(sampling, args.seed);
    let stop = loaded.tokenizer.eos_ids.clone();
    let engine = SpecEngine {
        target: &loaded.target,
        draft: Some(&loaded.head.draft),
        taps: loaded.taps.clone(),
        config,
    };
    // Warm-up (first kernels compile on GPU).
    engine.generate(&[prompts[0].clone()], 8, &stop)?;

    let label = args.model.device.to_string();
    measure_bench(
        args,
        &prompts,
        config,
        &label,
        |chunk, _| {
            chunk
                .iter()
                .map(|p| {
                    let options = tandem_model::GenerateOptions {
                        max_new_tokens: args.max_new_tokens,
                        sampling,
                        stop_ids: stop.clone(),
                        seed: args.seed,
                    };
                    Ok(tandem_model::generate(&loaded.target, p, &options)?.tokens)
                })
                .collect()
        },
        |chunk, _| {
            Ok(engine.generate_with(chunk, args.max_new_tokens, &stop, args.phase_timing)?)
        },
        |context| target_logits(&loaded.target, context),
    )
}

/// The measurement both engines share: target-only decoding of every batch of `prompts`
/// (`baseline(chunk, first prompt index)`), then speculative decoding of the same batches
/// (`speculative`), each timed; greedy outputs compared and every difference traced with
/// `logits_after`; the table printed and the JSON written.
pub fn measure_bench(
    args: &BenchArgs,
    prompts: &[Vec<u32>],
    config: SpecConfig,
    label: &str,
    mut baseline: impl FnMut(&[Vec<u32>], usize) -> anyhow::Result<Vec<Vec<u32>>>,
    mut speculative: impl FnMut(&[Vec<u32>], usize) -> anyhow::Result<tandem_infer::BatchOutput>,
    logits_after: impl FnMut(&[u32]) -> anyhow::Result<Vec<f32>>,
) -> anyhow::Result<()> {
    let batch = args.batch.max(1);
    let chunks: Vec<&[Vec<u32>]> = prompts.chunks(batch).collect();
    // (speculative?, batch index) in the order they run.
    let baseline_runs = (!args.no_baseline).then_some(false);
    let order: Vec<(bool, usize)> = if args.interleave {
        (0..chunks.len())
            .flat_map(|c| baseline_runs.into_iter().chain([true]).map(move |s| (s, c)))
            .collect()
    } else {
        baseline_runs
            .into_iter()
            .flat_map(|s| (0..chunks.len()).map(move |c| (s, c)))
            .chain((0..chunks.len()).map(|c| (true, c)))
            .collect()
    };
    let mut reference: Vec<Vec<u32>> = Vec::new();
    let (mut target_tokens, mut target_seconds) = (0usize, 0f64);
    let mut stats = AcceptanceStats::new(config.num_steps);
    let mut per_prompt = Vec::with_capacity(prompts.len());
    let mut timings = tandem_infer::Timings::default();
    let (mut spec_tokens, mut spec_seconds) = (0usize, 0f64);
    let mut outputs = Vec::new();
    // Per batch: (tokens, seconds) of the target-only and of the speculative run.
    let mut per_batch = vec![[(0usize, 0f64); 2]; chunks.len()];
    for (speculative_run, c) in order {
        let chunk = chunks[c];
        let start = Instant::now();
        if !speculative_run {
            let out = baseline(chunk, c * batch)?;
            let seconds = start.elapsed().as_secs_f64();
            let tokens = out.iter().map(Vec::len).sum::<usize>();
            per_batch[c][0] = (tokens, seconds);
            target_seconds += seconds;
            target_tokens += tokens;
            reference.extend(out);
            continue;
        }
        let out = speculative(chunk, c * batch)?;
        let seconds = start.elapsed().as_secs_f64();
        spec_seconds += seconds;
        timings += out.timings;
        let mut tokens = 0;
        for seq in out.sequences {
            tokens += seq.tokens.len();
            stats.merge(&seq.stats);
            per_prompt.push(seq.stats);
            outputs.push(seq.tokens);
        }
        spec_tokens += tokens;
        per_batch[c][1] = (tokens, seconds);
    }
    let paired: Vec<tandem_infer::PairedRun> = per_batch
        .iter()
        .map(|[(tt, ts), (st, ss)]| tandem_infer::PairedRun {
            spec_tokens: *st as f64,
            spec_seconds: *ss,
            target_tokens: *tt as f64,
            target_seconds: *ts,
        })
        .collect();
    let comparison = if config.sampling.is_greedy() {
        compare_outputs(&outputs, &reference, prompts, logits_after)?
    } else {
        Comparison::default()
    };
    let per_second = |tokens: usize, seconds: f64| tokens as f64 / seconds.max(1e-9);
    // No baseline, no target-only rate: 0 tok/s and an infinite speedup would be printed.
    let baseline_rate = (!args.no_baseline).then(|| per_second(target_tokens, target_seconds));
    let report = BenchReport {
        prompts: prompts.len(),
        config,
        batch: args.batch,
        target_tokens,
        target_seconds,
        target_tokens_per_second: baseline_rate,
        spec_tokens,
        spec_seconds,
        spec_tokens_per_second: per_second(spec_tokens, spec_seconds),
        speedup: baseline_rate.map(|rate| per_second(spec_tokens, spec_seconds) / rate),
        speedup_se: baseline_rate.and_then(|_| tandem_infer::speedup_se(&paired)),
        interleaved: args.interleave,
        accept_length: stats.accept_length(),
        accept_length_se: tandem_infer::accept_length_se(&stats, &per_prompt),
        per_position: stats.per_position(),
        per_position_se: (0..stats.reached.len())
            .map(|i| tandem_infer::position_se(&stats, &per_prompt, i))
            .collect(),
        identical_outputs: comparison.identical,
        compared_outputs: reference.len().min(outputs.len()),
        first_mismatch: comparison.first_mismatch,
        mismatches: comparison.mismatches,
        timings,
        phase_timing: args.phase_timing,
    };
    print_report(&report, label);
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

fn write_json(path: &Path, report: &BenchReport) -> anyhow::Result<()> {
    let tmp = path.with_extension("json.partial");
    std::fs::write(&tmp, serde_json::to_string_pretty(report)?)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The target-only tok/s and speedup cells of the bench table: "-" without a baseline run.
fn baseline_cells(r: &BenchReport) -> (String, String) {
    match (r.target_tokens_per_second, r.speedup) {
        (Some(rate), Some(speedup)) => (
            format!("{rate:.1}"),
            match r.speedup_se {
                Some(se) => format!("{speedup:.3}x (se {se:.3})"),
                None => format!("{speedup:.2}x"),
            },
        ),
        _ => ("- (--no-baseline)".to_owned(), "-".to_owned()),
    }
}

fn print_report(r: &BenchReport, device: &str) {
    let c = &r.config;
    println!(
        "| device | steps/topk/tokens | batch | prompts | target tok/s | speculative tok/s | speedup | accept length | per-position acceptance | greedy identical |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let per: Vec<String> = r.per_position.iter().map(|p| format!("{p:.2}")).collect();
    let (target, speedup) = baseline_cells(r);
    println!(
        "| {device} | {}/{}/{} | {} | {} | {target} | {:.1} | {speedup} | {:.3}{} | {} | {}/{} |",
        c.num_steps,
        c.topk,
        c.num_draft_tokens,
        r.batch,
        r.prompts,
        r.spec_tokens_per_second,
        r.accept_length,
        r.accept_length_se
            .map(|se| format!(" (se {se:.3})"))
            .unwrap_or_default(),
        per.join(" "),
        r.identical_outputs,
        r.compared_outputs
    );
    let t = &r.timings;
    println!(
        "time split ({}): prefill {:.2}s, draft {:.2}s, verify {:.2}s, extend {:.2}s",
        if r.phase_timing {
            "each phase waited for its device work"
        } else {
            "host time to each phase's end; device work shows where the host waits"
        },
        t.prefill_s,
        t.draft_s,
        t.verify_s,
        t.extend_s
    );
    if r.phase_timing {
        println!(
            "of which the host queued: draft {:.2}s, verify {:.2}s, extend {:.2}s",
            t.draft_queue_s, t.verify_queue_s, t.extend_queue_s
        );
    }
    if tandem_cuda::host_spans::enabled() {
        // TANDEM_HOST_SPANS=1: where the fast path's host time went (every bench of the
        // process so far, target-only baselines included).
        print!("{}", tandem_cuda::host_spans::totals().table());
    }
    if let Some(m) = &r.first_mismatch {
        println!("first mismatch: {m}");
    }
    if !r.mismatches.is_empty() {
        println!(
            "| prompt | at token | speculative | target-only | logit gap | bf16 ulp | verdict |"
        );
        println!("|---|---|---|---|---|---|---|");
        for m in &r.mismatches {
            println!(
                "| {} | {} | {} ({:.4}) | {} ({:.4}) | {:.4} | {:.4} | {} |",
                m.prompt,
                m.position,
                m.speculative_token,
                m.speculative_logit,
                m.target_token,
                m.target_logit,
                m.gap,
                m.bf16_ulp,
                m.verdict
            );
        }
    }
}

/// Where a greedy speculative output left target-only greedy output, and whether the two
/// tokens were a near-tie for the target: their logits from one more target forward over the
/// shared prefix, the gap, and the bf16 spacing at that magnitude. A gap within a few bf16
/// steps means the two paths (tree verification vs one-token decode) rounded differently, not
/// that the engine is wrong.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MismatchTrace {
    pub prompt: usize,
    pub position: usize,
    pub speculative_token: u32,
    pub target_token: u32,
    pub speculative_logit: f32,
    pub target_logit: f32,
    pub gap: f32,
    pub bf16_ulp: f32,
    pub verdict: &'static str,
}

/// A gap of at most this many bf16 steps counts as a near-tie.
const TIE_ULPS: f32 = 4.0;

/// Spacing of bf16 numbers around `x` (8 significant bits).
pub fn bf16_ulp(x: f32) -> f32 {
    let x = x.abs().max(f32::MIN_POSITIVE);
    2f32.powi(x.log2().floor() as i32 - 7)
}

/// How speculative greedy outputs compare with target-only greedy outputs.
#[derive(Debug, Default)]
pub struct Comparison {
    pub identical: usize,
    pub first_mismatch: Option<String>,
    pub mismatches: Vec<MismatchTrace>,
}

/// Compares outputs prompt by prompt and traces each divergence to the target's logits after
/// the shared prefix (`logits_after(context)`: the target's last-position logits).
pub fn compare_outputs(
    outputs: &[Vec<u32>],
    baseline: &[Vec<u32>],
    prompts: &[Vec<u32>],
    mut logits_after: impl FnMut(&[u32]) -> anyhow::Result<Vec<f32>>,
) -> anyhow::Result<Comparison> {
    let mut comparison = Comparison::default();
    for (i, (a, b)) in outputs.iter().zip(baseline).enumerate() {
        if a == b {
            comparison.identical += 1;
            continue;
        }
        let at = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        if comparison.first_mismatch.is_none() {
            comparison.first_mismatch = Some(format!(
                "prompt {i}: first difference at generated token {at} (speculative {:?} vs target {:?})",
                a.get(at),
                b.get(at)
            ));
        }
        if let (Some(&spec), Some(&plain)) = (a.get(at), b.get(at)) {
            let mut context = prompts[i].clone();
            context.extend_from_slice(&a[..at]);
            let logits = logits_after(&context)?;
            comparison
                .mismatches
                .push(trace_mismatch(i, at, &logits, spec, plain));
        }
    }
    Ok(comparison)
}

/// The target's last-position logits after `context` (one prefill on the burn path).
fn target_logits<B: Backend>(target: &TargetModel<B>, context: &[u32]) -> anyhow::Result<Vec<f32>> {
    let mut cache = target.new_cache(1, context.len() + 1);
    let step = cache.prefill_step(&[context])?;
    let out = target.forward(
        &step,
        &mut cache,
        &TapRequest::none(),
        tandem_model::LogitsFor::Last,
    )?;
    out.logits
        .expect("asked for logits")
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| anyhow::anyhow!("reading logits: {e:?}"))
}

/// The near-tie verdict for one divergence, from the target's logits at that position.
pub fn trace_mismatch(
    prompt: usize,
    position: usize,
    logits: &[f32],
    speculative_token: u32,
    target_token: u32,
) -> MismatchTrace {
    let (ls, lt) = (
        logits[speculative_token as usize],
        logits[target_token as usize],
    );
    let gap = (ls - lt).abs();
    let ulp = bf16_ulp(ls.abs().max(lt.abs()));
    MismatchTrace {
        prompt,
        position,
        speculative_token,
        target_token,
        speculative_logit: ls,
        target_logit: lt,
        gap,
        bf16_ulp: ulp,
        verdict: if gap <= TIE_ULPS * ulp {
            "bf16 near-tie"
        } else {
            "NOT a tie: investigate"
        },
    }
}

#[cfg(test)]
mod tests {
    use super::{BenchReport, baseline_cells, bf16_ulp};

    fn report(target: Option<f64>, speedup: Option<f64>) -> BenchReport {
        BenchReport {
            prompts: 2,
            config: tandem_infer::SpecConfig {
                num_steps: 3,
                topk: 1,
                num_draft_tokens: 4,
                sampling: tandem_model::SamplingParams::greedy(),
                seed: 0,
            },
            batch: 1,
            target_tokens: 0,
            target_seconds: 0.0,
            target_tokens_per_second: target,
            spec_tokens: 64,
            spec_seconds: 0.5,
            spec_tokens_per_second: 128.0,
            speedup,
            speedup_se: None,
            interleaved: false,
            accept_length: 1.9,
            accept_length_se: Some(0.02),
            per_position: vec![0.5, 0.5, 0.5],
            per_position_se: vec![Some(0.01); 3],
            identical_outputs: 0,
            compared_outputs: 0,
            first_mismatch: None,
            mismatches: Vec::new(),
            timings: Default::default(),
            phase_timing: false,
        }
    }

    #[test]
    fn no_baseline_prints_no_rate_and_no_speedup() {
        // `bench --no-baseline` used to print "target 0.0 tok/s" and speedup "infx".
        let none = report(None, None);
        assert_eq!(
            baseline_cells(&none),
            ("- (--no-baseline)".to_owned(), "-".to_owned())
        );
        let json = serde_json::to_value(&none).unwrap();
        assert!(json["speedup"].is_null() && json["target_tokens_per_second"].is_null());
        assert_eq!(json["accept_length"], 1.9);
        assert_eq!(json["accept_length_se"], 0.02);
        assert_eq!(json["per_position_se"][2], 0.01);
        let both = report(Some(100.0), Some(1.28));
        assert_eq!(
            baseline_cells(&both),
            ("100.0".to_owned(), "1.28x".to_owned())
        );
        let with_se = BenchReport {
            speedup_se: Some(0.021),
            ..report(Some(100.0), Some(1.2834))
        };
        assert_eq!(baseline_cells(&with_se).1, "1.283x (se 0.021)");
    }

    #[test]
    fn bf16_spacing_by_hand() {
        // bf16 keeps 8 significant bits: numbers in [16, 32) are 2^(4-7) = 0.125 apart.
        assert_eq!(bf16_ulp(17.3), 0.125);
        assert_eq!(bf16_ulp(-20.0), 0.125);
        assert_eq!(bf16_ulp(1.0), 2f32.powi(-7));
        assert_eq!(bf16_ulp(0.75), 2f32.powi(-8));
    }
}
