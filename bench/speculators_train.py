"""Train an EAGLE-3 draft with speculators' own model, loss and TTT, on eaglet's data.

The "speculators" side of the quality benchmark: the same extracted run, the same
micro-batches in the same order, the same optimizer, schedule and step budget as eaglet's
Trainer, but the forward (TTT unroll, attention, teacher, loss) is speculators 0.9.0's
`Eagle3DraftModel`. The saved draft is evaluated with eaglet's `evaluate_draft`.

    python bench/speculators_train.py CONFIG --run-dir RUN --steps N --out DIR [--eval]

RUN must have gone through `eaglet run CONFIG --until vocab`. Prints one JSON line. Needs
the speculators package (0.9.0) next to eaglet: /work/main/.venv-speculators locally, the
wheels of fetch_speculators_wheels.sh on the GPU image. Imports from speculators only what
its anchor script imports (models.eagle3, config, proposals.greedy, losses).

How eaglet's Batch is fed to speculators (worked out from speculators' train/data.py
`shift_batch`, models/eagle3/core.py and metrics.py `align_for_step`)
-----------------------------------------------------------------------------------------
speculators' step j, row t reads input_ids[t+j] at position_ids[t]+j with hidden row t and
is scored against teacher row t+j under loss_mask[t+j]. eaglet's step j, row t reads token
x[t+1+j] at position pos[t]+1+j with aux[t], teacher final[t+1+j], counted when
loss_mask[t+2+j] & in_vocab[t+1+j] & doc[t] == doc[t+2+j] (eaglet/draft/loss.py). So, for the
whole packed sequence (not per sample, which is what speculators' collator does; its
per-sample shift drops each document's last row, whose every prediction eaglet masks):

    hidden_states                aux                      (unshifted)
    document_ids                 doc_ids                  (unshifted: rows are aux rows)
    input_ids                    x[1:] ++ 0
    position_ids                 pos + 1
    verifier_last_hidden_states  final[1:] ++ 0
    loss_mask  (mask="eaglet")   loss_mask[s+2] & in_vocab[s+1] & doc[max(s-k+1, 0)] == doc[s+2]

Differences between the two trainers and what is done about each:
- Loss mask position. speculators' mask is the teacher position's own (after its shift,
  loss_mask[t+1] for the prediction of x[t+2]): it skips the first token of each reply and
  scores one prediction past its end. eaglet's marks the predicted token. mask="eaglet"
  (default) passes eaglet's; mask="speculators" passes loss_mask[s+1] and nothing else.
- Out-of-vocabulary teacher argmax. eaglet drops rows whose full-vocabulary argmax is not
  a draft token; speculators has no such mask. mask="eaglet" folds eaglet's in_vocab
  (eaglet's own teacher_targets, outside autocast) into the loss mask.
- Document boundaries. eaglet drops (row, step) pairs whose predicted token is in another
  document; speculators' mask is per position, so mask="eaglet" uses the stricter
  doc[max(s-k+1, 0)] == doc[s+2]. It drops more only when a document has a trained token
  among its first k+1 tokens (never with a chat template before the reply); the log's
  `eaglet_rows_dropped` counts the rows eaglet would have counted and this run did not.
- Loss. speculators: KL(teacher || draft) per row, masked mean (denominator + 1e-5),
  times ttt_step_loss_decay**j. eaglet: soft cross-entropy, masked mean, times gamma**j.
  Same gradients (KL = CE - teacher entropy); the logged values differ by the entropy.
  ttt_step_loss_decay = train.gamma. speculators' own default decay is 1.0.
- Teacher. Both: the target's LM head rows of the draft vocabulary on the final state,
  softmaxed over the draft vocabulary. speculators computes it inside the forward, under
  autocast (bf16 on CUDA); eaglet outside autocast in the head's stored dtype (bf16 for
  a bf16 target): the same rounding for a bf16 head, fp32 vs bf16 logits otherwise.
- Final norm. speculators always applies `verifier_norm` to verifier_last_hidden_states
  (its vLLM states are pre-norm). eaglet's store holds the post-norm state
  (meta final_state "post_norm"): verifier_norm is then an Identity, since a second
  RMSNorm is not a no-op. For "pre_norm" it is the target's final norm (weight and eps).
- lm_head. speculators 0.9.0 starts lm_head from the verifier's head rows and keeps it
  frozen. init="eaglet" (default) starts every weight exactly as eaglet's build_draft
  does (same seed, train.init_head_from_target, train.init_from) and trains lm_head as
  eaglet does; init="speculators" keeps speculators' own initialisation and frozen head.
- Training accuracies. speculators' full_acc_j counts the rows whose steps 0..j all agree
  with the teacher (a prefix, as a chain is accepted), cond_acc_j the same over the rows
  right through step j-1; eaglet's acc_j is step j's own agreement. The log keeps
  speculators' (full_acc_j, cond_acc_j, prefix_tau = 1 + sum_j full_acc_j): compare the
  two trainers by eval's tau, or by loss_j (the KL, per step, decay undone).
- Optimizer, schedule, clipping, accumulation, precision: eaglet's (AdamW with
  train.lr/betas/weight_decay, lr_lambda warmup + cosine, clip train.grad_clip,
  train.grad_accum micro-batches, bf16 autocast on CUDA), not speculators' (Muon, linear
  schedule, clip 1.0, no accumulation, weight decay 0.01).
- Attention. speculators' flex_attention BlockMask on CUDA (its forward compiled, the
  batch padded to a fixed multiple of 128 rows with document id -1, as its collator
  pads); its dense "eager" mask on CPU (CPU flex_attention has no backward).

The states source is a seam: `open_states` returns what eaglet's trainer reads (the offline
store, or online states for an extract.mode online run); anything with the
interface this module and eaglet's Trainer use can be passed as `states=`: get(sample id)
-> {aux, final, input_ids, loss_mask}, sample_ids and lengths (aligned arrays), meta
(layers, final_state, norm_eps), n_aux, target_head(device) (the target's head for those
states), and folder holding extract's head.safetensors and target_config.json.

--probe DIR (after training): speculators' forward of the saved draft on the first micro-batch
it trained on, written to DIR for a check against eaglet's own TTT unroll, teacher and loss
(tests/test_bench_speculators.py): see `probe_forward`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from eaglet.config import Config, load_config
from eaglet.distributed import resolve_device
from eaglet.draft.eagle3.loss import step_mask
from eaglet.draft.loss import teacher_targets
from eaglet.draft.step import Batch, lr_lambda
from eaglet.formats.store import TARGET_CONFIG, StoreReader, TargetHead, read_target_head
from eaglet.formats.vocab import load_vocab
from eaglet.training.build import build_draft
from eaglet.training.loop import Trainer
from eaglet.training.data import load_batch
from eaglet.utils import atomic_write_json, log

MASKS = ("eaglet", "speculators")
INITS = ("eaglet", "speculators")
LOG_FILE = "train_log.jsonl"
RESULT_FILE = "bench.json"
FLEX_BLOCK = 128  # speculators' BlockMask grows by whole blocks per TTT step


def open_states(run_dir: str | Path, cfg: Any) -> Any:
    """The hidden-state source eaglet's trainer reads for this run (its offline store, or the
    online or streamed states when its extract stage ran with extract.mode: online), from
    eaglet's own `open_states`; `cfg`: the run config."""
    from eaglet.pipeline import STAGE_NAMES
    from eaglet.training.data import open_states as eaglet_open_states

    run_dir = Path(run_dir)
    # this harness loads in an order of its own, so an online run's target computes in this process
    return eaglet_open_states(cfg, {name: run_dir / name for name in STAGE_NAMES}, run_dir / "train", planned=False)


# ---- the model ------------------------------------------------------------------------------------

def speculators_config(dcfg: Any, aux_layer_ids: list[int], verifier: str, architectures: list[str],
                       speculative_tokens: int, attn_impl: str) -> Any:
    """Eagle3SpeculatorConfig of the draft eaglet builds (its DraftConfig `dcfg`)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    from eaglet.draft.eagle3.serving import llama_fields

    fields = {k: v for k, v in llama_fields(dcfg, "float32").items() if k not in ("model_type", "torch_dtype")}
    tl = LlamaConfig(**fields)
    tl._attn_implementation = attn_impl
    return Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=dcfg.draft_vocab_size, target_hidden_size=dcfg.target_hidden_size,
        norm_before_residual=dcfg.norm_before_residual, norm_before_fc=False, fc_norm=dcfg.fc_norm,
        norm_output=dcfg.norm_output, embed_requires_grad=False, eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=list(architectures))))


def set_verifier(model: nn.Module, head: TargetHead) -> None:
    """The teacher's weights: the target's head rows of the draft vocabulary, and the final
    norm when the states are pre-norm (head.norm set) or an Identity when they are post-norm."""
    with torch.no_grad():
        cols = torch.arange(model.d2t.numel()) + model.d2t.cpu() if model.d2t is not None else slice(None)
        w = model.verifier_lm_head.weight
        w.copy_(head.lm_head[cols].to(device=w.device, dtype=w.dtype))
        if head.norm is None:
            model.verifier_norm = nn.Identity()
        else:
            norm = model._model_definitions.norm_class(model.hidden_size, eps=head.norm_eps)
            norm.weight.copy_(head.norm)
            norm.weight.requires_grad_(False)
            model.verifier_norm = norm.to(device=w.device, dtype=w.dtype)


def build_speculators_draft(cfg: Config, states: Any, d2t: Tensor, t2d: Tensor, head: TargetHead,
                            init: str = "eaglet", attn_impl: str = "eager",
                            eaglet_draft: nn.Module | None = None) -> nn.Module:
    """speculators' Eagle3DraftModel of the shape eaglet builds, with the target's embedding,
    the verifier head/norm for `head`, and eaglet's d2t/t2d. init: see the module header."""
    from speculators.models.eagle3 import Eagle3DraftModel

    if init not in INITS:
        raise ValueError(f"init {init!r}: expected one of {INITS}")
    eaglet_draft = eaglet_draft if eaglet_draft is not None else build_draft(cfg, states, d2t, t2d, head)
    target_cfg = json.loads((Path(states.folder) / TARGET_CONFIG).read_text())
    spec_cfg = speculators_config(eaglet_draft.config, list(states.meta["layers"]), str(cfg.target.path),
                                  target_cfg.get("architectures") or [], cfg.export.speculative_tokens, attn_impl)
    torch.manual_seed(cfg.run.seed)
    model = Eagle3DraftModel(spec_cfg)
    state = {k: v for k, v in eaglet_draft.state_dict().items() if model.d2t is not None or k not in ("d2t", "t2d")}
    if init == "eaglet":
        missing, unexpected = model.load_state_dict(state, strict=False)
        if set(missing) - {"verifier_lm_head.weight", "verifier_norm.weight"} or unexpected:
            raise RuntimeError(f"eaglet -> speculators weights: missing {missing}, unexpected {unexpected}")
    else:  # speculators' from_training_args: its own init, embedding and frozen head from the verifier
        model.load_state_dict({k: state[k] for k in ("embed_tokens.weight", "d2t", "t2d") if k in state}, strict=False)
        with torch.no_grad():
            cols = torch.arange(d2t.numel()) + d2t
            model.lm_head.weight.copy_(head.lm_head[cols.to(head.lm_head.device)].to(model.lm_head.weight))
    set_verifier(model, head)
    model.embed_tokens.weight.requires_grad_(False)
    model.verifier_lm_head.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(init == "eaglet")
    return model


# ---- the inputs -----------------------------------------------------------------------------------

def _shift(x: Tensor, n: int) -> Tensor:
    """x[:, n:] padded with zeros back to x's length (along dim 1)."""
    pad = x.new_zeros((x.shape[0], min(n, x.shape[1]), *x.shape[2:]))
    return torch.cat([x[:, n:], pad], dim=1)


@torch.no_grad()
def draft_vocab_rows(b: Batch, head: TargetHead, t2d: Tensor, d2t: Tensor, chunk: int) -> Tensor:
    """eaglet's in_vocab [1, N]: the target's full-vocabulary argmax is a draft token."""
    dev = b.final.device
    t2d, d2t = t2d.to(dev), d2t.to(dev)
    parts = [teacher_targets(b.final[:, a:a + chunk], head.lm_head, t2d, d2t, chunk, head.norm, head.norm_eps)[1]
             for a in range(0, b.final.shape[1], chunk)]
    return torch.cat(parts, dim=1)


def speculators_inputs(b: Batch, ttt_steps: int, in_vocab: Tensor | None = None, mask: str = "eaglet",
                       pad_to: int | None = None) -> dict[str, Tensor]:
    """Eagle3DraftModel.forward's tensors for eaglet's micro-batch `b` (module header)."""
    if mask not in MASKS:
        raise ValueError(f"mask {mask!r}: expected one of {MASKS}")
    T = b.input_ids.shape[1]
    if mask == "eaglet":
        s = torch.arange(T, device=b.doc_ids.device)
        lo, hi = (s - ttt_steps + 1).clamp(min=0), s + 2
        same_doc = (hi < T) & (b.doc_ids[0, lo] == b.doc_ids[0, hi.clamp(max=T - 1)])
        loss_mask = _shift(b.loss_mask, 2) & _shift(in_vocab, 1) & same_doc[None]
    else:
        loss_mask = _shift(b.loss_mask, 1)
    out = {
        "hidden_states": b.aux,
        "input_ids": _shift(b.input_ids, 1),
        "document_ids": b.doc_ids,
        "loss_mask": loss_mask,
        "position_ids": b.position_ids + 1,
        "verifier_last_hidden_states": _shift(b.final.float(), 1),  # as load_batch gives aux
    }
    if pad_to is not None and pad_to > T:
        n = pad_to - T
        for k, v in out.items():
            fill = -1 if k == "document_ids" else 0
            out[k] = torch.cat([v, v.new_full((1, n, *v.shape[2:]), fill)], dim=1)
    return out


def eaglet_counts(b: Batch, in_vocab: Tensor, ttt_steps: int) -> Tensor:
    """Rows eaglet's loss counts per TTT step [k] (eaglet.draft.eagle3.loss.step_mask)."""
    return torch.stack([step_mask(b.loss_mask, in_vocab, b.doc_ids, j).sum() for j in range(ttt_steps)])


# ---- training -------------------------------------------------------------------------------------

class _Sums:
    """speculators' metric tensors summed over micro-batches (one host sync per log line)."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.n = 0

    def add(self, metrics: dict[str, Tensor], **extra: Tensor) -> None:
        for k, v in {**metrics, **extra}.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        self.n += 1

    def record(self, ttt_steps: int, gamma: float) -> dict[str, Any]:
        s = {k: v.tolist() for k, v in self.sums.items()}
        n = max(self.n, 1)
        rec: dict[str, Any] = {"loss": s["loss_sum"] / n}
        for j in range(ttt_steps):  # speculators' loss_j carries the decay: undo it to compare with eaglet's
            rec[f"loss_{j}"] = s[f"loss_{j}_sum"] / n / (gamma ** j if gamma else 1.0)
        full = [s[f"full_acc_{j}_sum"] / max(s[f"full_acc_{j}_total"], 1.0) for j in range(ttt_steps)]
        rec.update({f"full_acc_{j}": a for j, a in enumerate(full)})
        rec.update({f"cond_acc_{j}": s[f"cond_acc_{j}_sum"] / max(s[f"cond_acc_{j}_total"], 1.0) for j in range(ttt_steps)})
        rec["prefix_tau"] = 1.0 + sum(full)
        rec["counted"] = int(s["full_acc_0_total"])
        if "eaglet_rows_dropped" in s:
            rec["eaglet_rows_dropped"] = int(s["eaglet_rows_dropped"])
        return rec


def train_with_speculators(cfg: Config, run_dir: str | Path, out_dir: str | Path, steps: int | None,
                           device: str | None = None, loss_impl: str = "eager", log_every: int = 1,
                           states: Any = None, mask: str = "eaglet", init: str = "eaglet") -> dict[str, Any]:
    """Train speculators' draft on `run_dir`'s states as eaglet's Trainer would see them, for
    `steps` optimizer steps (None: train.max_steps / train.epochs, as eaglet); save it with
    save_pretrained into out_dir (+ train_log.jsonl, bench.json). Returns the summary.
    `states`: the hidden-state source (default open_states(run_dir, cfg)); run_dir/vocab is read.

    The schedule spans eaglet's total for train.max_steps = steps: min(steps, epochs x steps
    per epoch). `device` defaults to train.device."""
    from speculators.losses import resolve_loss_config

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    tc = cfg.train
    dev = resolve_device(device or tc.device)
    states = states if states is not None else open_states(run_dir, cfg)
    d2t, t2d = load_vocab(run_dir / "vocab")
    head_cpu = states.target_head(torch.device("cpu"))
    eaglet_draft = build_draft(cfg, states, d2t, t2d, head_cpu)
    # eaglet's own Trainer (on the CPU, never stepped) decides split, epoch plans, packing and the
    # step count, so the micro-batches are exactly those it would train on, in its order.
    attn_impl = "simple_flex_attention" if dev.type == "cuda" else "eager"
    model = build_speculators_draft(cfg, states, d2t, t2d, head_cpu, init, attn_impl, eaglet_draft).to(dev)
    plan_cfg = replace(cfg, train=replace(tc, max_steps=steps if steps is not None else tc.max_steps, device="cpu"))
    trainer = Trainer(plan_cfg, states, eaglet_draft, head_cpu, out_dir)  # takes over head_cpu's tensors
    plan, peak = trainer.plan, trainer.opt.defaults["lr"]  # train.lr as eaglet's optimizer resolved it
    total_steps = plan.total_steps
    del trainer, eaglet_draft
    head = states.target_head(dev)
    pad_to = math.ceil(tc.max_tokens / FLEX_BLOCK) * FLEX_BLOCK if attn_impl == "simple_flex_attention" else None
    use_bf16 = tc.precision == "bf16" or (tc.precision == "auto" and dev.type == "cuda")
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=peak, betas=tuple(tc.betas), weight_decay=tc.weight_decay, fused=dev.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tc, total_steps))
    loss_config = resolve_loss_config("kl_div", implementation=loss_impl)
    k = tc.ttt_steps

    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / LOG_FILE
    log_path.write_text("")
    log(f"[speculators] {len(plan.train_ids)} train samples; {plan.steps_per_epoch} steps per epoch; {total_steps} "
        f"steps; device {dev}; attention {attn_impl}; loss {loss_impl}; mask {mask}; init {init}")
    model.train()
    data = plan.micro_batches(0, 0)
    sums, first, last = _Sums(), None, None
    first_ids: list[int] | None = None
    t0 = t_log = time.perf_counter()
    tokens = tokens_log = 0
    for step in range(1, total_steps + 1):
        for _ in range(tc.grad_accum):
            epoch, _micro, ids = next(data)
            first_ids = first_ids if first_ids is not None else [int(i) for i in ids]
            b = load_batch(states, ids, tc.max_tokens, dev)
            extra = {}
            in_vocab = None
            if mask == "eaglet":
                in_vocab = draft_vocab_rows(b, head, t2d, d2t, tc.teacher_chunk)
            inputs = speculators_inputs(b, k, in_vocab, mask, pad_to)
            with autocast:
                _, loss, metrics = model(**inputs, ttt_steps=k, ttt_step_loss_decay=tc.gamma, loss_config=loss_config)
            (loss / tc.grad_accum).backward()
            if in_vocab is not None:
                counted = torch.stack([metrics[f"full_acc_{j}_total"] for j in range(k)])
                extra["eaglet_rows_dropped"] = (eaglet_counts(b, in_vocab, k).float() - counted).sum()
            sums.add(metrics, **extra)
            tokens += b.tokens
            tokens_log += b.tokens
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == total_steps:
            rec = sums.record(k, tc.gamma)
            dt = time.perf_counter() - t_log
            rec.update(split="train", step=step, epoch=epoch, lr=lr, tokens_per_s=tokens_log / dt)
            with log_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            first = first or rec
            last = rec
            sums, t_log, tokens_log = _Sums(), time.perf_counter(), 0
    seconds = time.perf_counter() - t0
    model.save_pretrained(str(out_dir))
    result = {
        "system": "speculators-0.9.0", "out": str(out_dir), "steps": total_steps, "lr": peak,
        "micro_batches_per_step": tc.grad_accum,
        "tokens": tokens, "seconds": round(seconds, 3), "device": str(dev), "attention": attn_impl, "loss_impl": loss_impl,
        "mask": mask, "init": init, "final_state": states.meta.get("final_state", "post_norm"),
        "first": first, "last": last, "first_micro_batch": first_ids,
    }
    atomic_write_json(out_dir / RESULT_FILE, result)
    return result


# ---- a check of the forward against eaglet's --------------------------------------------------------

class PreNormStates:
    """`states` presented as a pre-norm source (what the vLLM backend stores) without one:
    each final row scaled by a random factor in [0.3, 3.3) seeded by its sample id, which the
    target's final RMSNorm undoes, and meta final_state "pre_norm" (so its head has the norm)."""

    def __init__(self, states: Any):
        self.s, self.meta = states, {**states.meta, "final_state": "pre_norm"}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.s, name)

    def __len__(self) -> int:
        return len(self.s)

    def target_head(self, device: torch.device) -> TargetHead:
        return read_target_head(self.s.folder, self.meta, device)

    def get(self, i: int) -> dict[str, Tensor]:
        d = dict(self.s.get(i))
        g = torch.Generator().manual_seed(int(i))
        d["final"] = d["final"].float() * (0.3 + 3 * torch.rand(d["final"].shape[0], 1, generator=g))
        return d


PROBE_CASES = ("post_norm", "pre_norm")


@torch.no_grad()
def probe_forward(cfg: Config, run_dir: str | Path, draft_dir: str | Path, probe_dir: str | Path, ids: list[int],
                  loss_impl: str = "eager") -> dict[str, str]:
    """speculators' forward (on the CPU, eval mode) of the draft saved in `draft_dir` on the
    micro-batch of sample ids `ids`, for the run's states ("post_norm") and for the same states
    as a pre-norm source ("pre_norm": PreNormStates): eager attention, and the flex_attention
    path CUDA trains with on the batch padded to twice training's padded length (forward only:
    CPU flex_attention has no backward). Writes probe_dir/<case>.safetensors: the batch (aux,
    final, input_ids, loss_mask, position_ids, doc_ids), the verifier head's logits ("teacher"),
    each step's draft logits ("logits<j>", "flex_logits<j>", cut to the batch's rows) and
    speculators' metrics ("m.<name>"). Returns case -> file."""
    from safetensors.torch import load_file, save_file
    from speculators.losses import resolve_loss_config

    run_dir, probe_dir = Path(run_dir), Path(probe_dir)
    probe_dir.mkdir(parents=True, exist_ok=True)
    tc, cpu = cfg.train, torch.device("cpu")
    d2t, t2d = load_vocab(run_dir / "vocab")
    saved = load_file(str(Path(draft_dir) / "model.safetensors"))
    loss_config = resolve_loss_config("kl_div", implementation=loss_impl)
    pad_to = 2 * math.ceil(tc.max_tokens / FLEX_BLOCK) * FLEX_BLOCK
    files = {}
    for case in PROBE_CASES:
        states = open_states(run_dir, cfg)
        if case == "pre_norm":
            states = PreNormStates(states)
        head = states.target_head(cpu)
        model = build_speculators_draft(cfg, states, d2t, t2d, head, attn_impl="eager")
        missing, unexpected = model.load_state_dict(saved, strict=False)
        if unexpected or set(missing) - {"verifier_lm_head.weight", "verifier_norm.weight"}:
            raise RuntimeError(f"saved draft -> speculators: missing {missing}, unexpected {unexpected}")
        model.eval()
        b = load_batch(states, ids, tc.max_tokens, cpu)
        in_vocab = draft_vocab_rows(b, head, t2d, d2t, tc.teacher_chunk)
        logits: list[Tensor] = []
        teacher: list[Tensor] = []
        h1 = model.lm_head.register_forward_hook(lambda m, a, o: logits.append(o.detach()))
        h2 = model.verifier_lm_head.register_forward_hook(lambda m, a, o: teacher.append(o.detach()))
        _, _loss, metrics = model(**speculators_inputs(b, tc.ttt_steps, in_vocab), ttt_steps=tc.ttt_steps,
                                  ttt_step_loss_decay=tc.gamma, loss_config=loss_config)
        h1.remove()
        h2.remove()
        flex = build_speculators_draft(cfg, states, d2t, t2d, head, attn_impl="simple_flex_attention")
        flex.load_state_dict(saved, strict=False)
        flex_logits: list[Tensor] = []
        h3 = flex.eval().lm_head.register_forward_hook(lambda m, a, o: flex_logits.append(o.detach()))
        flex(**speculators_inputs(b, tc.ttt_steps, in_vocab, pad_to=pad_to), ttt_steps=tc.ttt_steps,
             loss_config=loss_config)
        h3.remove()
        T = b.input_ids.shape[1]
        tensors = {"aux": b.aux, "final": b.final.float(), "input_ids": b.input_ids, "loss_mask": b.loss_mask,
                   "position_ids": b.position_ids, "doc_ids": b.doc_ids, "teacher": teacher[0],
                   **{f"logits{j}": t for j, t in enumerate(logits)},
                   **{f"flex_logits{j}": t[:, :T] for j, t in enumerate(flex_logits)},
                   **{f"m.{k}": v.reshape(1).float() for k, v in metrics.items()}}
        path = probe_dir / f"{case}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        files[case] = str(path)
    return files


# ---- evaluation -----------------------------------------------------------------------------------

def evaluate_saved_draft(cfg: Config, run_dir: str | Path, draft_dir: str | Path, states: Any = None) -> dict[str, Any]:
    """eaglet's evaluate_draft of the draft in `draft_dir` (any format load_draft reads) on the
    run's held-out prompts, with cfg.eval's settings (chain or tree, temperature, ...)."""
    from eaglet.targets.chat import load_tokenizer
    from eaglet.evaluation.inprocess import evaluate_draft
    from eaglet.evaluation.inputs import heldout_prompts, resolve_eval_dtype
    from eaglet.formats.prepared import PreparedData
    from eaglet.formats.serving import load_draft_model
    from eaglet.targets.load import load_target

    run_dir = Path(run_dir)
    if states is None:  # the held-out split and the head need no target, even for an online run
        from eaglet.engines.states import split_source
        from eaglet.pipeline import STAGE_NAMES

        store = StoreReader(run_dir / "extract", verify=False)
        split = split_source({name: run_dir / name for name in STAGE_NAMES})
    else:
        store, split = states, states.sample_ids
    draft, meta = load_draft_model(draft_dir, store.target_head(torch.device("cpu")).embed)
    data = PreparedData(run_dir / "prepare")
    named = heldout_prompts(data, split, cfg.train.eval_fraction, cfg.run.seed, cfg.eval.num_prompts)
    if not named:
        raise ValueError("eval: no held-out sample has a prompt before its first assistant turn")
    target, _info = load_target(replace(cfg.target, device=cfg.eval.device, dtype=resolve_eval_dtype(cfg.eval)))
    tokenizer = load_tokenizer(cfg.target)
    aux_layers = meta["aux_layer_ids"] or list(store.meta["layers"])
    result = evaluate_draft(target, tokenizer, draft, aux_layers, [p for _, p in named], cfg.eval, seed=cfg.run.seed)
    atomic_write_json(Path(draft_dir) / "eval.json", result)
    return result


# ---- CLI ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=None,
                    help="eaglet config of the run (default none: the defaults and the --set overrides).")
    ap.add_argument("--run-dir", required=True, help="Run folder that has gone through `eaglet run --until vocab`.")
    ap.add_argument("--steps", type=int, help="Optimizer steps (default: train.max_steps / train.epochs).")
    ap.add_argument("--out", required=True, help="Folder for the speculators checkpoint, train_log.jsonl, bench.json.")
    ap.add_argument("--eval", action="store_true", help="Also evaluate the draft with eaglet's evaluate_draft.")
    ap.add_argument("--device", help="Training device (default: train.device).")
    ap.add_argument("--loss-impl", default="eager", choices=["eager", "fused"], help="speculators' loss kernels.")
    ap.add_argument("--mask", default="eaglet", choices=MASKS, help="Loss mask convention (module header).")
    ap.add_argument("--init", default="eaglet", choices=INITS, help="Initial weights (module header).")
    ap.add_argument("--log-every", type=int, default=1, help="Log a line every N optimizer steps.")
    ap.add_argument("--probe", metavar="DIR", help="Also write speculators' forward of the saved draft on the first "
                                                     "micro-batch to DIR (module header, `probe_forward`).")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="Override a config key (repeatable), as `eaglet --set`.")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, [*args.overrides, f"run.dir={args.run_dir}"])
    result = train_with_speculators(cfg, args.run_dir, args.out, args.steps, args.device, args.loss_impl, args.log_every,
                                    mask=args.mask, init=args.init)
    if args.eval:
        result["eval"] = evaluate_saved_draft(cfg, args.run_dir, args.out)["aggregate"]
    if args.probe:
        result["probe"] = probe_forward(cfg, args.run_dir, args.out, args.probe, result["first_micro_batch"],
                                        args.loss_impl)
    if args.eval or args.probe:
        atomic_write_json(Path(args.out) / RESULT_FILE, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
