"""What a draft proposes and how decoding reads it, shared by the in-process decoder
(eaglet/engines/hf/decode.py) and the draft types' proposers and replays (eaglet/draft/<type>/):
the proposal `Tree`, `follow` (the nodes a target's tokens accept), `cut_at_eos` (a decoded
output as it is kept) and `ReplaySide`, the target's half of a replay as a draft type's replay
reads it. Change here what every proposer's tree or every decoded output holds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class Tree:
    """Proposals as a tree in verification order: node 0 is the root (the pending token),
    every parent comes before its children (a chain is parents [-1, 0, 1, ...])."""

    tokens: list[int]  # target token ids
    parents: list[int]  # parent node, -1 for the root
    depths: list[int]  # root 0; a node at depth d sits at position Q + d
    scores: list[float] = field(default_factory=list)  # cumulative draft log-prob (tree drafts)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self, node: int) -> list[int]:
        """Children of `node`, best cumulative score first (verification order for a chain)."""
        kids = [i for i, p in enumerate(self.parents) if p == node]
        if self.scores:
            kids.sort(key=lambda i: -self.scores[i])
        return kids


def chain_tree(root: int, tokens: Sequence[int]) -> Tree:
    """A chain of proposals after the pending token `root`, as a Tree."""
    n = len(tokens) + 1
    return Tree([root, *tokens], list(range(-1, n - 1)), list(range(n)))


def follow(tree: Tree, next_token: Callable[[int], int]) -> list[int]:
    """The tree nodes accepted when every node's next token is `next_token(node)` (greedy: the
    target's argmax there): from the root, the child holding that token, while there is one."""
    path: list[int] = []
    node = 0
    while kids := tree.children(node):
        want = next_token(node)
        node = next((c for c in kids if tree.tokens[c] == want), -1)
        if node < 0:
            break
        path.append(node)
    return path


def cut_at_eos(tokens: Sequence[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """The first max_new_tokens of `tokens`, ending at the first EOS among them."""
    out = list(tokens[:max_new_tokens])
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


class ReplaySide(Protocol):
    """The target's half of a replay (eaglet/engines/hf/replay.py `TargetSide`), as a draft
    type's `chain_hits` and tree replay read it: tensors and token lists, no engine object."""

    prompts: list[list[int]]
    sequences: list[list[int]]  # prompt + the target's continuation (max_new_tokens + k tokens)
    aux: list[Tensor]  # per sequence [len, num_aux*H], the target's captured states, on the CPU
    max_new_tokens: int
    k: int
    temperature: float  # > 0: the continuations were sampled at this temperature
    p_token: list[Tensor] | None  # sampled: per sequence [len] fp64, p_T(token i | tokens < i)
