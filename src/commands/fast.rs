//! `tandem fast-check` and `tandem fast-bench`: the CUDA fast path (crate `tandem-cuda`)
//! against the CPU f32 reference over a sweep of batch sizes and KV lengths, and its decode
//! speed measured like `bench-target`.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use tandem_cuda::check::{CheckPoint, Tolerance, check_point, load_pair};
use tandem_cuda::{CudaTarget, Gpu};
use tandem_model::{LogitsFor, TapRequest, TargetTokenizer};
use tandem_wiring::TapId;

use super::DEFAULT_MODEL_DIR;
use super::bench::time_decode;

#[derive(Args, Debug)]
pub struct FastCheckArgs {
    #[arg(long, default_value = DEFAULT_MODEL_DIR)]
    pub model: PathBuf,
    /// KV lengths swept at batch 1.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,31,32,33,144,160,511,1024,2048,4095,4096"
    )]
    pub kv_lens: Vec<usize>,
    /// Batch sizes swept at KV length 48.
    #[arg(long, value_delimiter = ',', default_value = "2,3,4,5,8,13,16")]
    pub batches: Vec<usize>,
    /// Extra points `BATCHxKV` (e.g. 16x4096: the largest of both).
    #[arg(long, value_delimiter = ',', default_value = "16x4096,8x1000")]
    pub points: Vec<String>,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Check the target split over N tensor-parallel ranks (GPUs 0..N over NCCL;
    /// TANDEM_CUDA_TP_SIMULATE=1: every rank on GPU 0) against the same CPU reference.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
}

pub fn run_check(args: FastCheckArgs) -> anyhow::Result<()> {
    let (fast, reference) = if args.tp > 1 {
        (
            CudaTarget::load_ranks(&args.model, args.tp)?,
            tandem_model::TargetModel::load(&args.model, &Default::default())?,
        )
    } else {
        load_pair(&args.model, Gpu::new(0)?)?
    };
    let gpu = fast.gpu().clone();
    let mut points: Vec<CheckPoint> = args
        .kv_lens
        .iter()
        .map(|&kv_len| CheckPoint { batch: 1, kv_len })
        .collect();
    points.extend(
        args.batches
            .iter()
            .map(|&batch| CheckPoint { batch, kv_len: 48 }),
    );
    for p in &args.points {
        let (b, k) = p
            .split_once('x')
            .ok_or_else(|| anyhow::anyhow!("--points entry {p:?} is not BATCHxKV"))?;
        points.push(CheckPoint {
            batch: b.parse()?,
            kv_len: k.parse()?,
        });
    }
    let tolerance = Tolerance::default();
    eprintln!(
        "fast path on {}{} vs CPU f32 reference; tolerance {tolerance:?}",
        gpu.name(),
        fast.tensor_parallel_label()
    );
    // Rows are printed as points finish, so a run cut short keeps what it measured.
    println!(
        "| batch | KV length | rows checked | logits rel err | worst tap (rel err) | worst element: step, token, channel, fast vs ref (token's rel err) | greedy agree | real mismatches | pass |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut reports = Vec::new();
    for point in points {
        let t = Instant::now();
        let r = check_point(&fast, &reference, point, tolerance)?;
        eprintln!("{r:?} ({:.1} s)", t.elapsed().as_secs_f64());
        let at = r.worst_at.as_ref().map_or(String::new(), |w| {
            format!(
                "{}, {}, {}, {:.3} vs {:.3} ({:.2e})",
                w.step, w.token, w.channel, w.fast, w.reference, w.token_rel
            )
        });
        println!(
            "| {} | {} | {} | {:.2e} | {} ({:.2e}) | {} | {}/{} | {} | {} |",
            r.point.batch,
            r.point.kv_len,
            r.rows_checked.len(),
            r.logits_rel,
            r.worst_tap,
            r.taps_rel,
            at,
            r.greedy_agree,
            r.greedy_total,
            r.greedy_real_mismatches,
            if r.passed { "yes" } else { "NO" }
        );
        reports.push(r);
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&reports)?)?;
    }
    let failed = reports.iter().filter(|r| !r.passed).count();
    anyhow::ensure!(
        failed == 0,
        "{failed} of {} points outside tolerance",
        reports.len()
    );
    Ok(())
}

#[derive(Args, Debug)]
pub struct FastBenchArgs {
    #[arg(long, default_value = DEFAULT_MODEL_DIR)]
    pub model: PathBuf,
    /// Split the target over N tensor-parallel ranks on GPUs 0..N (NCCL; every rank on GPU 0
    /// with host sums under TANDEM_CUDA_TP_SIMULATE=1). Split steps run the unfused kernels
    /// (`--fused` and `--persistent` do not apply); CUDA graphs replay over NCCL, not with
    /// host sums. Rows record the kernels and graphs that actually ran.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 64)]
    pub new_tokens: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,8,16")]
    pub batch: Vec<usize>,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Also measure decode with the head's three taps requested (blocks 1, L/2-1, L-4).
    #[arg(long)]
    pub with_taps: bool,
    /// Bytes of freed memory the CUDA memory pool keeps across synchronisations (default: all;
    /// 0 is CUDA's default, which re-maps every step's scratch buffers).
    #[arg(long)]
    pub pool_release_threshold: Option<u64>,
    /// Tree-verification widths to time besides decode: a step of W draft tokens per sequence
    /// (a chain), logits for every slot and the head's three taps, as the speculative loop
    /// verifies.
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    pub verify_widths: Vec<usize>,
    /// Measure only with CUDA graphs (the default measures eager launches first, as the
    /// baseline, then graphs, in the same run).
    #[arg(long)]
    pub graphs_only: bool,
    /// The fused small-step kernels (steps of at most 8 rows): `default` (as serving runs: on
    /// for targets of hidden size up to 1,024, off above, unless TANDEM_CUDA_FUSED=N sets the
    /// cut-off; 0 turns them off), `on`, `off` (cuBLAS
    /// GEMMs and separate kernels), or `both` (off first, as the baseline, then on, in the same
    /// run).
    #[arg(long, value_enum, default_value_t = FusedModes::Default)]
    pub fused: FusedModes,
    /// Also measure the persistent step (every step of at most 8 rows in one launch, batch
    /// invariant; TANDEM_CUDA_PERSISTENT=8 turns it on for serving), after the `--fused`
    /// modes, in the same run.
    #[arg(long)]
    pub persistent: bool,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedModes {
    Default,
    On,
    Off,
    Both,
}

impl FusedModes {
    /// The fused-row cut-offs to measure, in order (0: unfused), given the cut-off the engine
    /// loaded with (`loaded`: by hidden size, or TANDEM_CUDA_FUSED=N) and the one `on` means
    /// (`on`).
    fn cut_offs(self, loaded: usize, on: usize) -> Vec<usize> {
        match self {
            Self::Default => vec![loaded],
            Self::On => vec![on],
            Self::Off => vec![0],
            Self::Both => vec![0, on],
        }
    }
}

#[derive(Debug, serde::Serialize)]
struct FastBenchRow {
    /// Tensor-parallel ranks the target ran on (1: one GPU).
    tensor_parallel: usize,
    /// How the ranks' sums were added: `Nccl`, or `HostSimulation` (one GPU, a stand-in).
    tp_reduction: Option<String>,
    graphs: bool,
    /// `unfused`, `fused` or `persistent`.
    kernels: &'static str,
    /// `decode` or `verify` (a tree step of `width` tokens per sequence).
    step: &'static str,
    width: usize,
    batch: usize,
    taps: usize,
    ttft_ms_median: f64,
    step_ms_median: f64,
    tokens_per_second: f64,
    /// The step's graph replayed back to back (no host work between replays), ms a replay:
    /// its device time, so `step_ms_median` minus this is what the host adds a step (input
    /// uploads, the launch, the logits' copy, argmax and read-back). One GPU with graphs only.
    graph_replay_ms: Option<f64>,
}

/// Replays of the last step's graph timed back to back ([`CudaTarget::time_last_replay`]),
/// ms a replay; `None` without graphs or on a split target (rank 0's graph alone would wait
/// for ever at its all-reduces).
fn device_step_ms(model: &CudaTarget, graphs: bool) -> anyhow::Result<Option<f64>> {
    if !graphs || model.tensor_parallel() > 1 {
        return Ok(None);
    }
    Ok(model
        .time_last_replay(DEVICE_STEP_REPLAYS)?
        .map(|s| s * 1e3))
}

/// Back-to-back replays behind [`device_step_ms`]: enough that the first launch's latency and
/// the final synchronisation are ~1% of the time.
const DEVICE_STEP_REPLAYS: usize = 100;

pub fn run_bench(args: FastBenchArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let model = CudaTarget::load_ranks(&args.model, args.tp)?;
    let gpu = model.gpu().clone();
    if let Some(bytes) = args.pool_release_threshold {
        // Every rank's pool: a split target allocates its scratch buffers on each GPU.
        for rank_gpu in model.rank_gpus() {
            rank_gpu.set_pool_release_threshold(bytes)?;
        }
    }
    let tokenizer = TargetTokenizer::load(&args.model)?;
    let seed = tokenizer.encode(
        "The history of mathematics spans thousands of years, from counting and geometry in \
         ancient civilisations to the abstract structures of today. ",
        false,
    )?;
    let prompt: Vec<u32> = seed
        .iter()
        .copied()
        .cycle()
        .take(args.prompt_tokens)
        .collect();
    let layers = model.spec.num_layers;
    anyhow::ensure!(
        layers >= 4,
        "fast-bench taps the head's three layers (1, L/2-1, L-4): the model needs at least 4 \
         layers, {} has {layers}",
        args.model.display()
    );
    let eagle_taps = TapRequest::new(vec![
        TapId::Block(1),
        TapId::Block(layers / 2 - 1),
        TapId::Block(layers - 4),
    ]);
    let mut requests = vec![TapRequest::none()];
    if args.with_taps {
        requests.push(eagle_taps.clone());
    }
    let mut first_token_s = None;
    let mut rows = Vec::new();
    // `--fused on` runs FUSED_MAX_ROWS (or TANDEM_CUDA_FUSED=N's cut-off when not 0).
    let loaded = model.fused_rows();
    let cut_offs = args.fused.cut_offs(
        loaded,
        match loaded {
            0 => tandem_cuda::FUSED_MAX_ROWS,
            n => n,
        },
    );
    let graph_modes: &[bool] = if args.graphs_only {
        &[true]
    } else {
        &[false, true]
    };
    // (fused cut-off, persistent cut-off) per mode; the loaded persistent cut-off (0 unless
    // TANDEM_CUDA_PERSISTENT=N) stays in the `--fused` modes.
    let loaded_persistent = model.persistent_rows();
    let mut kernel_modes: Vec<(usize, usize)> =
        cut_offs.iter().map(|&f| (f, loaded_persistent)).collect();
    if args.persistent {
        kernel_modes.push((0, tandem_cuda::GEMV_MAX_ROWS));
    }
    if model.tensor_parallel() > 1 {
        // The fused and persistent kernels add o_proj and down_proj into the residual, which
        // leaves nothing to all-reduce: a split target runs the unfused ones whatever is set.
        if args.persistent || matches!(args.fused, FusedModes::On | FusedModes::Both) {
            eprintln!("fast-bench: --tp {}: the unfused kernels only", args.tp);
        }
        kernel_modes = vec![(0, 0)];
    }
    // Graph modes as they run: a split target with host sums replays none.
    let mut measured = Vec::new();
    if let Some((regs, spilled, threads, cluster)) = gpu.qkv_attention_resources()? {
        eprintln!(
            "one-launch q|k|v and attention: {regs} registers and {spilled} spilled bytes per thread, blocks of up to {threads} threads in clusters of {cluster} (TANDEM_CUDA_QKV_ATTENTION_CLUSTER); steps of up to {} sequences (TANDEM_CUDA_QKV_ATTENTION) and {} tokens a sequence (TANDEM_CUDA_QKV_ATTENTION_WIDTH) take it",
            model.qkv_attention_sequences(),
            model.qkv_attention_width()
        );
    }
    let (regs, spilled, sms, warps) = gpu.persistent_resources()?;
    eprintln!(
        "persistent step: {regs} registers and {spilled} spilled bytes per thread, one block of {warps} warps on each of {sms} SMs"
    );
    let modes = graph_modes
        .iter()
        .flat_map(|&g| kernel_modes.iter().map(move |&(f, p)| (g, f, p)));
    for (graphs, fused_rows, persistent_rows) in modes {
        let kernels = match (fused_rows, persistent_rows) {
            (_, p) if p > 0 => "persistent",
            (0, _) => "unfused",
            _ => "fused",
        };
        model.set_graphs(graphs);
        model.set_fused_rows(fused_rows);
        model.set_persistent_rows(persistent_rows);
        let graphs = model.graphs_enabled();
        if measured.contains(&(graphs, fused_rows, persistent_rows)) {
            continue;
        }
        measured.push((graphs, fused_rows, persistent_rows));
        for taps in &requests {
            for &batch in &args.batch {
                let prompts: Vec<&[u32]> = (0..batch).map(|_| prompt.as_slice()).collect();
                let (ttft, step) = time_decode(
                    args.repeats,
                    args.new_tokens,
                    || Ok(model.new_cache(batch, args.prompt_tokens + args.new_tokens + 1)?),
                    |cache| {
                        let step = cache.layout().prefill_step(&prompts)?;
                        let out = model.forward(&step, cache, taps, LogitsFor::Last)?;
                        let next = out.logits.expect("logits").argmax()?;
                        first_token_s.get_or_insert(started.elapsed().as_secs_f64());
                        Ok(next)
                    },
                    |cache, next| {
                        let step = cache.layout().decode_step(next)?;
                        let out = model.forward(&step, cache, taps, LogitsFor::Last)?;
                        Ok(out.logits.expect("logits").argmax()?)
                    },
                )?;
                if let Some(profile) = model
                    .persistent_profile()?
                    .filter(|_| kernels == "persistent")
                {
                    // Block 0's clock over the last step (TANDEM_CUDA_PERSISTENT_PROFILE=1).
                    let phases: Vec<String> = profile
                        .phases
                        .iter()
                        .map(|(name, work, wait)| format!("{name} {work}+{wait}"))
                        .collect();
                    eprintln!(
                        "persistent profile, decode batch {batch}, taps {}: cycles work+wait by phase (all layers): {}; final {}",
                        taps.taps.len(),
                        phases.join(", "),
                        profile.final_cycles
                    );
                }
                let row = FastBenchRow {
                    tensor_parallel: model.tensor_parallel(),
                    tp_reduction: model.tensor_parallel_reduction().map(|r| format!("{r:?}")),
                    graphs,
                    kernels,
                    step: "decode",
                    width: 1,
                    batch,
                    taps: taps.taps.len(),
                    ttft_ms_median: ttft * 1e3,
                    step_ms_median: step * 1e3,
                    tokens_per_second: batch as f64 / step,
                    graph_replay_ms: device_step_ms(&model, graphs)?,
                };
                eprintln!("{row:?}");
                rows.push(row);
            }
        }
        for &width in &args.verify_widths {
            let parents: Vec<Option<usize>> = (0..width).map(|i| i.checked_sub(1)).collect();
            for &batch in &args.batch {
                let prompts: Vec<&[u32]> = (0..batch).map(|_| prompt.as_slice()).collect();
                let (ttft, step) = time_decode(
                    args.repeats,
                    args.new_tokens,
                    || Ok(model.new_cache(batch, args.prompt_tokens + args.new_tokens * width + 1)?),
                    |cache| {
                        let step = cache.layout().prefill_step(&prompts)?;
                        let out = model.forward(&step, cache, &eagle_taps, LogitsFor::Last)?;
                        Ok(out.logits.expect("logits").argmax()?)
                    },
                    |cache, next| {
                        let drafts: Vec<Vec<u32>> = next.iter().map(|&t| vec![t; width]).collect();
                        let trees: Vec<(&[u32], &[Option<usize>])> = drafts
                            .iter()
                            .map(|d| (d.as_slice(), parents.as_slice()))
                            .collect();
                        let step = cache.layout().tree_step(&trees)?;
                        let out = model.forward(&step, cache, &eagle_taps, LogitsFor::All)?;
                        let ids = out.logits.expect("logits").argmax()?;
                        // Each sequence keeps the step's first token only, as a round that
                        // accepts nothing does: the attention then reads the context a decode
                        // step at the same point reads (keeping all `width` tokens grew it
                        // `width` times as fast, and a verify step looked dearer than it is).
                        for b in 0..batch {
                            cache.layout_mut().keep_only(b, width, &[0]);
                        }
                        Ok(ids.iter().step_by(width).copied().collect())
                    },
                )?;
                let row = FastBenchRow {
                    tensor_parallel: model.tensor_parallel(),
                    tp_reduction: model.tensor_parallel_reduction().map(|r| format!("{r:?}")),
                    graphs,
                    kernels,
                    step: "verify",
                    width,
                    batch,
                    taps: eagle_taps.taps.len(),
                    ttft_ms_median: ttft * 1e3,
                    step_ms_median: step * 1e3,
                    tokens_per_second: batch as f64 / step,
                    graph_replay_ms: device_step_ms(&model, graphs)?,
                };
                eprintln!("{row:?}");
                rows.push(row);
            }
        }
    }
    let stats = model.graph_stats();
    println!(
        "cold start (process start to first token, fast path on {}{}): {:.2} s; graphs captured {}, steps replayed {}",
        gpu.name(),
        model.tensor_parallel_label(),
        first_token_s.unwrap_or(0.0),
        stats.captured,
        stats.replays
    );
    println!(
        "| path | step | batch | taps | TTFT ms (median) | step ms (median) | tokens/s (decode) | step / decode step | graph replayed back to back, ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let decode = rows
            .iter()
            .find(|d| {
                d.graphs == r.graphs
                    && d.kernels == r.kernels
                    && d.step == "decode"
                    && d.batch == r.batch
                    && d.taps == 0
            })
            .map_or(f64::NAN, |d| d.step_ms_median);
        let path = format!(
            "fast path + {}, {}",
            if r.graphs {
                "CUDA graphs"
            } else {
                "eager launches"
            },
            match r.kernels {
                "fused" => "fused small steps",
                "persistent" => "persistent step",
                other => other,
            }
        );
        let step = if r.step == "decode" {
            "decode".to_string()
        } else {
            format!("verify {}", r.width)
        };
        println!(
            "| {path} | {step} | {} | {} | {:.2} | {:.3} | {} | {:.2} | {} |",
            r.batch,
            r.taps,
            r.ttft_ms_median,
            r.step_ms_median,
            if r.step == "decode" {
                format!("{:.1}", r.tokens_per_second)
            } else {
                "-".into()
            },
            r.step_ms_median / decode,
            r.graph_replay_ms
                .map_or_else(|| "-".into(), |ms| format!("{ms:.3}"))
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
    }
    Ok(())
}
