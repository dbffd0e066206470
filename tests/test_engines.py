"""The engine interface (eaglet/engines/base.py) and its registry (eaglet/engines/__init__.py):
every engine gives every entry point, every state source the trainer-facing protocol, the
registry picks the engine (no backend name compared outside the engine packages), and a store's
`read_parts` reads what training read before."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import eaglet.engines as registry
from eaglet.config import EvalSection, ExtractSection
from eaglet.engines.base import Engine, StateSource
from eaglet.engines.hf.online import AheadStates, OnlineStates
from eaglet.engines.states import PreparedStates
from eaglet.engines.vllm.stream import StreamedStates
from eaglet.errors import ConfigError
from eaglet.formats.store import StoreReader, StoreWriter
from eaglet.training import data as training_data

ROOT = Path(__file__).resolve().parents[1]
H, N_AUX = 16, 3


def _protocol_names(proto: type) -> tuple[set[str], set[str]]:
    """(the protocol's attributes, its methods), as its class body declares them."""
    attributes = set(proto.__dict__.get("__annotations__", {}))
    methods = {k for k, v in vars(proto).items() if callable(v) and not k.startswith("_")}
    return attributes, methods


def test_every_registered_engine_gives_every_entry_point():
    attributes, methods = _protocol_names(Engine)
    assert {"NAME", "run_extract", "state_source", "doctor", "run_eval"} <= attributes | methods
    for name, package in registry.ENGINES.items():
        missing = sorted(n for n in attributes | methods if not hasattr(package, n))
        assert not missing, f"engine {name} ({package.__name__}) lacks {missing}"
        assert all(callable(getattr(package, m)) for m in methods), name
        assert package.NAME == name
        assert package.CONTRACT_STAGES and isinstance(package.CONTRACT_STAGES, frozenset)
        # an entry point named as a module of the package would hide it (`import eaglet.engines.hf.extract`)
        for f in [f for f in Path(package.__file__).parent.glob("*.py") if f.stem != "__init__"]:
            assert not callable(getattr(package, f.stem, None)) or isinstance(getattr(package, f.stem), type(re)), f


def test_every_state_source_gives_the_trainer_facing_protocol():
    attributes, methods = _protocol_names(StateSource)
    for source in (StoreReader, PreparedStates, OnlineStates, AheadStates, StreamedStates):
        missing = sorted(m for m in methods | {"computes_ahead", "prefetchable", "stats_key"}
                         if not hasattr(source, m))
        assert not missing, f"{source.__name__} lacks {missing}"
    # what the trainer asks instead of isinstance
    assert (StoreReader.computes_ahead, StoreReader.prefetchable, StoreReader.stats_key) == (False, True, None)
    assert (OnlineStates.computes_ahead, OnlineStates.prefetchable, OnlineStates.stats_key) == (False, False, "online")
    assert (AheadStates.computes_ahead, AheadStates.prefetchable, AheadStates.stats_key) == (True, False, "online_ahead")
    assert (StreamedStates.computes_ahead, StreamedStates.prefetchable, StreamedStates.stats_key) == (
        True, False, "stream")


def test_an_unregistered_backend_is_one_line_from_the_command(tmp_path, capsys):
    """config.py holds no list of engines (it sits below the registry): the command checks
    extract.backend against the registry as soon as it reads the config, in one line."""
    from eaglet.cli import main

    assert main(["config", "--set", "extract.backend=sglang"]) == ConfigError.exit_code
    err = capsys.readouterr().err.strip()
    assert err == ("eaglet: extract.backend 'sglang' is not an engine eaglet has: "
                   + ", ".join(registry.ENGINES)), err
    assert main(["config", "--set", "extract.backend=vllm"]) == 0


def test_an_unknown_engine_is_one_config_error():
    with pytest.raises(ConfigError) as e:
        registry.engine("sglang-nope")
    assert "\n" not in str(e.value) and "hf" in str(e.value) and "vllm" in str(e.value)
    assert registry.engine("hf") is registry.ENGINES["hf"]


def test_the_shadow_and_eval_questions_go_to_the_engines(monkeypatch):
    assert registry.tiny_cpu_engine() == "hf"
    assert registry.eval_engine(EvalSection(vllm="off")) is None
    monkeypatch.setattr(registry.ENGINES["vllm"], "wants_eval", lambda ecfg: True)
    assert registry.eval_engine(SimpleNamespace()) is registry.ENGINES["vllm"]
    assert registry.contract_stages() == {"extract", "extract-vllm", "eval-vllm"}


# ---- open_states asks the registry ------------------------------------------------------------------

def test_open_states_takes_an_online_store_s_source_from_its_engine(monkeypatch, tmp_path):
    calls = []
    source = object()

    def state_source(cfg, store, prepared, train_dir, rank, planned):
        calls.append((store.meta["backend"], prepared, train_dir, rank, planned))
        return source

    fake = SimpleNamespace(NAME="fake", state_source=state_source)
    monkeypatch.setitem(registry.ENGINES, "fake", fake)
    store = SimpleNamespace(meta={"mode": "online", "backend": "fake"})
    monkeypatch.setattr(training_data, "open_verified", lambda folder: store)
    upstream = {"extract": tmp_path / "extract", "prepare": tmp_path / "prepare"}
    got = training_data.open_states(SimpleNamespace(), upstream, tmp_path / "train", rank=3, planned=False)
    assert got is source and calls == [("fake", tmp_path / "prepare", tmp_path / "train", 3, False)]
    # a store the HF engine wrote names no backend: the HF engine's source
    hf_calls = []
    monkeypatch.setattr(registry.ENGINES["hf"], "state_source", lambda *a: hf_calls.append(a) or source)
    store.meta = {"mode": "online"}
    assert training_data.open_states(SimpleNamespace(), upstream, tmp_path / "train") is source and len(hf_calls) == 1
    store.meta = {"mode": "offline", "backend": "fake"}  # an offline store is read as it is
    assert training_data.open_states(SimpleNamespace(), upstream, tmp_path / "train") is store and len(calls) == 1


# ---- StoreReader.read_parts reads what read_batch read before -----------------------------------------

def _store(folder: Path, dtype: str) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    samples = {}
    for k, T in enumerate([5, 12, 3, 9]):
        samples[10 + k] = {"aux": (torch.randn(T, N_AUX * H, generator=g) * 3).to(torch.bfloat16),
                           "final": torch.randn(T, H, generator=g).to(torch.bfloat16),
                           "input_ids": torch.randint(0, 99, (T,), generator=g, dtype=torch.int32),
                           "loss_mask": torch.randint(0, 2, (T,), generator=g, dtype=torch.uint8)}
    meta = {"input_hash": "h", "hidden_size": H, "n_aux": N_AUX, "layers": [1, 2, 3], "dtype": dtype,
            "final_state": "post_norm"}
    w = StoreWriter(folder, meta, shard_bytes=2000, queue_size=1, fsync=False)
    for sid, s in samples.items():
        w.add(sid, s["aux"], s["final"], s["input_ids"], s["loss_mask"])
    w.close()
    return samples


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_read_parts_is_the_old_per_sample_read(tmp_path, dtype):
    _store(tmp_path, dtype)
    store = StoreReader(tmp_path)
    ids, max_tokens = [12, 10, 13], 8
    # the read of training/data.py read_batch before read_parts
    raw = {"raw": True} if getattr(store, "scaled", False) else {}
    old = [{k: v[:max_tokens] for k, v in store.get(i, **raw).items()} for i in ids]
    lens, parts = store.read_parts(ids, max_tokens)
    assert lens == [int(p["input_ids"].shape[0]) for p in old] == [3, 5, 8]
    assert [sorted(p) for p in parts] == [sorted(p) for p in old]
    assert ("aux_scale" in parts[0]) == (dtype == "float8_e4m3fn")  # fp8 as stored, with its scales
    for a, b in zip(parts, old):
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn
                                                            else a[k], b[k].view(torch.uint8)
                                                            if b[k].dtype == torch.float8_e4m3fn else b[k]), k
    batch = training_data.read_batch(store, ids, max_tokens, pin=False)
    assert batch.lens == (3, 5, 8) and batch.tensors["aux"].shape == (1, 16, N_AUX * H)
    assert (store.progress(), store.stats()) == ({}, {})


# ---- no backend name compared outside the engine packages ------------------------------------------------

ENGINE_NAMES = "|".join(re.escape(n) for n in ("hf", "vllm", "sglang"))
COMPARES = [
    re.compile(r"\bbackend\b[\w.\]\)\"']*\s*(==|!=|\bin\b|\bnot in\b)"),  # extract.backend == ..., meta["backend"] != ...
    re.compile(rf"(==|!=)\s*[\"']({ENGINE_NAMES})[\"']"),  # ... == "vllm"
    re.compile(rf"[\"']({ENGINE_NAMES})[\"']\s*(==|!=)"),  # "vllm" == ...
    re.compile(r"\.get\(\s*[\"']backend[\"']"),  # meta.get("backend") and a compare somewhere later
]
# Export format names ("vllm", "sglang": a draft type's serving formats, eaglet/draft/eagle3/serving.py
# FORMATS), which are formats, not engines.
FORMAT_COMPARES = {
    "eaglet/draft/eagle3/serving.py": ('fmt == "vllm"', 'fmt == "sglang"'),
    "eaglet/draft/eagle3/read_export.py": ('fmt == "vllm"',),
    "eaglet/draft/eagle3/serving_mla.py": ('fmt == "sglang"',),  # an export format
    "eaglet/stages/export.py": ("fmt == 'vllm'",),
}


def backend_compares(path: str, text: str) -> list[str]:
    """The lines of `text` that compare a backend name (those of FORMAT_COMPARES left out)."""
    allowed = FORMAT_COMPARES.get(path, ())
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if any(p.search(code) for p in COMPARES) and not any(a in code for a in allowed):
            out.append(f"{path}:{n}: {line.strip()}")
    return out


def test_no_module_outside_the_engines_compares_a_backend_name():
    found = []
    for f in sorted((ROOT / "eaglet").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith("eaglet/engines/"):
            continue
        found += backend_compares(rel, f.read_text())
    assert not found, "ask the engine (eaglet/engines/__init__.py) instead:\n" + "\n".join(found)


@pytest.mark.parametrize("planted", [
    'if cfg.extract.backend == "vllm":',
    "    if e.backend != 'hf':",
    'online = store.meta.get("backend") == "vllm"',
    'if store.meta["backend"] in ("hf",):',
    'use_hf = "hf" == name',
])
def test_the_scan_finds_a_planted_compare(planted):
    assert backend_compares("eaglet/training/data.py", f"x = 1\n{planted}\n") == [
        f"eaglet/training/data.py:2: {planted.strip()}"]
    assert backend_compares("eaglet/stages/export.py", "if fmt == 'vllm':\n") == []  # an export format


def test_the_trainer_tells_no_state_source_apart_by_its_class():
    """training/ and stages/ consume every source through engines/base.py's StateSource: no
    isinstance (or class name) of a source decides anything there."""
    sources = ("StoreReader", "PreparedStates", "OnlineStates", "AheadStates", "StreamedStates")
    bad = []
    for folder in ("training", "stages"):
        for path in sorted((Path(registry.__file__).parents[1] / folder).glob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if "isinstance(" in line and any(s in line for s in sources):
                    bad.append(f"{path.name}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)
