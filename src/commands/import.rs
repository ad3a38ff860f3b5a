use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// The GGUF file to convert.
    pub file: PathBuf,
    /// Output HF model directory (created).
    pub out_dir: PathBuf,
}

pub fn run(args: ImportArgs) -> anyhow::Result<()> {
    let report = tandem_gguf::import_gguf(&args.file, &args.out_dir)
        .with_context(|| format!("importing {}", args.file.display()))?;
    println!(
        "{} tensors ({} parameters), vocab {}, pre-tokenizer {}, tied embeddings: {}",
        report.tensor_count,
        report.parameter_count,
        report.vocab_size,
        report.tokenizer_pre,
        report.tie_word_embeddings
    );
    for warning in &report.warnings {
        eprintln!("warning: {warning}");
    }
    println!("wrote {}", args.out_dir.display());
    Ok(())
}
