//! `tandem replay`: re-runs a dump's samples through the serving path and names every wiring
//! fault (the logic is in `tandem-replay`). Exits non-zero when any slot or finding is a
//! mismatch, after printing the table and writing the JSON / HTML reports.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use tandem_dump::DumpReader;
use tandem_model::burn::prelude::Backend;
use tandem_replay::{HeadWiring, ReplayOptions, Tolerance, fingerprint_model, replay};

use super::ModelArgs;
use crate::with_backend;

#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// The dump directory to replay.
    #[arg(long)]
    pub dump: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    /// EAGLE-3 head whose serving taps are checked against the dump (its Tandem manifest, else
    /// its eagle_aux_hidden_state_layer_ids as SGLang reads them, else the default taps).
    #[arg(long)]
    pub head: Option<PathBuf>,
    /// Replay only the first N samples.
    #[arg(long)]
    pub max_samples: Option<usize>,
    /// Smallest cosine similarity that counts as a match.
    #[arg(long, default_value_t = Tolerance::default().min_cosine)]
    pub min_cosine: f64,
    /// Largest relative error (max |dump - recomputed| / max |recomputed|) that counts.
    #[arg(long, default_value_t = Tolerance::default().max_rel_err)]
    pub max_rel_err: f64,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the report as a self-contained HTML page here.
    #[arg(long)]
    pub html: Option<PathBuf>,
}

pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    with_backend!(args.model.device, |B, device| run_on::<B>(&args, &device))
}

fn run_on<B: Backend>(args: &ReplayArgs, device: &B::Device) -> anyhow::Result<()> {
    let dump = DumpReader::open(&args.dump)?;
    let model = args.model.load::<B>(device)?;
    let target = fingerprint_model(&args.model.model)?;
    let head = args
        .head
        .as_deref()
        .map(|dir| HeadWiring::load(dir, model.spec.num_layers))
        .transpose()
        .context("reading the head's config")?;
    let device_name = args.model.device.to_string();
    let options = ReplayOptions {
        max_samples: args.max_samples,
        tolerance: Tolerance {
            min_cosine: args.min_cosine,
            max_rel_err: args.max_rel_err,
        },
        serving_dtype: if device_name == "cuda" { "bf16" } else { "f32" }.to_owned(),
        device: device_name,
        model_label: args.model.model.display().to_string(),
    };
    let report = replay(&model, &target, &dump, head.as_ref(), &options)?;
    print!("{}", report.to_table());
    if let Some(path) = &args.json {
        std::fs::write(path, report.to_json() + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.html {
        std::fs::write(path, report.to_html())
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    let problems = report.problems();
    if !problems.is_empty() {
        anyhow::bail!(
            "replay found {} problem(s) in {}; first: {}",
            problems.len(),
            args.dump.display(),
            problems[0]
        );
    }
    Ok(())
}

/// `tandem compare`: offline (teacher-forced on a dump) vs online (the engine on prompts)
/// acceptance per draft position.
#[derive(Args, Debug)]
pub struct CompareArgs {
    /// Dump the head is evaluated on offline.
    #[arg(long)]
    pub dump: PathBuf,
    /// EAGLE-3 head directory.
    #[arg(long)]
    pub head: PathBuf,
    /// Prompt set for the online run: mtbench, humaneval, or a JSONL/JSON path.
    #[arg(long, default_value = "mtbench")]
    pub prompts: String,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Where datasets were fetched (scripts/fetch_datasets.sh).
    #[arg(long, default_value = "data")]
    pub data_root: PathBuf,
    /// Dump samples evaluated offline.
    #[arg(long, default_value_t = 16)]
    pub max_samples: usize,
    /// Prompts run online.
    #[arg(long, default_value_t = 8)]
    pub max_prompts: usize,
    /// Draft steps (chain), offline and online.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Tokens generated per prompt online.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Flag a draft position whose offline acceptance exceeds the online one by more.
    #[arg(long, default_value_t = 0.2)]
    pub threshold: f64,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the report (with a plot) as a self-contained HTML page here.
    #[arg(long)]
    pub html: Option<PathBuf>,
}

pub fn run_compare(args: CompareArgs) -> anyhow::Result<()> {
    with_backend!(args.model.device, |B, device| compare_on::<B>(
        &args, &device
    ))
}

fn compare_on<B: Backend>(args: &CompareArgs, device: &B::Device) -> anyhow::Result<()> {
    use tandem_infer::wiring::{check_head, head_taps, serving_manifest};
    use tandem_model::{ChatMessage, TapRequest, TargetTokenizer};

    let dump = DumpReader::open(&args.dump)?;
    let tokenizer = TargetTokenizer::load(&args.model.model)?;
    let model = args.model.load::<B>(device)?;
    let head = tandem_eagle::load_pretrained(&args.head, model.embed_tokens.clone(), device)
        .with_context(|| format!("loading the head {}", args.head.display()))?;
    let taps = head_taps(&head.config, model.spec.num_layers)?;
    let device_name = args.model.device.to_string();
    let dtype = if device_name == "cuda" { "bf16" } else { "f32" };
    let serving = serving_manifest(&args.model.model, taps.clone(), dtype, &device_name)?;
    // Compare diagnoses: a wiring mismatch is reported, not refused (it explains a gap).
    for m in check_head(&head.config, &serving)? {
        eprintln!("wiring: {m}");
    }
    let offline = tandem_replay::offline_acceptance(
        &model,
        &head.draft,
        &dump,
        args.steps,
        Some(args.max_samples),
    )?;
    let prompts: Vec<Vec<u32>> = tandem_data::eval_prompts(&args.prompts, &args.data_root)
        .with_context(|| format!("reading prompts {}", args.prompts))?
        .iter()
        .take(args.max_prompts)
        .map(|p| {
            let first = p.turns.first().cloned().unwrap_or_default();
            tokenizer.encode_chat(&[ChatMessage::new("user", first)], true)
        })
        .collect::<Result<_, _>>()?;
    let online = tandem_replay::online_acceptance(
        &model,
        &head.draft,
        TapRequest::new(taps),
        &prompts,
        args.steps,
        args.max_new_tokens,
        &tokenizer.eos_ids,
    )?;
    let report = tandem_replay::CompareReport::new(
        [
            args.dump.display().to_string(),
            args.head.display().to_string(),
            args.prompts.clone(),
        ],
        args.steps,
        offline,
        online,
        args.threshold,
    );
    print!("{}", report.to_table());
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)? + "\n";
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.html {
        std::fs::write(path, report.to_html())
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if report.flagged {
        anyhow::bail!("{}", report.verdict[0]);
    }
    Ok(())
}
