//! `tandem diagnose`: which wiring was a head trained with? Generates greedy continuations of a
//! few prompts with the target, teacher-forces the head on them under every candidate wiring
//! and ranks the wirings by acceptance (the logic is in `tandem_replay::diagnose`). Exits
//! non-zero when the wiring Tandem / SGLang would serve the head on loses significant acceptance
//! against the best one.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use tandem_model::burn::prelude::Backend;
use tandem_model::{ChatMessage, TargetTokenizer};
use tandem_replay::{DiagnoseLabels, DiagnoseOptions, diagnose, generate_samples};

use super::ModelArgs;
use crate::with_backend;

#[derive(Args, Debug)]
pub struct DiagnoseArgs {
    /// EAGLE-3 head directory (Tandem, SpecForge, EAGLE or SGLang/vLLM layout; the config may
    /// carry a Tandem manifest, only eagle_aux_hidden_state_layer_ids, or no ids at all).
    #[arg(long)]
    pub head: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt set the target continues: mtbench, humaneval, or a JSONL/JSON path.
    #[arg(long, default_value = "mtbench")]
    pub prompts: String,
    /// Where datasets were fetched (scripts/fetch_datasets.sh).
    #[arg(long, default_value = "data")]
    pub data_root: PathBuf,
    /// Prompts continued (the first turn of each); at least 1.
    #[arg(long, default_value_t = 4, value_parser = super::at_least_one)]
    pub samples: usize,
    /// Tokens the target generates per prompt (greedy); the head is measured on these.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Draft steps of the chain measured.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Accept-length margin over the runner-up below which the result is called inconclusive.
    #[arg(long, default_value_t = 0.05)]
    pub min_margin: f64,
    /// Wirings printed in the terminal table (all of them go to the JSON / HTML reports).
    #[arg(long, default_value_t = 15)]
    pub top: usize,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the report as a self-contained HTML page here.
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// The table: diagnose_wirings (every wiring swept).
    #[command(flatten)]
    pub export: super::ExportArgs,
}

pub fn run(args: DiagnoseArgs) -> anyhow::Result<()> {
    with_backend!(args.model.device, |B, device| run_on::<B>(&args, &device))
}

fn run_on<B: Backend>(args: &DiagnoseArgs, device: &B::Device) -> anyhow::Result<()> {
    let tokenizer = TargetTokenizer::load(&args.model.model)?;
    let model = args.model.load::<B>(device)?;
    let head = tandem_eagle::load_pretrained(&args.head, model.embed_tokens.clone(), device)
        .with_context(|| format!("loading the head {}", args.head.display()))?;
    let prompts: Vec<Vec<u32>> = tandem_data::eval_prompts(&args.prompts, &args.data_root)
        .with_context(|| format!("reading prompts {}", args.prompts))?
        .iter()
        .take(args.samples)
        .map(|p| {
            let first = p.turns.first().cloned().unwrap_or_default();
            tokenizer.encode_chat(&[ChatMessage::new("user", first)], true)
        })
        .collect::<Result<_, _>>()?;
    anyhow::ensure!(!prompts.is_empty(), "no prompts in {}", args.prompts);
    let samples = generate_samples(&model, &prompts, args.max_new_tokens, &tokenizer.eos_ids)?;
    let options = DiagnoseOptions {
        steps: args.steps,
        min_margin: args.min_margin,
        labels: DiagnoseLabels {
            head: args.head.display().to_string(),
            model: args.model.model.display().to_string(),
            prompts: args.prompts.clone(),
            device: args.model.device.to_string(),
            architecture: String::new(),
        },
    };
    let report = diagnose(&model, &head.draft, &head.config, &samples, &options)?;
    print!("{}", report.to_table(args.top));
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
    args.export.write(|| report.tables())?;
    if !report.consistent {
        anyhow::bail!(
            "serving the head on {} costs significant acceptance against {}; see the diagnosis",
            tandem_wiring::format_taps(&report.serving),
            tandem_replay::diagnose::format_wiring(&report.best)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::DiagnoseArgs;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: DiagnoseArgs,
    }

    #[test]
    fn zero_samples_is_refused_naming_the_option() {
        let err = Cli::try_parse_from(["diagnose", "--head", "h", "--samples", "0"])
            .err()
            .expect("--samples 0 must be refused")
            .to_string();
        assert!(
            err.contains("--samples") && err.contains("at least 1"),
            "{err}"
        );
        let ok = Cli::try_parse_from(["diagnose", "--head", "h", "--samples", "3"]).unwrap();
        assert_eq!(ok.args.samples, 3);
    }
}
