"""The typed run config: defaults, YAML, overrides, and errors that name the key."""

from pathlib import Path

import pytest

from eaglet import cli
from eaglet.config import Config, ConfigError, all_keys, describe_defaults, load_config


def test_defaults_and_every_key_documented():
    cfg = load_config()
    assert cfg.extract.batch_tokens == 16384 and cfg.extract.layers is None
    text = describe_defaults()
    for key in all_keys():
        section, name = key.split(".")
        assert f"  {name}:" in text
    import dataclasses
    for f in dataclasses.fields(Config):
        for sub in dataclasses.fields(getattr(Config(), f.name)):
            assert sub.metadata.get("doc"), f"{f.name}.{sub.name} has no doc"


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("target:\n  path: /models/x\nextract:\n  layers: [1, 5, 9]\n")
    cfg = load_config(p, ["extract.batch_tokens=8192", "prepare.overflow=drop", "extract.shard_mb=3"])
    assert cfg.target.path == "/models/x"
    assert cfg.extract.layers == [1, 5, 9]
    assert cfg.extract.batch_tokens == 8192
    assert cfg.prepare.overflow == "drop"
    assert cfg.extract.shard_mb == 3.0 and isinstance(cfg.extract.shard_mb, float)
    assert load_config(p, ["extract.layers=null"]).extract.layers is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("extract.batch_token=5", "did you mean 'extract.batch_tokens'"),
        ("extrct.batch_tokens=5", "did you mean 'extract'"),
        ("extract.batch_tokens=many", "extract.batch_tokens: expected int"),
        ("extract.batch_tokens=true", "extract.batch_tokens: expected int"),
        ("prepare.overflow=cut", "prepare.overflow: expected one of 'truncate' | 'drop'"),
        ("extract.layers=[1, x]", "extract.layers[1]: expected int"),
        ("target.trust_remote_code=1", "target.trust_remote_code: expected bool"),
        ("batch_tokens=5", "the key must be section.key"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("|", r"\|")):
        load_config(None, [override])


def test_unknown_key_in_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("vocab:\n  sise: 100\n")
    with pytest.raises(ConfigError, match=r"unknown key 'vocab.sise'.*vocab.size"):
        load_config(p)


def test_cli_config_error_exit_code(capsys):
    assert cli.main(["config", "--set", "vocab.sise=3"]) == 2
    assert "vocab.size" in capsys.readouterr().err


def test_every_option_has_help():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.dest != "help":
                assert action.help, f"eaglet {name}: option {action.dest} has no help"


def test_the_config_page_is_current():
    """docs/config.md is generated from the config's own defaults and docs."""
    from eaglet.config import config_page

    page = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    assert page == config_page(), "regenerate it: python -m eaglet.config > docs/config.md"
    assert "regenerate:\n" in page and "  max_new_tokens: 512" in page


def test_regenerate_flags_set_the_regenerate_section(tmp_path, monkeypatch):
    """`eaglet regenerate`'s flags are shortcuts for the regenerate section's keys: the config's
    values hold unless a flag is given; without an output anywhere it is a config error. The
    file's relative out is taken against its folder, the flag's against the working directory."""
    from eaglet.stages import regenerate

    monkeypatch.chdir(tmp_path.parent)
    seen = []
    monkeypatch.setattr(cli, "run_regenerate", lambda cfg, **kw: seen.append(cfg.regenerate))
    path = tmp_path / "run.yaml"
    path.write_text("regenerate:\n  out: from-config.jsonl\n  max_new_tokens: 64\n  engine: continuous\n")
    assert cli.main(["regenerate", str(path)]) == 0
    assert cli.main(["regenerate", str(path), "--out", "flag.jsonl", "--max-new-tokens", "8", "--shard", "1/4",
                     "--temperature", "0.5"]) == 0
    (a, b) = seen
    assert (a.out, a.max_new_tokens, a.engine, a.shard) == (str(tmp_path / "from-config.jsonl"), 64, "continuous", None)
    assert (b.out, b.max_new_tokens, b.engine, b.shard, b.temperature) == (
        str(tmp_path.parent / "flag.jsonl"), 8, "continuous", "1/4", 0.5)
    assert cli.main(["regenerate", str(path), "--engine", "fast"]) == 2  # a value the section does not take
    with pytest.raises(ConfigError, match="regenerate.out"):
        regenerate.run_regenerate(load_config(None))


# ---- value ranges -----------------------------------------------------------------------------

DEVICES = "auto, cpu, cuda, cuda:N, mps, xpu[:N], npu[:N], hpu[:N]"
OUT_OF_RANGE = [
    ("train.eval_fraction", "1.5", "train.eval_fraction: 1.5 is not in [0, 1)"),
    ("train.eval_fraction", "1", "train.eval_fraction: 1.0 is not in [0, 1)"),
    ("extract.batch_tokens", "0", "extract.batch_tokens: 0 is not >= 1"),
    ("extract.shard_mb", "-1", "extract.shard_mb: -1.0 is not > 0"),
    ("extract.shard_mb", "0", "extract.shard_mb: 0.0 is not > 0"),
    ("vocab.size", "0", "vocab.size: 0 is not >= 1"),
    ("train.ttt_steps", "0", "train.ttt_steps: 0 is not >= 1"),
    ("train.lr", "-1", "train.lr: -1.0 is not > 0"),
    ("train.lr", "0", "train.lr: 0.0 is not > 0"),
    ("train.ckpt_every", "0", "train.ckpt_every: 0 is not >= 1"),
    ("train.keep_last", "0", "train.keep_last: 0 is not >= 1"),
    ("train.betas", "[0.9]", "train.betas: [0.9] is not a list of 2 values"),
    ("train.betas", "[0.9, 0.95, 0.99]", "train.betas: [0.9, 0.95, 0.99] is not a list of 2 values"),
    ("train.betas", "[0.9, 1.0]", "train.betas[1]: 1.0 is not in [0, 1)"),
    ("train.betas", "[-0.1, 0.9]", "train.betas[0]: -0.1 is not in [0, 1)"),
    ("train.grad_accum", "0", "train.grad_accum: 0 is not >= 1"),
    ("train.epochs", "0", "train.epochs: 0 is not >= 1"),
    ("train.max_steps", "0", "train.max_steps: 0 is not >= 1"),
    ("train.log_every", "0", "train.log_every: 0 is not >= 1"),
    ("train.gamma", "0", "train.gamma: 0.0 is not in (0, 1]"),
    ("train.min_lr_ratio", "2", "train.min_lr_ratio: 2.0 is not in [0, 1]"),
    ("prepare.max_length", "1", "prepare.max_length: 1 is not >= 2"),
    ("prepare.num_workers", "-1", "prepare.num_workers: -1 is not >= 0"),
    ("extract.layers", "[2, -1]", "extract.layers[1]: -1 is not >= 0"),
    ("extract.writer_queue", "0", "extract.writer_queue: 0 is not >= 1"),
    ("eval.temperature", "-0.5", "eval.temperature: -0.5 is not >= 0"),
    ("regenerate.max_turns", "0", "regenerate.max_turns: 0 is not >= 1"),
    ("train.lr", ".inf", "train.lr: expected a finite number, got inf"),
    # seeds reach numpy's and torch's generators (numpy's legacy seed takes 32 bits; eval derives torch's from it)
    ("run.seed", "99999999999999999999", "run.seed: 99999999999999999999 is not in [0, 4294967295]"),
    ("train.seed", "4294967296", "train.seed: 4294967296 is not in [0, 4294967295]"),
    ("run.seed", "-1", "run.seed: -1 is not in [0, 4294967295]"),
    # every integer becomes a numpy or torch int64 somewhere
    ("train.max_tokens", "99999999999999999999", "train.max_tokens: 99999999999999999999 does not fit a 64-bit integer"),
    ("eval.max_new_tokens", "9223372036854775808", "eval.max_new_tokens: 9223372036854775808 does not fit a 64-bit integer"),
    # a million draft layers: the doctor's meta skeleton alone took minutes
    ("train.draft_layers", "1000000", "train.draft_layers: 1000000 is not in [1, 64]"),
    # a device torch cannot read failed only when the stage reached torch.device (exit 70)
    ("train.device", "changed", "train.device: 'changed' is not one of " + DEVICES),
    ("eval.device", "cuda:x", "eval.device: 'cuda:x' is not one of " + DEVICES),
    ("target.device", "gpu", "target.device: 'gpu' is not one of " + DEVICES),
]


@pytest.mark.parametrize("key, value, message", OUT_OF_RANGE)
def test_values_out_of_range_name_the_key_in_file_and_override(tmp_path, key, value, message):
    """Where the config is read: from --set, and from the file (which the message then names)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={value}"])
    assert e.value.message == message
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.message == f"{message}, in {path}" and e.value.fix


@pytest.mark.parametrize("key, value", [("train.eval_fraction", "0"), ("train.eval_fraction", "0.99"),
                                        ("train.max_steps", "null"), ("train.betas", "[0, 0.999]"),
                                        ("train.gamma", "1"), ("train.grad_clip", "0"), ("extract.selfcheck_samples", "0"),
                                        ("train.eval_every", "0"), ("prepare.max_length", "2"),
                                        ("run.seed", "4294967295"), ("train.seed", "0"),
                                        ("train.max_steps", "9223372036854775807"), ("train.device", "cuda:1"),
                                        ("eval.device", "cpu"), ("target.device", "auto"), ("train.device", "mps")])
def test_values_at_the_edge_of_their_range_are_accepted(key, value):
    load_config(None, [f"{key}={value}"])


def test_every_numeric_field_has_a_range_its_default_is_in_and_the_docs_show():
    import dataclasses
    import typing

    from eaglet.config import Range, _check, _sections, config_page

    page = config_page()
    for sname, cls in _sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not any(t in str(hints[f.name]) for t in ("int", "float")) or "Literal" in str(hints[f.name]):
                continue
            rng = f.metadata.get("check")
            assert isinstance(rng, Range), f"{sname}.{f.name} has no range"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            _check(f"{sname}.{f.name}", default, rng)
            section = page.split(f"\n{sname}:\n")[1]  # the key's own section: eval and regenerate share names
            assert str(rng) in section.split(f"  {f.name}:")[0].rsplit("\n", 2)[-2], f"{sname}.{f.name}: range not in docs"


def test_float_forms_people_write(tmp_path):
    """YAML 1.1 reads 1e-3 and 1E-4 as strings: a float field takes them, from the file and --set."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1e-3\n  weight_decay: 1E-4\n  min_lr_ratio: 3.0e-5\n  grad_clip: 1\n"
                    "extract:\n  shard_mb: 2\n  selfcheck_min_cosine: .5\n")
    cfg = load_config(path)
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.min_lr_ratio, cfg.train.grad_clip) == (1e-3, 1e-4, 3e-5, 1.0)
    assert (cfg.extract.shard_mb, cfg.extract.selfcheck_min_cosine) == (2.0, 0.5)
    assert all(isinstance(v, float) for v in (cfg.train.lr, cfg.train.weight_decay, cfg.train.grad_clip))
    cfg = load_config(None, ["train.lr=1e-3", "train.gamma=+8E-1", "train.betas=[9e-1, 95e-2]"])
    assert (cfg.train.lr, cfg.train.gamma, cfg.train.betas) == (1e-3, 0.8, [0.9, 0.95])
    for bad in ("train.lr=1e-3x", "train.lr=e-3", "train.lr=one", "train.epochs=1e1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])


def test_cli_range_error_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  ckpt_every: 0\n")
    assert cli.main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"eaglet: train.ckpt_every: 0 is not >= 1, in {path}; set a value >= 1"]


# ---- relative paths -----------------------------------------------------------------------------


def test_relative_paths_in_a_file_resolve_against_its_folder(tmp_path, monkeypatch):
    folder, elsewhere = tmp_path / "cfg", tmp_path / "cwd"
    (folder / "models" / "local").mkdir(parents=True)
    (folder / "org").mkdir()  # "org/name" is a path only where it exists
    (folder / "org" / "here").mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = folder / "c.yaml"
    path.write_text(
        "run: {dir: runs/x}\n"
        "target: {path: models/local, tokenizer: org/name, chat_template: t.jinja, gguf_file: m.gguf}\n"
        "prepare: {data: [a.jsonl, ../b.jsonl, /abs/c.jsonl, sub/../d.jsonl]}\n"
        "extract: {vllm_storage: states}\ntrain: {init_from: ../draft}\nregenerate: {out: regen.jsonl}\n")
    cfg = load_config(path, ["eval.num_prompts=3"])
    assert cfg.paths() == [
        ("run.dir", str(folder / "runs" / "x")),
        ("target.path", str(folder / "models" / "local")),
        ("target.gguf_file", str(folder / "models" / "local" / "m.gguf")),
        ("target.tokenizer", "org/name"),  # a hub id: no folder of that name under the config's folder
        ("target.chat_template", str(folder / "t.jinja")),
        ("prepare.data[0]", str(folder / "a.jsonl")),
        ("prepare.data[1]", str(tmp_path / "b.jsonl")),
        ("prepare.data[2]", "/abs/c.jsonl"),
        ("prepare.data[3]", str(folder / "d.jsonl")),
        ("extract.vllm_storage", str(folder / "states")),
        ("train.init_from", str(tmp_path / "draft")),
        ("regenerate.out", str(folder / "regen.jsonl")),
    ]
    assert cfg.run_dir == folder / "runs" / "x"
    # a hub-id-shaped value that exists under the folder, or starts with ./, is a path
    path.write_text("target: {path: org/here, tokenizer: ./org/name}\n")
    cfg = load_config(path)
    assert (cfg.target.path, cfg.target.tokenizer) == (str(folder / "org" / "here"), str(folder / "org" / "name"))
    # --set and the defaults: against the working directory, where the user typed them
    cfg = load_config(path, ["target.path=./models/local", "prepare.data=[a.jsonl]", "target.tokenizer=HuggingFaceTB/x"])
    assert (cfg.target.path, cfg.prepare.data, cfg.run.dir) == (
        str(elsewhere / "models" / "local"), [str(elsewhere / "a.jsonl")], str(elsewhere / "runs" / "default"))
    assert cfg.target.tokenizer == "HuggingFaceTB/x"


def test_cli_config_prints_resolved_paths(tmp_path, monkeypatch, capsys):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    path = tmp_path / "c.yaml"
    path.write_text("prepare: {data: [d.jsonl]}\n")
    assert cli.main(["config", str(path)]) == 0
    assert f"- {tmp_path / 'd.jsonl'}\n" in capsys.readouterr().out


def test_the_example_config_works_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    example = Path(__file__).parent.parent / "examples" / "tiny" / "config.yaml"
    cfg = load_config(example)
    assert (Path(cfg.target.path) / "config.json").is_file()
    assert all(Path(f).is_file() for f in cfg.prepare.data) and cfg.prepare.data
    assert Path(cfg.run.dir).is_relative_to(example.parent)


def test_a_bare_on_or_off_is_the_setting_not_a_boolean(tmp_path):
    from eaglet.config import load_config

    cfg = load_config(None, ["eval.vllm=on", "train.compile=off"])
    assert (cfg.eval.vllm, cfg.train.compile) == ("on", "off")
    path = tmp_path / "c.yaml"
    path.write_text("eval:\n  vllm: off\n")
    assert load_config(path, []).eval.vllm == "off"


# ---- every key that can hold a path ---------------------------------------------------------------

# The keys whose type takes free text and that are not paths, each reviewed: a new text key must be
# marked with its path kind (config._f's `path`) or added here with the reason.
NOT_PATHS = {
    "run.preset": "a preset's name (cpu)",
    "extract.backend": "an engine's name in the registry (eaglet/engines/__init__.py)",
    "extract.draft_types": "draft types' names in the registry (eaglet/draft/__init__.py)",
    "train.algorithm": "a draft type's name in the registry (eaglet/draft/__init__.py)",
    "target.device_map": "a transformers device_map ('auto', 'balanced', ...)",
    "target.attn_implementation": "a transformers attention implementation's name",
    "target.revision": "a branch, tag or commit of the hub repository",
    "extract.vllm_engine_args": "vllm.LLM's keyword arguments, handed to vLLM as written",
    "extract.vllm_server": "a URL",
    "extract.vllm_server_api_key_env": "an environment variable's name",
    "export.formats": "format names",
    "export.verifier_name_or_path": "the target as the serving machine names it, written as given",
    "eval.vllm_engine_args": "vllm.LLM's keyword arguments, handed to vLLM as written",
    "regenerate.shard": "'R/N'",
    "regenerate.url": "a URL",
    "regenerate.model": "the served model's name",
    "regenerate.api_key_env": "an environment variable's name",
}


def _fields():
    """(key, field, type) of every config key."""
    import dataclasses
    import typing

    for section in dataclasses.fields(Config):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield f"{section.name}.{f.name}", f, hints[f.name]


def _takes_text(tp):
    """Whether a value of type `tp` may be any string (or a list or mapping of them)."""
    import typing

    if tp is str or typing.get_origin(tp) is dict:
        return True
    return any(_takes_text(a) for a in typing.get_args(tp)) if typing.get_origin(tp) is not typing.Literal else False


def test_every_key_that_can_hold_a_path_is_marked():
    from eaglet.config import Pattern

    text = {k for k, f, tp in _fields() if _takes_text(tp) and not isinstance(f.metadata["check"], Pattern)}
    marked = {k for k, f, _ in _fields() if f.metadata["path"]}
    assert text - marked == set(NOT_PATHS), "a text key is neither marked as a path nor reviewed in NOT_PATHS"
    assert {"eval.prompts", "eval.draft", "regenerate.out", "extract.stream_dir", "train.compile_cache",
            "train.init_from", "target.gguf_file"} <= marked


def test_each_path_key_resolves_against_the_config_files_folder_and_set_against_the_cwd(tmp_path, monkeypatch, capsys):
    import typing

    import yaml

    from eaglet.config import IN_TARGET, MODEL

    folder, elsewhere = tmp_path / "configs" / "sub", tmp_path / "cwd"
    (folder / "rel" / "v").mkdir(parents=True)
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    keys = [(k, f, typing.get_origin(tp) is list) for k, f, tp in _fields() if f.metadata["path"]]
    # a MODEL value shaped like a hub id is a path where it exists (rel/v does) or starts with ./
    relative = {k: ("./rel/v" if f.metadata["path"] == MODEL else "rel/v") for k, f, _ in keys}
    written = {k: [relative[k]] if many else relative[k] for k, _, many in keys}
    data = {}
    for k, _, _ in keys:
        section, name = k.split(".")
        data.setdefault(section, {})[name] = written[k]
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    paths = dict(cfg.paths())
    assert cli.main(["config", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)  # `eaglet config FILE`: the resolved config
    for k, f, many in keys:
        section, name = k.split(".")
        value = getattr(getattr(cfg, section), name)
        got, label = (value[0], f"{k}[0]") if many else (value, k)
        assert printed[section][name] == value, k
        if f.metadata["path"] == IN_TARGET:  # a name inside target.path, wherever the config or the cwd is
            assert (got, paths[label]) == ("rel/v", str(folder / "rel" / "v" / "rel" / "v")), k
            assert getattr(getattr(load_config(path, [f"{k}=rel/v"]), section), name) == "rel/v", k
            continue
        assert got == paths[label] == str(folder / "rel" / "v"), k
        again = getattr(getattr(load_config(path, [f"{k}={written[k]}"]), section), name)
        assert (again[0] if many else again) == str(elsewhere / "rel" / "v"), k
        for word in f.metadata["words"]:  # eval.prompts heldout / mt_bench stay words, in the file and --set
            path.write_text(yaml.safe_dump({section: {name: word}}))
            assert getattr(getattr(load_config(path), section), name) == word, (k, word)
            assert getattr(getattr(load_config(None, [f"{k}={word}"]), section), name) == word, (k, word)
            assert k not in dict(load_config(path).paths()), (k, word)
        path.write_text(yaml.safe_dump(data))


# ---- presets ------------------------------------------------------------------------------------

def _preset_keys(name):
    from eaglet.config import PRESETS

    return [(s, k, v) for s, values in PRESETS[name].items() for k, v in values.items()]


def test_the_cpu_preset_applies_under_the_file_and_set(tmp_path):
    """A preset's values replace the defaults; every key a file sets and every --set win over it,
    named by --preset or by the file's run.preset (which --set run.preset=null drops)."""
    cfg = load_config(None, preset="cpu")
    assert cfg.run.preset == "cpu" and load_config().run.preset is None
    for s, k, v in _preset_keys("cpu"):
        assert getattr(getattr(cfg, s), k) == v != getattr(getattr(Config(), s), k), (s, k)
    assert cfg.train.lr == Config().train.lr  # a key the preset leaves alone keeps its default

    path = tmp_path / "my.yaml"
    path.write_text("prepare:\n  max_length: 2048\ntrain:\n  ttt_steps: 5\n")
    cfg = load_config(path, ["vocab.size=2048"], preset="cpu")
    assert (cfg.prepare.max_length, cfg.train.ttt_steps, cfg.vocab.size) == (2048, 5, 2048)  # the file's, --set's
    assert (cfg.train.max_tokens, cfg.extract.batch_tokens, cfg.run.preset) == (1024, 4096, "cpu")  # the preset's

    path.write_text("run:\n  preset: cpu\ntrain:\n  ttt_steps: 5\n")  # named in the file: applied under it
    cfg = load_config(path)
    assert (cfg.run.preset, cfg.train.ttt_steps, cfg.train.max_tokens) == ("cpu", 5, 1024)
    cfg = load_config(path, ["run.preset=null"])
    assert (cfg.run.preset, cfg.train.ttt_steps, cfg.train.max_tokens) == (None, 5, 8192)


def test_an_unknown_preset_is_one_line_naming_the_valid_ones(tmp_path, capsys):
    assert cli.main(["config", "--preset", "gpu"]) == 2
    err = capsys.readouterr().err
    assert err == ("eaglet: unknown preset 'gpu', in --preset; use one of: cpu; leave it out for the defaults, "
                   "sized for a GPU\n")
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  preset: tiny\n")
    assert cli.main(["doctor", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"eaglet: unknown preset 'tiny', in run.preset, in {path}; use one of: cpu")


def test_every_command_that_reads_a_config_takes_the_preset(tmp_path, capsys):
    """--preset on each of them; `eaglet config FILE --preset cpu` prints the resolved values."""
    import yaml

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        if any(a.dest == "config" for a in sub._actions):
            assert any("--preset" in a.option_strings for a in sub._actions), name
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  ttt_steps: 5\n")
    assert cli.main(["config", str(path), "--preset", "cpu"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["run"]["preset"] == "cpu" and printed["train"]["ttt_steps"] == 5
    assert printed["train"]["max_tokens"] == 1024 and printed["vocab"]["size"] == 1024


def test_a_stage_records_its_preset_and_hashes_only_the_values(tmp_path):
    """The manifest names the preset (run.preset in its config); the input hash covers the values:
    the same values set key by key, without the preset, leave the stage up to date."""
    import yaml

    from eaglet import pipeline
    from eaglet.testing import tiny

    target = tiny.save_target(tmp_path / "t", family="llama", template="chatml")
    data = tiny.write_jsonl(tmp_path / "d.jsonl", tiny.make_conversations(6, seed=1))
    base = [f"run.dir={tmp_path / 'run'}", f"target.path={target}", f"prepare.data=[{data}]"]
    first = pipeline.run_stage(load_config(None, base, preset="cpu"), "prepare", preflight=False)
    assert first["config"]["run"]["preset"] == "cpu" and first["config"]["prepare"]["max_length"] == 256
    same = [f"{s}.{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
            for s, k, v in _preset_keys("cpu")]
    again = pipeline.run_stage(load_config(None, base + same), "prepare", preflight=False)
    assert again["started"] == first["started"] and again["input_hash"] == first["input_hash"]  # skipped
