"""Parallelism, applied from outside the draft: the one `parallelize` step.

Training builds the plain draft, then wraps it here for `train.parallel` over torchrun's
ranks (eaglet/distributed.py); one process goes through the same path with strategy
'none', which wraps nothing, and writes the same checkpoint files.

Training strategies (`train.parallel`):
- `ddp`: every rank holds the draft; DistributedDataParallel all-reduces (averages) the
  gradients of the last micro-batch of a step, the others run under `no_sync()`.
- `fsdp`: FSDP2 `fully_shard` over a 1-D mesh of all ranks. Each of the draft type's
  `shard_units` (its decoder layers) is a unit, the root holds the rest (EAGLE-3: fc, norm, lm_head). Gradient sync is switched off for all micro-batches
  but the last of a step (`set_requires_gradient_sync`).
- `none`: one process.

The frozen pieces taken from the target (the token embedding inside the draft, and the
teacher head: the target's LM head and final norm, outside it) are never trainable: no
gradients, no optimizer state, and they are kept in the dtype the target was extracted in
(bf16 for a bf16 target) rather than the fp32 of the trained weights. Under `ddp` they are
replicated (a 163840 x 7168 head is 2.3 GB in bf16). Under `fsdp` each is its own FSDP unit,
sharded at rest (1/world of it per rank): the embedding is gathered once per micro-batch
(not once per TTT step) and the teacher head once per teacher computation, and both are
resharded right after (`Parallel.reshard_frozen`). The teacher runs before the draft's
forward, so the gathered head and the draft's activations are never in memory together.

Checkpoints have one format for every strategy and world size: the full (unsharded)
trainable weights and the `optimizer.state_dict()` layout, written once by rank 0. Under
FSDP2 they are gathered to rank 0's CPU with torch.distributed.checkpoint's state-dict API
and loaded back with it (rank 0 reads, the others receive shards). This suits drafts of up
to a few billion parameters; a resume on another world size then works whenever the number
of micro-batches per optimizer step is the same (see eaglet/training/plan.py).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..distributed import DistEnv, dist_env
from . import draft_type_of

STRATEGIES = ("none", "ddp", "fsdp")


def resolve_strategy(name: str, world_size: int) -> str:
    """`train.parallel` -> the strategy used ('auto': ddp under torchrun, none alone)."""
    if name == "auto":
        return "ddp" if world_size > 1 else "none"
    if name not in STRATEGIES:
        raise ValueError(f"train.parallel {name!r}: expected one of auto, {', '.join(STRATEGIES)}")
    if name == "none" and world_size > 1:
        raise ValueError(f"train.parallel 'none' with {world_size} ranks: every rank would train its own draft; "
                         "use 'ddp' or 'fsdp' (or launch one process)")
    return name


@dataclass
class Parallel:
    """The draft as training uses it. `draft` is the pure model (its parameters are DTensor
    shards under fsdp); `module` is what the training forward calls (draft, DDP(draft), or the
    FSDP2 draft, which is `draft` itself); `teacher` computes the teacher distributions."""

    strategy: str
    env: DistEnv
    draft: nn.Module
    module: nn.Module
    teacher: nn.Module
    compiled: bool = False  # the draft's step pieces are compiled; the loss should be too

    @contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        """Around a micro-batch's forward and backward: reduce gradients across ranks only when
        `enabled` (the last micro-batch of an optimizer step)."""
        if self.strategy == "ddp" and not enabled:
            with self.module.no_sync():
                yield
            return
        if self.strategy == "fsdp":
            self.draft.set_requires_gradient_sync(enabled)
        yield

    def reshard_frozen(self) -> None:
        """Free the gathered copies of the frozen embedding and teacher head (fsdp; else a no-op)."""
        if self.strategy == "fsdp":
            self.draft.embed_tokens.reshard()
            self.teacher.reshard()

    def held_parameters(self) -> dict[str, int]:
        """Parameter elements this rank holds at rest (its shards under fsdp): trained, frozen
        embedding, teacher head."""
        def local(p: torch.Tensor) -> int:
            return p.to_local().numel() if hasattr(p, "to_local") else p.numel()

        emb = self.draft.embed_tokens.weight
        return {"trained": sum(local(p) for p in self.draft.parameters() if p.requires_grad),
                "embedding": local(emb), "teacher_head": sum(local(p) for p in self.teacher.parameters())}

    def trainable_names(self) -> list[str]:
        """Names of the trained parameters, in the optimizer's order."""
        return [n for n, p in self.draft.named_parameters() if p.requires_grad]

    def full_state(self, frozen: bool = True) -> dict[str, torch.Tensor]:
        """The draft's full state dict on CPU, on rank 0 (the other ranks get {}). Every rank
        must call it: under fsdp it gathers the shards. `frozen` False leaves out the frozen
        embedding (a checkpoint does not hold it): neither gathered nor copied to the host."""
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.draft, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=not frozen))
        if not self.env.is_main:
            return {}
        skip = set() if frozen else {n for n, q in self.draft.named_parameters() if not q.requires_grad}
        return {k: v.detach().cpu() for k, v in self.draft.state_dict().items() if k not in skip}

    def full_optimizer_state(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """`opt.state_dict()` with full tensors (parameter ids in `trainable_names` order):
        on every rank (none, ddp) or rank 0 only (fsdp). Every rank must call it under fsdp."""
        if self.strategy != "fsdp":
            return opt.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(self.draft, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not osd:
            return {}
        ids = {n: i for i, n in enumerate(self.trainable_names())}
        return {"state": {ids[n]: s for n, s in osd["state"].items()},
                "param_groups": [{**g, "params": [ids[n] for n in g["params"]]} for g in osd["param_groups"]]}

    def load_full_state(self, opt: torch.optim.Optimizer, model_state: dict[str, torch.Tensor],
                        optim_state: dict[str, Any]) -> None:
        """Load what `full_state` / `full_optimizer_state` returned (minus the frozen embedding,
        which the draft already holds). Under fsdp only rank 0's arguments are read."""
        if self.strategy != "fsdp":
            self.draft.load_state_dict({**model_state, "embed_tokens.weight": self.draft.embed_tokens.weight},
                                       strict=True)
            opt.load_state_dict(optim_state)
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        keys = set_model_state_dict(self.draft, model_state if self.env.is_main else {}, options=options)
        if self.env.is_main and (set(keys.missing_keys) - {"embed_tokens.weight"} or keys.unexpected_keys):
            raise RuntimeError(f"checkpoint does not fit the draft: missing {keys.missing_keys}, "
                               f"unexpected {keys.unexpected_keys}")
        names = self.trainable_names()
        fqn = {}
        if self.env.is_main:
            fqn = {"state": {names[int(i)]: s for i, s in optim_state["state"].items()},
                   "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                    for g in optim_state["param_groups"]]}
        set_optimizer_state_dict(self.draft, opt, fqn, options=options)


def parallelize(draft: nn.Module, teacher: nn.Module, strategy: str, device: torch.device,
                frozen_dtype: torch.dtype | None = None, env: DistEnv | None = None,
                compile: bool = False, kind: Any = None) -> Parallel:
    """Move the draft and teacher to `device` and wrap them for `strategy` (see the module doc).

    `frozen_dtype`: the dtype the frozen embedding is kept in (the target's); None keeps it.
    `kind`: the draft's type (a `DraftType`; None: the one its class names). Its
    `prepare_training` installs the fast training paths first (EAGLE-3: the fast TTT unroll,
    its pieces torch.compiled when `compile`), before any wrapper, as torchtitan compiles its
    blocks before sharding them. A single process goes through here too (strategy 'none':
    nothing is wrapped).
    """
    env = env or dist_env()
    kind = kind if kind is not None else draft_type_of(draft)
    kind.prepare_training(draft, compile=compile, sharded=strategy == "fsdp")
    emb = draft.embed_tokens.weight
    if frozen_dtype is not None and emb.dtype != frozen_dtype:  # before the move: never on the device in fp32
        draft.embed_tokens.weight = nn.Parameter(emb.detach().to(frozen_dtype), requires_grad=False)
    draft.embed_tokens.weight.requires_grad_(False)
    for p in teacher.parameters():
        p.requires_grad_(False)
    draft.to(device)
    teacher.to(device)
    if strategy == "none":
        return Parallel("none", env, draft, draft, teacher, compile)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # No buffer sync in forward: the buffers (d2t, t2d) are constant, and a broadcast in
        # every forward would make evaluation (no backward) a collective too.
        no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})  # the older name (torch < 2.13)
        module = DDP(draft, device_ids=[device.index] if device.type == "cuda" else None,
                     gradient_as_bucket_view=True, **no_buffer_sync)
        return Parallel("ddp", env, draft, module, teacher, compile)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (env.world_size,))
        for unit in kind.shard_units(draft):
            fully_shard(unit, mesh=mesh)
        # Frozen, target dtype: a unit of its own (one dtype per all-gather). Kept gathered
        # for the whole forward (every TTT step looks tokens up) and resharded by reshard_frozen.
        fully_shard(draft.embed_tokens, mesh=mesh, reshard_after_forward=False)
        fully_shard(draft, mesh=mesh)
        fully_shard(teacher, mesh=mesh, reshard_after_forward=True)
        return Parallel("fsdp", env, draft, draft, teacher, compile)
    raise ValueError(f"unknown strategy {strategy!r}")
