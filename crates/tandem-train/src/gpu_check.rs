//! `tandem train-check`: the GPU trainer (`tandem_cuda::CudaHeadTrainer`, hand-written
//! backward) against burn's autodiff on the CPU in f32, on one batch of a small random target:
//! the target argmax, the loss and accuracy denominators of every TTT step, the gradient of
//! every parameter, and one AdamW step. Run for 1, 4 and 7 TTT steps. The ignored test
//! `gpu_trainer` runs it too.
//!
//! Tolerances: the GPU computes matmuls with bf16 operands (as torch autocast does), so each
//! gradient is compared by relative L2 error (|g_gpu - g_cpu| / |g_cpu|) < 4e-2, and each
//! step's loss within 1% relative.

use std::path::PathBuf;

use burn::backend::{Autodiff, NdArray};
use burn::prelude::*;
use burn::tensor::TensorData;
use rand::{Rng, SeedableRng};
use tandem_cuda::{AdamWStep, CorpusBatch, CudaHeadTrainer, Gpu, TargetPieces};
use tandem_eagle::{Eagle3Config, Eagle3Draft, Linear, RmsNorm, build_vocab_map};
use tandem_model::HfConfig;
use tandem_model::testing::{rel_l2, scratch_dir, write_random_model};

use crate::data::Batch;
use crate::error::TrainError;
use crate::objective::{BatchTargets, draft_id_tensor, objective};
use crate::target::TargetHead;

fn gpu_err(e: tandem_cuda::CudaError) -> TrainError {
    TrainError::Gpu {
        reason: e.to_string(),
    }
}

pub(crate) type B = NdArray<f32>;
pub(crate) type AB = Autodiff<B>;

pub(crate) const VOCAB: usize = 512;
pub(crate) const HIDDEN: usize = 128;

/// A small random Llama target: hidden 128, 4 heads over 2 KV heads (head_dim 32),
/// SwiGLU 256, vocabulary 512, untied lm_head.
pub(crate) fn target_dir() -> Result<PathBuf, TrainError> {
    let dir = scratch_dir("gpu-trainer");
    let config: HfConfig = serde_json::from_value(serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "vocab_size": VOCAB, "max_position_embeddings": 512,
        "tie_word_embeddings": false
    }))
    .map_err(|source| TrainError::Json {
        path: dir.join("config.json"),
        source,
    })?;
    write_random_model(&dir, &config, 11).map_err(TrainError::io("write", &dir))?;
    Ok(dir)
}

pub(crate) fn bf16_round(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// A batch of sequences of `lengths` at `width` with random bf16-rounded taps (aux in [-2, 2),
/// last hidden in [-3, 3)) and token ids, each position's loss mask from `mask(t, rng)`: the
/// batch the trainer checks are run on (one RNG stream, drawn in this order).
pub(crate) fn random_batch(
    rng: &mut rand::rngs::StdRng,
    lengths: &[usize],
    width: usize,
    fc_in: usize,
    mut mask: impl FnMut(usize, &mut rand::rngs::StdRng) -> bool,
) -> Batch {
    let b = lengths.len();
    let mut batch = Batch {
        rows: (0..b).collect(),
        lengths: lengths.to_vec(),
        width,
        input_ids: vec![0; b * width],
        loss_mask: vec![0; b * width],
        aux: vec![0.0; b * width * fc_in],
        last_hidden: vec![0.0; b * width * HIDDEN],
    };
    for (s, &len) in lengths.iter().enumerate() {
        for t in 0..len {
            let row = s * width + t;
            for v in &mut batch.aux[row * fc_in..(row + 1) * fc_in] {
                *v = bf16_round(rng.random::<f32>() * 4.0 - 2.0);
            }
            for v in &mut batch.last_hidden[row * HIDDEN..(row + 1) * HIDDEN] {
                *v = bf16_round(rng.random::<f32>() * 6.0 - 3.0);
            }
            batch.input_ids[row] = rng.random_range(0..VOCAB as u32);
            batch.loss_mask[row] = u8::from(mask(t, rng));
        }
    }
    batch
}

/// The trainer's gradient tests' setup (the data-parallel replicas, the CPU backends): the
/// small target's head on `C`, a draft vocabulary of 128 from random token counts, a fresh head
/// for 3 TTT steps under autodiff, and four sequences of 32, 19, 27 and 12 tokens at width 32
/// (loss from position 2), all drawn from one RNG (seed 21) in that order.
#[cfg(test)]
pub(crate) struct GradientFixture<C: Backend> {
    pub head: TargetHead<C>,
    pub vocab: tandem_eagle::VocabMap,
    pub model: Eagle3Draft<Autodiff<C>>,
    pub fc_in: usize,
    pub batch: Batch,
}

#[cfg(test)]
pub(crate) fn gradient_fixture<C: Backend>(device: &C::Device) -> GradientFixture<C> {
    let head = TargetHead::<C>::load(&target_dir().unwrap(), device).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let counts: Vec<u64> = (0..VOCAB).map(|_| rng.random_range(0..1000)).collect();
    let vocab = build_vocab_map(&counts, 128, VOCAB).unwrap();
    let spec = Eagle3Config::for_target(&head.config, 128, 3)
        .resolve()
        .unwrap();
    let fc_in = spec.fc_in();
    let model = Eagle3Draft::<Autodiff<C>>::init(
        spec,
        vocab.clone(),
        Tensor::from_inner(head.embed_tokens.clone()),
        3,
        device,
    )
    .unwrap();
    let batch = random_batch(&mut rng, &[32, 19, 27, 12], 32, fc_in, |t, _| t > 1);
    GradientFixture {
        head,
        vocab,
        model,
        fc_in,
        batch,
    }
}

fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 data")
}

/// Gradient of a burn linear (`[in, out]`) in HF layout (`[out, in]`).
pub(crate) fn linear_grad<A: burn::tensor::backend::AutodiffBackend>(
    l: &Linear<A>,
    grads: &A::Gradients,
) -> Vec<f32> {
    let g = l.weight.val().grad(grads).expect("linear has a gradient");
    let [inp, out] = g.dims();
    let values = g
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 data");
    let mut t = vec![0f32; inp * out];
    for i in 0..inp {
        for o in 0..out {
            t[o * inp + i] = values[i * out + o];
        }
    }
    t
}

fn norm_grad(
    n: &RmsNorm<AB>,
    grads: &<AB as burn::tensor::backend::AutodiffBackend>::Gradients,
) -> Vec<f32> {
    host(n.weight.val().grad(grads).expect("norm has a gradient"))
}

/// Runs the check; returns one line per compared quantity and fails on the first quantity
/// outside its tolerance.
pub fn gpu_parity_check() -> Result<Vec<String>, TrainError> {
    let mut lines = Vec::new();
    let dir = target_dir()?;
    let device = Default::default();
    let head = TargetHead::<B>::load(&dir, &device)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let counts: Vec<u64> = (0..VOCAB).map(|_| rng.random_range(0..1000)).collect();
    let draft_vocab = 128;
    let vocab = build_vocab_map(&counts, draft_vocab, VOCAB)?;
    let spec = Eagle3Config::for_target(&head.config, draft_vocab, 3).resolve()?;
    let model = Eagle3Draft::<AB>::init(
        spec.clone(),
        vocab.clone(),
        Tensor::from_inner(head.embed_tokens.clone()),
        7,
        &device,
    )?;

    // Three sequences (lengths 40, 23, 31; width 40), inputs rounded to bf16 so both sides
    // read the same values (the GPU corpus is bf16, like the dumps).
    let lengths = vec![40usize, 23, 31];
    let (b, w) = (lengths.len(), 40usize);
    let fc_in = spec.fc_in();
    let batch = random_batch(&mut rng, &lengths, w, fc_in, |t, rng| {
        t > 2 && rng.random::<f32>() < 0.85
    });
    let (aux, last, ids, mask) = (
        batch.aux.clone(),
        batch.last_hidden.clone(),
        batch.input_ids.clone(),
        batch.loss_mask.clone(),
    );

    for steps in [1usize, 4, 7] {
        // burn, autodiff on the CPU.
        let draft_ids = draft_id_tensor::<B>(&vocab, &device);
        let targets = BatchTargets::<B>::compute(&head, &batch, &draft_ids);
        let aux_t =
            Tensor::<AB, 3>::from_data(TensorData::new(aux.clone(), [b, w, fc_in]), &device);
        let outputs = model.forward_ttt(aux_t, &ids, &lengths, steps)?;
        let ad_targets = BatchTargets::<AB> {
            probs: Tensor::from_inner(targets.probs.clone()),
            argmax: targets.argmax.clone(),
        };
        let (loss, stats) = objective(&outputs, &ad_targets, &batch, &model.vocab);
        let grads = loss.backward();
        let m = &model.midlayer;
        let want: Vec<(&str, Vec<f32>)> = vec![
            ("fc.weight", linear_grad(&model.fc, &grads)),
            (
                "midlayer.self_attn.q_proj.weight",
                linear_grad(&m.self_attn.q_proj, &grads),
            ),
            (
                "midlayer.self_attn.k_proj.weight",
                linear_grad(&m.self_attn.k_proj, &grads),
            ),
            (
                "midlayer.self_attn.v_proj.weight",
                linear_grad(&m.self_attn.v_proj, &grads),
            ),
            (
                "midlayer.self_attn.o_proj.weight",
                linear_grad(&m.self_attn.o_proj, &grads),
            ),
            (
                "midlayer.mlp.gate_proj.weight",
                linear_grad(&m.mlp.gate_proj, &grads),
            ),
            (
                "midlayer.mlp.up_proj.weight",
                linear_grad(&m.mlp.up_proj, &grads),
            ),
            (
                "midlayer.mlp.down_proj.weight",
                linear_grad(&m.mlp.down_proj, &grads),
            ),
            ("lm_head.weight", linear_grad(&model.lm_head, &grads)),
            (
                "midlayer.input_layernorm.weight",
                norm_grad(&m.input_layernorm, &grads),
            ),
            (
                "midlayer.hidden_norm.weight",
                norm_grad(&m.hidden_norm, &grads),
            ),
            (
                "midlayer.post_attention_layernorm.weight",
                norm_grad(&m.post_attention_layernorm, &grads),
            ),
            ("norm.weight", norm_grad(&model.norm, &grads)),
        ];

        // The GPU trainer on the same weights and rows.
        let pieces = head.host_pieces();
        let target_ids = vocab.target_ids();
        let gpu = Gpu::new(0).map_err(gpu_err)?;
        let mut trainer = CudaHeadTrainer::new(
            gpu,
            spec.clone(),
            &model.to_host(),
            &TargetPieces {
                embed_tokens: &pieces.embed_tokens,
                norm: &pieces.norm,
                lm_head: &pieces.lm_head,
                draft_ids: &target_ids,
            },
        )
        .map_err(gpu_err)?;
        let tokens: usize = lengths.iter().sum();
        trainer.reserve_corpus(tokens).map_err(gpu_err)?;
        let mut starts = Vec::new();
        for (s, &len) in lengths.iter().enumerate() {
            let bits = |v: &[f32]| -> Vec<u16> {
                v.iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect()
            };
            let a = bits(&aux[s * w * fc_in..(s * w + len) * fc_in]);
            let l = bits(&last[s * w * HIDDEN..(s * w + len) * HIDDEN]);
            starts.push(trainer.append_corpus(&a, &l).map_err(gpu_err)?);
        }
        trainer.finish_corpus().map_err(gpu_err)?;
        let argmax = trainer.corpus_argmax().map_err(gpu_err)?;
        let mut agree = 0;
        let mut total = 0;
        for (s, &len) in lengths.iter().enumerate() {
            for t in 0..len {
                total += 1;
                agree += usize::from(argmax[starts[s] + t] == targets.argmax[s * w + t]);
            }
        }
        lines.push(format!("target argmax agrees on {agree} of {total} tokens"));
        ensure(agree * 100 >= total * 97, || {
            format!("target argmax agrees on only {agree} of {total} tokens")
        })?;
        let cb = CorpusBatch {
            starts,
            lengths: lengths.clone(),
            width: w,
            input_ids: ids.clone(),
            loss_mask: mask.clone(),
        };
        let (counts_gpu, got) = trainer.gradients(&cb, steps).map_err(gpu_err)?;
        for (i, (c, s)) in counts_gpu.iter().zip(&stats).enumerate() {
            lines.push(format!(
                "TTT {steps}, step {i}: loss gpu {:.5} cpu {:.5}; correct {} / {} vs {} / {}",
                c.loss, s.loss, c.correct, c.denominator, s.correct, s.denominator
            ));
            ensure(c.denominator == s.denominator, || {
                format!(
                    "step {i}: denominator {} vs {}",
                    c.denominator, s.denominator
                )
            })?;
            ensure(
                (c.loss - s.loss).abs() <= 1e-2 * s.loss.abs().max(1e-3),
                || format!("step {i}: loss {} vs {}", c.loss, s.loss),
            )?;
        }
        for (name, want) in &want {
            let err = rel_l2(&got[*name].1, want);
            lines.push(format!(
                "TTT {steps}: {name}: gradient rel L2 err {err:.2e}"
            ));
            ensure(err < 4e-2, || {
                format!("{name}: gradient rel L2 error {err}")
            })?;
        }

        // One AdamW step: the reported norm is the gradients' norm, and no weight moves by more
        // than lr (Adam's first step is lr * sign(g) up to eps).
        let before = trainer.weights().map_err(gpu_err)?;
        let norm_want: f64 = got
            .values()
            .flat_map(|(_, v)| v.iter())
            .map(|&x| f64::from(x).powi(2))
            .sum::<f64>()
            .sqrt();
        let lr = 1e-3;
        let report = trainer
            .train_step(
                &cb,
                steps,
                &AdamWStep {
                    lr,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.0,
                    max_grad_norm: 0.5,
                },
            )
            .map_err(gpu_err)?;
        lines.push(format!(
            "TTT {steps}: grad norm {:.6} vs {norm_want:.6}",
            report.grad_norm
        ));
        ensure(
            (report.grad_norm - norm_want).abs() <= 1e-3 * norm_want,
            || format!("grad norm {} vs {norm_want}", report.grad_norm),
        )?;
        let after = trainer.weights().map_err(gpu_err)?;
        let mut moved = 0usize;
        for (name, (_, v0)) in &before {
            for (a, b) in v0.iter().zip(&after[name].1) {
                ensure((a - b).abs() <= lr as f32 * 1.001, || {
                    format!("{name} moved by {}", a - b)
                })?;
                moved += usize::from(a != b);
            }
        }
        ensure(moved > 0, || "AdamW moved no weight".to_owned())?;
    }
    Ok(lines)
}

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), TrainError> {
    if ok {
        Ok(())
    } else {
        Err(TrainError::Gpu {
            reason: format!("parity check failed: {}", what()),
        })
    }
}
