"""The draft-type seam on the serving side: in-process decoding, replay, export, the draft loaders
and eval reach a draft's type through eaglet.draft (`draft_type`, `draft_type_of`) and name no
algorithm. A stand-in type, registered here, that offers only the Proposer protocol
(eaglet/draft/base.py) decodes to the target's own greedy output; it has no tree and no replay,
which the decoder and eval say in one line; a final/ folder written before draft types (no
"algorithm") still loads as EAGLE-3."""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save
from torch import Tensor, nn

import eaglet.draft as draft_registry
from eaglet.config import EvalSection
from eaglet.draft import DRAFT_TYPES, draft_type, draft_type_of
from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft
from eaglet.engines.hf.decode import SpecSettings, TargetRunner, plain_generate, speculative_generate
from eaglet.engines.hf.replay import replay_note
from eaglet.errors import ConfigError, InputError
from eaglet.formats.checked import write_files
from eaglet.formats.draft import DRAFT_CONFIG, WEIGHTS_FILE, load_final, save_final
from eaglet.formats.serving import export_draft, load_draft, serving_type
from eaglet.testing.tiny import build_model

ROOT = Path(__file__).resolve().parents[1]
AUX = [2, 4, 5]
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 77]

pytestmark = pytest.mark.usefixtures("one_thread")

# The files that reach the draft's type only through eaglet.draft (the serving/eval side).
SEAM_FILES = ["eaglet/engines/hf/decode.py", "eaglet/engines/hf/replay.py", "eaglet/formats/serving.py",
              "eaglet/formats/draft.py", "eaglet/formats/loaders.py", "eaglet/formats/loaders_common.py",
              "eaglet/formats/loaders_mla.py", "eaglet/stages/export.py",
              "eaglet/engines/vllm/decode.py", "eaglet/engines/vllm/eval.py",
              *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "eaglet" / "evaluation").glob("*.py"))]


def eagle3_imports(rel: str, source: str) -> list[str]:
    """'file:line: import' for every import of eaglet.draft.eagle3 (absolute or relative) in `source`."""
    package = rel.removesuffix(".py").replace("/", ".").rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == "eaglet.draft.eagle3" or n.startswith("eaglet.draft.eagle3.") for n in names):
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_serving_module_imports_the_eagle3_package():
    found = [hit for rel in SEAM_FILES for hit in eagle3_imports(rel, (ROOT / rel).read_text())]
    assert not found, "ask the draft's type (eaglet.draft.draft_type_of) instead:\n" + "\n".join(found)


@pytest.mark.parametrize("planted", ["from ..draft.eagle3.model import Eagle3Draft",
                                     "from ..draft import eagle3", "import eaglet.draft.eagle3.propose",
                                     "from eaglet.draft.eagle3 import proposer"])
def test_the_scan_finds_a_planted_import(planted):
    assert eagle3_imports("eaglet/formats/serving.py", f"x = 1\n{planted}\n") == [
        f"eaglet/formats/serving.py:2: {planted}"]
    assert eagle3_imports("eaglet/formats/serving.py", "from ..draft import draft_type_of\n") == []


# ---- a stand-in draft type: the Proposer protocol and nothing else ----------------------------------


class StandInDraft(nn.Module):
    """A draft of the stand-in type: it proposes from a token list given to it (the target's own
    continuation, or anything else), and holds what eval checks against the target."""

    ALGORITHM = "standin"

    def __init__(self, proposals: Sequence[int], num_aux: int, target_hidden_size: int, vocab_size: int):
        super().__init__()
        self.proposals = list(proposals)  # proposals[i]: the token proposed for position len(prompt) + 1 + i
        self.config = SimpleNamespace(num_aux=num_aux, target_hidden_size=target_hidden_size, vocab_size=vocab_size)
        self.scale = nn.Parameter(torch.ones(()))


class StandInProposer:
    """reset, length, extend, propose (eaglet/draft/base.py), holding the decoder to the protocol's
    indexing: row s commits the target's states at position s and the token x[s+1] (checked
    against the target's greedy continuation when given one)."""

    def __init__(self, draft: StandInDraft, prompt: Sequence[int], continuation: Sequence[int] | None):
        self.draft = draft
        # x[0..]: the prompt, then the target's own tokens; None: not checked (sampled decoding)
        self.sequence = None if continuation is None else list(prompt) + list(continuation)
        self.draft_to_target = torch.arange(draft.config.vocab_size)
        self.rows = 0
        self.prompt_len = len(prompt)

    def reset(self) -> None:
        self.rows = 0

    @property
    def length(self) -> int:
        return self.rows

    def extend(self, aux_NA: Tensor, next_tokens: Sequence[int], first_row: int) -> None:
        assert first_row == self.rows, (first_row, self.rows)
        assert aux_NA.shape == (len(next_tokens), self.draft.config.num_aux * self.draft.config.target_hidden_size)
        if self.sequence is not None:
            assert list(next_tokens) == self.sequence[first_row + 1: first_row + 1 + len(next_tokens)]
        self.rows += len(next_tokens)

    def propose(self, root: int, prefix: int, k: int, temperature: float,
                generator: torch.Generator | None) -> tuple[list[int], list[Tensor]]:
        assert prefix == self.rows and (self.sequence is None or root == self.sequence[prefix]), (prefix, self.rows)
        start = prefix - self.prompt_len
        tokens = [int(t) for t in self.draft.proposals[start: start + k]]
        tokens += [0] * (k - len(tokens))
        if temperature <= 0:
            return tokens, []
        q = torch.zeros(k, self.draft.config.vocab_size, dtype=torch.float64)
        q[torch.arange(k), torch.tensor(tokens)] = 1.0
        return tokens, list(q)


@pytest.fixture
def standin(monkeypatch):
    """The stand-in type registered beside EAGLE-3 (its proposer sees the prompt and the target's
    greedy continuation through `standin.expect`)."""
    expect: dict[str, list[int]] = {}
    kind = SimpleNamespace(NAME="standin", TITLE="Stand-in", SERVING_METHOD="standin",
                           proposer=lambda draft: StandInProposer(draft, expect["prompt"], expect["continuation"]))
    monkeypatch.setitem(draft_registry.DRAFT_TYPES, "standin", kind)
    return SimpleNamespace(kind=kind, expect=expect)


@pytest.fixture(scope="module")
def target():
    return build_model("llama", seed=0)


def greedy(target, n: int) -> list[int]:
    return plain_generate(TargetRunner(target, AUX), PROMPT, n).tokens


def standin_draft(target, proposals: Sequence[int]) -> StandInDraft:
    cfg = target.config
    return StandInDraft(proposals, len(AUX), cfg.hidden_size, cfg.vocab_size)


@pytest.mark.parametrize("which", ["oracle", "half", "wrong"])
def test_a_stand_in_proposer_decodes_to_the_targets_greedy_output(target, standin, which):
    """The decoder drives any Proposer: right, partly right and wrong proposals all give the
    target's greedy tokens, each cycle accepting what the proposals get right."""
    n, k = 20, 3
    want = greedy(target, n + k + 1)
    proposals = {"oracle": want[1:], "half": [t if i % 2 else (t + 1) % 512 for i, t in enumerate(want[1:])],
                 "wrong": [(t + 1) % 512 for t in want[1:]]}[which]
    standin.expect.update(prompt=PROMPT, continuation=want)
    draft = standin_draft(target, proposals)
    proposer = draft_type_of(draft).proposer(draft)
    g = speculative_generate(TargetRunner(target, AUX), proposer, PROMPT, SpecSettings("chain", k, max_new_tokens=n))
    assert g.tokens == want[:n]
    if which == "oracle":
        assert g.accepted[:-1] == [k] * (len(g.accepted) - 1)
    if which == "wrong":
        assert set(g.accepted) == {0}


def test_a_stand_in_proposer_keeps_sampled_decoding_running(target, standin):
    """At T > 0 its point-mass distributions go through rejection sampling (draft_to_target, q rows)."""
    want = greedy(target, 30)
    standin.expect.update(prompt=PROMPT, continuation=None)
    draft = standin_draft(target, want[1:])
    s = SpecSettings("chain", 3, temperature=0.7, max_new_tokens=12)
    g = speculative_generate(TargetRunner(target, AUX), draft_type_of(draft).proposer(draft), PROMPT, s,
                             generator=torch.Generator().manual_seed(0))
    assert len(g.tokens) == 12 and len(g.accepted) >= 1


def test_a_proposer_without_a_tree_is_one_line_naming_eval_method(target, standin):
    standin.expect.update(prompt=PROMPT, continuation=greedy(target, 8))
    draft = standin_draft(target, [])
    with pytest.raises(ConfigError, match=r"^eval\.method tree: .*StandInProposer.*drafts no tree; set eval\.method: "
                                          r"chain$"):
        speculative_generate(TargetRunner(target, AUX), draft_type_of(draft).proposer(draft), PROMPT,
                             SpecSettings("tree", max_new_tokens=8))


def test_eval_of_a_type_without_replay_decodes_with_a_note(target, standin):
    """eval.replay on a type with no chain_hits: measured by decoding (its tokens are the
    target's), the result's settings say so in one line; EAGLE-3 replays."""
    from eaglet.evaluation.inprocess import evaluate_draft

    want = greedy(target, 16)
    standin.expect.update(prompt=PROMPT, continuation=want)
    draft = standin_draft(target, want[1:])
    note = replay_note(draft, "chain")
    assert note == "replay skipped: the Stand-in draft type offers no chain replay (chain_hits); measured by decoding"
    ecfg = EvalSection(method="chain", chain_tokens=3, max_new_tokens=10, replay=True, baseline=False,
                       lossless_check=False)
    result = evaluate_draft(target, None, draft, AUX, [PROMPT], ecfg, eos_token_ids=[], warmup=False, verbose=False)
    assert result["settings"]["replay_note"] == note and "replay" not in result["settings"]
    assert result["prompts"][0]["tokens"] == want[:10]
    eagle = Eagle3Draft(DraftConfig.from_target_config(target.config, 300, num_aux=len(AUX)))
    assert replay_note(eagle, "chain") is None and replay_note(eagle, "tree") is None


# ---- saved drafts name their type -----------------------------------------------------------------------


def tiny_eagle3() -> Eagle3Draft:
    torch.manual_seed(0)
    return Eagle3Draft(DraftConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   intermediate_size=64, vocab_size=128, draft_vocab_size=128, target_hidden_size=32))


def test_a_final_draft_written_before_draft_types_loads_as_eagle3(tmp_path):
    """draft_config.json as eaglet wrote it before "algorithm" existed: an EAGLE-3 draft."""
    m = tiny_eagle3()
    state = {k: v.contiguous() for k, v in m.state_dict().items()}
    old = tmp_path / "old"
    old.mkdir()
    write_files(old, {WEIGHTS_FILE: save(state),
                      DRAFT_CONFIG: json.dumps({"draft": m.config.to_dict(), "aux_layers": [2, 4, 5]}).encode()})
    back, aux = load_final(old)
    assert type(back) is Eagle3Draft and aux == [2, 4, 5]
    assert all(torch.equal(back.state_dict()[k], v) for k, v in state.items())
    new = tmp_path / "new"
    save_final(new, state, m.config, [2, 4, 5], draft_type_of(m).NAME)
    assert json.loads((new / DRAFT_CONFIG).read_text())["algorithm"] == "eagle3"
    assert type(load_final(new)[0]) is Eagle3Draft


def test_a_final_draft_of_a_type_this_eaglet_lacks_is_one_line(tmp_path):
    m = tiny_eagle3()
    save_final(tmp_path, m.state_dict(), m.config, [2, 4, 5], "medusa")
    with pytest.raises(InputError, match=r"holds a 'medusa' draft, a draft type this eaglet does not have \(eagle3"):
        load_final(tmp_path)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_an_export_is_read_back_by_its_type(tmp_path, fmt):
    m = tiny_eagle3()
    folder = export_draft(m, tmp_path / fmt, fmt, aux_layer_ids=[2, 4, 5], verifier_name_or_path="t",
                          verifier_architectures=[], num_speculative_tokens=3, dtype="float32")
    cfg, state, meta = load_draft(folder)
    assert meta["algorithm"] == "eagle3" and meta["format"] == fmt
    assert draft_type(meta["algorithm"]) is draft_type_of(m)
    titles = ", ".join(kind.TITLE for kind in DRAFT_TYPES.values())
    with pytest.raises(ValueError, match=rf"config.json is no export of a draft type eaglet reads \({titles}\): "
                                         r"speculators_model_type 'medusa'"):
        serving_type({"speculators_model_type": "medusa", "architectures": ["X"]})
