"""The sizes the doctor's plans are made of, shared by eaglet/doctor.py and the engines' own
checks (eaglet/engines/vllm/plan.py): bytes of the target's weights as it loads them, the draft
training builds (its memory and the disk its checkpoints take, with either attention layer), the
KV cache a token the target and the served draft take in vLLM, tokens per sample, and the
reference rates a time estimate scales by FLOPs (the draft's counted from its own linears).

Each function reads a `Probe` (eaglet/checks/findings.py) and adds no finding. Change a function
here when what it sizes changes (the draft's shapes, the checkpoint format, a quantization
method's width); the lines that report the sizes live with their checks.
"""

from __future__ import annotations

import json
from typing import Any

from ..draft.eagle3.model import Eagle3Draft
from ..draft.eagle3.training import draft_config
from ..formats.checkpoints import CKPT_DIR, checkpoint_bytes, checkpoints, safetensors_bytes
from ..formats.prepared import PreparedData
from ..formats.store import TARGET_CONFIG, read_target_config
from ..targets.families import text_config_from_dict
from .findings import Probe

GiB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def gib(n: float) -> str:
    """`n` bytes as the doctor's lines write them (GiB, or MiB below a tenth of one)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def hidden_and_aux(p: Probe) -> tuple[int | None, int]:
    """(the target's hidden size, None before its config is known; the captured aux layers)."""
    H = p.parts.hidden_size if p.parts is not None else getattr(p.text_config, "hidden_size", None)
    n_aux = len(p.layers) if p.layers else len(p.cfg.extract.layers or [0, 0, 0])
    return H, n_aux


def target_dtype_bytes(p: Probe) -> int:
    """Bytes a value of the target's weights takes as loaded (target.dtype; auto: the config's)."""
    name = p.cfg.target.dtype
    if name == "auto":
        cd = getattr(p.hf_config, "dtype", None) or getattr(p.text_config, "dtype", None)
        name = str(cd).removeprefix("torch.") if cd is not None else "bfloat16"
    return DTYPE_BYTES.get(name, 2)


def quant_bits(quant: Any) -> int | None:
    """Bits per weight of a checkpoint's quantization_config, where the method says it."""
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else {}
    method = str(quant.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8"):
        return 8
    if method == "mxfp4":
        return 4
    if method == "bitsandbytes":
        return 4 if quant.get("load_in_4bit") else 8 if quant.get("load_in_8bit") else None
    if method == "compressed-tensors":
        bits = [g.get("weights", {}).get("num_bits") for g in (quant.get("config_groups") or {}).values()
                if isinstance(g, dict) and isinstance(g.get("weights"), dict)]
        return min((x for x in bits if isinstance(x, int)), default=None)
    return quant.get("bits") if isinstance(quant.get("bits"), int) else None


def weight_bytes(p: Probe, b: int) -> int:
    """Parameters x target.dtype bytes; a quantized checkpoint's decoder-layer matrices
    (experts included) at its own bits per weight."""
    quant = getattr(p.hf_config, "quantization_config", None) or getattr(p.text_config, "quantization_config", None)
    bits = quant_bits(quant) if quant else None
    total = sum(t.numel() for t in p.model.parameters()) * b
    if bits is None:
        return total
    in_layers = sum(t.numel() for layer in p.parts.layers for t in layer.parameters() if t.dim() >= 2)
    return int(total - in_layers * b + in_layers * bits / 8)


def _text_config_for_train(p: Probe) -> Any:
    """The target's text config: the probe's, or the store's (train reads it from there)."""
    if p.text_config is not None:
        return p.text_config
    folder = p.cfg.run_dir / "extract"
    if not (folder / TARGET_CONFIG).is_file():
        return None
    return text_config_from_dict(read_target_config(folder))


def draft_skeleton(p: Probe) -> tuple[Any, Eagle3Draft] | None:
    """(the target's text config, the draft training builds from it on the meta device: its
    shapes and dtypes, no memory); None before the target's config is known. Built once per
    probe: the memory, disk and stream checks all size it."""
    import torch

    if p.draft is not None:
        return p.draft
    text_cfg = _text_config_for_train(p)
    if text_cfg is None:
        return None
    _, n_aux = hidden_and_aux(p)
    dcfg = draft_config(p.cfg, text_cfg, min(p.cfg.vocab.size, int(text_cfg.vocab_size)), n_aux)
    with torch.device("meta"):
        p.draft = text_cfg, Eagle3Draft(dcfg)
    return p.draft


def attention_widths(dcfg: Any) -> int:
    """Values per token that one TTT step's attention keeps for backward, as `draft_need` counts
    them: a dense layer's q, k, v and output as four H-wide ones (the estimate's unit, whatever
    its KV heads); an MLA layer's own (eaglet/draft/eagle3/mla.py): q_a (q_lora_rank, none
    without one), kv_a (kv_lora_rank + rope), the normed latent (kv_lora_rank), q and k (heads x
    (nope + rope) each) and v and the output (heads x v each). Change it with the layer."""
    if dcfg.attention != "mla":
        return 4 * dcfg.hidden_size
    heads, qk = dcfg.mla_heads, dcfg.qk_nope_head_dim + dcfg.qk_rope_head_dim
    return (dcfg.q_lora_rank + (dcfg.kv_lora_rank + dcfg.qk_rope_head_dim) + dcfg.kv_lora_rank
            + 2 * heads * qk + 2 * heads * dcfg.v_head_dim)


def activation_bytes(dcfg: Any, tokens: int, ttt_steps: int, n_aux: int, act_bytes: int) -> int:
    """What training keeps for backward over a micro-batch of `tokens`: per token and TTT step,
    ~12 H-wide activations besides the attention's (the 2H-wide q/k/v input, norms, residuals),
    the attention's (`attention_widths`: 16 H-wide in all for a dense layer) and 4 I-wide ones
    (SwiGLU), `act_bytes` each (the autocast dtype), and the draft logits with their fp32
    softmax for the loss; per token the captured states in fp32."""
    widths = 12 * dcfg.hidden_size + attention_widths(dcfg) + 4 * dcfg.intermediate_size
    return tokens * (ttt_steps * (widths * act_bytes + 3 * dcfg.draft_vocab_size * 4)
                     + n_aux * dcfg.target_hidden_size * 4)


def served_kv_bytes(dcfg: Any, tensor_parallel: int = 1) -> tuple[int, int, str]:
    """(bytes of KV cache a token takes for the EAGLE-3 draft served in vLLM, in bf16; those on
    one GPU at `tensor_parallel` ranks; what they are). Dense (vLLM's Eagle3LlamaForCausalLM):
    layers x 2 (K and V) x KV heads x head_dim, the heads split over the ranks (at least one
    each). MLA (Eagle3DeepseekV2ForCausalLM on the MLA backend): layers x (kv_lora_rank +
    qk_rope_head_dim), vLLM's latent cache, whole on every rank."""
    L = dcfg.num_layers
    if dcfg.attention == "mla":
        one = L * (dcfg.kv_lora_rank + dcfg.qk_rope_head_dim) * 2
        return one, one, f"MLA latent {dcfg.kv_lora_rank}+{dcfg.qk_rope_head_dim} x {L} layer(s), whole on every rank"
    heads, hd = dcfg.num_key_value_heads, dcfg.head_dim
    return (L * 2 * heads * hd * 2, L * 2 * max(heads // tensor_parallel, 1) * hd * 2,
            f"K and V, {heads} KV heads x {hd} x {L} layer(s)")


def target_kv_bytes(text_cfg: Any, L: int, tensor_parallel: int = 1) -> tuple[int, str]:
    """(bytes of KV cache a token takes for the target's `L` decoder layers in vLLM on one GPU at
    `tensor_parallel` ranks, in bf16; what they are): an MLA target's latent (whole on every
    rank), else K and V of its KV heads split over the ranks."""
    if getattr(text_cfg, "kv_lora_rank", None):
        return (L * (text_cfg.kv_lora_rank + text_cfg.qk_rope_head_dim) * 2,
                f"MLA latent {text_cfg.kv_lora_rank}+{text_cfg.qk_rope_head_dim} x {L} layers")
    heads = getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads
    hd = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    per_rank = max(heads // tensor_parallel, 1)
    return L * 2 * per_rank * hd * 2, f"K and V, {per_rank} heads x {hd} x {L} layers"


def draft_need(p: Probe, target_beside: bool) -> tuple[int, str, Any, int] | None:
    """Training's memory on one device: (bytes, breakdown, the draft's DraftConfig, trainable
    parameters); None before the target's config is known. `target_beside`: the target runs in
    training's own processes (extract.mode online with an in-process engine), its weights and
    forward counted too."""
    import torch

    found = draft_skeleton(p)
    if found is None:
        return None
    text_cfg, draft = found
    t, dcfg = p.cfg.train, draft.config
    V, Vd = int(text_cfg.vocab_size), dcfg.draft_vocab_size
    _, n_aux = hidden_and_aux(p)
    trainable = sum(q.numel() for q in draft.parameters() if q.requires_grad)
    frozen = sum(q.numel() for q in draft.parameters() if not q.requires_grad)
    states = trainable * 16 + frozen * 4  # fp32 weights + grads + AdamW moments; frozen embedding
    head = V * dcfg.target_hidden_size * 2  # the target's LM head (teacher), bf16
    act_bytes = 4 if t.precision == "fp32" or (t.precision == "auto" and not torch.cuda.is_available()) else 2
    acts = activation_bytes(dcfg, t.max_tokens, t.ttt_steps, n_aux, act_bytes)
    teacher = min(t.teacher_chunk, t.max_tokens) * (V if t.mask_out_of_vocab else Vd) * 4 * 2  # chunks of a micro-batch
    online = 0
    if target_beside and p.model is not None:
        # The target runs beside the draft: its weights and one micro-batch's forward.
        b = target_dtype_bytes(p)
        online = weight_bytes(p, b) + t.max_tokens * 10 * dcfg.target_hidden_size * b
    need = states + head + acts + teacher + online
    breakdown = (f"draft {trainable / 1e6:.1f}M trainable params with AdamW {gib(states)} + target LM head "
                 f"{gib(head)} + activations {gib(acts)} for train.max_tokens={t.max_tokens} x "
                 f"ttt_steps={t.ttt_steps} + teacher {gib(teacher)}"
                 + (f" + the target beside it (extract.mode online) {gib(online)}" if online else "") + "; rough")
    return need, breakdown, dcfg, trainable


def peak_writes(have: list[int], ckpt: int, final: int, saves: int | None, keep: int) -> int:
    """The most bytes training adds to its disk at once, over what is there now. Checkpoints
    come in turn, each complete before the oldest beyond `keep` goes (formats/checkpoints.py
    save_checkpoint: keep + 1 at once); then the final draft beside the kept ones (formats/draft.py
    save_final; an old final/ goes only once the new one is written). `have`: the checkpoints
    there, newest first; `saves`: how many the run writes, None when not known (then enough to
    reach keep + 1)."""
    keep = max(keep, 1)
    held, now, peak = list(have), sum(have), 0
    for _ in range(keep + 1 if saves is None else min(saves, keep + 1)):
        held = [ckpt, *held]
        peak = max(peak, sum(held) - now)
        held = held[:keep]
    return max(peak, sum(held) + final - now)


def train_disk(p: Probe) -> dict[str, Any] | None:
    """What training writes into run.dir/train (eaglet/training/: checkpoints/ and final/), from
    the draft it builds (`draft_skeleton`, as the memory check sizes it): `ckpt` one checkpoint's
    bytes, `final` the final draft's, `saves` the checkpoints the run writes (None: not known),
    `have` the bytes of each checkpoint there (newest first), `peak` the most it adds at once
    (`peak_writes`); the parameter counts and dtypes. None before the target's config is known."""
    found = draft_skeleton(p)
    if found is None:
        return None
    draft, t = found[1], p.cfg.train
    state = draft.state_dict()
    optimized = [q for q in draft.parameters() if q.requires_grad]
    ckpt = checkpoint_bytes(state, optimized)
    # save_final: every weight, the frozen embedding in fp32 like the rest (as the meta draft holds it).
    final = safetensors_bytes(state) + len(json.dumps(draft.config.to_dict(), indent=1)) + 100
    folder = p.cfg.run_dir / "train" / CKPT_DIR
    have = [sum(f.stat().st_size for f in c.rglob("*") if f.is_file()) for c in checkpoints(folder)] \
        if folder.is_dir() else []
    saves = -(-t.max_steps // t.ckpt_every) if t.max_steps else None  # every ckpt_every steps and at the end
    return {"ckpt": ckpt, "final": final, "saves": saves, "have": have,
            "peak": peak_writes(have, ckpt, final, saves, t.keep_last),
            "trainable": sum(q.numel() for q in optimized), "params": sum(q.numel() for q in draft.parameters()),
            "dtypes": "/".join(sorted({str(q.dtype).removeprefix("torch.") for q in draft.parameters()}))}


def mean_tokens(p: Probe) -> tuple[float, str]:
    """Tokens per sample: the prepared data's mean when prepare has run, else prepare.max_length."""
    folder = p.cfg.run_dir / "prepare"
    try:
        lengths = PreparedData(folder).lengths
        if len(lengths):
            return float(lengths.mean()), f"the prepared data's mean ({len(lengths)} samples)"
    except Exception:  # noqa: BLE001 - not prepared yet
        pass
    return float(p.cfg.prepare.max_length), "prepare.max_length (no prepared data yet: an upper bound)"


# Rates measured on one H200 (bench/results/README.md), which the plan scales by FLOPs:
# the target's forward at Llama-3-8B's dims (8.03B parameters) in bf16, batches of 8 x 2048
# (2026-12-01-h200-fp8, bench/extract_throughput.py), and the draft's training step at
# Kimi-K2's dims (a dense draft: hidden 7168, intermediate 18432, draft vocabulary 32000, kv
# width 1024, 7 TTT steps; 2026-11-30-h200-h c7, bench/train_throughput.py --preset kimi-k2
# --tokens 4096).
FORWARD_REF = {"tokens_per_s": 34.6e3, "active_params": 8.03e9}
TRAIN_REF = {"tokens_per_s": 18.6e3, "hidden": 7168, "inter": 18432, "draft_vocab": 32000, "kv": 1024, "ttt": 7}
H200_BYTES = 141e9  # the GPU the plan assumes where none is visible


def dense_draft_flops(H: int, inter: int, vocab: int, kv: int, ttt: int) -> float:
    """Training FLOPs per token of a one-layer dense EAGLE-3 draft of these dims (TRAIN_REF's):
    fc over 3H, then per TTT step q/k/v from 2H, o, the MLP and the LM head, forward and
    backward. It equals `draft_train_flops` of such a draft (H-wide queries, 3 captured states)."""
    step = 2 * H * H + 2 * 2 * H * kv + H * H + 3 * H * inter + H * vocab
    return 6.0 * 3 * H * H + ttt * 6.0 * step


def linear_weights(module: Any) -> int:
    """Multiply-accumulates per token of the linears in `module` (their weights' in x out)."""
    from torch import nn

    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def draft_train_flops(draft: Any, ttt: int) -> float:
    """Training FLOPs per token of an EAGLE-3 draft from its own linears (the skeleton's shapes,
    any attention): fc once, then per TTT step every layer's linears and the LM head, 6 x the
    weights each (forward and backward). The attention over the sequence is left out: the plan
    uses a ratio to the reference draft's (`dense_draft_flops`)."""
    step = sum(linear_weights(layer) for layer in draft.layers) + linear_weights(draft.lm_head)
    return 6.0 * linear_weights(draft.fc) + ttt * 6.0 * step
