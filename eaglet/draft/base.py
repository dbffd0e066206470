"""The draft-type interface: what every draft package (eaglet/draft/<type>/) provides.

A draft type is an architecture with its objective, its decoding and its serving format:
EAGLE-3 (`eagle3`), DFlash (`dflash`), P-EAGLE (`peagle`). `train.algorithm` names the type a
run trains; eaglet/draft/__init__.py maps each name to its package, and everything above the
draft layer (the trainer, the store and stream, checkpoints, resume, the doctor, the pipeline,
export and eval) reaches the type through these entry points only. Change these protocols when
every type must give something new (then each package, and docs/development.md's "Adding a
draft type"); tests/test_draft_types.py checks that every registered type gives them.

Each package gives the `DraftType` entry points as module-level functions and constants, as
an engine package does (eaglet/engines/base.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from ..config import Config
    from .step import Batch


class Proposer(Protocol):
    """A draft's proposal state for one request of in-process speculative decoding (batch 1).

    Indexing as the decoder's (eaglet/engines/hf/decode.py): with Q tokens committed to the
    target's cache and the pending token x[Q] at position Q not yet through the target, the
    draft has committed rows 0..Q-1, row s holding the target's captured states at position s
    and the token x[s+1]."""

    draft_to_target: Tensor  # [draft_vocab] -> target token id

    def reset(self) -> None:
        """Forget every committed row (a new request)."""

    @property
    def length(self) -> int:
        """Rows committed."""

    def extend(self, aux_NA: Tensor, next_tokens: Sequence[int], first_row: int) -> None:
        """Commit rows first_row..first_row+N-1: the target's captured states at those positions
        (aux_NA, the layers concatenated) and next_tokens = x[s+1]."""

    def propose(self, root: int, prefix: int, k: int, temperature: float,
                generator: torch.Generator | None) -> tuple[list[int], list[Tensor]]:
        """k chained proposals (target ids) after the pending token `root` at position `prefix`,
        and at temperature > 0 the draft distribution each was sampled from (draft vocabulary,
        CPU fp64). The committed rows are left as they were."""


class DraftType(Protocol):
    """The entry points of one draft package (module-level functions and constants)."""

    NAME: str  # the value of train.algorithm; written into the draft's meta as "algorithm"
    TITLE: str  # as people write it: "EAGLE-3", "DFlash", "P-EAGLE"
    SERVING_METHOD: str  # vLLM's speculative method that serves it ("eagle3", "dflash")
    SERVING_FORMATS: tuple[str, ...]  # the export formats `serving` writes ("vllm", "sglang"; P-EAGLE: "vllm")

    def layers(self, num_target_layers: int, cfg: Config) -> list[int] | None:
        """The target layers the draft reads (HF hidden_states indices, 0 = the embeddings), or
        None: extract.layers as configured. The extraction plan takes what the type asks for."""

    def build(self, cfg: Config, target_config: Any, draft_vocab_size: int, num_aux: int) -> nn.Module:
        """A fresh draft of the target's shape, initialised (the caller seeds torch first)."""

    def from_config(self, draft_config: dict[str, Any]) -> nn.Module:
        """The draft a saved draft config describes (its `config.to_dict()`), weights not loaded."""

    def host_rows(self, loss_mask_BT: Tensor, doc_ids_BT: Tensor, cfg: Config, seed: int
                  ) -> dict[str, Tensor] | None:
        """One micro-batch's preparation on the host, sent to the device with it (Batch.rows).
        seed: the same for the same micro-batch of the same run, resumed or not."""

    def prepare_training(self, draft: nn.Module, compile: bool, sharded: bool) -> None:
        """Install the fast training paths, before any wrapper."""

    def shard_units(self, draft: nn.Module) -> list[nn.Module]:
        """The FSDP2 units besides the root (the decoder layers)."""

    def unroll_linears(self, draft: nn.Module) -> list[nn.Module] | None:
        """The linears whose bf16 copies UnrollAdamW keeps; None: the plain AdamW."""

    def num_positions(self, cfg: Config) -> int:
        """How many per-position losses and accuracies `loss` gives."""

    def loss(self, module: nn.Module, draft: nn.Module, batch: Batch, teacher_BTV: Tensor, in_vocab_BT: Tensor,
             cfg: Config, compiled: bool) -> Any:
        """The loss of one packed micro-batch (a PositionLoss). teacher_BTV: the target's logits
        over the draft vocabulary at every row (row t predicts token t+1)."""

    def serving(self, draft: nn.Module, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The export's config.json and weights, named as vLLM loads them."""

    def serving_format(self, config: dict[str, Any], weights: dict[str, Tensor] | None = None) -> str | None:
        """The format ("vllm", "sglang") an export's config.json is this type's in, or None: not this type's."""

    def from_serving(self, config: dict[str, Any], weights: dict[str, Tensor], fmt: str, folder: Path
                     ) -> tuple[Any, dict[str, Tensor], list[str], dict[str, Any]]:
        """An export read back: (the draft config, the state dict under eaglet's names, the names
        missing from it, meta: aux_layer_ids, verifier_name_or_path, verifier_architectures,
        num_speculative_tokens)."""

    def reload_logits(self, draft: nn.Module) -> list[Tensor]:
        """The draft's logits on one fixed input (seeded inside): the export stage compares the
        trained draft's with those of its export read back (the check that the export is the draft)."""

    def proposer(self, draft: nn.Module) -> Proposer:
        """The draft's proposal state for in-process decoding."""

    # Optional: replay (eaglet/engines/hf/replay.py) is offered for a type that has chain_hits:
    #   chain_hits(draft, side, k, max_tokens, attn_impl) -> per position of the target's
    #   continuation, whether each of the k proposals made there equals the target's token (what
    #   a greedy chain replays; eaglet/draft/agreement.py computes it from the type's steps);
    #   replay_tree(...) as EAGLE-3's (eaglet/draft/eagle3/replay.py).
    # Optional: ATTENTIONS (tuple): the train.draft_attention values the type's layers take (eagle3:
    #   dense, mla); without it dense only (the doctor's `draft type` check FAILs on another).
    # Optional: config_problems(cfg) -> [(what, fix)]: settings this type cannot honour (the doctor's
    #   `draft type` check FAILs on each, before any weight loads).
    # Optional: LAYER_KEYS (tuple): the keys of the type's own config section that choose its target
    #   layers (dflash: layers, target_layers); the extract stage hashes them.
    # Optional: VLLM_SPECULATIVE (dict): keys added to vLLM's speculative config besides method,
    #   model and num_speculative_tokens (P-EAGLE: {"parallel_drafting": True}), by the vLLM eval
    #   (eaglet/engines/vllm/decode.py) and the serve command (eaglet/formats/loaders.py).
    # Optional: VLLM_SERVING_CONTRACTS: ((where, params, why), ...), what serving it in vLLM needs of
    #   vLLM, in eaglet/checks/contracts.py's row syntax; eaglet/engines/vllm/contracts.py makes
    #   them rows of stage "eval-vllm" for a config whose train.algorithm is this type.
    # Optional: VLLM_SERVING_CONTRACTS_BY_ATTENTION: {train.draft_attention value: rows}: the rows that
    #   replace VLLM_SERVING_CONTRACTS for a config training the type with that attention (eagle3:
    #   "mla", served by vLLM's Eagle3DeepseekV2ForCausalLM).
