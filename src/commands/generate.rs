use std::time::Instant;

use clap::Args;
use tandem_model::burn::prelude::Backend;
use tandem_model::{ChatMessage, GenerateOptions, SamplingParams, TargetTokenizer};

use super::ModelArgs;
use crate::with_backend;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text.
    #[arg(long, default_value = "The capital of France is")]
    pub prompt: String,
    /// Render the prompt as a user turn with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System prompt for --chat (default: whatever the template does without one).
    #[arg(long)]
    pub system: Option<String>,
    /// Tokens to generate (at least 1).
    #[arg(long, default_value_t = 32, value_parser = super::at_least_one)]
    pub max_tokens: usize,
    /// Keep generating past the end-of-sequence token (by default generation stops there,
    /// with or without --chat, as HF transformers' `generate` does).
    #[arg(long)]
    pub ignore_eos: bool,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the generated token ids too.
    #[arg(long)]
    pub ids: bool,
    /// Decode speculatively with this EAGLE-3 head (see also --steps, --topk,
    /// --num-draft-tokens).
    #[arg(long)]
    pub draft: Option<std::path::PathBuf>,
    /// Draft depth (SGLang --speculative-num-steps).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Branching (SGLang --speculative-eagle-topk); 1 = chain.
    #[arg(long, default_value_t = 1)]
    pub topk: usize,
    /// Tree size verified (default steps + 1 for a chain, 8 for a tree).
    #[arg(long)]
    pub num_draft_tokens: Option<usize>,
    /// Serve even when the head's wiring differs from the serving taps (experiments only).
    #[arg(long)]
    pub allow_wiring_mismatch: bool,
    /// For a head without a Tandem manifest: the convention of its ids (see `tandem bench
    /// --help`).
    #[arg(long)]
    pub convention: Option<tandem_wiring::Convention>,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    // On --device cuda, decoding (speculative or not) runs on the CUDA fast path, which every
    // build has; burn-cuda would need a build with --features cuda.
    if args.model.device.to_string() == "cuda" {
        let tokenizer = TargetTokenizer::load(&args.model.model)?;
        let tokens = if args.draft.is_some() {
            let (spec, request) = speculative_request(&args, &tokenizer)?;
            super::spec_fast::generate(&args.model, &spec, &request)?
        } else {
            super::spec_fast::generate_target_only(&args.model, &request(&args, &tokenizer)?)?
        };
        return print_output(&args, &tokenizer, &tokens);
    }
    with_backend!(args.model.device, |B, device| run_on::<B>(&args, &device))
}

/// The prompt (chat template applied with --chat) and the sampling settings.
fn encode_prompt(
    args: &GenerateArgs,
    tokenizer: &TargetTokenizer,
) -> anyhow::Result<(Vec<u32>, SamplingParams, Vec<u32>)> {
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.clone()));
        }
        messages.push(ChatMessage::new("user", args.prompt.clone()));
        tokenizer.encode_chat(&messages, true)?
    } else {
        tokenizer.encode(&args.prompt, true)?
    };
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
    };
    // HF transformers stops raw (non-chat) generation at EOS too (`generation_config`).
    let stop_ids = if args.ignore_eos {
        Vec::new()
    } else {
        tokenizer.eos_ids.clone()
    };
    Ok((prompt, sampling, stop_ids))
}

/// The prompt, sampling, seed, budget and stop ids of one generation.
fn request(
    args: &GenerateArgs,
    tokenizer: &TargetTokenizer,
) -> anyhow::Result<super::spec::SpecRequest> {
    let (prompt, sampling, stop_ids) = encode_prompt(args, tokenizer)?;
    Ok(super::spec::SpecRequest {
        prompt,
        sampling,
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop_ids,
    })
}

fn speculative_request(
    args: &GenerateArgs,
    tokenizer: &TargetTokenizer,
) -> anyhow::Result<(super::spec::SpecArgs, super::spec::SpecRequest)> {
    let spec = super::spec::SpecArgs {
        draft: args.draft.clone().expect("called with --draft"),
        steps: args.steps,
        topk: args.topk,
        num_draft_tokens: args.num_draft_tokens,
        allow_wiring_mismatch: args.allow_wiring_mismatch,
        convention: args.convention,
    };
    Ok((spec, request(args, tokenizer)?))
}

fn print_output(
    args: &GenerateArgs,
    tokenizer: &TargetTokenizer,
    tokens: &[u32],
) -> anyhow::Result<()> {
    let text = tokenizer.decode(tokens, false)?;
    if args.chat {
        println!("{text}");
    } else {
        println!("{}{}", args.prompt, text);
    }
    if args.ids {
        println!("ids: {tokens:?}");
    }
    Ok(())
}

fn run_on<B: Backend>(args: &GenerateArgs, device: &B::Device) -> anyhow::Result<()> {
    let load_start = Instant::now();
    let tokenizer = TargetTokenizer::load(&args.model.model)?;
    if args.draft.is_some() {
        let (spec, request) = speculative_request(args, &tokenizer)?;
        let tokens = super::spec::generate::<B>(&args.model, &spec, &request, device)?;
        return print_output(args, &tokenizer, &tokens);
    }
    let (prompt, sampling, stop_ids) = encode_prompt(args, &tokenizer)?;
    // Loaded only on the plain path: the speculative path loads target and head together.
    let model = args.model.load::<B>(device)?;
    eprintln!(
        "loaded {} ({} layers) on {} in {:.2}s",
        args.model.model.display(),
        model.spec.num_layers,
        args.model.device,
        load_start.elapsed().as_secs_f64()
    );
    let options = GenerateOptions {
        max_new_tokens: args.max_tokens,
        sampling,
        stop_ids,
        seed: args.seed,
    };
    let generation = tandem_model::generate(&model, &prompt, &options)?;
    print_output(args, &tokenizer, &generation.tokens)?;
    eprintln!(
        "prompt {} tokens, generated {} ({:?}); time to first token {:.1} ms; decode {:.1} tok/s",
        prompt.len(),
        generation.tokens.len(),
        generation.finish_reason,
        generation.time_to_first_token * 1e3,
        generation.decode_tokens_per_second()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{GenerateArgs, encode_prompt};
    use clap::Parser;
    use tandem_model::TargetTokenizer;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: GenerateArgs,
    }

    fn parse(extra: &[&str]) -> Result<GenerateArgs, clap::Error> {
        let mut argv = vec!["generate"];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).map(|cli| cli.args)
    }

    #[test]
    fn zero_max_tokens_is_refused_naming_the_option() {
        // It used to fail later with "KV cache is full".
        let err = parse(&["--max-tokens", "0"]).err().unwrap().to_string();
        assert!(
            err.contains("--max-tokens") && err.contains("at least 1"),
            "{err}"
        );
        assert_eq!(parse(&["--max-tokens", "5"]).unwrap().max_tokens, 5);
    }

    #[test]
    fn raw_generation_stops_at_eos_like_hf_unless_told_not_to() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct");
        if !dir.join("tokenizer.json").is_file() {
            eprintln!(
                "skipped: {} is missing (scripts/fetch_smollm2.sh)",
                dir.display()
            );
            return;
        }
        let tokenizer = TargetTokenizer::load(&dir).unwrap();
        assert!(!tokenizer.eos_ids.is_empty());
        for chat in [false, true] {
            let mut args = parse(&["--prompt", "Hello"]).unwrap();
            args.chat = chat;
            let (_, _, stop) = encode_prompt(&args, &tokenizer).unwrap();
            assert_eq!(stop, tokenizer.eos_ids, "chat {chat}: stops at EOS");
            args.ignore_eos = true;
            let (_, _, stop) = encode_prompt(&args, &tokenizer).unwrap();
            assert!(stop.is_empty(), "chat {chat}: --ignore-eos");
        }
    }
}
