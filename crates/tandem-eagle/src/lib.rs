//! The EAGLE-3 draft head, exactly as SGLang, vLLM and the EAGLE/SpecForge code define it,
//! trainable with burn autodiff and servable step by step.
//!
//! ```text
//! aux [n, num_taps*T] --fc--> h0 [n, H]            emb = target.embed_tokens[token t+1]
//!        residual = h ; x = cat[input_layernorm(emb), hidden_norm(h)]   (2H wide)
//!        h' = h + o_proj(attn(q,k,v(x)))  ;  out = h' + mlp(post_attention_layernorm(h'))
//!        out (pre-norm) -> next step's h ;  logits = lm_head(norm(out))  [n, draft_vocab]
//! ```
//!
//! - [`Eagle3Config`] mirrors the head's `config.json`; [`DraftSpec`] is its resolved form.
//! - [`Eagle3Draft`] is the burn [`burn::module::Module`]; [`Eagle3Draft::forward_ttt`] is the
//!   training unroll, [`Eagle3Draft::extend`] / [`Eagle3Draft::forward_step`] with a
//!   [`DraftCache`] the serving path. Both run [`DecoderLayer::forward`].
//! - [`io`] reads and writes `config.json` + `model.safetensors` with the keys the engines load.
//! - [`build_vocab_map`] / [`VocabMap`]: the draft vocabulary and its `d2t` / `t2d` buffers.

#![warn(missing_docs)]

pub mod config;
pub mod error;
pub mod io;
pub mod model;
pub mod vocab;

pub use burn;
pub use config::{
    ARCHITECTURE, DraftSpec, Eagle3Config, EagleConfig, SPECULATORS_TYPE_KEY, Verifier, WIRING_KEY,
};
pub use error::EagleError;
pub use io::{
    Checkpoint, HostHead, LoadReport, LoadedHead, WeightDtype, checkpoint_layout, load_host,
    load_pretrained, read_checkpoint, save_pretrained, save_safetensors, save_speculators,
};
pub use model::{
    AttentionContext, DecoderLayer, DraftCache, DraftOutput, Eagle3Draft, HostWeights, Linear,
    RmsNorm, Rope, parameter_shapes, ttt_step_tokens,
};
pub use vocab::{VocabMap, build_vocab_map};
