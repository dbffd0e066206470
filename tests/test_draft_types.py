"""The draft-type seam on the training side (eaglet/draft/base.py `DraftType`, the registry in
eaglet/draft/__init__.py): every registered type gives the entry points, the generic machinery
names no type, an unknown train.algorithm is one line from the command, a store holding more
layers than a type reads is read by columns, and a checkpoint of another type is not resumed."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest
import torch

import eaglet.draft as registry
from eaglet.config import Config, TrainSection, load_config
from eaglet.draft.base import DraftType
from eaglet.draft.eagle3.model import DraftConfig
from eaglet.errors import ConfigError, InputError, ResumeError
from eaglet.formats import checkpoints
from eaglet.formats.store import StoreReader, StoreWriter
from eaglet.targets.families import extraction_layers, resolve_layers
from eaglet.training import resume
from eaglet.training.data import load_batch

ROOT = Path(__file__).resolve().parents[1]

# Entry points a type may still lack while its serving side is written (none: every registered
# type gives them all, the optional ones of base.py's end aside).
SERVING_SIDE: set[str] = set()


def _protocol_names(proto: type) -> tuple[set[str], set[str]]:
    """(the protocol's attributes, its methods), as its class body declares them."""
    attributes = set(proto.__dict__.get("__annotations__", {}))
    methods = {k for k, v in vars(proto).items() if callable(v) and not k.startswith("_")}
    return attributes, methods


def test_every_registered_type_gives_every_entry_point():
    attributes, methods = _protocol_names(DraftType)
    assert {"NAME", "TITLE", "SERVING_METHOD", "layers", "build", "host_rows", "loss", "num_positions"} <= (
        attributes | methods)
    for name, package in registry.DRAFT_TYPES.items():
        wanted = (attributes | methods) - {m for m in SERVING_SIDE if not hasattr(package, m)}
        missing = sorted(n for n in wanted if not hasattr(package, n))
        assert not missing, f"draft type {name} ({package.__name__}) lacks {missing}"
        assert all(callable(getattr(package, m)) for m in methods & wanted), name
        assert package.NAME == name and isinstance(package.TITLE, str) and isinstance(package.SERVING_METHOD, str)
        assert registry.draft_type(name) is package


# ---- the generic machinery names no type --------------------------------------------------------------

# Where no draft type is named: these reach the type through draft_type(cfg.train.algorithm).
GENERIC = [*sorted((ROOT / "eaglet" / "training").glob("*.py")), *sorted((ROOT / "eaglet" / "stages").glob("*.py")),
           *(ROOT / "eaglet" / "draft" / f"{m}.py" for m in ("step", "parallelize", "loss", "optim")),
           ROOT / "eaglet" / "pipeline.py", ROOT / "eaglet" / "doctor.py", ROOT / "eaglet" / "shadow.py",
           *(ROOT / "eaglet" / "engines" / "vllm" / f"{m}.py" for m in ("contracts", "decode", "eval")),
           ROOT / "eaglet" / "formats" / "serving.py"]
# Modules left out of the scan while a change makes them generic (none now).
SERVING_SIDE_MODULES: set[str] = set()
TYPE_NAMES = {"eagle3", "dflash", "peagle"}


def _imported(node: ast.AST, module: str) -> list[str]:
    """The absolute modules an import statement in `module` (dotted) names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = module.split(".")[: len(module.split(".")) - node.level] if node.level else []
    stem = ".".join(base + ([node.module] if node.module else []))
    return [stem] + [f"{stem}.{a.name}" for a in node.names]


def type_names_in(path: str, text: str) -> list[str]:
    """The lines of `text` (module `path`) that import a draft type's package or compare
    train.algorithm (anything named `algorithm`) with a type's name."""
    module = path.removesuffix(".py").replace("/", ".")
    found = []
    for node in ast.walk(ast.parse(text)):
        if any(re.match(r"eaglet\.draft\.(eagle3|dflash|peagle)(\.|$)", m) for m in _imported(node, module)):
            found.append(f"{path}:{node.lineno}: imports a draft type's package")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, (ast.Attribute, ast.Name)) and (getattr(s, "attr", None) or getattr(s, "id", None))
                        == "algorithm" for s in sides)
            constants = [c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)]
            if named and any(c in TYPE_NAMES for c in constants):
                found.append(f"{path}:{node.lineno}: compares train.algorithm with a name")
    return found


def test_no_generic_module_names_a_draft_type():
    found = []
    for f in GENERIC:
        rel = f.relative_to(ROOT).as_posix()
        if rel not in SERVING_SIDE_MODULES:
            found += type_names_in(rel, f.read_text())
    assert not found, "ask the type (eaglet.draft.draft_type(cfg.train.algorithm)) instead:\n" + "\n".join(found)


@pytest.mark.parametrize("planted", [
    "from ..draft.eagle3.model import Eagle3Draft",
    "from ..draft import eagle3",
    "import eaglet.draft.dflash.model",
    "from eaglet.draft.peagle import loss",
    'if cfg.train.algorithm == "eagle3":\n    pass',
    "if train_cfg.algorithm in ('dflash', 'peagle'):\n    pass",
    'fast = "eagle3" != algorithm',
])
def test_the_scan_finds_a_planted_type_name(planted):
    assert len(type_names_in("eaglet/training/loop.py", f"x = 1\n{planted}\n")) == 1
    assert type_names_in("eaglet/training/loop.py", "kind = draft_type(cfg.train.algorithm)\n") == []


# ---- the name, checked by the command -----------------------------------------------------------------

def test_an_unknown_train_algorithm_is_one_line_from_the_command(capsys):
    """config.py sits below the registry: the command checks train.algorithm (and
    extract.draft_types) against it as soon as it reads the config, in one line."""
    from eaglet.cli import main

    assert main(["config", "--set", "train.algorithm=medusa"]) == ConfigError.exit_code
    err = capsys.readouterr().err.strip()
    assert err == ("eaglet: train.algorithm 'medusa' is not a draft type eaglet trains: "
                   + ", ".join(registry.DRAFT_TYPES)), err
    assert main(["config", "--set", "extract.draft_types=[eagle3, medusa]"]) == ConfigError.exit_code
    err = capsys.readouterr().err.strip()
    assert err == ("eaglet: extract.draft_types ['medusa'] are not draft types eaglet trains: "
                   + ", ".join(registry.DRAFT_TYPES)), err
    assert main(["config", "--set", "train.algorithm=eagle3"]) == 0


def test_the_type_sections_refuse_unknown_keys():
    assert load_config(None, ["dflash.block_size=8"]).dflash.block_size == 8
    assert load_config(None, []).peagle.depths == 8 and load_config(None, []).train.algorithm == "eagle3"
    with pytest.raises(ConfigError, match="unknown key 'dflash.blocksize'"):
        load_config(None, ["dflash.blocksize=8"])
    with pytest.raises(ConfigError, match="unknown key 'peagle.depth'"):
        load_config(None, ["peagle.depth=4"])


# ---- the extraction plan, and a store holding more than a type reads ---------------------------------

H, TARGET_LAYERS = 8, 12


def _fake_type(layers):
    """A draft type that reads `layers` and prepares nothing on the host."""
    return types.SimpleNamespace(NAME="fake", layers=lambda num_layers, cfg: list(layers),
                                 host_rows=lambda mask, docs, cfg, seed: None)


def test_extraction_captures_the_union_of_the_types_layers(monkeypatch):
    cfg = Config()
    assert extraction_layers(cfg, TARGET_LAYERS) == resolve_layers(None, TARGET_LAYERS) == [2, 6, 9]  # as before
    cfg.extract.layers = [4, 1, 7]
    assert extraction_layers(cfg, TARGET_LAYERS) == [4, 1, 7]
    monkeypatch.setitem(registry.DRAFT_TYPES, "fake", _fake_type([1, 3, 5, 7]))
    cfg.extract.draft_types = ["fake"]
    assert extraction_layers(cfg, TARGET_LAYERS) == [4, 1, 7, 3, 5]
    cfg.train.algorithm, cfg.extract.draft_types = "fake", ["eagle3"]
    assert extraction_layers(cfg, TARGET_LAYERS) == [1, 3, 5, 7, 4]


def _write_store(folder: Path, layers: list[int], dtype: str, columns: list[int] | None = None) -> StoreReader:
    """A store of four samples whose state of layer i is the same random tensor in every store;
    `layers` in that order."""
    states = {i: torch.randn(40, H, generator=torch.Generator().manual_seed(100 + i)) * (1 + i) for i in range(12)}
    g = torch.Generator().manual_seed(0)
    final = torch.randn(40, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 99, (40,), generator=g, dtype=torch.int32)
    mask = torch.randint(0, 2, (40,), generator=g, dtype=torch.uint8)
    meta = {"input_hash": "h", "hidden_size": H, "n_aux": len(layers), "layers": layers, "dtype": dtype,
            "final_state": "post_norm", "num_target_layers": TARGET_LAYERS}
    w = StoreWriter(folder, meta, shard_bytes=4000, queue_size=1, fsync=False)
    at = 0
    for sid, T in enumerate([5, 12, 3, 9]):
        aux = torch.cat([states[i][at:at + T] for i in layers], dim=-1).to(torch.bfloat16)
        w.add(sid, aux, final[at:at + T], ids[at:at + T], mask[at:at + T])
        at += T
    w.close()
    return StoreReader(folder)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_store_of_more_layers_is_read_by_the_types_columns(tmp_path, dtype):
    """A type reading layers [7, 2, 5] of a store holding [2, 5, 7, 9]: the batch is the one a
    store of [7, 2, 5] alone gives (fp8: the states' scales selected with them)."""
    big = _write_store(tmp_path / "big", [2, 5, 7, 9], dtype)
    small = _write_store(tmp_path / "small", [7, 2, 5], dtype)
    kind, cfg, cpu = _fake_type([7, 2, 5]), Config(), torch.device("cpu")
    for ids in ([0, 1], [3, 2, 1], [1]):
        got = load_batch(big, ids, 8, cpu, cfg, kind)
        want = load_batch(small, ids, 8, cpu)
        assert got.aux.shape == want.aux.shape == (1, got.tokens, 3 * H)
        for key in ("aux", "final", "input_ids", "loss_mask", "position_ids", "doc_ids"):
            assert torch.equal(getattr(got, key), getattr(want, key)), key
        assert torch.equal(load_batch(small, ids, 8, cpu, cfg, kind).aux, want.aux)  # all its layers: as stored
    with pytest.raises(InputError) as e:
        load_batch(small, [0], 8, cpu, cfg, _fake_type([7, 3]))
    assert "\n" not in e.value.line() and "extract.layers" in e.value.line() and "extract.draft_types" in str(e.value)
    assert "[7, 3]" in e.value.line() and "(not [3])" in e.value.line()


def test_eagle3_reads_extract_layers_from_a_store_of_more(tmp_path):
    """The trainer's own type: EAGLE-3 (layers None) reads extract.layers' columns of a store
    that also holds another type's, with its head rows."""
    big = _write_store(tmp_path / "big", [2, 5, 7, 9], "bfloat16")
    small = _write_store(tmp_path / "small", [9, 5, 2], "bfloat16")
    cfg = load_config(None, ["extract.layers=[9, 5, 2]", "train.ttt_steps=2"])
    got, want = (load_batch(s, [1, 3], 16, torch.device("cpu"), cfg) for s in (big, small))
    assert torch.equal(got.aux, want.aux) and list(got.rows) == ["head_rows_0", "head_rows_1", "active_rows"]
    assert all(torch.equal(got.rows[k], want.rows[k]) for k in want.rows)


def test_host_rows_get_a_seed_of_the_run_and_the_micro_batch(tmp_path):
    """The same micro-batch gets the same seed (a resumed run's rows are the first run's);
    another micro-batch, or another train seed, another."""
    store = _write_store(tmp_path / "s", [2, 5, 7], "bfloat16")
    seen = []
    kind = types.SimpleNamespace(NAME="fake", layers=lambda n, cfg: [2, 5, 7],
                                 host_rows=lambda mask, docs, cfg, seed: seen.append(seed) or None)
    for seed, ids in ((1, [0, 1]), (1, [0, 1]), (1, [1, 0]), (2, [0, 1])):
        load_batch(store, ids, 8, torch.device("cpu"), load_config(None, [f"train.seed={seed}"]), kind)
    assert seen[0] == seen[1] and len(set(seen)) == 3


# ---- a checkpoint of another type ---------------------------------------------------------------------

class _Store:
    meta = {"input_hash": "0" * 64}

    def __len__(self) -> int:
        return 20


def _fingerprint(*overrides: str) -> dict:
    model = types.SimpleNamespace(config=DraftConfig(
        hidden_size=64, target_hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=256, draft_vocab_size=128))
    return resume.run_fingerprint(model, _Store(), torch.arange(128), load_config(None, list(overrides)), 1,
                                  torch.device("cpu"))


def test_a_checkpoint_of_another_type_is_not_resumed(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    state = {"fingerprint": _fingerprint(), "epoch": 0, "micro": 1, "schedule": [{"start": 0, "total": 10}]}
    checkpoints.save_checkpoint(tmp_path / resume.CKPT_DIR, 3, model.state_dict(), opt.state_dict(),
                                sched.state_dict(), state, 2)

    def choose(*overrides: str):
        return resume.choose_checkpoint(tmp_path, _fingerprint(*overrides), {}, False, "cpu", TrainSection(), 10, 1,
                                        1e-3)

    assert choose()[0]["name"] == "step-0000003"  # the same type resumes
    with pytest.raises(ResumeError) as e:
        choose("train.algorithm=dflash")
    line = e.value.line()
    assert "\n" not in line and "train.algorithm: 'eagle3' -> 'dflash'" in line and "--force" in line
    assert "dflash.block_size: None -> 16" in line  # the type's own section is the fingerprint's
    assert _fingerprint("train.algorithm=dflash", "dflash.gamma=4")["dflash.gamma"] == 4.0
    assert "dflash.gamma" not in _fingerprint("dflash.gamma=4")  # another type's section: not this run's


# ---- the generic step around the type ---------------------------------------------------------------

def test_host_rows_go_to_the_device_as_the_type_made_them():
    """Batch.rows: the type's dict, its tensors of each dtype sent in one copy, back in its order,
    shapes and values."""
    from eaglet.draft.step import HostRows, send_rows

    rows = {"b": torch.arange(5), "mask": torch.tensor([True, False, True]), "a": torch.arange(6).view(2, 3) * 7,
            "weights": torch.rand(4), "empty": torch.zeros(0, dtype=torch.int64)}
    packed = HostRows.pack(rows)
    assert len(packed.flat) == 3  # one tensor (one copy) per dtype
    got = send_rows(packed, torch.device("cpu"))
    assert list(got) == list(rows)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in rows.items())
    assert HostRows.pack(None) is None and send_rows(None, torch.device("cpu")) is None


def test_the_state_noise_is_added_in_training_only():
    """forward_loss asks the type for its loss; EAGLE-3 adds train.state_noise to the states of
    a draft in training mode only: an evaluation (draft.eval()) sees the states as stored."""
    from eaglet.draft.eagle3.model import Eagle3Draft
    from eaglet.draft.parallelize import parallelize
    from eaglet.draft.step import TeacherHead, forward_loss
    from eaglet.testing.synthetic import synthetic_batch

    dims = DraftConfig(hidden_size=32, target_hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=64, draft_vocab_size=32)
    torch.manual_seed(0)
    head = torch.randn(dims.vocab_size, dims.target_hidden_size)
    par = parallelize(Eagle3Draft(dims), TeacherHead(head, chunk=16), "none", torch.device("cpu"))
    b = synthetic_batch(dims, 64, 32, torch.device("cpu"), torch.float32, seed=1, head=head, ttt_steps=2)
    off = torch.autocast("cpu", enabled=False)

    def total(noise: float, training: bool) -> float:
        cfg = Config(train=TrainSection(ttt_steps=2, attn_impl="chunked", state_noise=noise))
        par.draft.train(training)
        torch.manual_seed(1)
        with torch.no_grad():
            return float(forward_loss(par, par.module, b, cfg, off).total)

    assert total(0.5, training=False) == total(0.0, training=False) == total(0.0, training=True)
    assert total(0.5, training=True) != total(0.0, training=True)
