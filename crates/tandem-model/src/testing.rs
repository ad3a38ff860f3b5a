//! Tiny random models written to disk as real HF directories, so tests exercise the same loader
//! and forward pass as the real model in milliseconds.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::{Rng, SeedableRng};
use safetensors::{Dtype, serialize_to_file, tensor::TensorView};

use crate::config::HfConfig;

/// A golden file of an independent reference (HF transformers, `scripts/reference/make_*_golden.py`):
/// f32 tensors and i64 token ids by name, read from its safetensors bytes.
pub struct GoldenFile {
    bytes: Vec<u8>,
}

impl GoldenFile {
    pub fn open(path: &Path) -> Self {
        Self {
            bytes: std::fs::read(path)
                .unwrap_or_else(|e| panic!("golden file {}: {e}", path.display())),
        }
    }

    fn tensor(&self, key: &str) -> (Vec<usize>, Vec<u8>) {
        let st = safetensors::SafeTensors::deserialize(&self.bytes).expect("a safetensors file");
        let v = st
            .tensor(key)
            .unwrap_or_else(|e| panic!("golden tensor {key}: {e}"));
        (v.shape().to_vec(), v.data().to_vec())
    }

    /// An f32 tensor: its shape and row-major values.
    pub fn f32s(&self, key: &str) -> (Vec<usize>, Vec<f32>) {
        let (shape, data) = self.tensor(key);
        let values = data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        (shape, values)
    }

    /// An i64 tensor of token ids.
    pub fn ids(&self, key: &str) -> Vec<u32> {
        self.tensor(key)
            .1
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")) as u32)
            .collect()
    }
}

/// A small Llama-style config: `layers` blocks, hidden 32, 4 heads / 2 KV heads, vocab 96.
pub fn tiny_config(architecture: &str, layers: usize) -> HfConfig {
    serde_json::from_value(serde_json::json!({
        "architectures": [architecture],
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "vocab_size": 96, "max_position_embeddings": 256,
        "tie_word_embeddings": false
    }))
    .expect("tiny config is valid")
}

/// Prefills each golden case (`case{i}.input_ids`) through `model` with every tap point and
/// checks the logits (`case{i}.logits`) and every tap against HF's `case{i}.hidden_states`
/// (embed, blocks 0..L-2, then the final norm's output in the last slot) to `tol` in
/// [`rel_err`]. Block L-1's output is not in `hidden_states`; it is returned per case (host
/// values) for callers that hold another reference for it.
pub fn check_prefill_against_hf<B: burn::prelude::Backend>(
    model: &crate::TargetModel<B>,
    golden: &GoldenFile,
    cases: usize,
    tol: f32,
    label: &str,
) -> Vec<Vec<f32>> {
    use crate::{LogitsFor, TapRequest};
    let host = |t: burn::prelude::Tensor<B, 3>| t.into_data().to_vec::<f32>().expect("f32");
    let (layers, hidden) = (model.spec.num_layers, model.spec.hidden_size);
    let mut last_blocks = Vec::with_capacity(cases);
    for case in 0..cases {
        let ids = golden.ids(&format!("case{case}.input_ids"));
        let n = ids.len();
        let mut cache = model.new_cache(1, n);
        let step = cache.prefill_step(&[&ids]).expect("a prefill step");
        let out = model
            .forward(&step, &mut cache, &TapRequest::all(layers), LogitsFor::All)
            .expect("a forward pass");
        let (_, logits) = golden.f32s(&format!("case{case}.logits"));
        let e = rel_err(&host(out.logits.expect("logits")), &logits);
        eprintln!("{label} case{case}: logits rel err {e:.2e}");
        assert!(e <= tol, "{label} case{case}: logits rel err {e}");
        let (shape, states) = golden.f32s(&format!("case{case}.hidden_states"));
        assert_eq!(shape, vec![layers + 1, n, hidden]);
        let mut worst = 0f32;
        for (k, tensor) in out.taps.tensors.iter().enumerate() {
            if k == layers {
                continue; // block L-1: its hidden_states slot holds `final`
            }
            let hf = if k == layers + 1 { layers } else { k };
            let reference = &states[hf * n * hidden..(hf + 1) * n * hidden];
            let e = rel_err(&host(tensor.clone()), reference);
            worst = worst.max(e);
            assert!(
                e <= tol,
                "{label} case{case}: tap {} vs hidden_states[{hf}]: rel err {e}",
                out.taps.taps[k]
            );
        }
        eprintln!("{label} case{case}: worst hidden-state rel err {worst:.2e}");
        last_blocks.push(host(out.taps.tensors[layers].clone()));
    }
    last_blocks
}

/// Relative L2 error `|actual - reference| / |reference|` (in f64): the metric of gradient and
/// tensor-parallel comparisons, where every element counts.
pub fn rel_l2(actual: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(
        actual.len(),
        reference.len(),
        "compared tensors differ in length"
    );
    let num: f64 = actual
        .iter()
        .zip(reference)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let den: f64 = reference.iter().map(|b| f64::from(*b).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Relative error of `actual` against `reference`: max |actual - reference| / max |reference|
/// (the metric every parity check and test here states its tolerance in).
pub fn rel_err(actual: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(
        actual.len(),
        reference.len(),
        "compared tensors differ in length"
    );
    let scale = reference
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(1e-12);
    actual
        .iter()
        .zip(reference)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

/// A fresh, empty scratch directory under the system temp dir, unique per call even within one
/// test process (tests run in parallel threads of one process, so the pid alone is not enough).
/// Pearson's chi-square of observed `counts` against `expected` probabilities (cells expected
/// below 5 draws pooled into one), and its 99.9% quantile for the resulting degrees of freedom
/// (Wilson-Hilferty approximation): `(statistic, limit)`. A sampler that follows `expected`
/// stays below the limit 999 times in 1000.
pub fn chi_square_999(expected: &[f64], counts: &[usize]) -> (f64, f64) {
    let draws: usize = counts.iter().sum();
    let (mut chi2, mut dof, mut pooled_e, mut pooled_c) = (0f64, 0usize, 0f64, 0f64);
    for (e, c) in expected.iter().map(|m| m * draws as f64).zip(counts) {
        if e < 5.0 {
            pooled_e += e;
            pooled_c += *c as f64;
        } else {
            chi2 += (*c as f64 - e).powi(2) / e;
            dof += 1;
        }
    }
    if pooled_e > 0.0 {
        chi2 += (pooled_c - pooled_e).powi(2) / pooled_e;
        dof += 1;
    }
    let k = dof.saturating_sub(1).max(1) as f64;
    let z = 3.09;
    let limit = k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3);
    (chi2, limit)
}

/// The exact distribution of the second token sampled after `prompt`:
/// `sum_t1 p(t1 | prompt) p(t2 | prompt, t1)`, from `probs_after(context)` (the sampling
/// distribution over the vocabulary after `context`); first tokens below 1e-6 are skipped.
pub fn second_token_marginal(
    prompt: &[u32],
    mut probs_after: impl FnMut(&[u32]) -> Vec<f32>,
) -> Vec<f64> {
    let first = probs_after(prompt);
    let mut marginal = vec![0f64; first.len()];
    for (t1, &p) in first.iter().enumerate() {
        if p < 1e-6 {
            continue;
        }
        let mut context = prompt.to_vec();
        context.push(t1 as u32);
        for (t2, q) in probs_after(&context).into_iter().enumerate() {
            marginal[t2] += f64::from(p) * f64::from(q);
        }
    }
    marginal
}

pub fn scratch_dir(name: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("tandem-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir is writable");
    dir
}

/// Writes `config.json` and `model.safetensors` with seeded random weights (HF names) to `dir`.
///
/// Both files are written under a temporary name and renamed into place: a model that another
/// thread has already memory-mapped keeps its old inode instead of being truncated under it
/// (which is a SIGBUS, not an error).
pub fn write_random_model(dir: &Path, config: &HfConfig, seed: u64) -> std::io::Result<()> {
    let spec = config.resolve().map_err(std::io::Error::other)?;
    std::fs::create_dir_all(dir)?;
    let unique = format!("{}-{:?}", std::process::id(), std::thread::current().id())
        .replace(|c: char| !c.is_ascii_alphanumeric(), "");
    let config_tmp = dir.join(format!(".config.json.{unique}"));
    std::fs::write(
        &config_tmp,
        serde_json::to_string_pretty(config).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(&config_tmp, dir.join("config.json"))?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n: usize = shape.iter().product();
        let bytes: Vec<u8> = (0..n)
            .flat_map(|_| (offset + scale * (rng.random::<f32>() * 2.0 - 1.0)).to_le_bytes())
            .collect();
        tensors.push((name, shape, bytes));
    };
    let (h, hd, i) = (spec.hidden_size, spec.head_dim, spec.intermediate_size);
    let w = 1.0 / (h as f32).sqrt();
    add(
        "model.embed_tokens.weight".into(),
        vec![spec.vocab_size, h],
        1.0,
        0.0,
    );
    for l in 0..spec.num_layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![h], 0.2, 1.0);
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            0.2,
            1.0,
        );
        add(
            format!("{p}.self_attn.q_proj.weight"),
            vec![spec.num_heads * hd, h],
            w,
            0.0,
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            vec![spec.num_kv_heads * hd, h],
            w,
            0.0,
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            vec![spec.num_kv_heads * hd, h],
            w,
            0.0,
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, spec.num_heads * hd],
            w,
            0.0,
        );
        if spec.qkv_bias {
            add(
                format!("{p}.self_attn.q_proj.bias"),
                vec![spec.num_heads * hd],
                0.1,
                0.0,
            );
            add(
                format!("{p}.self_attn.k_proj.bias"),
                vec![spec.num_kv_heads * hd],
                0.1,
                0.0,
            );
            add(
                format!("{p}.self_attn.v_proj.bias"),
                vec![spec.num_kv_heads * hd],
                0.1,
                0.0,
            );
        }
        if spec.qk_norm {
            add(format!("{p}.self_attn.q_norm.weight"), vec![hd], 0.2, 1.0);
            add(format!("{p}.self_attn.k_norm.weight"), vec![hd], 0.2, 1.0);
        }
        add(format!("{p}.mlp.gate_proj.weight"), vec![i, h], w, 0.0);
        add(format!("{p}.mlp.up_proj.weight"), vec![i, h], w, 0.0);
        add(
            format!("{p}.mlp.down_proj.weight"),
            vec![h, i],
            1.0 / (i as f32).sqrt(),
            0.0,
        );
    }
    add("model.norm.weight".into(), vec![h], 0.2, 1.0);
    if !spec.tie_word_embeddings {
        add("lm_head.weight".into(), vec![spec.vocab_size, h], w, 0.0);
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            (
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), bytes).expect("sizes agree"),
            )
        })
        .collect();
    let weights_tmp = dir.join(format!(".model.safetensors.{unique}"));
    serialize_to_file(views, None, &weights_tmp).map_err(std::io::Error::other)?;
    std::fs::rename(&weights_tmp, dir.join("model.safetensors"))
}

/// The workspace root (the folder above `crates/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The imported SmolLM2 directory (`scripts/fetch_smollm2.sh`, run by `scripts/test.sh` first),
/// or `$TANDEM_SMOLLM2_DIR`; panics naming the fetch script when it is missing.
pub fn smollm2_dir() -> PathBuf {
    let dir = std::env::var_os("TANDEM_SMOLLM2_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("models/SmolLM2-135M-Instruct"));
    assert!(
        dir.join("model.safetensors").exists() && dir.join("tokenizer.json").exists(),
        "{} is missing: run scripts/fetch_smollm2.sh first",
        dir.display()
    );
    dir
}

/// Writes into `dir` a tiny random Llama (`layers` blocks, hidden 32) with SmolLM2's tokenizer
/// and chat template (vocabulary 49,152, 1,024 positions): chat datasets go through the whole
/// pipeline (template, loss mask, capture) in milliseconds.
pub fn write_tiny_chat_model(dir: &Path, layers: usize, seed: u64) -> std::io::Result<()> {
    let mut config = tiny_config("LlamaForCausalLM", layers);
    config.vocab_size = 49152;
    config.model_type = Some("llama".to_owned());
    config.max_position_embeddings = 1024;
    write_random_model(dir, &config, seed)?;
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(smollm2_dir().join(file), dir.join(file))?;
    }
    Ok(())
}
