//! `tandem serve`: loads the target and the head on the engine thread (the wiring manifest is
//! checked there and a mismatch refuses to start), then serves the OpenAI API with axum.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use tandem_model::{SamplingParams, TargetTokenizer};
use tandem_serve::scheduler::DecoderFactory;
use tandem_serve::{AppState, Decoder, Scheduler, SchedulerConfig, SpecDecoder};

use super::ModelArgs;
use super::spec::{EngineKind, SpecArgs};
use crate::with_backend;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Serve the target alone (the baseline), without the draft head.
    #[arg(long)]
    pub no_draft: bool,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (printed on start).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Sequences decoded together at most.
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Requests waiting to join the batch at most; more are answered 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Rounds a request may wait outside a busy batch so that several join in one prefill
    /// (only while fewer than one request waits for every 8 running rows; 0: join at once).
    /// 4 by default: with prefill groups it took speculative serving at c=32 from 0.875x to
    /// 0.998x target-only on an H100 (BENCHMARKS.md, issue #16 session 36).
    #[arg(long, default_value_t = 4)]
    pub join_hold_rounds: usize,
    /// Context (KV-cache columns) per sequence.
    #[arg(long, default_value_t = 2048)]
    pub context: usize,
    /// max_tokens when a request gives none.
    #[arg(long, default_value_t = 256)]
    pub default_max_tokens: usize,
    /// The model name clients pass (default: the model directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// auto (the CUDA fast path on --device cuda, burn on cpu), burn, or fast.
    #[arg(long, default_value = "auto")]
    pub engine: EngineKind,
    /// How each round's draft shape is chosen: `adaptive` (from the batch size, the cost of
    /// each shape measured at start-up on this device and the acceptance observed; rounds
    /// without drafts when speculation would be slower) or `fixed` (always
    /// --steps/--topk/--num-draft-tokens). The fast path measures at the CUDA graphs' batch
    /// sizes; the burn engines at batch 1 and 2 (costs grow about linearly with rows there).
    #[arg(long, default_value = "adaptive")]
    pub speculation: Speculation,
    /// The shapes the adaptive policy chooses among, steps/topk/num_draft_tokens. Default:
    /// 3/1/4,3/4/8,6/8/48 on the fast path; 3/1/4 on the burn engines, where measuring the
    /// wide trees at start-up took most of a minute on a 2-core CPU, where they lost to plain rounds.
    #[arg(long)]
    pub policy_shapes: Option<String>,
    /// Write every round and admission of the fast path (batch size, context, choice, time by
    /// phase, the policy's prediction) as CSV to this file when the server stops.
    #[arg(long)]
    pub round_log: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Speculation {
    Adaptive,
    Fixed,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let tokenizer = Arc::new(TargetTokenizer::load(&args.model.model)?);
    let model_id = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "tandem".into())
    });
    let factory_args = args.clone();
    let factory: DecoderFactory =
        Box::new(move || load_decoder(&factory_args).map_err(|e| format!("{e:#}")));
    let (scheduler, engine) = Scheduler::spawn(
        SchedulerConfig {
            max_batch: args.max_batch,
            max_queue: args.max_queue,
            join_hold_rounds: args.join_hold_rounds,
        },
        factory,
    )
    .map_err(|e| anyhow::anyhow!("tandem serve did not start: {e}"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let head = if args.no_draft {
        "none (target only)".to_owned()
    } else {
        args.spec.draft.display().to_string()
    };
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        println!(
            "tandem serve: listening on http://{addr} (model `{model_id}` from {}, head {head}, \
             device {}{}{}, context {}, max batch {})",
            args.model.model.display(),
            args.model.device,
            if args.model.device.to_string() == "cuda" && args.engine != EngineKind::Burn {
                ", CUDA fast path"
            } else {
                ""
            },
            match args.model.tp {
                1 => String::new(),
                n => format!(", tensor-parallel over {n} ranks"),
            },
            scheduler.limits.context,
            args.max_batch
        );
        let state = AppState {
            scheduler,
            tokenizer,
            model_id,
            default_max_tokens: args.default_max_tokens,
        };
        tandem_serve::serve(listener, tandem_serve::router(state)).await?;
        anyhow::Ok(())
    })?;
    // Every handle is gone with the router: the engine thread finishes and exits.
    let _ = engine.join();
    println!("tandem serve: stopped");
    Ok(())
}

fn load_decoder(args: &ServeArgs) -> anyhow::Result<Box<dyn Decoder>> {
    let cuda = args.model.device.to_string() == "cuda";
    match args.engine {
        EngineKind::Fast | EngineKind::Auto if cuda => {
            let policy = adaptive_shapes(args, FAST_POLICY_SHAPES)?;
            let mut decoder = super::spec_fast::serve_decoder(
                &args.model,
                &args.spec,
                args.no_draft,
                args.context,
                args.max_batch,
                policy,
            )?;
            if let Some(path) = &args.round_log {
                decoder.log_rounds(path.clone());
            }
            return Ok(Box::new(decoder));
        }
        EngineKind::Fast => anyhow::bail!("--engine fast runs on the GPU: pass --device cuda"),
        _ => {}
    }
    with_backend!(args.model.device, |B, device| {
        if args.no_draft {
            let target = args.model.load::<B>(&device)?;
            let config = args.spec.config(SamplingParams::greedy(), 0);
            let decoder = SpecDecoder::new(
                target,
                None,
                tandem_model::TapRequest::none(),
                config,
                args.context,
                None,
                0,
            )?;
            Ok(Box::new(decoder) as Box<dyn Decoder>)
        } else {
            let loaded = super::spec::load::<B>(&args.model, &args.spec, &device)?;
            // Sampling and seed are per request; the engine's own are unused by the server.
            let config = args.spec.config(SamplingParams::greedy(), 0);
            let shapes = adaptive_shapes(args, BURN_POLICY_SHAPES)?;
            // Rounds are plain until the costs are measured on the decoder's own caches.
            let forced = shapes.clone().map(|shapes| {
                tandem_infer::SpeculationPolicy::forced(shapes, tandem_infer::Choice::Plain)
            });
            let mut decoder = SpecDecoder::new(
                loaded.target,
                Some(loaded.head.draft),
                loaded.taps,
                config,
                args.context,
                forced,
                0,
            )?;
            if let Some(shapes) = shapes {
                let batches: Vec<usize> = if args.max_batch > 1 {
                    vec![1, 2]
                } else {
                    vec![1]
                };
                calibrate_policy(&mut decoder, &batches, &shapes)?;
            }
            Ok(Box::new(decoder) as Box<dyn Decoder>)
        }
    })
}

/// The adaptive policy's default shapes on the CUDA fast path.
const FAST_POLICY_SHAPES: &str = "3/1/4,3/4/8,6/8/48";
/// ... and on the burn engines: on a 2-core CPU the start-up measurement of all three took 50 s
/// (release build, SmolLM2, context 2048), 6/8/48's rounds most of it, at 21x a plain round.
const BURN_POLICY_SHAPES: &str = "3/1/4";

/// The shapes the adaptive policy chooses among (`--policy-shapes`, else `default`), or `None`
/// for a fixed shape (`--speculation fixed`) or no head.
fn adaptive_shapes(
    args: &ServeArgs,
    default: &str,
) -> anyhow::Result<Option<Vec<tandem_infer::Shape>>> {
    let list = args.policy_shapes.as_deref().unwrap_or(default);
    Ok(match args.speculation {
        Speculation::Adaptive if !args.no_draft => {
            Some(tandem_infer::Shape::parse_list(list).context("--policy-shapes")?)
        }
        _ => None,
    })
}

/// Measures the cost of each of `shapes` and of a plain round on `decoder`'s own caches at
/// `batches` (the adaptive policy's start-up table; the policy chooses each round from then on)
/// and prints the table with the time it took. The policy's settings are the defaults, but for
/// `TANDEM_POLICY_MARGIN=F`, the fraction a shape must beat plain rounds by, and
/// `TANDEM_POLICY_PROBE_BUDGET=F|off`, what a probe may cost, and `TANDEM_POLICY_MIN_MET=N`,
/// the sequence-rounds at a batch class before they cap a shape's estimate there (A/B knobs
/// for the serve load test).
pub fn calibrate_policy<T: tandem_infer::SpecBackend>(
    decoder: &mut tandem_serve::EngineDecoder<T>,
    batches: &[usize],
    shapes: &[tandem_infer::Shape],
) -> anyhow::Result<()> {
    let mut config = tandem_infer::PolicyConfig::default();
    if let Some(margin) =
        tandem_infer::policy::margin_override(std::env::var("TANDEM_POLICY_MARGIN").ok().as_deref())
    {
        config.margin = margin;
    }
    if let Some(budget) = tandem_infer::policy::probe_budget_override(
        std::env::var("TANDEM_POLICY_PROBE_BUDGET").ok().as_deref(),
    ) {
        config.probe_budget = budget;
    }
    if let Some(weight) = tandem_infer::policy::min_met_override(
        std::env::var("TANDEM_POLICY_MIN_MET").ok().as_deref(),
    ) {
        config.min_met_weight = weight;
    }
    let start = std::time::Instant::now();
    let costs = decoder
        .calibrate(batches, config)
        .context("measuring the cost of each draft shape")?;
    eprintln!(
        "speculation policy: round costs measured in {:.1}s (ms per round):\n{}",
        start.elapsed().as_secs_f64(),
        costs.render(shapes)
    );
    Ok(())
}
