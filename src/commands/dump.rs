//! `tandem dump` and `tandem dump-info`: thin wrappers over `tandem_dump`.

use std::path::PathBuf;

use clap::Args;
use tandem_dump::{DumpOptions, GenerationSettings, ShardLimits, StorageDtype};
use tandem_model::Execution;
use tandem_wiring::TapSpec;

use super::ModelArgs;
use super::spec::EngineKind;
use crate::with_backend;

#[derive(Args, Debug)]
pub struct DumpArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Registry name (sharegpt, mtbench, humaneval) or path of a ShareGPT JSON / chat JSONL file.
    #[arg(long)]
    pub dataset: String,
    /// Where registry datasets are fetched to (scripts/fetch_datasets.sh).
    #[arg(long, default_value = "data")]
    pub data_root: PathBuf,
    /// Output directory; re-running the same command resumes it.
    #[arg(long)]
    pub out: PathBuf,
    /// Aux taps: `default` (blocks [1, L/2-1, L-4]), `canonical:block1,block14,block26`, or
    /// engine ids such as `sglang:1,14,26`, `vllm:2,15,27`, `hf:2,15,27`.
    #[arg(long, default_value = "default")]
    pub taps: TapSpec,
    /// Let the target write the assistant turns itself (recommended EAGLE-3 data).
    #[arg(long)]
    pub regenerate: bool,
    /// Stop once the dump holds this many samples (earlier runs included).
    #[arg(long)]
    pub max_samples: Option<u64>,
    /// Start no new batch after this many seconds (the batch under way is finished and
    /// written; the dump stays resumable, like --max-samples).
    #[arg(long)]
    pub max_seconds: Option<f64>,
    /// Samples are truncated to this many tokens.
    #[arg(long, default_value_t = 2048)]
    pub max_len: usize,
    /// --regenerate: token budget of one assistant turn.
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// --regenerate: sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// --regenerate: nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// --regenerate: top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// --regenerate: base seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// --regenerate: conversations generated together.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Storage type of the hidden states: bf16 (UInt16 bit patterns) or f16 (Float16).
    #[arg(long, default_value = "bf16")]
    pub dtype: StorageDtype,
    /// Close a shard after this many samples.
    #[arg(long, default_value_t = 4096)]
    pub shard_rows: u64,
    /// Close a shard after this many MiB of (uncompressed) hidden states.
    #[arg(long, default_value_t = 512)]
    pub shard_mib: u64,
    /// Allow an evaluation set (mtbench, humaneval) as training data.
    #[arg(long)]
    pub allow_eval: bool,
    /// auto (the CUDA fast path on --device cuda, burn on cpu), burn, or fast: the target the
    /// dump captures through (auto = the one serving runs).
    #[arg(long, default_value = "auto")]
    pub engine: EngineKind,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// This process's rank in a data-parallel dump (default: $RANK as torchrun sets it): it
    /// dumps the dataset records `i % world_size == rank` into OUT/rank-RRRRR/ and resumes
    /// there; `tandem train --dump OUT` reads the ranks as one dump. One process per GPU
    /// (scripts/dump_dp.sh).
    #[arg(long)]
    pub rank: Option<usize>,
    /// Processes in a data-parallel dump (default: $WORLD_SIZE). Given (or set), the dump is
    /// partitioned even with 1, through the same code path.
    #[arg(long)]
    pub world_size: Option<usize>,
    /// A data-parallel dump on these GPUs (`0,1`): one child process per device, each seeing
    /// only its GPU (CUDA_VISIBLE_DEVICES) and started as rank i of N (RANK, WORLD_SIZE,
    /// LOCAL_RANK), logs in OUT/rank-i.log; what `scripts/dump_dp.sh` does, for one machine.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["rank", "world_size"])]
    pub devices: Vec<String>,
}

/// `tandem dump --devices A,B,..`: this command again once per device, as ranks 0..N-1 of a
/// data-parallel dump, in parallel; fails when a rank fails, naming its log.
fn run_on_devices(args: &DumpArgs) -> anyhow::Result<()> {
    // Dump ranks never meet: one that fails leaves the others' records worth finishing (the
    // job resumes per rank).
    super::ranks::run_on_devices(
        &args.devices,
        &args.out,
        "data-parallel dump",
        super::ranks::OnRankFailure::LetOthersFinish,
    )?;
    let world = args.devices.len();
    let reader = tandem_dump::DumpReader::open(&args.out)?;
    let m = reader.manifest();
    eprintln!(
        "{}: {world} ranks, {} rows, {} tokens ({})",
        args.out.display(),
        m.rows,
        m.tokens,
        if m.complete { "complete" } else { "incomplete" }
    );
    Ok(())
}

/// `--rank` / `--world-size`, else torchrun's RANK / WORLD_SIZE; `None` for a single-process
/// dump.
fn partition(args: &DumpArgs) -> anyhow::Result<Option<tandem_dump::Partition>> {
    Ok(super::ranks::rank_and_world(args.rank, args.world_size)?
        .map(|(rank, world_size)| tandem_dump::Partition { rank, world_size }))
}

#[derive(Args, Debug)]
pub struct DumpInfoArgs {
    /// A directory written by `tandem dump`.
    pub dir: PathBuf,
    #[command(flatten)]
    pub tables: TableArgs,
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    /// Directories written by `tandem dump`.
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    #[command(flatten)]
    pub tables: TableArgs,
}

#[derive(Args, Debug)]
pub struct TableArgs {
    /// Read at most this many rows of each dump for the statistics.
    #[arg(long)]
    pub limit: Option<usize>,
    /// The tables: datasets, norms, norms_by_position.
    #[command(flatten)]
    pub export: super::ExportArgs,
}

impl TableArgs {
    /// Computes the polars tables of `dirs`, prints them and exports them when asked.
    fn run(&self, dirs: &[&std::path::Path]) -> anyhow::Result<()> {
        let stats = tandem_stats::dump_stats(dirs, self.limit)?;
        print!("{stats}");
        if let Some(dir) = &self.export.export {
            for path in stats.export(dir, &self.export.format)? {
                println!("wrote {}", path.display());
            }
        }
        Ok(())
    }
}

pub fn run(args: DumpArgs) -> anyhow::Result<()> {
    if !args.devices.is_empty() {
        return run_on_devices(&args);
    }
    let options = DumpOptions {
        model_dir: args.model.model.clone(),
        dataset: args.dataset.clone(),
        data_root: args.data_root.clone(),
        out: args.out.clone(),
        taps: args.taps.clone(),
        max_samples: args.max_samples,
        max_seconds: args.max_seconds,
        max_len: args.max_len,
        regenerate: args.regenerate.then_some(GenerationSettings {
            max_new_tokens: args.max_new_tokens,
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            seed: args.seed,
        }),
        batch_size: args.batch_size,
        dtype: args.dtype,
        shard_limits: ShardLimits {
            max_rows: args.shard_rows,
            max_bytes: args.shard_mib << 20,
        },
        allow_eval: args.allow_eval,
        device_label: args.model.device.to_string(),
        progress: !args.quiet,
        simulate_full_disk_after: None,
        execution: args.model.execution,
        tensor_parallel: args.model.tp,
        partition: partition(&args)?,
    };
    // On a GPU the dump runs the path serving runs (the CUDA fast path), so the head is trained
    // on what its kernels will feed it; burn keeps micro-batched execution and other
    // architectures.
    let cuda = args.model.device.to_string() == "cuda";
    let micro_batched = args.model.execution == Execution::MicroBatched;
    match args.engine {
        EngineKind::Fast if !cuda => {
            anyhow::bail!("--engine fast runs on the GPU: pass --device cuda")
        }
        EngineKind::Fast if micro_batched => {
            anyhow::bail!("the CUDA fast path has no micro-batched execution: use --engine burn")
        }
        EngineKind::Fast | EngineKind::Auto if cuda && !micro_batched => {
            let model = &args.model;
            // A data-parallel rank's GPUs: its own when the launcher left them all visible
            // (torchrun's LOCAL_RANK), GPU 0 of the one `--devices` leaves it.
            let first = match options.partition {
                Some(_) => super::ranks::local_device()? * model.tp,
                None => 0,
            };
            let summary = tandem_dump::run_dump_with(&options, || {
                let target =
                    tandem_cuda::CudaTarget::load_ranks_from(&model.model, model.tp, first)?;
                eprintln!(
                    "dump: the CUDA fast path's target{}",
                    target.tensor_parallel_label()
                );
                Ok(Box::new(target))
            })?;
            report(&options, &summary)
        }
        _ => with_backend!(args.model.device, |B, device| {
            let summary = tandem_dump::run_dump::<B>(&options, &device)?;
            report(&options, &summary)
        }),
    }
}

fn report(options: &DumpOptions, s: &tandem_dump::DumpSummary) -> anyhow::Result<()> {
    let m = &s.manifest;
    if s.resumed_rows > 0 {
        eprintln!(
            "resumed after {} rows already in {}",
            s.resumed_rows,
            tandem_dump::dump_dir(options).display()
        );
    }
    eprintln!(
        "wrote {} rows, {} tokens in {:.1}s: {:.0} tok/s overall, {:.0} tok/s in prefill captures",
        s.rows,
        s.tokens,
        s.seconds,
        s.tokens_per_second(),
        s.capture_tokens_per_second()
    );
    if options.regenerate.is_some() {
        eprintln!(
            "regenerated {} turns ({} hit the token budget): {} tokens in {:.1}s, {:.1} tok/s",
            s.generated_turns,
            s.cut_turns,
            s.generated_tokens,
            s.generation_seconds,
            s.generation_tokens_per_second()
        );
    }
    let skipped: Vec<String> = s.skipped.iter().map(|(r, n)| format!("{r}={n}")).collect();
    eprintln!(
        "skipped this run: {}",
        if skipped.is_empty() {
            "none".to_owned()
        } else {
            skipped.join(" ")
        }
    );
    eprintln!(
        "{}: {} rows, {} tokens ({:.1}% assistant), {} shards, taps {}, {}{}",
        tandem_dump::dump_dir(options).display(),
        m.rows,
        m.tokens,
        100.0 * m.assistant_share(),
        m.shards.len(),
        tandem_wiring::format_taps(&m.wiring.taps),
        m.dtype,
        if m.complete { ", dataset complete" } else { "" }
    );
    if s.resumed_rows == 0
        && let Some(why) = tandem_dump::zero_rows_reason(
            s.rows,
            &s.skipped,
            options.regenerate.is_some(),
            &options.dataset,
        )
    {
        anyhow::bail!(why);
    }
    Ok(())
}

pub fn run_info(args: DumpInfoArgs) -> anyhow::Result<()> {
    let info = tandem_dump::dump_info(&args.dir)?;
    print!("{info}");
    args.tables.run(&[&args.dir])
}

pub fn run_stats(args: StatsArgs) -> anyhow::Result<()> {
    let dirs: Vec<&std::path::Path> = args.dirs.iter().map(PathBuf::as_path).collect();
    args.tables.run(&dirs)
}
