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
    /// Dump EAGLE-3 training data (aux hidden states through the capture hook) as Arrow shards.
    Dump(commands::dump::DumpArgs),
    /// Summarise a dump directory: rows, tokens, taps, dtype, then polars tables (per dataset,
    /// per-tap norms overall and by position); `--export DIR` writes them as Parquet or CSV.
    DumpInfo(commands::dump::DumpInfoArgs),
    /// The polars tables of `dump-info` over one or more dumps together (one row group per
    /// dataset), printed and optionally exported as Parquet or CSV.
    Stats(commands::dump::StatsArgs),
    /// Benchmark target-only decoding (TTFT, step time, tokens/s) at several batch sizes.
    BenchTarget(commands::bench::BenchTargetArgs),
    /// Compare a device (CUDA bf16) against the CPU f32 path: logits, taps, greedy tokens.
    CheckDevice(commands::check_device::CheckDeviceArgs),
    /// The CUDA fast path against the CPU f32 reference: logits, every tap and greedy tokens
    /// over a sweep of batch sizes and KV lengths (prefill, decode and tree steps).
    FastCheck(commands::fast::FastCheckArgs),
    /// Decode speed of the CUDA fast path (TTFT, step time, tokens/s), like bench-target.
    FastBench(commands::fast::FastBenchArgs),
    /// Train an EAGLE-3 draft head on dumps and export it for SGLang / vLLM.
    Train(commands::train::TrainArgs),
    /// The GPU trainer against burn's autodiff on the CPU (loss, every gradient, one AdamW
    /// step) on a small random target; exits non-zero outside tolerance.
    TrainCheck,
    /// Export a head in another format: `speculators` (vLLM loads it natively; the aux ids at
    /// the top level in vLLM's convention, the Tandem manifest kept).
    ExportHead(commands::export::ExportHeadArgs),
    /// Redraw curves.html from metrics.jsonl files; several, in order, for a head trained in
    /// stages (each run --init-from the previous head): one plot of its whole training.
    TrainCurves(commands::train::TrainCurvesArgs),
    /// Speculative vs target-only decoding on a prompt set: tokens/s, accept length,
    /// per-position acceptance, greedy equality.
    Bench(commands::spec::BenchArgs),
    /// Re-run a dump through the serving path: per slot, what it holds vs its manifest and
    /// what serving feeds the head; fingerprints, widths, dtypes. Non-zero exit on a mismatch.
    Replay(commands::replay::ReplayArgs),
    /// Offline acceptance (the head teacher-forced on a dump) next to online acceptance (the
    /// speculative engine on prompts), per draft position; flags a gap.
    Compare(commands::replay::CompareArgs),
    /// Sweep candidate wirings (conventions, +-1 shifts, embed, permutations, normed taps) and
    /// measure the head's acceptance under each on target-generated text: which wiring the head
    /// was trained with, and what serving it otherwise costs.
    Diagnose(commands::diagnose::DiagnoseArgs),
    /// Serve the target and the head behind an OpenAI-compatible HTTP API.
    Serve(commands::serve::ServeArgs),
    /// A bounded load test against a running server: p50/p99 latency and throughput.
    LoadTest(commands::load_test::LoadTestArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::ImportGguf(args) => commands::import::run(args),
        Command::Generate(args) => commands::generate::run(args),
        Command::Taps(args) => commands::taps::run(args),
        Command::Dump(args) => commands::dump::run(args),
        Command::DumpInfo(args) => commands::dump::run_info(args),
        Command::Stats(args) => commands::dump::run_stats(args),
        Command::BenchTarget(args) => commands::bench::run(args),
        Command::CheckDevice(args) => commands::check_device::run(args),
        Command::FastCheck(args) => commands::fast::run_check(args),
        Command::FastBench(args) => commands::fast::run_bench(args),
        Command::Train(args) => commands::train::run(args),
        Command::TrainCheck => commands::train::run_check(),
        Command::ExportHead(args) => commands::export::run(args),
        Command::TrainCurves(args) => commands::train::run_curves(args),
        Command::Bench(args) => commands::spec::run_bench(args),
        Command::Replay(args) => commands::replay::run(args),
        Command::Compare(args) => commands::replay::run_compare(args),
        Command::Diagnose(args) => commands::diagnose::run(args),
        Command::Serve(args) => commands::serve::run(args),
        Command::LoadTest(args) => commands::load_test::run(args),
    }
}
