//! The head against its contracts: the training unroll and the serving draft steps compute the
//! same function, checkpoints carry the keys/shapes/dtypes the engines load, and a saved head
//! reloads (also under vLLM's names) to identical outputs.

use std::path::PathBuf;

use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Module};
use burn::prelude::*;
use burn::tensor::TensorData;
use rand::{Rng, SeedableRng};
use safetensors::{Dtype, SafeTensors};
use tandem_eagle::{
    DraftOutput, Eagle3Config, Eagle3Draft, WeightDtype, build_vocab_map, load_pretrained,
    save_pretrained, ttt_step_tokens,
};
use tandem_model::testing::tiny_config;

type B = NdArray<f32>;

fn temp_dir(name: &str) -> PathBuf {
    tandem_model::testing::scratch_dir(&format!("eagle-{name}"))
}

fn random(rng: &mut rand::rngs::StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
        .collect()
}

/// A tiny head (hidden 32, 4 heads / 2 KV heads, vocab 96, draft vocab 40, 3 taps) on a
/// random embedding table.
fn tiny_head(seed: u64) -> (Eagle3Draft<B>, Eagle3Config) {
    let target = tiny_config("LlamaForCausalLM", 4);
    let config = Eagle3Config::for_target(&target, 40, 3);
    let spec = config.resolve().unwrap();
    let counts: Vec<u64> = (0..96u64).map(|i| (i * 37) % 11).collect();
    let vocab = build_vocab_map(&counts, 40, 96).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let device = Default::default();
    let embed = Tensor::<B, 2>::from_data(
        TensorData::new(random(&mut rng, 96 * 32, 1.0), [96, 32]),
        &device,
    );
    let draft = Eagle3Draft::init(spec, vocab, embed, seed, &device).unwrap();
    (draft, config)
}

fn values(t: Tensor<B, 3>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

/// Row `t` of `[1, n, d]` (or of batch row `b` of `[batch, n, d]`) as host values.
fn row(t: &Tensor<B, 3>, b: usize, i: usize) -> Vec<f32> {
    let [_, _, d] = t.dims();
    values(t.clone().slice([b..b + 1, i..i + 1, 0..d]))
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        diff / scale <= 1e-5,
        "{what}: max abs diff {diff} (relative {})",
        diff / scale
    );
}

/// The issue's requirement: "The training unroll and the serving draft step must compute the
/// same function". For every sequence of a ragged batch and every root position `t`, serving
/// runs a draft extend over positions `0..=t` (aux states `0..=t`, tokens `1..=t+1`), then
/// single draft steps fed with the previous step's pre-norm output and the next token, and
/// every step's hidden output and logits must equal the unroll's step `i` at index `t`.
#[test]
fn train_serve_parity() {
    let (draft, _) = tiny_head(7);
    let device = Default::default();
    let steps = 4;
    let width = 9;
    let lengths = [9usize, 6];
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let ids: Vec<u32> = (0..2 * width).map(|_| rng.random_range(0..96u32)).collect();
    let aux_values = random(&mut rng, 2 * width * 96, 2.0);
    let aux = Tensor::<B, 3>::from_data(TensorData::new(aux_values, [2, width, 96]), &device);
    let unroll: Vec<DraftOutput<B>> = draft
        .forward_ttt(aux.clone(), &ids, &lengths, steps)
        .unwrap();
    assert_eq!(unroll.len(), steps);
    assert_eq!(unroll[0].logits.dims(), [2, width, 40]);

    let mut compared = 0;
    for (b, &len) in lengths.iter().enumerate() {
        for t in 0..len {
            let mut cache = draft.new_cache(1, width + steps);
            // Extend: slot p pairs aux[p] with token p + 1 (0 past the end, as the unroll).
            let step0 = ttt_step_tokens(&ids, &lengths, width, 0);
            let tokens = &step0[b * width..b * width + t + 1];
            let step = cache.prefill_step(&[tokens]).unwrap();
            let aux_rows = aux.clone().slice([b..b + 1, 0..t + 1, 0..96]);
            let out = draft.extend(&step, aux_rows, &mut cache).unwrap();
            assert_close(
                "step 0 hidden",
                &row(&out.hidden, 0, t),
                &row(&unroll[0].hidden, b, t),
            );
            assert_close(
                "step 0 logits",
                &row(&out.logits, 0, t),
                &row(&unroll[0].logits, b, t),
            );
            let mut hidden = out.hidden.slice([0..1, t..t + 1, 0..32]);
            for (i, expected) in unroll.iter().enumerate().skip(1) {
                let token = ttt_step_tokens(&ids, &lengths, width, i)[b * width + t];
                let step = cache.decode_step(&[token]).unwrap();
                assert_eq!(step.positions, vec![t + i], "RoPE position of step {i}");
                let out = draft.forward_step(&step, hidden, &mut cache).unwrap();
                assert_close(
                    &format!("seq {b} t {t} step {i} hidden"),
                    &row(&out.hidden, 0, 0),
                    &row(&expected.hidden, b, t),
                );
                assert_close(
                    &format!("seq {b} t {t} step {i} logits"),
                    &row(&out.logits, 0, 0),
                    &row(&expected.logits, b, t),
                );
                hidden = out.hidden;
                compared += 1;
            }
        }
    }
    assert_eq!(compared, (9 + 6) * (steps - 1));
}

/// A later step must actually see the earlier steps' keys: changing the token fed at step 1
/// changes step 2's output at the same index (through its step-1 key), not only through the
/// hidden chain. Checked by comparing against a serving run whose step-1 key is dropped from
/// the cache (rollback) while the hidden chain is kept.
#[test]
fn later_steps_attend_to_earlier_steps_keys() {
    let (draft, _) = tiny_head(3);
    let device = Default::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let ids: Vec<u32> = (0..6).map(|_| rng.random_range(0..96u32)).collect();
    let aux = Tensor::<B, 3>::from_data(
        TensorData::new(random(&mut rng, 6 * 96, 2.0), [1, 6, 96]),
        &device,
    );
    let unroll = draft.forward_ttt(aux.clone(), &ids, &[6], 3).unwrap();
    let t = 3;
    let mut cache = draft.new_cache(1, 16);
    let tokens0 = ttt_step_tokens(&ids, &[6], 6, 0);
    let step = cache.prefill_step(&[&tokens0[..t + 1]]).unwrap();
    let out = draft
        .extend(&step, aux.slice([0..1, 0..t + 1, 0..96]), &mut cache)
        .unwrap();
    let h0 = out.hidden.slice([0..1, t..t + 1, 0..32]);
    let step = cache
        .decode_step(&[ttt_step_tokens(&ids, &[6], 6, 1)[t]])
        .unwrap();
    let out1 = draft.forward_step(&step, h0, &mut cache).unwrap();
    // Drop step 1's key/value but keep its output as the next hidden, and fix the position.
    cache.rollback(t + 1);
    let mut step = cache
        .decode_step(&[ttt_step_tokens(&ids, &[6], 6, 2)[t]])
        .unwrap();
    step.positions = vec![t + 2];
    let without = draft.forward_step(&step, out1.hidden, &mut cache).unwrap();
    let with = row(&unroll[2].hidden, 0, t);
    let diff = row(&without.hidden, 0, 0)
        .iter()
        .zip(&with)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff > 1e-3, "step 2 ignores step 1's key (diff {diff})");
}

/// The checkpoint table the engines load (facts section 2), for a head on SmolLM2-135M
/// (H = T = 576, 9 heads / 3 KV heads of 64, intermediate 1536, vocab 49152, 3 taps) with a
/// draft vocabulary of 64: exact keys, HF `[out, in]` shapes, dtypes.
#[test]
fn checkpoint_keys_shapes_and_dtypes_match_the_engines() {
    let target = serde_json::from_value::<tandem_model::HfConfig>(serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": true, "hidden_act": "silu"
    }))
    .unwrap();
    let mut config = Eagle3Config::for_target(&target, 64, 3);
    config
        .eagle_config
        .as_mut()
        .unwrap()
        .eagle_aux_hidden_state_layer_ids = Some(vec![1, 14, 26]);
    let spec = config.resolve().unwrap();
    let counts: Vec<u64> = (0..49152u64).map(|i| u64::from(i % 701 == 0)).collect();
    let vocab = build_vocab_map(&counts, 64, 49152).unwrap();
    let device = Default::default();
    let embed = Tensor::<B, 2>::zeros([49152, 576], &device);
    let draft = Eagle3Draft::init(spec, vocab, embed, 1, &device).unwrap();

    // (key, shape, dtype for f32 export): written out by hand from the facts doc.
    let expected: Vec<(&str, Vec<usize>, Dtype)> = vec![
        ("d2t", vec![64], Dtype::I64),
        ("fc.weight", vec![576, 3 * 576], Dtype::F32),
        ("lm_head.weight", vec![64, 576], Dtype::F32),
        ("midlayer.hidden_norm.weight", vec![576], Dtype::F32),
        ("midlayer.input_layernorm.weight", vec![576], Dtype::F32),
        ("midlayer.mlp.down_proj.weight", vec![576, 1536], Dtype::F32),
        ("midlayer.mlp.gate_proj.weight", vec![1536, 576], Dtype::F32),
        ("midlayer.mlp.up_proj.weight", vec![1536, 576], Dtype::F32),
        (
            "midlayer.post_attention_layernorm.weight",
            vec![576],
            Dtype::F32,
        ),
        (
            "midlayer.self_attn.k_proj.weight",
            vec![192, 2 * 576],
            Dtype::F32,
        ),
        (
            "midlayer.self_attn.o_proj.weight",
            vec![576, 576],
            Dtype::F32,
        ),
        (
            "midlayer.self_attn.q_proj.weight",
            vec![576, 2 * 576],
            Dtype::F32,
        ),
        (
            "midlayer.self_attn.v_proj.weight",
            vec![192, 2 * 576],
            Dtype::F32,
        ),
        ("norm.weight", vec![576], Dtype::F32),
        ("t2d", vec![49152], Dtype::BOOL),
    ];
    for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
        let dir = temp_dir(&format!("layout-{dtype:?}"));
        save_pretrained(&draft, &config, &dir, dtype).unwrap();
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let (_, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            metadata
                .metadata()
                .as_ref()
                .and_then(|m| m.get("format"))
                .map(String::as_str),
            Some("pt")
        );
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<&str> = st.names();
        names.sort_unstable();
        let want: Vec<&str> = expected.iter().map(|e| e.0).collect();
        assert_eq!(names, want, "{dtype:?}: keys");
        for (name, shape, f32_dtype) in &expected {
            let view = st.tensor(name).unwrap();
            assert_eq!(view.shape(), shape.as_slice(), "{name} shape");
            let want_dtype = match (f32_dtype, dtype) {
                (Dtype::F32, WeightDtype::Bf16) => Dtype::BF16,
                (d, _) => *d,
            };
            assert_eq!(view.dtype(), want_dtype, "{name} dtype ({dtype:?} export)");
        }
        // d2t holds offsets: 71 ids occur once (multiples of 701), ties go to the smaller ids,
        // so draft id i is target id 701 * i and d2t[i] = 700 * i.
        let d2t: Vec<i64> = st
            .tensor("d2t")
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(d2t[0], 0);
        assert_eq!(d2t[5], 5 * 700);
        assert_eq!(d2t[63], 63 * 700);
        let t2d = st.tensor("t2d").unwrap();
        assert_eq!(t2d.data().iter().filter(|b| **b == 1).count(), 64);

        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(
            json["architectures"],
            serde_json::json!(["LlamaForCausalLMEagle3"])
        );
        assert_eq!(json["num_hidden_layers"], 1);
        assert_eq!(json["tie_word_embeddings"], false);
        assert_eq!(json["draft_vocab_size"], 64);
        assert_eq!(json["vocab_size"], 49152);
        assert_eq!(json["target_hidden_size"], 576);
        assert_eq!(json["torch_dtype"], dtype.torch_dtype());
        assert_eq!(
            json["eagle_config"],
            serde_json::json!({"eagle_aux_hidden_state_layer_ids": [1, 14, 26],
                               "use_aux_hidden_state": true})
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

fn outputs(draft: &Eagle3Draft<B>) -> Vec<Vec<f32>> {
    let device = Default::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(99);
    let ids: Vec<u32> = (0..7).map(|_| rng.random_range(0..96u32)).collect();
    let aux = Tensor::<B, 3>::from_data(
        TensorData::new(random(&mut rng, 7 * 96, 1.0), [1, 7, 96]),
        &device,
    );
    draft
        .forward_ttt(aux, &ids, &[7], 3)
        .unwrap()
        .into_iter()
        .flat_map(|o| [values(o.hidden), values(o.logits)])
        .collect()
}

/// A saved head reloads to identical outputs (f32), to outputs within bf16 rounding (bf16),
/// and a vLLM-named copy (`layers.0.`) with a stray `embed_tokens.weight` loads the same.
#[test]
fn save_load_round_trip_including_vllm_names() {
    let (draft, config) = tiny_head(21);
    let embed = draft.embed_tokens.clone();
    let device = Default::default();
    let want = outputs(&draft);

    let dir = temp_dir("roundtrip");
    save_pretrained(&draft, &config, &dir, WeightDtype::F32).unwrap();
    let loaded = load_pretrained::<B>(&dir, embed.clone(), &device).unwrap();
    assert_eq!(loaded.draft.vocab, draft.vocab);
    assert_eq!(outputs(&loaded.draft), want, "f32 round trip is exact");
    assert!(loaded.report.renamed.is_empty() && loaded.report.ignored.is_empty());

    // Rename to vLLM's keys and add an embedding, as some exports carry.
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            let name = name.replace("midlayer.", "layers.0.");
            (name, v.dtype(), v.shape().to_vec(), v.data().to_vec())
        })
        .collect();
    owned.push((
        "embed_tokens.weight".into(),
        Dtype::F32,
        vec![2, 2],
        vec![0u8; 16],
    ));
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let vllm = temp_dir("vllm");
    safetensors::serialize_to_file(views, None, &vllm.join("model.safetensors")).unwrap();
    std::fs::copy(dir.join("config.json"), vllm.join("config.json")).unwrap();
    let loaded = load_pretrained::<B>(&vllm, embed.clone(), &device).unwrap();
    assert_eq!(
        outputs(&loaded.draft),
        want,
        "vLLM names load to the same head"
    );
    assert_eq!(
        loaded.report.ignored,
        vec!["embed_tokens.weight".to_owned()]
    );
    assert_eq!(loaded.report.renamed.len(), 10);

    save_pretrained(&draft, &config, &dir, WeightDtype::Bf16).unwrap();
    let loaded = load_pretrained::<B>(&dir, embed, &device).unwrap();
    for (got, want) in outputs(&loaded.draft).iter().zip(&want) {
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff / scale < 0.05,
            "bf16 round trip drifted {diff} / {scale}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&vllm).unwrap();
}

/// Training reaches every parameter and never the frozen embedding.
#[test]
fn gradients_reach_every_parameter_and_not_the_embedding() {
    type AB = Autodiff<B>;
    let (draft, config) = tiny_head(5);
    let device = Default::default();
    let embed = Tensor::<AB, 2>::from_inner(draft.embed_tokens.clone());
    let spec = config.resolve().unwrap();
    let draft =
        Eagle3Draft::<AB>::from_host(spec, draft.vocab.clone(), &draft.to_host(), embed, &device)
            .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let ids: Vec<u32> = (0..5).map(|_| rng.random_range(0..96u32)).collect();
    let aux = Tensor::<AB, 3>::from_data(
        TensorData::new(random(&mut rng, 5 * 96, 1.0), [1, 5, 96]),
        &device,
    );
    let outs = draft.forward_ttt(aux, &ids, &[5], 3).unwrap();
    let loss = outs
        .iter()
        .map(|o| o.logits.clone().powi_scalar(2).mean())
        .reduce(|a, b| a + b)
        .unwrap();
    let grads = loss.backward();
    let mut params = 0;
    struct Check<'a> {
        grads: &'a <AB as burn::tensor::backend::AutodiffBackend>::Gradients,
        count: &'a mut usize,
    }
    impl burn::module::ModuleVisitor<AB> for Check<'_> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<AB, D>>) {
            let g = param
                .val()
                .grad(self.grads)
                .expect("every parameter has a gradient");
            let norm: f32 = g.abs().sum().into_scalar();
            assert!(norm > 0.0, "a parameter got a zero gradient");
            *self.count += 1;
        }
    }
    draft.visit(&mut Check {
        grads: &grads,
        count: &mut params,
    });
    assert_eq!(params, 13, "fc, 4 norms, q/k/v/o, gate/up/down, lm_head");
    assert!(draft.embed_tokens.grad(&grads).is_none());
    let _ = draft.valid();
}
