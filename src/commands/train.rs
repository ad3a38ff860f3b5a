//! `tandem train`: a thin wrapper over `tandem_train`.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::Args;
use tandem_dump::{DumpOptions, OnlineCapture, ShardLimits, StorageDtype};
use tandem_model::backend::DeviceKind;
use tandem_model::burn::backend::Autodiff;
use tandem_model::burn::prelude::Backend;
use tandem_model::{Execution, TargetModel};
use tandem_train::data::Dataset;
use tandem_train::{TrainOptions, TrainReport};
use tandem_wiring::TapSpec;

use super::DEFAULT_MODEL_DIR;
use super::spec::EngineKind;
use crate::with_backend;

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// A dump directory written by `tandem dump` (repeat to train on several; their wiring
    /// must agree).
    #[arg(long = "dump", required_unless_present = "online")]
    pub dumps: Vec<PathBuf>,
    /// Train on taps captured from the target while training instead of a dump: the
    /// conversations of --dataset (with their own replies, e.g. the regenerated ones kept in
    /// datasets/regenerated/) go through the capture hook `tandem dump` uses, on the GPU (the
    /// fast path) or the CPU; no hidden state is written to disk.
    #[arg(long, requires = "dataset", conflicts_with = "dumps")]
    pub online: bool,
    /// --online: registry name (`sharegpt`) or chat-JSONL/JSON path.
    #[arg(long)]
    pub dataset: Option<String>,
    /// --online: where registry datasets are fetched to.
    #[arg(long, default_value = "data")]
    pub data_root: PathBuf,
    /// --online: aux taps, as `tandem dump --taps`.
    #[arg(long, default_value = "default")]
    pub taps: TapSpec,
    /// --online: use at most this many conversations.
    #[arg(long)]
    pub max_samples: Option<u64>,
    /// The target model directory the dumps were captured from (checked against their wiring).
    #[arg(long, default_value = DEFAULT_MODEL_DIR)]
    pub model: PathBuf,
    /// Output directory: the exported head (config.json + model.safetensors, loadable by
    /// SGLang/vLLM), checkpoints/, metrics.jsonl, curves.html.
    #[arg(long)]
    pub out: PathBuf,
    /// Draft vocabulary size: the most frequent assistant tokens of the training split
    /// [default: min(32000, target vocab)].
    #[arg(long)]
    pub draft_vocab: Option<usize>,
    /// Training-time-test unroll length.
    #[arg(long, default_value_t = 7)]
    pub ttt_steps: usize,
    /// Passes over the training split.
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 1e-4)]
    pub lr: f64,
    /// Sequences per batch.
    #[arg(long, default_value_t = 4)]
    pub batch_size: usize,
    /// Samples are cut to this many tokens.
    #[arg(long, default_value_t = 2048)]
    pub max_len: usize,
    /// Share of the steps spent on linear warm-up before the cosine decay.
    #[arg(long, default_value_t = 0.015)]
    pub warmup_ratio: f64,
    /// Final learning rate as a share of --lr.
    #[arg(long, default_value_t = 0.0)]
    pub min_lr_ratio: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0 = off).
    #[arg(long, default_value_t = 0.5)]
    pub max_grad_norm: f64,
    /// Share of samples (by sample id) held out for validation.
    #[arg(long, default_value_t = 0.02)]
    pub val_fraction: f64,
    /// Validate every N steps (0 = at the end of each epoch only).
    #[arg(long, default_value_t = 0)]
    pub eval_every: usize,
    /// Checkpoint every N steps (0 = at the end only).
    #[arg(long, default_value_t = 500)]
    pub save_every: usize,
    /// Checkpoints kept on disk.
    #[arg(long, default_value_t = 2)]
    pub keep_checkpoints: usize,
    /// Seed of the initialisation and the data order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop after this many steps in total (the schedule still spans --epochs).
    #[arg(long)]
    pub max_steps: Option<usize>,
    /// Stop after the step during which this run has trained for this many seconds (then
    /// validate, checkpoint and export as after --max-steps). The cosine schedule is fitted to
    /// the limit: 50 steps after the warm-up are timed, and the schedule then ends (at its
    /// floor) after the steps that fit in 95% of the remaining time at that rate, or at
    /// --epochs if sooner. The warm-up stays a share of --epochs; the fitted horizon is saved
    /// in the checkpoints and kept by --resume.
    #[arg(long)]
    pub max_seconds: Option<f64>,
    /// Continue the run in --out from its latest checkpoint (same options required).
    #[arg(long)]
    pub resume: bool,
    /// Start from an existing head directory (SGLang/vLLM/SpecForge/EAGLE/Tandem layout).
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// Export the final head in bf16 (checkpoints stay f32).
    #[arg(long)]
    pub export_bf16: bool,
    /// cpu (ndarray, f32) or cuda (the GPU trainer, in every build; `--engine burn` for
    /// burn-cuda, which needs a build with --features cuda).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// auto (the GPU trainer on --device cuda, burn on cpu), burn, or fast (the GPU trainer:
    /// cuBLAS + kernels/train.cu, the corpus held on the GPU).
    #[arg(long, default_value = "auto")]
    pub engine: EngineKind,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Data-parallel training on these GPUs (`0,1`; --device cuda): one replica process per
    /// device (CUDA_VISIBLE_DEVICES, RANK/WORLD_SIZE/LOCAL_RANK as torchrun sets them, logs in
    /// OUT/rank-i.log), each training on its share of every global batch of --batch-size rows,
    /// gradients summed over NCCL every step. Rank 0 writes the head, checkpoints and metrics.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["rank", "world_size"])]
    pub devices: Vec<String>,
    /// This replica's rank when the ranks are started by a launcher (default: $RANK), e.g.
    /// one process per GPU on several machines (scripts/train_dp.sh).
    #[arg(long)]
    pub rank: Option<usize>,
    /// Replicas in the run (default: $WORLD_SIZE); given (or set), the run goes through NCCL
    /// even with 1.
    #[arg(long)]
    pub world_size: Option<usize>,
    /// The file through which rank 0 hands the NCCL id to the others (on a filesystem every
    /// rank sees) [default: OUT/nccl-id]; without a shared filesystem set NCCL_COMM_ID=HOST:PORT
    /// (rank 0's machine and a free port) on every rank instead.
    #[arg(long)]
    pub rendezvous: Option<PathBuf>,
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    if !args.devices.is_empty() {
        if args.device.to_string() != "cuda" {
            anyhow::bail!("--devices trains data-parallel on GPUs: pass --device cuda");
        }
        // Replicas meet in every step's all-reduce: one that fails would leave the others
        // waiting in NCCL for good.
        return super::ranks::run_on_devices(
            &args.devices,
            &args.out,
            "data-parallel train",
            super::ranks::OnRankFailure::StopOthers,
        );
    }
    let data_parallel = super::ranks::rank_and_world(args.rank, args.world_size)?
        .map(|(rank, world_size)| -> anyhow::Result<_> {
            Ok(tandem_train::replicas::DataParallel {
                rank,
                world_size,
                device: super::ranks::local_device()?,
                rendezvous: super::ranks::default_rendezvous(&args.out, args.rendezvous.as_ref()),
                run_tag: super::ranks::run_tag(),
            })
        })
        .transpose()?;
    let options = TrainOptions {
        dumps: args.dumps.clone(),
        model: args.model.clone(),
        out: args.out.clone(),
        draft_vocab: args.draft_vocab,
        ttt_steps: args.ttt_steps,
        epochs: args.epochs,
        lr: args.lr,
        batch_size: args.batch_size,
        max_len: args.max_len,
        warmup_ratio: args.warmup_ratio,
        min_lr_ratio: args.min_lr_ratio,
        weight_decay: args.weight_decay,
        max_grad_norm: args.max_grad_norm,
        val_fraction: args.val_fraction,
        eval_every: args.eval_every,
        save_every: args.save_every,
        keep_checkpoints: args.keep_checkpoints,
        seed: args.seed,
        max_steps: args.max_steps,
        max_seconds: args.max_seconds,
        init_from: args.init_from.clone(),
        export_bf16: args.export_bf16,
        resume: args.resume,
        progress: !args.quiet && std::io::stderr().is_terminal(),
        device_label: args.device.to_string(),
        online: args.online.then(|| args.dataset.clone()).flatten(),
        data_parallel,
    };
    let online = args.online.then(|| online_options(&args));
    if options.data_parallel.is_some() && online.is_some() {
        anyhow::bail!("data-parallel training reads dumps (--dump), not --online capture");
    }
    let cuda = args.device.to_string() == "cuda";
    match args.engine {
        EngineKind::Fast | EngineKind::Auto if cuda => {
            let report = match &online {
                Some(capture) => {
                    let capture = OnlineCapture::open(capture, || {
                        let gpu = tandem_cuda::Gpu::new(0)?;
                        let target = tandem_cuda::CudaTarget::load(&args.model, gpu)?;
                        eprintln!("online: capturing through the CUDA fast path's hook");
                        Ok(Box::new(target))
                    })?;
                    tandem_train::train_gpu_on(&options, Dataset::new(vec![Box::new(capture)])?)?
                }
                None => tandem_train::train_gpu(&options)?,
            };
            print_report(&report);
            Ok(())
        }
        EngineKind::Fast => anyhow::bail!("--engine fast trains on the GPU: pass --device cuda"),
        _ => with_backend!(args.device, |B, device| run_on::<B>(
            &options,
            online.as_ref(),
            &device
        )),
    }
}

/// `tandem train-curves`.
#[derive(Args, Debug)]
pub struct TrainCurvesArgs {
    /// A run's metrics.jsonl; repeat for the stages of a head, first stage first.
    #[arg(long = "metrics", required = true)]
    pub metrics: Vec<PathBuf>,
    /// The HTML page to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Title of the page.
    #[arg(long, default_value = "EAGLE-3 head training")]
    pub title: String,
}

/// `tandem train-curves`: one plot over the stages' metrics, steps continued across stages.
pub fn run_curves(args: TrainCurvesArgs) -> anyhow::Result<()> {
    let mut stages = Vec::new();
    for path in &args.metrics {
        let lines = tandem_train::metrics::read_lines(path)?;
        anyhow::ensure!(
            !lines.is_empty(),
            "{}: no metrics lines (or no such file)",
            path.display()
        );
        stages.push(lines);
    }
    let lines = tandem_train::metrics::chain_stages(&stages);
    tandem_train::plot::write(&args.out, &args.title, &lines)?;
    println!(
        "wrote {} ({} stages, {} lines, {} steps)",
        args.out.display(),
        stages.len(),
        lines.len(),
        lines.iter().map(|l| l.step).max().unwrap_or(0)
    );
    Ok(())
}

/// `tandem train-check`: see `tandem_train::gpu_check`.
pub fn run_check() -> anyhow::Result<()> {
    let lines = tandem_train::gpu_check::gpu_parity_check()?;
    for line in lines {
        println!("{line}");
    }
    println!("train-check: the GPU trainer matches burn autodiff within tolerance");
    Ok(())
}

fn run_on<B: Backend>(
    options: &TrainOptions,
    online: Option<&DumpOptions>,
    device: &B::Device,
) -> anyhow::Result<()> {
    let report = match online {
        Some(capture) => {
            let capture = OnlineCapture::open(capture, || {
                Ok(Box::new(TargetModel::<B>::load(
                    &capture.model_dir,
                    device,
                )?))
            })?;
            let data = Dataset::new(vec![Box::new(capture)])?;
            tandem_train::train_on::<Autodiff<B>>(options, data, device)?
        }
        None => tandem_train::train::<Autodiff<B>>(options, device)?,
    };
    print_report(&report);
    Ok(())
}

/// What `--online` captures: a dump's options without the output (nothing is written).
fn online_options(args: &TrainArgs) -> DumpOptions {
    DumpOptions {
        model_dir: args.model.clone(),
        dataset: args.dataset.clone().unwrap_or_default(),
        data_root: args.data_root.clone(),
        out: PathBuf::new(),
        taps: args.taps.clone(),
        max_samples: args.max_samples,
        max_seconds: None,
        max_len: args.max_len,
        regenerate: None,
        batch_size: 1,
        dtype: StorageDtype::Bf16,
        shard_limits: ShardLimits::default(),
        allow_eval: false,
        device_label: args.device.to_string(),
        progress: false,
        simulate_full_disk_after: None,
        execution: Execution::default(),
        tensor_parallel: 1,
        partition: None,
    }
}

fn print_report(r: &TrainReport) {
    if let Some(step) = r.resumed_from {
        eprintln!("resumed at step {step}");
    }
    eprintln!(
        "{} of {} steps ({} train / {} validation samples): {:.2} steps/s, {:.0} tokens/s",
        r.steps, r.total_steps, r.train_rows, r.val_rows, r.steps_per_s, r.tokens_per_s
    );
    let fmt = |acc: &[f64]| {
        acc.iter()
            .map(|a| format!("{a:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    if let (Some(a), Some(b)) = (&r.first_train, &r.last_train) {
        eprintln!(
            "train: loss {:.4} -> {:.4}, acc_i [{}] -> [{}]",
            a.loss,
            b.loss,
            fmt(&a.acc),
            fmt(&b.acc)
        );
    }
    if let (Some(a), Some(b)) = (&r.first_val, &r.last_val) {
        eprintln!(
            "validation: loss {:.4} -> {:.4}, acc_i [{}] -> [{}]",
            a.loss,
            b.loss,
            fmt(&a.acc),
            fmt(&b.acc)
        );
    }
    for d in &r.trained_on {
        eprintln!("trained on dump {d}");
    }
    println!("{}", r.export_dir.display());
}
