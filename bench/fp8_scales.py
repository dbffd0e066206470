"""What fp8 rounding of the teacher state costs, for scale granularities, on a bf16 store.

    python bench/fp8_scales.py runs/demo/extract            # the demo's store (eaglet demo)
    python bench/fp8_scales.py STORE --samples 200 --out OUT.json

For the stored final states of the first `--samples` samples: the teacher's logits (the
target's LM head, after its final norm when the store holds the state before it) from the
state as stored, and from the state through float8_e4m3fn with one scale per token (eaglet's
format), per block of channels, and int8 per token for reference. Printed and saved: the
share of tokens whose top-1 is unchanged, the mean KL divergence from the stored state's
distribution, and the mean relative error of the state.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eaglet.formats.store import StoreReader, dequantize_states, quantize_states


def _int8(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (x / s).round().clamp(-127, 127) * s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    store = StoreReader(args.store)
    if store.scaled:
        raise SystemExit(f"{args.store} is an fp8 store: give a bf16 or fp32 one (its states are the reference)")
    head = store.target_head(torch.device("cpu"))
    lm_head = head.lm_head.float()
    norm = None if head.norm is None else head.norm.float()

    def logits(f: torch.Tensor) -> torch.Tensor:
        f = f.float()
        if norm is not None:  # a store of the state before the final norm
            f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + head.norm_eps) * norm
        return f @ lm_head.T

    final = torch.cat([store.get(int(s))["final"] for s in store.sample_ids.tolist()[:args.samples]]).float()
    ref = logits(final)
    ref_lp, ref_top = ref.log_softmax(-1), ref.argmax(-1)
    H = final.shape[-1]
    schemes = {"fp8, a scale per token (eaglet)": dequantize_states(*quantize_states(final, 1))}
    for block in (256, 192, 128, 64, 32):
        if H % block == 0 and block < H:  # the store's quantizer, the width cut into H / block "states"
            schemes[f"fp8, a scale per {block} channels"] = dequantize_states(*quantize_states(final, H // block))
    schemes["int8, a scale per token"] = _int8(final)
    rows = {}
    for name, x in schemes.items():
        lp = logits(x).log_softmax(-1)
        rows[name] = {"top1_unchanged": round(float((lp.argmax(-1) == ref_top).float().mean()), 4),
                      "kl_nats": round(float((ref_lp.exp() * (ref_lp - lp)).sum(-1).mean()), 5),
                      "relative_error": round(float(((x - final).norm(dim=-1) / final.norm(dim=-1)).mean()), 4)}
        print(f"{name:34} top-1 unchanged {rows[name]['top1_unchanged']:.2%}  KL {rows[name]['kl_nats']:.5f} nats  "
              f"relative error {rows[name]['relative_error']:.4f}")
    result = {"store": str(args.store), "tokens": int(final.shape[0]), "hidden": H, "schemes": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
