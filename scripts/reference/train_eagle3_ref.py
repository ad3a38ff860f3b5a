#!/usr/bin/env python3
"""Independent PyTorch reference trainer for Tandem's EAGLE-3 draft head.

It reads Tandem dumps (`tandem dump`, format tandem-dump/1) and trains the same head with the
same objective, data split, batch order, schedule and optimizer as `tandem train`
(crates/tandem-train), so the two can be compared on speed (tokens/s) and quality
(validation acc_0..acc_{k-1}). It shares no code with Tandem: everything below is re-derived
from the Rust sources and cited by file.

Usage (flags and defaults mirror `tandem train`):

    python3 scripts/reference/train_eagle3_ref.py --dump DIR [--dump DIR2] \
        --model TARGET_HF_DIR --out report.json [--vocab-from HEAD | --draft-vocab N] \
        [--ttt-steps 7] [--epochs 1] [--lr 1e-4] [--batch-size 4] [--max-len 2048] \
        [--warmup-ratio 0.015] [--min-lr-ratio 0] [--weight-decay 0] [--max-grad-norm 0.5] \
        [--val-fraction 0.02] [--seed 0] [--max-steps N] [--max-seconds S] [--compile] \
        [--device cuda|cpu] [--dtype auto|bf16|f32] [--export HEAD_DIR] [--bench-only] \
        [--init-head HEAD] [--tandem-metrics RUN/metrics.jsonl]
    python3 scripts/reference/train_eagle3_ref.py --self-check

- `--init-head HEAD` starts from a head's weights and vocabulary (like `--init-from`); with
  `--max-steps 0` it only validates: the parity check against Tandem's last "val" line.
  A random init cannot be bit-identical (Tandem draws with Rust's StdRng); to start both
  trainers from the same weights, export Tandem's init with `tandem train ... --max-steps 0
  --out INIT` (same dump, vocab, seed) and pass `--init-head INIT` here.
- `--tandem-metrics` compares the per-step token counts with a Tandem run's metrics.jsonl
  (same counts = same batches in the same order).
- `--bench-only` skips validation: run `--max-steps` steps and measure tokens/s.
Prints `reference: N steps, X tokens/s (median), val acc [..]` and writes the JSON report.
"""

import argparse
import glob
import hashlib
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch
import torch.nn.functional as F
from torch import nn

BUCKET_BATCHES = 32  # trainer.rs: batches sorted together by length when planning an epoch
MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------------------------
# Data order: bit-exact copies of crates/tandem-train/src/data.rs and schedule.rs
# ----------------------------------------------------------------------------------------------
class SplitMix64:
    """data.rs `SplitMix64` (u64 arithmetic emulated with masks)."""

    def __init__(self, seed):
        self.state = seed & MASK64

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n):  # (u128(next) * n) >> 64
        return (self.next_u64() * n) >> 64

    def shuffle(self, items):  # Fisher-Yates from the end, as data.rs
        for i in range(len(items) - 1, 0, -1):
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]


def plan_epoch(rows, batch_size, bucket_batches, seed, epoch):
    """data.rs `plan_epoch`: rows = [(index, len)]; returns lists of global row indices."""
    batch_size = max(batch_size, 1)
    rng = SplitMix64(seed ^ ((epoch * 0xA0761D6478BD642F) & MASK64))
    order = list(rows)
    rng.shuffle(order)
    batches = []
    window_size = batch_size * max(bucket_batches, 1)
    for w in range(0, len(order), window_size):
        window = sorted(order[w:w + window_size], key=lambda r: (r[1], r[0]))
        for c in range(0, len(window), batch_size):
            batches.append([r[0] for r in window[c:c + batch_size]])
    rng.shuffle(batches)
    return batches


def is_validation(sample_id, val_fraction):
    """data.rs: SHA-256 of the id, first 8 bytes big-endian, as a fraction of 2^64."""
    x = int.from_bytes(hashlib.sha256(sample_id.encode("utf-8")).digest()[:8], "big")
    return float(x) / 2.0**64 < val_fraction  # int->float rounds to nearest even, as Rust `as`


def warmup_steps(total, ratio):
    if ratio <= 0.0:
        return 0
    return min(max(math.floor(total * ratio + 0.5), 1), max(total, 1))  # Rust round(): half up


def lr_at(step, total, warmup, peak, min_ratio):
    if step < warmup:
        return peak * (step + 1) / warmup
    lo = peak * min_ratio
    span = max(total - (warmup + 1), 0)
    p = 0.0 if span == 0 else min((step - warmup) / span, 1.0)
    return lo + (peak - lo) * (1.0 + math.cos(math.pi * p)) / 2.0


def build_vocab_map(counts, draft_size, vocab_size):
    """vocab.rs `build_vocab_map`: top-N by count (ties: smaller id), padded with the smallest
    unused ids, sorted by id; d2t holds offsets (target = draft + d2t)."""
    seen = [(int(c), i) for i, c in enumerate(counts) if c > 0]
    seen.sort(key=lambda x: (-x[0], x[1]))
    t2d = np.zeros(vocab_size, dtype=bool)
    for _, i in seen[:draft_size]:
        t2d[i] = True
    missing = draft_size - int(t2d.sum())
    if missing > 0:
        t2d[np.flatnonzero(~t2d)[:missing]] = True
    ids = np.flatnonzero(t2d).astype(np.int64)
    return ids - np.arange(len(ids), dtype=np.int64), t2d


def self_check():
    r = SplitMix64(0)  # reference values of the algorithm (data.rs test)
    assert r.next_u64() == 0xE220A8397B1DCDAF and r.next_u64() == 0x6E789E6AA1B965F4
    rows = [(i, (i * 37) % 50 + 1) for i in range(103)]
    plan = plan_epoch(rows, 4, 5, 42, 0)
    assert sorted(i for b in plan for i in b) == list(range(103))
    assert sum(1 for b in plan if len(b) < 4) == 1
    assert plan == plan_epoch(rows, 4, 5, 42, 0) != plan_epoch(rows, 4, 5, 42, 1)
    lr = lambda s: lr_at(s, 10, 2, 1e-3, 0.1)  # schedule.rs tests
    assert abs(lr(0) - 0.5e-3) < 1e-12 and abs(lr(2) - 1e-3) < 1e-12 and abs(lr(9) - 1e-4) < 1e-12
    assert abs(lr_at(5, 12, 2, 1.0, 0.0) - 0.75) < 1e-12
    assert warmup_steps(100, 0.015) == 2 and warmup_steps(10, 0.01) == 1
    d2t, t2d = build_vocab_map([0, 5, 0, 9, 9, 0, 1, 2], 3, 8)  # vocab.rs tests
    assert d2t.tolist() == [1, 2, 2] and np.flatnonzero(t2d).tolist() == [1, 3, 4]
    assert build_vocab_map([0, 0, 3, 0, 0, 7], 4, 6)[0].tolist() == [0, 0, 0, 2]
    assert build_vocab_map([0, 0, 4, 0, 0, 4, 4], 2, 7)[0].tolist() == [2, 4]
    n = sum(is_validation(f"conv-{i}", 0.1) for i in range(2000))
    assert 150 <= n < 250 and not is_validation("x", 0.0)
    print("self-check ok: SplitMix64, plan_epoch, lr_at, warmup_steps, build_vocab_map, split")


# ----------------------------------------------------------------------------------------------
# Configs and weights
# ----------------------------------------------------------------------------------------------
def rope_inv_freq(cfg, head_dim):
    """tandem-model config.rs `rope_inv_freq`: plain, or llama3-scaled (f64, as HF)."""
    theta = float(cfg.get("rope_theta", 10000.0))
    base = [1.0 / theta ** ((2 * i) / head_dim) for i in range(head_dim // 2)]
    s = cfg.get("rope_scaling")
    rope_type = (s or {}).get("rope_type", (s or {}).get("type"))
    if rope_type != "llama3":
        return base  # none/default (a draft's Llama view supports only default and llama3)
    factor, low = s.get("factor") or 8.0, s.get("low_freq_factor") or 1.0
    high, old = s.get("high_freq_factor") or 4.0, float(s.get("original_max_position_embeddings") or 8192)
    out = []
    for f in base:
        wl = 2.0 * math.pi / f
        if wl < old / high:
            out.append(f)
        elif wl > old / low:
            out.append(f / factor)
        else:
            sm = (old / wl - low) / (high - low)
            out.append((1.0 - sm) * f / factor + sm * f)
    return out


def is_mla(cfg):
    return "kv_lora_rank" in cfg or any("Deepseek" in a for a in cfg.get("architectures", []))


def draft_config_for_target(tcfg, draft_vocab, taps):
    """config.rs `Eagle3Config::for_target` + trainer.rs `head_config` (MLA: no head_dim/yarn)."""
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": tcfg["hidden_size"], "intermediate_size": tcfg["intermediate_size"],
           "num_hidden_layers": 1, "num_attention_heads": tcfg["num_attention_heads"],
           "num_key_value_heads": tcfg.get("num_key_value_heads"), "head_dim": tcfg.get("head_dim"),
           "hidden_act": "silu", "vocab_size": tcfg["vocab_size"], "draft_vocab_size": draft_vocab,
           "rms_norm_eps": tcfg["rms_norm_eps"], "rope_theta": tcfg.get("rope_theta", 10000.0),
           "rope_scaling": tcfg.get("rope_scaling"),
           "max_position_embeddings": tcfg.get("max_position_embeddings", 2048),
           "tie_word_embeddings": False, "target_hidden_size": tcfg["hidden_size"],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids(taps),
                            "use_aux_hidden_state": True}, "torch_dtype": "float32"}
    if is_mla(tcfg):
        cfg["head_dim"], cfg["rope_scaling"] = None, None
    for k in ("bos_token_id", "eos_token_id"):
        if tcfg.get(k) is not None:
            cfg[k] = tcfg[k]
    return {k: v for k, v in cfg.items() if v is not None or k == "rope_scaling"}


def sglang_ids(taps):
    """Canonical taps ('block:N') as SGLang ids (tandem-wiring convention.rs, sglang-heuristic):
    first tap block 1 -> id = block; otherwise id = block + 1 (input of the next layer)."""
    blocks = [int(t.split(":")[1]) for t in taps] if taps else []
    if not blocks:
        return None
    return blocks if blocks[0] == 1 else [b + 1 for b in blocks]


def spec_of(cfg):
    """config.rs `Eagle3Config::resolve` (the sizes the head is built from)."""
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return dict(hidden=cfg["hidden_size"], inter=cfg["intermediate_size"], heads=heads,
                kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=hd,
                vocab=cfg["vocab_size"], draft_vocab=cfg.get("draft_vocab_size") or cfg["vocab_size"],
                target_hidden=cfg.get("target_hidden_size") or cfg["hidden_size"],
                eps=float(cfg["rms_norm_eps"]), inv_freq=rope_inv_freq(cfg, hd))


def read_tensors(directory, names):
    """Named tensors from an HF directory (model.safetensors or a sharded index), as torch."""
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    out = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key in names:
                    out[key] = f.get_tensor(key)
    return out


def canonical_key(raw):
    """io.rs `canonical_key`: a leading `model.`, vLLM's `layers.0.`; embed_tokens ignored."""
    key = raw[len("model."):] if raw.startswith("model.") else raw
    if key.startswith("layers.0."):
        key = "midlayer." + key[len("layers.0."):]
    return None if key == "embed_tokens.weight" else key


def load_head(directory):
    """A head directory's weights (canonical keys, f32) and d2t/t2d (io.rs names, int64/bool)."""
    from safetensors import safe_open
    weights = {}
    with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
        for raw in f.keys():
            key = canonical_key(raw)
            if key is not None:
                weights[key] = f.get_tensor(raw)
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    with open(os.path.join(directory, "config.json")) as fh:
        cfg = json.load(fh)
    return cfg, {k: v.float() for k, v in weights.items()}, d2t, t2d


# ----------------------------------------------------------------------------------------------
# Dumps: two passes; everything kept on the device before the timed loop
# ----------------------------------------------------------------------------------------------
def shard_paths(dump):
    paths = sorted(glob.glob(os.path.join(dump, "shard-*.arrow")))  # reader.rs: sorted names
    if not paths:
        sys.exit(f"{dump}: no shard-*.arrow files")
    return paths


def open_shard(path, fields):
    names = ipc.open_file(pa.memory_map(path)).schema.names
    opts = ipc.IpcReadOptions(included_fields=[names.index(f) for f in fields])
    return ipc.open_file(pa.memory_map(path), options=opts)


def hidden_rows(col):
    """List<FixedSizeList<E, w>> of one row -> torch [n, w] (bf16 bits or f16)."""
    flat = col.flatten().flatten()  # flatten() honours slicing offsets
    arr = flat.to_numpy(zero_copy_only=False, writable=True).reshape(-1, col.type.value_type.list_size)
    if flat.type == pa.uint16():  # bf16 bit patterns (README: Arrow has no bf16)
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)  # f16 dumps


def index_dumps(dumps, max_len, val_fraction, vocab):
    """trainer.rs `index_rows`: global row order over the dumps, split by id, lengths after
    --max-len (rows under 3 tokens dropped), counts of the training split's assistant tokens."""
    rows, train, val = [], [], []
    counts = np.zeros(vocab, dtype=np.int64)
    for dump in dumps:
        for path in shard_paths(dump):
            reader = open_shard(path, ["sample_id", "input_ids", "loss_mask"])
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                sid = batch.column("sample_id")[0].as_py()
                ids = batch.column("input_ids").flatten().to_numpy().astype(np.int64)
                mask = batch.column("loss_mask").flatten().to_numpy().astype(np.uint8)
                index, n = len(rows), min(len(ids), max_len)
                rows.append(dict(path=path, batch=b, ids=ids[:n], mask=mask[:n], len=n))
                if int(ids.max(initial=0)) >= vocab:
                    sys.exit(f"row {index} ({sid}): a token id is outside the vocabulary {vocab}")
                if n < 3:
                    continue
                if is_validation(sid, val_fraction):
                    val.append((index, n))
                else:
                    counts += np.bincount(ids[:n][mask[:n] != 0], minlength=vocab)
                    train.append((index, n))
    return rows, train, val, counts


class DeviceData:
    """Every used row flattened into [tokens + 1, ...] device tensors; the last row is zeros and
    is what padding gathers, so a batch is one index_select (data.rs `assemble`: cut to max_len,
    right-padded with zeros)."""

    def __init__(self, rows, used, device, dtype):
        total = sum(rows[i]["len"] for i in used)
        self.start = {}
        ids, mask, at = np.zeros(total + 1, np.int64), np.zeros(total + 1, np.uint8), 0
        for i in sorted(used):
            self.start[i] = at
            n = rows[i]["len"]
            ids[at:at + n], mask[at:at + n] = rows[i]["ids"], rows[i]["mask"]
            at += n
        self.pad = total
        self.ids = torch.from_numpy(ids).to(device)
        self.mask = torch.from_numpy(mask).to(device).bool()
        self.lens = {i: rows[i]["len"] for i in used}
        self.aux = self.last = None
        by_path = {}
        for i in sorted(used):
            by_path.setdefault(rows[i]["path"], []).append(i)
        for path, indices in by_path.items():
            reader = open_shard(path, ["aux_hidden", "last_hidden"])
            for i in indices:
                batch, n, at = reader.get_batch(rows[i]["batch"]), rows[i]["len"], self.start[i]
                aux = hidden_rows(batch.column("aux_hidden"))[:n]
                last = hidden_rows(batch.column("last_hidden"))[:n]
                if self.aux is None:
                    self.aux = torch.zeros(total + 1, aux.shape[1], dtype=dtype, device=device)
                    self.last = torch.zeros(total + 1, last.shape[1], dtype=dtype, device=device)
                self.aux[at:at + n].copy_(aux.to(device).to(dtype))
                self.last[at:at + n].copy_(last.to(device).to(dtype))

    def batch(self, indices, pad_to=None, rows=None):
        """`pad_to`: round the width up to a multiple of it and add all-padding rows up to
        `rows` (length 0, fully masked), so that a static-shape torch.compile sees one shape."""
        lens = [self.lens[i] for i in indices]
        width = max(lens)
        if pad_to:
            width = -(-width // pad_to) * pad_to
            lens = lens + [0] * max((rows or 0) - len(lens), 0)
        idx = np.full((len(lens), width), self.pad, dtype=np.int64)
        for r, (i, n) in enumerate(zip(indices, lens)):
            idx[r, :n] = np.arange(self.start[i], self.start[i] + n)
        idx = torch.from_numpy(idx).to(self.ids.device, non_blocking=True)
        lens_t = torch.tensor(lens, device=self.ids.device)
        return (self.aux[idx], self.ids[idx], self.mask[idx], lens_t, self.last[idx]), sum(lens)


# ----------------------------------------------------------------------------------------------
# The head (crates/tandem-eagle/src/model.rs); attribute names = canonical checkpoint keys
# ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):  # HF LlamaRMSNorm: statistics in f32, weight applied after the cast
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Bag(nn.Module):  # a plain container so parameter names nest as in the checkpoint
    def __init__(self, **children):
        super().__init__()
        for k, v in children.items():
            setattr(self, k, v)


class Eagle3Head(nn.Module):
    def __init__(self, s, taps):
        super().__init__()
        h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
        lin = lambda i, o: nn.Linear(i, o, bias=False)
        self.s = s
        self.fc = lin(taps * s["target_hidden"], h)
        self.midlayer = Bag(
            input_layernorm=RMSNorm(h, s["eps"]), hidden_norm=RMSNorm(h, s["eps"]),
            self_attn=Bag(q_proj=lin(2 * h, q), k_proj=lin(2 * h, kv), v_proj=lin(2 * h, kv),
                          o_proj=lin(q, h)),
            post_attention_layernorm=RMSNorm(h, s["eps"]),
            mlp=Bag(gate_proj=lin(h, s["inter"]), up_proj=lin(h, s["inter"]),
                    down_proj=lin(s["inter"], h)))
        self.norm = RMSNorm(h, s["eps"])
        self.lm_head = lin(h, s["draft_vocab"])

    def init_(self, seed):
        """model.rs `Eagle3Draft::init`: linears uniform in +-1/sqrt(in), norms 1 (own RNG)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    b = 1.0 / math.sqrt(p.shape[1])
                    p.copy_(torch.rand(p.shape, generator=g) * 2 * b - b)


def rotate(x, cos, sin):  # HF apply_rotary_pos_emb (tables cast to the activations' dtype)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


def forward_ttt(m, aux, ids, embed, cos_t, sin_t, steps):
    """model.rs `forward_ttt` + `TttAttention`: step i reads token t+1+i (0 past the end), its
    queries/keys sit at position t+i; it attends to step 0's keys causally and to steps 1..i's
    keys at its own index, one softmax over all. Returns the draft logits of every step."""
    s, L = m.s, m.midlayer
    B, W = ids.shape
    kvh, g, hd = s["kv_heads"], s["heads"] // s["kv_heads"], s["head_dim"]
    scale = 1.0 / math.sqrt(hd)
    causal = torch.full((W, W), float("-inf"), device=ids.device).triu(1)
    ids_p = torch.cat([ids, ids.new_zeros(B, steps + 1)], 1)  # padding ids are 0 already
    hidden = m.fc(aux)
    keys, values, logits = [], [], []
    for i in range(steps):
        emb = F.embedding(ids_p[:, 1 + i:1 + i + W], embed)
        cos, sin = cos_t[i:i + W], sin_t[i:i + W]
        x = torch.cat([L.input_layernorm(emb), L.hidden_norm(hidden)], -1)
        a = L.self_attn
        q = rotate(a.q_proj(x).view(B, W, kvh * g, hd).transpose(1, 2), cos, sin)
        k = rotate(a.k_proj(x).view(B, W, kvh, hd).transpose(1, 2), cos, sin)
        v = a.v_proj(x).view(B, W, kvh, hd).transpose(1, 2)
        keys.append(k)
        values.append(v)
        q5 = q.reshape(B, kvh, g, W, hd)  # head = kv * g + j (HF repeat_kv)
        parts = [(q5 @ keys[0].unsqueeze(2).transpose(-1, -2)).float() * scale + causal]
        for kj in keys[1:]:
            parts.append((q5.float() * kj.unsqueeze(2).float()).sum(-1, keepdim=True) * scale)
        p = torch.softmax(torch.cat(parts, -1), dim=-1).to(v.dtype)
        out = p[..., :W] @ values[0].unsqueeze(2)
        for j in range(1, i + 1):
            out = out + p[..., W + j - 1:W + j] * values[j].unsqueeze(2)
        out = out.reshape(B, kvh * g, W, hd).transpose(1, 2).reshape(B, W, kvh * g * hd)
        hidden = hidden + a.o_proj(out)
        y = L.post_attention_layernorm(hidden)
        hidden = hidden + L.mlp.down_proj(F.silu(L.mlp.gate_proj(y)) * L.mlp.up_proj(y))
        logits.append(m.lm_head(m.norm(hidden)))
    return logits


def compute_loss(m, batch, c, steps):
    """objective.rs `objective` on one batch: target logits recomputed from last_hidden (final
    norm + lm_head, argmax over the full vocabulary, softmax over the draft ids in f32);
    loss_i = -sum(position_mask * sum p log q) / (B * W); total = sum 0.8^i loss_i.
    Returns (total, [steps, 3] = loss_i, correct_i, denominator_i)."""
    aux, ids, mask, lens, last = batch
    B, W = ids.shape
    with torch.no_grad():
        xf = last.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + c["t_eps"])
        t_logits = (c["t_norm"] * xf).to(c["lm_head"].dtype) @ c["lm_head"].t()
        t_argmax = t_logits.argmax(-1)
        probs = torch.softmax(t_logits[..., c["draft_ids"]].float(), -1)
        pad = steps + 1  # rows shifted past the end: masked (zeros instead of Tandem's uniform)
        probs_p = torch.cat([probs, probs.new_zeros(B, pad, probs.shape[-1])], 1)
        arg_p = torch.cat([t_argmax, t_argmax.new_zeros(B, pad)], 1)
        pos = torch.arange(W, device=ids.device)
        base = mask & (pos[None, :] + 1 < lens[:, None])  # shifted loss mask, last real zeroed
        base_p = torch.cat([base, base.new_zeros(B, pad)], 1)
        inv_p = torch.cat([c["t2d"][t_argmax], base.new_zeros(B, pad)], 1)
    logits = forward_ttt(m, aux, ids, c["embed"], c["cos"], c["sin"], steps)
    total, stats = 0.0, []
    for i, lg in enumerate(logits):
        den = base_p[:, i:i + W]
        pm = den & inv_p[:, i + 1:i + 1 + W]  # target argmax at t+1+i in the draft vocab
        plogq = (probs_p[:, 1 + i:1 + i + W] * torch.log_softmax(lg.float(), -1)).sum(-1)
        loss = -(plogq * pm).sum() / (B * W)
        total = total + 0.8 ** i * loss
        with torch.no_grad():
            hit = c["draft_ids"][lg.argmax(-1)] == arg_p[:, 1 + i:1 + i + W]
            stats.append(torch.stack([loss.detach(), (pm & hit).sum().float(), den.sum().float()]))
    return total, torch.stack(stats)


def validate(m, data, val_rows, c, steps, batch_size, amp):
    """trainer.rs `validate`: whole split, sorted by (len, index), mean loss_i over batches,
    acc_i = correct / shifted-loss-mask count over the split."""
    rows = sorted(val_rows, key=lambda r: (r[1], r[0]))
    acc = torch.zeros(steps, 3, dtype=torch.float64)
    nb, tokens = 0, 0
    with torch.no_grad(), amp():
        for b in range(0, len(rows), batch_size):
            batch, n = data.batch([r[0] for r in rows[b:b + batch_size]])
            acc += compute_loss(m, batch, c, steps)[1].double().cpu()
            nb, tokens = nb + 1, tokens + n
    ploss = (acc[:, 0] / max(nb, 1)).tolist()
    return dict(loss=sum(0.8 ** i * l for i, l in enumerate(ploss)), ploss=ploss,
                acc=[(a / d if d else 0.0) for a, d in zip(acc[:, 1].tolist(), acc[:, 2].tolist())],
                correct=acc[:, 1].long().tolist(), denominator=acc[:, 2].long().tolist(),
                tokens=tokens, batches=nb)


def export_head(m, directory, cfg, d2t, t2d, bf16):
    """io.rs `save_safetensors`: canonical keys, HF [out, in] (= nn.Linear's layout), d2t int64
    offsets, t2d bool, metadata format=pt; config.json alongside."""
    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    dt = torch.bfloat16 if bf16 else torch.float32
    tensors = {k: v.detach().to("cpu", dt).contiguous() for k, v in m.state_dict().items()}
    tensors["d2t"], tensors["t2d"] = d2t.cpu().long(), t2d.cpu().bool()
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(cfg, torch_dtype="bfloat16" if bf16 else "float32")
    with open(os.path.join(directory, "config.json"), "w") as fh:
        fh.write(json.dumps(cfg, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------
def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--dump", action="append", default=[], help="dump directory (repeatable)")
    a("--model", default="models/SmolLM2-135M-Instruct", help="target HF directory")
    a("--out", help="JSON report path")
    a("--vocab-from", help="read d2t/t2d (and config.json) from this head directory")
    a("--init-head", help="start from this head's weights and vocabulary (like --init-from)")
    a("--draft-vocab", type=int, help="draft vocabulary [default: min(32000, target vocab)]")
    a("--ttt-steps", type=int, default=7)
    a("--epochs", type=int, default=1)
    a("--lr", type=float, default=1e-4)
    a("--batch-size", type=int, default=4)
    a("--max-len", type=int, default=2048)
    a("--warmup-ratio", type=float, default=0.015)
    a("--min-lr-ratio", type=float, default=0.0)
    a("--weight-decay", type=float, default=0.0)
    a("--max-grad-norm", type=float, default=0.5)
    a("--val-fraction", type=float, default=0.02)
    a("--seed", type=int, default=0)
    a("--max-steps", type=int)
    a("--max-seconds", type=float)
    a("--compile", action="store_true", help="torch.compile the forward + loss")
    a("--pad-to", type=int, help="pad every batch's width up to a multiple of this and to "
      "--batch-size rows; with --compile: static shapes (one graph per padded width). For speed "
      "runs (--bench-only): the loss is then normalised by the padded batch * width")
    a("--wait-file", help="after the --timing-warmup steps, wait until this file exists (so the "
      "timed steps can run alone on a GPU shared with other jobs during the warm-up)")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a("--dtype", choices=["auto", "bf16", "f32"], default="auto",
      help="auto: bf16 autocast (f32 master weights) on cuda, f32 on cpu")
    a("--export", help="write the trained head here (config.json + model.safetensors)")
    a("--export-bf16", action="store_true")
    a("--bench-only", action="store_true", help="no validation; time --max-steps steps")
    a("--timing-warmup", type=int, default=5, help="steps left out of the median tokens/s")
    a("--tandem-metrics", help="compare per-step token counts with this Tandem metrics.jsonl")
    a("--self-check", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    if args.self_check:
        return self_check()
    if not args.dump or not args.out:
        sys.exit("--dump and --out are required")
    t_start = time.perf_counter()
    device = torch.device(args.device)
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    dtype = torch.bfloat16 if bf16 else torch.float32
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    torch.manual_seed(args.seed)
    with open(os.path.join(args.model, "config.json")) as fh:
        tcfg = json.load(fh)
    vocab = tcfg["vocab_size"]
    with pa.memory_map(shard_paths(args.dump[0])[0]) as src:
        schema = ipc.open_file(src).schema
        field = schema.field("aux_hidden")
        taps = (field.metadata or {}).get(b"tandem.taps", b"").decode().split(",")
        num_taps = field.type.value_type.list_size // schema.field("last_hidden").type.value_type.list_size

    # First pass (ids and masks only): split, lengths, draft-vocabulary counts.
    rows, train_rows, val_rows, counts = index_dumps(args.dump, args.max_len, args.val_fraction, vocab)
    if not train_rows:
        sys.exit(f"{len(rows)} rows, {len(val_rows)} in validation, none left to train on")
    total_steps = math.ceil(len(train_rows) / args.batch_size) * args.epochs
    warmup = warmup_steps(total_steps, args.warmup_ratio)

    # The head: from --init-head, else fresh over --vocab-from's or a computed vocabulary.
    head_cfg, init_weights, d2t, t2d = None, None, None, None
    if args.init_head:
        head_cfg, init_weights, d2t, t2d = load_head(args.init_head)
    elif args.vocab_from:
        head_cfg, _, d2t, t2d = load_head(args.vocab_from)
    if d2t is None:
        n = args.draft_vocab or min(32000, vocab)
        d2t_np, t2d_np = build_vocab_map(counts, n, vocab)
        d2t, t2d = torch.from_numpy(d2t_np), torch.from_numpy(t2d_np)
    if args.draft_vocab and args.draft_vocab != len(d2t):
        sys.exit(f"--draft-vocab {args.draft_vocab}, but the head's d2t has {len(d2t)} entries")
    cfg = dict(head_cfg) if head_cfg else draft_config_for_target(tcfg, len(d2t), taps)
    cfg["draft_vocab_size"] = len(d2t)
    if not args.init_head:  # a fresh head is built for the target (trainer.rs `head_config`)
        base = draft_config_for_target(tcfg, len(d2t), taps)
        cfg.update({k: base.get(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling")})
    spec = spec_of(cfg)
    model = Eagle3Head(spec, num_taps)
    if init_weights is not None:
        model.load_state_dict(init_weights, strict=True)
    else:
        model.init_(args.seed)
    model.to(device)

    # Frozen target pieces (target.rs `TargetHead`): embedding, final norm, lm_head (or tied).
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    tw = read_tensors(args.model, names)
    embed = tw["model.embed_tokens.weight"]
    tied = tcfg.get("tie_word_embeddings", False) or "lm_head.weight" not in tw
    lm_head = embed if tied else tw["lm_head.weight"]
    target_ids = (torch.arange(len(d2t)) + d2t.long())
    max_pos = args.max_len + args.ttt_steps + 1
    angle = torch.outer(torch.arange(max_pos, dtype=torch.float32),
                        torch.tensor(spec["inv_freq"], dtype=torch.float64).float())  # f32, as Rope::new
    angle = torch.cat([angle, angle], -1)
    c = dict(embed=embed.to(device, dtype), lm_head=lm_head.to(device, dtype),
             t_norm=tw["model.norm.weight"].to(device, torch.float32), t_eps=float(tcfg["rms_norm_eps"]),
             draft_ids=target_ids.to(device), t2d=t2d.bool().to(device),
             cos=angle.cos().to(device), sin=angle.sin().to(device))
    del tw

    # Second pass: hidden states of every row used, onto the device.
    t_load = time.perf_counter()
    used = [r[0] for r in train_rows] + ([] if args.bench_only else [r[0] for r in val_rows])
    data = DeviceData(rows, used, device, dtype)
    del rows
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    load_s = time.perf_counter() - t_load

    # dynamic=True: widths and the last (smaller) batch vary; without it Dynamo recompiles on the
    # first new shape and again when the batch size changes (minutes each, inside the timed loop).
    # --pad-to: every batch has one of a few padded shapes, so the graph is static (dynamic=False)
    # and compiled once per width; padding costs compute, counted tokens stay the real ones.
    loss_fn = (torch.compile(compute_loss, dynamic=not args.pad_to) if args.compile else compute_loss)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=args.weight_decay, fused=device.type == "cuda")
    stop_at = min(args.max_steps if args.max_steps is not None else total_steps, total_steps)
    curve, vals, step_times, step_tokens, padded_tokens = [], [], [], [], []
    step, train_s = 0, 0.0

    def run_validation(epoch):
        if args.bench_only or not val_rows:
            return
        model.eval()
        v = validate(model, data, val_rows, c, args.ttt_steps, args.batch_size, amp)
        model.train()
        vals.append(dict(v, step=step, epoch=epoch))
        print(f"val step {step}: loss {v['loss']:.4f} acc {[round(a, 4) for a in v['acc']]}", flush=True)

    for epoch in range(args.epochs):
        if step >= stop_at:
            break
        plan = plan_epoch(train_rows, args.batch_size, BUCKET_BATCHES, args.seed, epoch)
        for bi, indices in enumerate(plan):
            if step >= stop_at:
                break
            sync()
            t0 = time.perf_counter()
            lr = lr_at(step, total_steps, warmup, args.lr, args.min_lr_ratio)
            if args.wait_file and step == args.timing_warmup:
                print(f"warm-up done ({step} steps); waiting for {args.wait_file}", flush=True)
                while not os.path.exists(args.wait_file):
                    time.sleep(1)
                sync()
                t0 = time.perf_counter()
            batch, tokens = data.batch(indices, args.pad_to, args.batch_size)
            padded_tokens.append(batch[1].numel())
            with amp():
                loss, stats = loss_fn(model, batch, c, args.ttt_steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm if args.max_grad_norm > 0 else math.inf)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            host = torch.cat([stats.flatten(), loss.detach().float().view(1), gn.float().view(1)]).cpu()
            sync()
            dt = time.perf_counter() - t0
            train_s += dt
            step += 1
            st = host[:-2].view(-1, 3).tolist()
            if not math.isfinite(host[-2].item()):
                sys.exit(f"diverged at step {step}: loss {host[-2].item()}")
            step_times.append(dt)
            step_tokens.append(tokens)
            curve.append(dict(step=step, epoch=epoch, lr=lr, loss=host[-2].item(), ploss=[s[0] for s in st],
                              acc=[(s[1] / s[2] if s[2] else 0.0) for s in st], grad_norm=host[-1].item(),
                              tokens=tokens, time_s=dt))
            if step % 10 == 0 or step == 1:
                print(f"step {step}/{stop_at} loss {curve[-1]['loss']:.4f} acc0 {curve[-1]['acc'][0]:.3f} "
                      f"{tokens / dt:.0f} tok/s", flush=True)
            time_up = args.max_seconds is not None and train_s >= args.max_seconds
            if bi + 1 == len(plan) or step == stop_at or time_up:  # when Tandem validates
                run_validation(epoch)
            if time_up:
                stop_at = step
                break
    if step == 0:
        run_validation(0)  # --max-steps 0: only the validation pass (the parity check)

    skip = min(args.timing_warmup, max(len(step_times) - 1, 0))
    per_step = [n / t for n, t in zip(step_tokens[skip:], step_times[skip:])]
    # Steady rate: steps after the warm-up, minus (re)compilation stalls (> 10x the median step).
    med = statistics.median(step_times[skip:]) if step_times else 0.0
    slow = [s + 1 for s in range(skip, len(step_times)) if step_times[s] > 10 * med]
    keep = [s for s in range(skip, len(step_times)) if s + 1 not in slow]
    steady_t, steady_n = sum(step_times[s] for s in keep), sum(step_tokens[s] for s in keep)
    report = dict(
        steps=step, total_steps=total_steps, warmup_steps=warmup, train_rows=len(train_rows),
        val_rows=len(val_rows), tokens=sum(step_tokens),
        tokens_per_s_median=statistics.median(per_step) if per_step else None,
        tokens_per_s_steady=steady_n / steady_t if steady_t else None, slow_steps_excluded=slow,
        tokens_per_s_overall=sum(step_tokens) / train_s if train_s else None,
        padded_tokens_per_s_median=(statistics.median(
            [n / t for n, t in zip(padded_tokens[skip:], step_times[skip:])]) if per_step else None),
        padding_share=1 - sum(step_tokens) / max(sum(padded_tokens), 1),
        step_time_median_s=med if step_times else None,
        timing_note=f"synchronised per-step timing (batch gather + target logits + forward + backward + "
                    f"clip + AdamW); median/steady leave out the first {skip} steps, steady also the "
                    f"slow_steps_excluded; overall = all steps; validation and loading excluded",
        train_time_s=train_s, load_time_s=load_s, wall_time_s=time.perf_counter() - t_start,
        val=vals[-1] if vals else None, val_curve=vals, train_curve=curve,
        hyper_parameters=dict(vars(args), draft_vocab_size=len(d2t), taps=taps, dtype=str(dtype),
                              bucket_batches=BUCKET_BATCHES),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch_version=torch.__version__, spec={k: v for k, v in spec.items() if k != "inv_freq"})
    if args.tandem_metrics:
        with open(args.tandem_metrics) as fh:
            theirs = [json.loads(l) for l in fh if l.strip()]
        theirs = [l["tokens"] for l in theirs if l["kind"] == "train"]
        n = min(len(theirs), len(step_tokens))
        same = theirs[:n] == step_tokens[:n]
        report["tandem_batch_tokens_match"] = dict(steps_compared=n, identical=same)
        print(f"per-step token counts vs Tandem ({n} steps): {'identical' if same else 'DIFFERENT'}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    if args.export:
        export_head(model, args.export, cfg, d2t, t2d, args.export_bf16)
    tps = report["tokens_per_s_median"]
    acc = [round(a, 4) for a in vals[-1]["acc"]] if vals else None
    print(f"reference: {step} steps, {tps or 0:.0f} tokens/s (median), val acc {acc}")


if __name__ == "__main__":
    main()
