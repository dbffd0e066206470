"""P-EAGLE's serving side: its export read back as the draft (eaglet's reader, the engines'
loader rows), no SGLang export, the serve command and the vLLM eval's speculative config with
parallel drafting, greedy chain replay equal to in-process decoding, and its vLLM contract rows.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eaglet.config import load_config
from eaglet.draft import DRAFT_TYPES, draft_type, eagle3, peagle
from eaglet.draft.peagle.model import PeagleConfig, PeagleDraft
from eaglet.engines.hf.decode import SpecSettings, TargetRunner, acceptance_stats, speculative_generate
from eaglet.engines.hf.replay import agreement_runs, replay_chain, replay_note, target_side
from eaglet.errors import ConfigError
from eaglet.formats.loaders import PROBLEMS, serve_commands
from eaglet.formats.serving import draft_model, export_draft, export_type, load_draft
from eaglet.testing.tiny import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

AUX = [2, 4, 5]


def tiny_peagle(seed: int = 0, **kw) -> PeagleDraft:
    base = dict(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, vocab_size=97, draft_vocab_size=40, num_layers=2, mask_token_id=7, num_depths=3)
    torch.manual_seed(seed)
    m = PeagleDraft(PeagleConfig(**{**base, **kw}))
    m.reset_parameters(std=0.3)
    with torch.no_grad():
        used = torch.randperm(97)[:40].sort().values
        m.d2t.copy_(used - torch.arange(40))
        m.t2d.zero_()
        m.t2d[used] = True
    return m.eval()


def export(draft, folder, fmt="vllm", k=3):
    return export_draft(draft, folder, fmt, aux_layer_ids=AUX, verifier_name_or_path="target",
                        verifier_architectures=["LlamaForCausalLM"], num_speculative_tokens=k, dtype="float32")


# ---- export and read-back ---------------------------------------------------------------------


def test_export_reads_back_as_the_draft_and_loads_as_vllms_loader_reads_it(tmp_path):
    draft = tiny_peagle()
    folder = export(draft, tmp_path / "vllm")
    assert export_type(folder) is peagle and eagle3.serving_format(json.loads((folder / "config.json").read_text())) \
        is None
    back, meta = draft_model(load_draft(folder), embed=draft.embed_tokens.weight)
    assert meta["algorithm"] == "peagle" and meta["format"] == "vllm" and meta["aux_layer_ids"] == AUX
    assert back.config.mask_token_id == 7 and back.config.num_aux == 3 and back.config.num_depths == 3
    for a, b in zip(peagle.reload_logits(draft), peagle.reload_logits(back.eval()), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert len(peagle.reload_logits(draft)) == 3  # depth 0 and two mask depths: mask_hidden is compared too
    assert PROBLEMS["peagle"]["vllm"](folder) == []
    assert PROBLEMS["eagle3"]["vllm"](folder) == ["config.json speculators_model_type 'peagle' is not eagle3"]


def test_a_missing_norm_before_residual_reads_as_vllms_peagle_default(tmp_path):
    """vLLM's update_peagle reads a missing norm_before_residual as false (update_eagle3: true)."""
    folder = export(tiny_peagle(norm_before_residual=True), tmp_path / "vllm")
    config = json.loads((folder / "config.json").read_text())
    del config["norm_before_residual"]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "checksums.json").unlink()
    cfg, _, _ = load_draft(folder)
    assert cfg.norm_before_residual is False


def _rewrite(folder, config=None, weights=None):
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if weights is not None:
        save_file(weights, str(folder / "model.safetensors"))
    (folder / "checksums.json").unlink(missing_ok=True)


def test_the_mask_slot_is_read_back_and_checked(tmp_path):
    """mask_hidden and mask_token_id are what vLLM's peagle path needs beyond EAGLE-3's: each
    missing or of the wrong size is named by eaglet's reader and by the loader rows."""
    folder = export(tiny_peagle(), tmp_path / "vllm")
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    assert weights["mask_hidden"].shape == (1, 1, 96)
    check = PROBLEMS["peagle"]["vllm"]

    _rewrite(folder, weights={k: v for k, v in weights.items() if k != "mask_hidden"})
    with pytest.raises(ValueError, match="no mask_hidden weight"):
        load_draft(folder)
    assert any("parameter 'mask_hidden'" in p for p in check(folder))

    _rewrite(folder, weights={**weights, "mask_hidden": weights["mask_hidden"][..., :64].contiguous()})
    with pytest.raises(ValueError, match="mask_hidden .* holds 64 values"):
        load_draft(folder)
    assert any("'mask_hidden' (1, 1, 64) holds 64 values" in p for p in check(folder))

    _rewrite(folder, config={k: v for k, v in config.items() if k != "mask_token_id"}, weights=weights)
    with pytest.raises(ValueError, match="needs mask_token_id"):
        load_draft(folder)
    assert "config.json has no 'mask_token_id', which vLLM 0.25.0 reads" in check(folder)


def test_no_sglang_export_a_note_for_the_default_formats_and_an_error_for_none(tmp_path, capfd):
    from eaglet.stages.export import export_formats

    with pytest.raises(ValueError, match="speculators format .* alone, not 'sglang'"):
        export(tiny_peagle(), tmp_path / "sglang", fmt="sglang")
    assert peagle.SERVING_FORMATS == ("vllm",) and "sglang" not in PROBLEMS["peagle"]
    cfg = load_config(None, ["train.algorithm=peagle"])
    assert export_formats(cfg, peagle) == ["vllm"]
    assert "[export] note: no sglang export: the P-EAGLE draft type has none" in capfd.readouterr().err
    assert export_formats(cfg, eagle3) == ["vllm", "sglang"]
    cfg = load_config(None, ["train.algorithm=peagle", "export.formats=[sglang]"])
    with pytest.raises(ConfigError, match=r"a P-EAGLE draft exports only as \['vllm'\]"):
        export_formats(cfg, peagle)


def test_the_serve_command_drafts_in_parallel():
    (command,) = serve_commands("peagle", "org/target", {"vllm": "/runs/x/export/vllm"}, 5).values()
    spec = json.loads(command.split("--speculative-config ")[1].strip("'"))
    assert spec == {"method": "eagle3", "model": "/runs/x/export/vllm", "num_speculative_tokens": 5,
                    "parallel_drafting": True}
    assert "parallel_drafting" not in serve_commands("eagle3", "org/target", {"vllm": "/v"}, 5)["vllm"]


# ---- the vLLM eval's speculative config ---------------------------------------------------------


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """A `vllm` module whose LLM records the arguments it is made with (what vLLM would get)."""
    made = []

    class LLM:
        def __init__(self, **kwargs):
            made.append(kwargs)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    return made


def test_the_vllm_eval_serves_the_export_with_its_types_speculative_keys(tmp_path, stand_in_vllm):
    from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft
    from eaglet.engines.vllm.eval import draft_decoder

    folder = export(tiny_peagle(), tmp_path / "peagle")
    engine = {"target": "t", "max_model_len": 64}
    draft_decoder(str(folder), 3, engine)
    assert stand_in_vllm[-1]["speculative_config"] == {"method": "eagle3", "model": str(folder),
                                                       "num_speculative_tokens": 3, "parallel_drafting": True}
    e3 = Eagle3Draft(DraftConfig(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=8, intermediate_size=48, vocab_size=97, draft_vocab_size=97))
    draft_decoder(str(export(e3, tmp_path / "eagle3")), 3, engine)
    assert stand_in_vllm[-1]["speculative_config"] == {"method": "eagle3", "model": str(tmp_path / "eagle3"),
                                                       "num_speculative_tokens": 3}


# ---- replay -----------------------------------------------------------------------------------

K, NEW = 4, 40
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 77], [9, 8, 7, 6], [400, 2, 33, 19, 101, 5, 5, 260]]


def partly_trained(target, side, steps: int) -> PeagleDraft:
    """A P-EAGLE draft fitted for `steps` Adam steps to the continuations' tokens at every row and
    depth (hard labels): right on some rows and depths, wrong on others."""
    cfg = types.SimpleNamespace(peagle=types.SimpleNamespace(layers=1, depths=K, down_sample_ratio=1.0,
                                                             down_sample_ratio_min=1.0, mask_token_id=None))
    torch.manual_seed(3)
    d = peagle.build(cfg, target.config, draft_vocab_size=target.config.vocab_size, num_aux=3)
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.0
        for seq, aux in zip(side.sequences, side.aux):
            ids, every = torch.tensor(seq)[None], torch.arange(len(seq))
            for j, logits in enumerate(d.depth_steps(aux[None], ids, depth_rows=[None] + [every] * (K - 1),
                                                     attn_impl="naive")):
                loss = loss + F.cross_entropy(logits.reshape(len(seq), -1)[: len(seq) - 2 - j], ids[0, 2 + j:])
        loss.backward()
        opt.step()
    return d.eval()


def test_greedy_chain_replay_is_in_process_decoding():
    """replay_chain (one forward over every row at every depth) gives speculative_generate's
    accepted count per verification and its tokens, prompt by prompt, for a draft that is right
    only part of the time; and at every row of the continuation (the cycles start at few of
    them) its hits are those of the proposer's k proposals there."""
    target = build_model("llama", seed=0)
    side = target_side(target, AUX, PROMPTS, NEW, K, batch=2)
    draft = partly_trained(target, side, 25)
    assert replay_note(draft, "chain") is None
    runner, settings = TargetRunner(target, AUX), SpecSettings("chain", chain_tokens=K, max_new_tokens=NEW)
    proposer = peagle.proposer(draft)
    replayed, decoded = [], []
    for prompt, (accepted, tokens) in zip(PROMPTS, replay_chain(draft, side, attn_impl="naive"), strict=True):
        g = speculative_generate(runner, proposer, prompt, settings)
        assert (accepted, tokens) == (g.accepted, g.tokens)
        replayed += accepted
        decoded += g.accepted
    assert len(set(replayed)) >= 3 and 0 in replayed  # cycles of several lengths: the comparison means something
    tau = acceptance_stats(replayed, K)["tau"]
    assert tau == acceptance_stats(decoded, K)["tau"] and 1.2 < tau < K + 1
    # every row, not only those the cycles start at: its hits are the proposer's agreement there
    for seq, aux, hits in zip(side.sequences, side.aux, agreement_runs(draft, side, K, attn_impl="naive"), strict=True):
        proposer.reset()
        for t in range(len(seq) - 2):
            proposer.extend(aux[t:t + 1], [seq[t + 1]], t)
            proposals, _ = proposer.propose(seq[t + 1], t + 1, K, 0.0, None)
            want = [float(p == x) for p, x in zip(proposals, seq[t + 2:])]
            assert hits[t, :len(want)].tolist() == want, (t, proposals, seq[t + 2:t + 2 + K])


# ---- the vLLM contract rows -------------------------------------------------------------------


def test_every_types_vllm_serving_needs_are_contract_rows_of_the_vllm_eval():
    from eaglet.engines.vllm.contracts import CONTRACTS, serving_contracts

    rows = [r for r in CONTRACTS if r.stages == ("eval-vllm",)]
    assert [(r.where, r.params, r.why) for r in rows] == [(r.where, r.params, r.why) for r in serving_contracts()]
    for name, kind in DRAFT_TYPES.items():
        own = [r for r in rows if (r.where, r.params, r.why) in set(getattr(kind, "VLLM_SERVING_CONTRACTS", ()))]
        assert len(own) == len(kind.VLLM_SERVING_CONTRACTS) and own
        for other in DRAFT_TYPES:
            cfg = load_config(None, [f"train.algorithm={other}"])
            assert all(r.when(cfg) == (other == name) for r in own), (name, other)
    wheres = {(r.where, r.params) for r in rows}
    assert ("vllm.config:SpeculativeConfig", ".parallel_drafting") in wheres
    assert ("vllm.model_executor.models.registry:_SPECULATIVE_DECODING_MODELS", "+Eagle3LlamaForCausalLM") in wheres
    assert draft_type("peagle").VLLM_SPECULATIVE == {"parallel_drafting": True}


def test_the_doctor_checks_the_eval_rows_of_the_type_trained_wherever_vllm_measures_the_export():
    from eaglet.checks.contracts import select_contracts
    from eaglet.engines import vllm
    from eaglet.engines.vllm.contracts import CONTRACTS

    cfg = load_config(None, ["train.algorithm=peagle", "eval.vllm=auto"])  # extract.backend hf
    assert vllm.contract_stages(cfg, {"eval"}) == {"eval-vllm"} and vllm.contract_stages(cfg, {"extract"}) == set()
    on, off = select_contracts({"eval-vllm"}, cfg, rows=CONTRACTS)
    assert {r.where for r in on} >= {"vllm.config:SpeculativeConfig"} and all(r.why.startswith("P-EAGLE") for r in on)
    assert off and all(r.why.startswith(("EAGLE-3", "DFlash")) for r in off)
    assert {r.why.split(":")[0] for r in off} == {"EAGLE-3", "DFlash"}  # every other type's rows are off
    assert vllm.contract_stages(load_config(None, ["eval.vllm=off"]), {"eval"}) == set()
    streamed = load_config(None, ["extract.backend=vllm", "extract.mode=online"])
    assert vllm.contract_stages(streamed, {"train"}) == {"extract-vllm"}


def test_the_doctors_contract_lines_reach_the_vllm_eval_rows_of_the_trained_type(tmp_path, monkeypatch):
    """With vLLM's rows made checkable (vLLM is not installed here, so each reads 'missing'), the
    doctor's eval preflight FAILs on P-EAGLE's eval rows for a P-EAGLE config, on EAGLE-3's for
    an EAGLE-3 one, on none with eval.vllm off; the HF engine's hooks stay with extract.backend hf."""
    from eaglet.doctor import diagnose
    from eaglet.engines import ENGINES, hf
    from eaglet.testing import tiny

    monkeypatch.setattr(ENGINES["vllm"], "unchecked_contract", lambda probe, row: False)
    target = tiny.save_target(tmp_path / "t", family="llama", template="llama3")
    data = tiny.write_jsonl(tmp_path / "d.jsonl", tiny.make_conversations(4, seed=1))
    base = [f"run.dir={tmp_path / 'run'}", f"target.path={target}", f"prepare.data=[{data}]",
            "export.verifier_name_or_path=org/t"]

    def failing(*overrides):
        findings = diagnose(load_config(None, [*base, *overrides]), "eval").findings
        return {f.expected.split("(for ")[-1].split(":")[0] for f in findings if f.status == "FAIL"
                and f.check.startswith("API vllm")}

    assert failing("train.algorithm=peagle", "eval.vllm=auto") == {"P-EAGLE"}
    assert failing("train.algorithm=eagle3", "eval.vllm=auto") == {"EAGLE-3"}
    assert failing("train.algorithm=peagle", "eval.vllm=off") == set()
    assert hf.contract_stages(load_config(None, [*base, "extract.backend=vllm"]), {"extract"}) == set()
    assert hf.contract_stages(load_config(None, base), {"extract"}) == {"extract"}


@pytest.mark.parametrize("version, ready", [("0.25.0", True), ("0.21.0", False), (None, False)])
def test_the_vllm_eval_check_makes_its_rows_checkable_where_vllm_is_new_enough(version, ready, monkeypatch):
    from eaglet.checks.findings import Probe
    from eaglet.engines.vllm import checks

    monkeypatch.setattr(checks.engine, "installed_vllm_version", lambda: version)
    probe = Probe(load_config(None, ["eval.vllm=auto"]), "eval")
    checks.check_vllm_eval(probe)
    assert probe.vllm_ready is ready


def test_a_types_speculative_keys_cannot_replace_eaglets():
    from eaglet.engines.vllm.decode import speculative_config

    with pytest.raises(ValueError, match=r"may not set \['method'\]"):
        speculative_config("/d", 3, "eagle3", {"method": "draft_model"})
