//! `tandem export-head`: a trained head in another engine's format (today: `speculators`,
//! which vLLM loads natively).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use tandem_eagle::{Verifier, WeightDtype, load_host, save_speculators};

#[derive(Args, Debug)]
pub struct ExportHeadArgs {
    /// The head directory to export (any layout `tandem` loads).
    #[arg(long)]
    pub head: PathBuf,
    /// Output directory (written under a temporary name, renamed when complete).
    #[arg(long)]
    pub out: PathBuf,
    /// HF id or path of the target, written as `speculators_config.verifier.name_or_path`.
    #[arg(long)]
    pub verifier: String,
    /// The target's architecture [default: the head manifest's target architecture].
    #[arg(long)]
    pub verifier_architecture: Option<String>,
    /// Draft tokens per round (`proposal_methods[0].speculative_tokens`; vLLM's default
    /// `num_speculative_tokens`).
    #[arg(long, default_value_t = 3, value_parser = super::at_least_one)]
    pub speculative_tokens: usize,
}

pub fn run(args: ExportHeadArgs) -> anyhow::Result<()> {
    let host = load_host(&args.head)
        .with_context(|| format!("loading the head {}", args.head.display()))?;
    let architecture = match (&args.verifier_architecture, &host.config.tandem_wiring) {
        (Some(a), _) => a.clone(),
        (None, Some(w)) => w.target.architecture.clone(),
        (None, None) => anyhow::bail!(
            "{} has no Tandem manifest naming its target: pass --verifier-architecture",
            args.head.display()
        ),
    };
    let dtype = match host.config.torch_dtype.as_deref() {
        Some("float32") => WeightDtype::F32,
        _ => WeightDtype::Bf16,
    };
    let verifier = Verifier {
        name_or_path: args.verifier.clone(),
        architecture,
        speculative_tokens: args.speculative_tokens,
    };
    let partial = args.out.with_extension("partial");
    if partial.exists() {
        std::fs::remove_dir_all(&partial)?;
    }
    save_speculators(&host, &partial, dtype, &verifier)?;
    if args.out.exists() {
        anyhow::bail!(
            "{} exists; the export is in {} (move it or remove the old one)",
            args.out.display(),
            partial.display()
        );
    }
    std::fs::rename(&partial, &args.out)?;
    println!(
        "wrote {} (speculators eagle3, verifier {} [{}], {} speculative tokens)",
        args.out.display(),
        verifier.name_or_path,
        verifier.architecture,
        verifier.speculative_tokens
    );
    Ok(())
}
