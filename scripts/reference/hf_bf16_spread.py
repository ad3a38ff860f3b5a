"""How far HF transformers' own bf16 forward is from its f32 forward on the fast-check prompt
(`tandem_cuda::check::prompt_for(0, n, vocab)`): the bf16 spread of the reference
implementation, per tap, to read `tandem fast-check` errors against.

Usage: python3 hf_bf16_spread.py MODEL_DIR [--tokens 4095] [--token T --channel C]
"""
import argparse

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=4095)
    ap.add_argument("--token", type=int, default=None)
    ap.add_argument("--channel", type=int, default=None)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = 49152
    ids = torch.tensor([[(i * 7919 + 17) % (vocab - 1) + 1 for i in range(args.tokens)]], device=dev)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype, attn_implementation="eager").to(dev)
        with torch.no_grad():
            o = m(ids, output_hidden_states=True)
        out[dtype] = [h[0].float().cpu() for h in o.hidden_states] + [o.logits[0, -1].float().cpu()]
        del m
    ref, bf = out[torch.float32], out[torch.bfloat16]
    names = ["embed"] + [f"block {k}" for k in range(len(ref) - 3)] + ["final", "last logits"]
    print("| tap (HF hidden_states index) | rel err bf16 vs f32 (max diff / max ref) | worst token | its own rel err |")
    print("|---|---|---|---|")
    for name, r, b in zip(names, ref, bf):
        d = (b - r).abs()
        rel = (d.max() / r.abs().max()).item()
        if r.dim() == 2:
            tok = int(d.max(dim=1).values.argmax())
            own = (d[tok].max() / r[tok].abs().max()).item()
            print(f"| {name} | {rel:.2e} | {tok} | {own:.2e} |")
        else:
            print(f"| {name} | {rel:.2e} | - | - |")
    if args.token is not None:
        t, c = args.token, args.channel
        print(f"final[{t}, {c}]: f32 {ref[-2][t, c].item():.3f}, bf16 {bf[-2][t, c].item():.3f}")


if __name__ == "__main__":
    main()
