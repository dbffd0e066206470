"""The extraction self-check: a few stored samples against the model's own reference path.

`extract` captures states with hooks, in padded batches, and stores them in shards; a
wrong layer, rows reordered by batching or a teacher state without the final norm would
all produce a store that trains a useless draft without any error. So at the end of
`run_extract` (before the manifest, so `train` cannot start on a bad store) a sample of
`extract.selfcheck_samples` stored samples is run again the plain way: alone, unpadded,
through the full CausalLM with `output_hidden_states=True`, and compared with what the
store holds after a round trip through the shards:

- each captured layer i: the stored state vs `output_hidden_states[i]` (the state entering
  decoder layer i);
- the teacher: the stored final state vs the tensor the model itself feeds its LM head
  (caught by a pre-hook on the LM head, so it is right whether or not the model's last
  `output_hidden_states` entry is normed), and the top-1 token of LM head(stored final)
  vs the argmax of the model's own logits.

Per state the cosine similarity of the whole sample, the max absolute error and the
relative error ||stored - ref|| / ||ref|| are measured, and, over all checked tokens, the share
of tokens whose own cosine is below the threshold (`tokens_below`: a wrong layer, order or norm
moves nearly every token; a mixture-of-experts router that sends a few near-tied tokens to other
experts in the batched forward moves only those). A state fails when its cosine is
below `extract.selfcheck_min_cosine`, or when its relative error exceeds
sqrt(2 * (1 - min_cosine)) (the error that cosine allows, 0.045 at 0.999: catches a wrong
scale, which cosine cannot see). The teacher also fails when top-1 agreement is below
`extract.selfcheck_min_top1`. Causal models let the check run on a prefix of at most
`REF_MAX_TOKENS` tokens of each sample: earlier tokens do not depend on later ones.

The vLLM backend cannot rerun the target here; its check (`logprob_agreement`, run by
eaglet/engines/vllm/extract.py on the first samples, before the rest is extracted) compares the
top token of the target's LM head on the stored final state with vLLM's own prompt logprobs.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from ..draft.loss import teacher_targets
from ..draft.layers import is_moe_config
from ..errors import VerificationError
from ..formats.store import StoreReader, dequantize_states, quantize_states
from ..targets.load import TargetParts

REF_MAX_TOKENS = 1024
TIE_NATS = 0.05  # against vLLM: eaglet's top token counts as agreeing when vLLM scores it this close to its own


class SelfCheckError(VerificationError):
    """Stored states disagree with the model's own; the message names the state and the error."""


def pick_samples(sample_ids: np.ndarray, n: int, seed: int) -> list[int]:
    """`n` stored sample ids chosen by the seed (all of them when there are fewer), sorted."""
    ids = np.asarray(sample_ids, dtype=np.int64)
    if n >= len(ids):
        return ids.tolist()
    return sorted(np.random.default_rng([seed, 11]).choice(ids, size=n, replace=False).tolist())


def compare(stored: torch.Tensor, ref: torch.Tensor, min_cosine: float = 1.0) -> dict[str, float]:
    """Cosine (whole sample flattened), max |error| and relative error, in fp32, and how many
    tokens (rows [T, H]) have their own cosine below `min_cosine`."""
    s, r = stored.float(), ref.float()
    a, b = s.reshape(-1), r.reshape(-1)
    diff = a - b
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0, eps=1e-12))
    return {
        "cosine": cos,
        "max_abs_error": float(diff.abs().max()) if diff.numel() else 0.0,
        "rel_error": float(diff.norm() / b.norm().clamp_min(1e-12)),
        "tokens_below": int((torch.nn.functional.cosine_similarity(s, r, dim=-1, eps=1e-12) < min_cosine).sum()),
    }


@torch.inference_mode()
def reference(model: torch.nn.Module, parts: TargetParts, layers: list[int], input_ids: torch.Tensor
              ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """One sample alone, through the CausalLM: ([state entering layer i for i in layers],
    the LM head's input [T, H], logits [T, V]), all on the CPU in fp32."""
    seen: list[torch.Tensor] = []
    handle = parts.lm_head.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        out = model(input_ids=input_ids[None].to(parts.input_device), output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    hidden = out.hidden_states
    if hidden is None or len(hidden) < parts.num_layers:
        raise SelfCheckError(
            f"{type(model).__name__} returned {0 if hidden is None else len(hidden)} output_hidden_states for "
            f"{parts.num_layers} decoder layers; the self-check needs one per layer (set extract.selfcheck_samples=0 "
            "to skip it)"
        )
    if len(seen) != 1:
        raise SelfCheckError(f"the LM head ran {len(seen)} times in one forward (expected once)")
    T = input_ids.shape[0]
    states = [hidden[i][0, :T].float().cpu() for i in layers]
    return states, seen[0][0, :T].float().cpu(), out.logits[0, :T].float().cpu()


def moe_hint(config: Any) -> str:
    """For a mixture-of-experts target, the one benign cause of a failed check, and how to tell it."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not is_moe_config(text):
        return ""
    return ("\nThis target routes tokens to experts. A batched forward sums in another order than the "
            "unbatched reference, and a token whose expert scores are nearly tied can go to other experts, "
            "which moves that token's state from that layer on (seen on a random-weight DeepSeek-V3 in "
            "bfloat16, whose routers have no margins). That is the cause when the states before the first "
            "MoE layer match and only a small share of the tokens is below the threshold; a wrong layer, "
            "order or norm moves nearly all of them. Confirm it with target.dtype=float32 on the same samples "
            "before lowering the thresholds.")


def run_selfcheck(model: torch.nn.Module, parts: TargetParts, store: StoreReader, layers: list[int],
                  num_samples: int, min_cosine: float, min_top1: float, seed: int = 0) -> dict[str, Any]:
    """Compare `num_samples` stored samples with the reference path; raise SelfCheckError on
    a mismatch, else return the measurements (for the extract stats)."""
    if num_samples <= 0 or len(store) == 0:
        return {"samples": []}
    ids = pick_samples(store.sample_ids, num_samples, seed)
    H = store.hidden_size
    names = [f"layer {i}" for i in layers] + ["final"]
    worst: dict[str, dict[str, Any]] = {n: {"cosine": 1.0, "max_abs_error": 0.0, "rel_error": 0.0} for n in names}
    below = dict.fromkeys(names, 0)
    agree = total = fp8_agree = 0
    for sid in ids:
        got = store.get(sid)
        n = min(int(got["input_ids"].shape[0]), REF_MAX_TOKENS)
        ids_T = got["input_ids"][:n].to(torch.int64)
        ref_states, ref_final, ref_logits = reference(model, parts, layers, ids_T)
        want = ref_logits.argmax(-1)
        if store.scaled:
            # An fp8 store's states are compared with what it would hold of the model's own, so the
            # check still finds the pipeline's bugs; fp8's own cost is for the quality bench to
            # measure (the top-1 of the model's own final state through fp8 is recorded).
            ref_states = [dequantize_states(*quantize_states(r, 1), torch.bfloat16) for r in ref_states]
            ref_final = dequantize_states(*quantize_states(ref_final, 1), torch.bfloat16)
            with torch.inference_mode():
                ref_logits_fp8 = parts.logits(ref_final.to(got["final"].dtype)).float().cpu()
            fp8_agree += int((ref_logits_fp8.argmax(-1) == want).sum())
        stored = [got["aux"][:n, j * H:(j + 1) * H] for j in range(len(layers))] + [got["final"][:n]]
        for name, s, r in zip(names, stored, ref_states + [ref_final]):
            m = compare(s, r, min_cosine)
            below[name] += m["tokens_below"]
            w = worst[name]
            if m["cosine"] < w["cosine"]:
                w["cosine"], w["sample"] = m["cosine"], sid
            w["max_abs_error"] = max(w["max_abs_error"], m["max_abs_error"])
            if m["rel_error"] > w["rel_error"]:
                w["rel_error"], w["rel_sample"] = m["rel_error"], sid
        with torch.inference_mode():
            teacher = parts.logits(got["final"][:n]).float().cpu()  # the family's logit scale/softcap too
        top = teacher.argmax(-1)
        if store.scaled:
            # Against the model's own final state through the same fp8 rounding, as the states above:
            # fp8 alone moves the top-1 of a few percent of a real model's tokens (3.4% of SmolLM2-135M's),
            # which is fp8's cost, not a pipeline bug. Batched and unbatched forwards differ in their
            # last bits, which fp8's rounding can widen: a top-1 within TIE_NATS of the best counts.
            ref = ref_logits_fp8.log_softmax(-1)
            agree += int((ref.gather(-1, top[:, None])[:, 0] >= ref.max(-1).values - TIE_NATS).sum())
        else:
            agree += int((top == want).sum())
        total += n
    top1 = agree / max(total, 1)
    for name in names:
        worst[name]["tokens_below"] = below[name] / max(total, 1)
    max_rel = math.sqrt(2 * max(0.0, 1 - min_cosine))
    problems = []
    for name, w in worst.items():
        what = "the teacher state (LM head input)" if name == "final" else f"the state entering decoder {name}"
        if w["cosine"] < min_cosine:
            problems.append(f"{name}: cosine {w['cosine']:.6f} < extract.selfcheck_min_cosine {min_cosine} "
                            f"(sample {w['sample']}; max abs error {w['max_abs_error']:.4g}, relative error "
                            f"{w['rel_error']:.4g}; {w['tokens_below']:.1%} of the tokens below) for {what}")
        elif w["rel_error"] > max_rel:
            problems.append(f"{name}: relative error {w['rel_error']:.4g} > {max_rel:.4g} (sample {w['rel_sample']}; "
                            f"max abs error {w['max_abs_error']:.4g}; cosine {w['cosine']:.6f}: a wrong scale) "
                            f"for {what}")
    if top1 < min_top1:
        against = ("the model's own final state through the same fp8 rounding (within "
                   f"{TIE_NATS} nats)" if store.scaled else "the model's own logits")
        problems.append(f"teacher top-1: LM head(stored final) agrees with {against} on {top1:.2%} of "
                        f"{total} tokens < extract.selfcheck_min_top1 {min_top1:.2%}")
    result = {
        "samples": ids,
        "tokens": total,
        "top1_agreement": top1,
        "states": {k: {m: (round(v, 6) if isinstance(v, float) else v) for m, v in w.items()}
                   for k, w in worst.items()},
        "min_cosine": min_cosine,
        "max_rel_error": max_rel,
        "min_top1": min_top1,
    }
    if store.scaled:
        result["fp8_top1_vs_model"] = fp8_agree / max(total, 1)  # fp8's rounding alone, against the model's logits
    if problems:
        raise SelfCheckError(
            "extract self-check failed: the stored states of samples " + str(ids) + " do not match the model's own "
            "unbatched forward (output_hidden_states and logits):\n  " + "\n  ".join(problems) + "\n"
            "The store is kept but the extract manifest is not written, so train cannot start on it. Likely "
            "causes: a hook on the wrong layer, batched rows mapped to the wrong samples, a teacher state without "
            "the final norm, a padding/attention-mask bug in the model's batched path. Thresholds: "
            "extract.selfcheck_min_cosine / selfcheck_min_top1 (selfcheck_samples=0 turns the check off)."
            + moe_hint(model.config)
        )
    return result


# ---- the vLLM backend's check: the stored final state against vLLM's prompt logprobs -------------

def _top_logprobs(position: Any) -> dict[int, float]:
    """One prompt-logprobs position (vLLM's {id: Logprob}, or the server's JSON {"id": {...}})."""
    out = {}
    for k, v in position.items():
        out[int(k)] = float(v["logprob"] if isinstance(v, dict) else v.logprob)
    return out


def teacher_argmax(final_TH: torch.Tensor, head: dict[str, torch.Tensor], pre_norm: bool, eps: float,
                   chunk: int = 128) -> torch.Tensor:
    """Top token of the target's logits from stored final states, through training's own
    teacher (loss.teacher_targets, final norm applied for a pre-norm store)."""
    lm_head = head["lm_head"]  # in its own dtype, as training computes the teacher
    V = lm_head.shape[0]
    every_id = torch.ones(V, dtype=torch.bool)
    no_offset = torch.zeros(V, dtype=torch.int64)
    norm = head["norm"].float() if pre_norm else None
    out = []
    for a in range(0, final_TH.shape[0], chunk):
        probs, _ = teacher_targets(final_TH[a:a + chunk].float()[None], lm_head, every_id, no_offset, chunk, norm, eps)
        out.append(probs[0].argmax(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def logprob_agreement(final_TH: torch.Tensor, prompt_logprobs: Sequence[Any], head: dict[str, torch.Tensor],
                      pre_norm: bool, eps: float, tie: float = TIE_NATS) -> dict[str, int]:
    """Positions t < T-1 (at most REF_MAX_TOKENS): does eaglet's top token of the logits at t
    match vLLM's top token for prompt position t+1? {"tokens", "agree", "exact"}."""
    n = min(final_TH.shape[0], len(prompt_logprobs), REF_MAX_TOKENS) - 1
    if n <= 0:
        return {"tokens": 0, "agree": 0, "exact": 0}
    ours = teacher_argmax(final_TH[:n], head, pre_norm, eps).tolist()
    agree = exact = 0
    for t in range(n):
        lp = _top_logprobs(prompt_logprobs[t + 1])
        top = max(lp.values())
        exact += lp.get(ours[t], -1.0) == top
        agree += ours[t] in lp and top - lp[ours[t]] <= tie
    return {"tokens": n, "agree": agree, "exact": exact}
