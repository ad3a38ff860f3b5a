use clap::Args;
use tandem_model::burn::prelude::{Backend, Tensor};
use tandem_model::{LogitsFor, TapRequest, TargetTokenizer};
use tandem_wiring::TapId;

use super::ModelArgs;
use crate::with_backend;

#[derive(Args, Debug)]
pub struct TapsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value = "The capital of France is")]
    pub prompt: String,
}

pub fn run(args: TapsArgs) -> anyhow::Result<()> {
    with_backend!(args.model.device, |B, device| run_on::<B>(&args, &device))
}

/// Prints the mean L2 norm per token of every tap point: the residual stream grows through the
/// blocks while `final` (normed) stays near sqrt(hidden) * |w|, which is how a normed tap is
/// told apart from a residual one.
fn run_on<B: Backend>(args: &TapsArgs, device: &B::Device) -> anyhow::Result<()> {
    let tokenizer = TargetTokenizer::load(&args.model.model)?;
    let model = args.model.load::<B>(device)?;
    let prompt = tokenizer.encode(&args.prompt, true)?;
    let mut taps = vec![TapId::Embed];
    taps.extend((0..model.spec.num_layers).map(TapId::Block));
    taps.push(TapId::Final);
    let mut cache = model.new_cache(1, prompt.len());
    let step = cache.prefill_step(&[&prompt])?;
    let out = model.forward(&step, &mut cache, &TapRequest::new(taps), LogitsFor::None)?;
    println!("{:<10} {:>12}", "tap", "mean |h|");
    for (tap, tensor) in out.taps.taps.iter().zip(&out.taps.tensors) {
        let norms: Tensor<B, 1> = tensor
            .clone()
            .powi_scalar(2)
            .sum_dim(2)
            .sqrt()
            .mean()
            .reshape([1]);
        let value = norms
            .into_data()
            .convert::<f32>()
            .as_slice::<f32>()
            .expect("floats")[0];
        println!("{:<10} {:>12.3}", tap.to_string(), value);
    }
    Ok(())
}
