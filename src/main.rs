//! `tandem`: the command line. Parses arguments and dispatches to `commands/*`; all logic lives
//! in the library crates.

mod commands;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tandem",
    version,
    about = "EAGLE-3 speculative decoding with one capture hook shared by training and serving"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert a GGUF file (llama.cpp) to a Hugging Face model directory.
    ImportGguf(commands::import::ImportArgs),
    /// Generate text with the target model alone (no drafting).
    Generate(commands::generate::GenerateArgs),
    /// Print the taps of the target for a prompt (through the capture hook) and their norms.
    Taps(commands::taps::TapsArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::ImportGguf(args) => commands::import::run(args),
        Command::Generate(args) => commands::generate::run(args),
        Command::Taps(args) => commands::taps::run(args),
    }
}
