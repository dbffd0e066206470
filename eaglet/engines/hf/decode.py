"""Speculative decoding with a transformers target and a draft, in process, batch 1.

The eval stage, the demo and the doctor measure a draft with this file; it is a measuring
instrument, not a serving engine. One decoding cycle:

    draft    propose a chain of k tokens (the draft's Proposer, eaglet/draft/base.py), or a
             tree where its type offers one (EAGLE-3's EAGLE-2 dynamic tree, `propose_tree`)
    verify   one target forward over [pending token] + proposals (a tree under a tree mask)
    accept   walk the proposals against the target: greedy match at T=0, rejection sampling
             at T>0; the target adds one bonus token
    commit   keep the accepted path in the target's KV cache; feed the accepted positions'
             captured target states to the draft, extending its KV cache

Indexing (the Proposer's): with Q tokens committed to both caches and the pending token x[Q]
(sampled, not yet run through the target), the draft has committed rows 0..Q-1, row s holding
the target's state at position s and the token x[s+1]. A draft node at depth d sits at
position Q+d.

Target KV cache: a transformers `DynamicCache()` made without a config, so every layer is a
plain `DynamicLayer` holding all keys/values as [B, Hkv, S, D] (sliding-window layers get
full layers too; their window is applied by the attention mask). After verification the
cache holds Q + N rows (N = 1 + proposals); `keep_cache_rows` keeps the prefix and the
accepted path: for a chain that is a prefix slice, for a tree an index_select of rows
[0..Q) + Q + path (path indices ascend, so rows stay in position order). It writes
`layer.keys` / `layer.values` directly: the layered Cache API of transformers >= 4.56 / 5.x;
`Cache.crop` cannot gather, and its argument changed meaning across versions (5.24 accepts
only negative "tokens to remove").

Draft state: the proposer's own (EAGLE-3: its KV cache, eaglet/draft/eagle3/propose.py). Its
proposals leave the committed rows as they were; the accepted positions are then committed
with the *target's* states (`extend`).

Tree verification mask: a 4D additive float mask [1, 1, N, Q+N] in the model's dtype (0 =
attend, finfo.min = masked): transformers 5.x passes any 4D mask through unchanged
(`masking_utils._preprocess_mask_arguments`), and both the eager (adds the mask) and sdpa
(takes bool or additive) kernels accept an additive one; flash-attention kernels take no
custom mask, so trees need attn_implementation eager or sdpa. Models with sliding-window
layers get a dict {"full_attention": ..., "sliding_attention": ...}, the form their forward
accepts. A chain is verified with no mask (consecutive positions, plain causal).

transformers API differences detected at run time: the cache keyword of the model's forward
(`cache` in 5.24, `past_key_values` in 5.17; `cache_kwarg`) and whether it takes
`logits_to_keep`.

Sampling (T > 0): a chain is drafted by sampling the draft (temperature T) and verified by
standard speculative rejection sampling against the draft's distribution mapped onto the
target vocabulary via the proposer's draft_to_target (accept x with min(1, p(x)/q(x)), else resample from
norm(max(p - q, 0))). EAGLE-3's EAGLE-2 tree is built from top-k (deterministic) proposals, so
its q is a point mass: each child in turn is accepted with the current p(x), else p(x) is
zeroed and p renormalised (what official EAGLE does). Both leave the target's output
distribution unchanged.
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ...draft.base import Proposer
from ...draft.proposals import Tree, chain_tree, cut_at_eos, follow
from ...errors import ConfigError
from ...targets.load import TargetParts

# ---- transformers API detection -------------------------------------------------------------


def forward_params(model: nn.Module) -> set[str]:
    """Parameter names of model.forward (inspect follows functools.wraps decorators)."""
    return set(inspect.signature(model.forward).parameters)


def cache_kwarg(model: nn.Module) -> str:
    """The KV-cache keyword of the model's forward: 'cache' (transformers 5.24) or
    'past_key_values' (5.17 and earlier)."""
    params = forward_params(model)
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`")


def new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def keep_cache_rows(cache: Any, keep: Tensor | int) -> None:
    """Keep sequence rows of every layer of a DynamicCache: an int n keeps rows [0, n), a
    tensor of ascending indices keeps those rows (tree: prefix + accepted path)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"{type(cache).__name__} has no `layers`: speculative decoding needs transformers' layered cache")
    for layer in layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or keys.numel() == 0:
            continue
        if getattr(layer, "is_sliding", False) or hasattr(layer, "cumulative_length"):
            raise TypeError(f"cache layer {type(layer).__name__} keeps a window, not every row; use DynamicCache()")
        if isinstance(keep, int):
            layer.keys, layer.values = keys[..., :keep, :], values[..., :keep, :]
        else:
            idx = keep.to(keys.device)
            layer.keys, layer.values = keys.index_select(-2, idx), values.index_select(-2, idx)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- trees ------------------------------------------------------------------------------------


def ancestor_mask(parents: Sequence[int]) -> Tensor:
    """bool [N, N]: row i is True at i and at every ancestor of i (parents before children)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            if p >= i:
                raise ValueError(f"node {i} has parent {p}: parents must come before their children")
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


# ---- target side ------------------------------------------------------------------------------


class TargetRunner:
    """The target's forwards with a KV cache, capturing the aux states (the states entering
    the decoder layers `aux_layers`, as extraction captures them) of every new position."""

    def __init__(self, model: nn.Module, aux_layers: Sequence[int]):
        self.model = model
        self.parts = TargetParts.of(model)
        self.aux_layers = list(aux_layers)
        self.cache_kw = cache_kwarg(model)
        self.logits_to_keep = "logits_to_keep" in forward_params(model)
        self.device = self.parts.input_device
        self.dtype = self.parts.embed_tokens.weight.dtype
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.layer_types = list(getattr(cfg, "layer_types", None) or [])
        self.sliding_window = getattr(cfg, "sliding_window", None)
        self.attn_impl = getattr(model.config, "_attn_implementation", None)

    @contextmanager
    def _capture(self, enabled: bool) -> Iterator[list[Tensor | None]]:
        box: list[Tensor | None] = [None] * len(self.aux_layers)
        if not enabled:
            yield box
            return

        def make_hook(j: int):
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                box[j] = (args[0] if args else kwargs[self.parts.layer_input]).detach().clone()

            return hook

        handles = [self.parts.layers[i].register_forward_pre_hook(make_hook(j), with_kwargs=True)
                   for j, i in enumerate(self.aux_layers)]
        try:
            yield box
        finally:
            for h in handles:
                h.remove()

    def tree_mask(self, tree: Tree, prefix: int) -> Tensor | dict[str, Tensor]:
        """The additive 4D mask [1, 1, N, prefix+N] for verifying `tree` after `prefix` rows."""
        allowed = torch.cat([torch.ones(tree.size, prefix, dtype=torch.bool), ancestor_mask(tree.parents)], dim=1)
        masked = torch.finfo(self.dtype).min

        def additive(a: Tensor) -> Tensor:
            return torch.zeros(a.shape, dtype=self.dtype).masked_fill(~a, masked)[None, None].to(self.device)

        kinds = set(self.layer_types) - {"full_attention"}
        uniform_window = not self.layer_types and self.sliding_window  # Mistral's config: every layer slides
        if not kinds and not uniform_window:
            return additive(allowed)
        if kinds - {"sliding_attention"} or not self.sliding_window:
            raise NotImplementedError(f"tree verification for attention layer types {sorted(kinds)}: use method 'chain'")
        q_pos = torch.tensor(tree.depths) + prefix
        k_pos = torch.cat([torch.arange(prefix), q_pos])
        in_window = k_pos[None, :] > q_pos[:, None] - int(self.sliding_window)
        if uniform_window:
            return additive(allowed & in_window)
        return {"full_attention": additive(allowed), "sliding_attention": additive(allowed & in_window)}

    @torch.no_grad()
    def forward(
        self, cache: Any, tokens: Sequence[int], positions: Sequence[int], mask: Any = None,
        capture: bool = True, last_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """(logits [N or 1, V] fp32, aux [N, num_aux*H] or None) for the new tokens."""
        kwargs: dict[str, Any] = {
            "input_ids": torch.tensor([list(tokens)], device=self.device),
            "position_ids": torch.tensor([list(positions)], device=self.device),
            self.cache_kw: cache,
            "use_cache": True,
        }
        if mask is not None:
            kwargs["attention_mask"] = mask
        if last_only and self.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with self._capture(capture) as box:
            out = self.model(**kwargs)
        logits = out.logits[0, -1:] if last_only else out.logits[0]
        if not capture:
            return logits.float(), None
        if any(b is None for b in box):
            raise RuntimeError(f"aux layers {self.aux_layers}: a hook did not fire in the target forward")
        return logits.float(), torch.cat([b[0].to(self.device) for b in box if b is not None], dim=-1)


# ---- acceptance -------------------------------------------------------------------------------


def accept_probability(p: Tensor, q: Tensor, x: int) -> float:
    """Speculative sampling: accept a draft token x ~ q with probability min(1, p(x)/q(x))."""
    qx = float(q[x])
    return 1.0 if qx <= 0 else min(1.0, float(p[x]) / qx)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """What to sample after a rejection: norm(max(p - q, 0)) (p itself when that is zero)."""
    r = (p - q).clamp_min(0)
    total = float(r.sum())
    return p if total <= 0 else r / total


def _sample(p: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def verify_chain_sampling(
    p_rows: Sequence[Tensor], q_rows: Sequence[Tensor], tokens: Sequence[int], generator: torch.Generator | None
) -> tuple[int, int]:
    """Rejection sampling of a sampled chain: p_rows [k+1] target distributions (row i scores
    draft position i; row k the bonus), q_rows [k] draft distributions over the target
    vocabulary, tokens [k]. Returns (number accepted, the next token)."""
    for i, x in enumerate(tokens):
        if uniform(generator) < accept_probability(p_rows[i], q_rows[i], x):
            continue
        return i, _sample(residual_distribution(p_rows[i], q_rows[i]), generator)
    return len(tokens), _sample(p_rows[len(tokens)], generator)


def pick_among_children(p: Tensor, child_tokens: Sequence[int], generator: torch.Generator | None) -> tuple[int | None, int]:
    """Deterministic proposals (q = point mass each): child j is accepted with the current
    p(x_j); on rejection p(x_j) is zeroed and p renormalised. Returns (accepted child index
    or None, token). The token is distributed exactly as p."""
    p = p.clone()
    for j, x in enumerate(child_tokens):
        if uniform(generator) < float(p[x]):
            return j, x
        p[x] = 0
        total = float(p.sum())
        if total <= 0:
            break
        p = p / total
    return None, _sample(p, generator)


def accept(
    tree: Tree, logits_NV: Tensor, temperature: float, q_rows: Sequence[Tensor] = (),
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Walk the target's verification logits down the tree: (accepted node indices, in
    order, root excluded; the bonus token)."""
    if temperature <= 0:
        greedy = logits_NV.argmax(-1).tolist()
        path = follow(tree, greedy.__getitem__)
        return path, int(greedy[path[-1] if path else 0])
    path: list[int] = []

    def p_row(i: int) -> Tensor:
        return torch.softmax(logits_NV[i].double() / temperature, -1).cpu()

    if q_rows:  # a sampled chain
        assert tree.is_chain(), "draft distributions are only kept for chains"
        n, token = verify_chain_sampling([p_row(i) for i in range(tree.size)], list(q_rows), tree.tokens[1:], generator)
        return list(range(1, n + 1)), token
    node = 0
    while True:
        kids = tree.children(node)
        j, token = pick_among_children(p_row(node), [tree.tokens[c] for c in kids], generator)
        if j is None:
            return path, token
        path.append(kids[j])
        node = kids[j]


def draft_q_on_target(q_draft: Tensor, draft_to_target: Tensor, vocab_size: int) -> Tensor:
    """A draft-vocabulary distribution placed on the target vocabulary (zero elsewhere)."""
    q = torch.zeros(vocab_size, dtype=q_draft.dtype)
    q[draft_to_target.cpu()] = q_draft
    return q


# ---- decoding loops ---------------------------------------------------------------------------


@dataclass
class SpecSettings:
    method: str = "chain"  # "chain" | "tree"
    chain_tokens: int = 7
    tree_top_k: int = 10
    tree_depth: int = 6
    tree_total_tokens: int = 60
    temperature: float = 0.0
    max_new_tokens: int = 256

    @property
    def num_positions(self) -> int:
        """Draft positions on the longest path (tau <= num_positions + 1)."""
        return self.chain_tokens if self.method == "chain" else self.tree_depth

    @classmethod
    def from_eval(cls, ecfg: Any) -> SpecSettings:
        return cls(**{f: getattr(ecfg, f) for f in cls.__dataclass_fields__})


@dataclass
class Generation:
    tokens: list[int]  # new tokens (after the prompt), cut at max_new_tokens / the first EOS
    seconds: float
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verification forward
    phases: dict[str, float] = field(default_factory=dict)  # seconds in drafting, verifying, the rest (`timed`)

    @property
    def verify_forwards(self) -> int:
        return len(self.accepted)


def _finished(tokens: list[int], new: Sequence[int], max_new_tokens: int, eos: set[int]) -> bool:
    """Enough tokens, or an EOS among the `new` ones (the end of `tokens`)."""
    return len(tokens) >= max_new_tokens or any(t in eos for t in new)


def _first_token(logits_V: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits_V.argmax())
    return _sample(torch.softmax(logits_V.double() / temperature, -1).cpu(), generator)


Progress = Callable[[int], None]  # called with the number of new tokens just committed


def _kept(before: int, new: Sequence[int], max_new_tokens: int, eos: set[int]) -> int:
    """How many of the tokens will be kept (`cut_at_eos`) once `new` follows `before` tokens
    holding no EOS: the progress a cycle makes, counted without looking back."""
    n = before
    for t in new:
        if n >= max_new_tokens:
            break
        n += 1
        if t in eos:
            break
    return n


TreeProposals = Callable[[int, int, int, int, int], Tree]  # (root, prefix, top_k, depth, total_tokens) -> Tree


def proposals_of(draft: Proposer, method: str) -> TreeProposals | None:
    """None for eval.method chain (the proposer's `propose`); for tree, the proposer's
    `propose_tree` (EAGLE-3's EAGLE-2 tree), a ConfigError naming eval.method when it has none."""
    if method == "chain":
        return None
    if method != "tree":
        raise ValueError(f"unknown drafting method {method!r} (expected 'chain' or 'tree')")
    tree = getattr(draft, "propose_tree", None)
    if tree is None:
        raise ConfigError(f"eval.method tree: this draft type's proposer ({type(draft).__name__}) drafts no tree; "
                          "set eval.method: chain")
    return tree


def speculative_generate(
    target: TargetRunner, draft: Proposer, prompt: Sequence[int], s: SpecSettings,
    eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None, timed: bool = False,
    progress: Progress | None = None,
) -> Generation:
    """Decode `prompt` speculatively with any draft type's proposer (`draft`: its type's
    `proposer(module)`); see the module docstring for the cycle. timed: also the
    seconds spent drafting and verifying (`Generation.phases`; on a GPU each phase then ends
    with a device sync, which slows decoding a little). progress: called after the prefill and
    after every cycle with the number of new tokens committed (counted as the output keeps them:
    the calls sum to len(tokens)); it adds no device sync, as the accepted count is on the host."""
    if not prompt:
        raise ValueError("speculative decoding needs a non-empty prompt")
    tree_proposals = proposals_of(draft, s.method)
    eos = set(eos_token_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    cache = new_cache()
    draft.reset()
    P = len(prompt)
    logits, aux = target.forward(cache, prompt, range(P), last_only=True)
    assert aux is not None
    pending = _first_token(logits[-1], s.temperature, generator)
    tokens = [pending]
    if progress is not None:
        progress(1)
    draft.extend(aux, list(prompt[1:]) + [pending], 0)
    Q = P  # rows committed to both caches; `pending` sits at position Q
    accepted: list[int] = []
    new = tokens
    phases = {"draft": 0.0, "verify": 0.0, "accept": 0.0}
    clock = 0.0

    def lap(phase: str) -> None:  # the seconds since the last lap go to `phase` (only when timed)
        nonlocal clock
        if timed:
            _sync(target.device)
            now = time.perf_counter()
            if phase:
                phases[phase] += now - clock
            clock = now

    lap("")  # the prefill is behind us
    while not _finished(tokens, new, s.max_new_tokens, eos):
        qs: list[Tensor] = []
        if tree_proposals is None:
            proposed, qs = draft.propose(pending, Q, s.chain_tokens, s.temperature, generator)
            tree = chain_tree(pending, proposed)
            mask = None
        else:
            tree = tree_proposals(pending, Q, s.tree_top_k, s.tree_depth, s.tree_total_tokens)
            mask = None if tree.is_chain() else target.tree_mask(tree, Q)
        lap("draft")
        logits, aux = target.forward(cache, tree.tokens, [Q + d for d in tree.depths], mask)
        assert aux is not None
        lap("verify")
        q_rows = [draft_q_on_target(q, draft.draft_to_target, logits.shape[-1]) for q in qs]
        path, bonus = accept(tree, logits, s.temperature, q_rows, generator)
        keep = [0, *path]
        if tree.is_chain():
            keep_cache_rows(cache, Q + len(keep))
        else:
            keep_cache_rows(cache, torch.cat([torch.arange(Q), Q + torch.tensor(keep)]))
        new = [tree.tokens[i] for i in path] + [bonus]
        accepted.append(len(path))
        if progress is not None:
            progress(_kept(len(tokens), new, s.max_new_tokens, eos) - len(tokens))
        tokens += new
        lap("accept")
        draft.extend(aux[keep], new, Q)
        lap("draft")
        Q += len(keep)
        pending = bonus
    _sync(target.device)
    seconds = time.perf_counter() - t0
    if timed:
        phases["prefill"] = seconds - sum(phases.values())
    return Generation(cut_at_eos(tokens, s.max_new_tokens, eos), seconds, accepted, phases if timed else {})


@torch.no_grad()
def plain_generate(
    target: TargetRunner, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
    eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None, progress: Progress | None = None,
) -> Generation:
    """The baseline: one target forward per token with the same KV cache (no aux capture).
    progress: called with 1 for every new token (as speculative_generate's)."""
    eos = set(eos_token_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    cache = new_cache()
    logits, _ = target.forward(cache, prompt, range(len(prompt)), capture=False, last_only=True)
    tokens = [_first_token(logits[-1], temperature, generator)]
    if progress is not None:
        progress(1)
    while not _finished(tokens, tokens[-1:], max_new_tokens, eos):
        pos = len(prompt) + len(tokens) - 1
        logits, _ = target.forward(cache, [tokens[-1]], [pos], capture=False, last_only=True)
        tokens.append(_first_token(logits[-1], temperature, generator))
        if progress is not None:
            progress(1)
    _sync(target.device)
    return Generation(cut_at_eos(tokens, max_new_tokens, eos), time.perf_counter() - t0)


# ---- metrics ----------------------------------------------------------------------------------


def acceptance_stats(accepted: Sequence[int], num_positions: int) -> dict[str, Any]:
    """tau and per-position acceptance from the draft tokens accepted per verification.

    tau = sum(accepted + 1) / verifications (each accepted run plus the bonus token; the
    prefill forward is no verification). Position i (0-based) is reached in a cycle that
    accepted >= i tokens, and accepted in one that accepted > i.
    """
    n = len(accepted)
    reached = [sum(1 for a in accepted if a >= i) for i in range(num_positions)]
    hit = [sum(1 for a in accepted if a > i) for i in range(num_positions)]
    return {
        "verify_forwards": n,
        "tokens_from_verification": sum(a + 1 for a in accepted),
        "tau": (sum(a + 1 for a in accepted) / n) if n else None,
        "position_reached": reached,
        "position_accepted": hit,
        "acceptance_rate": [(h / r if r else None) for h, r in zip(hit, reached)],
    }
