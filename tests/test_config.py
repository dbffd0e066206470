"""The typed run config: defaults, YAML, overrides, and errors that name the key."""

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
    from pathlib import Path

    from eaglet.config import config_page

    page = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    assert page == config_page(), "regenerate it: python -m eaglet.config > docs/config.md"
    assert "regenerate:\n" in page and "  max_new_tokens: 512" in page


def test_regenerate_flags_set_the_regenerate_section(tmp_path, monkeypatch):
    """`eaglet regenerate`'s flags are shortcuts for the regenerate section's keys: the config's
    values hold unless a flag is given; without an output anywhere it is a config error."""
    from eaglet.stages import regenerate

    seen = []
    monkeypatch.setattr(cli, "run_regenerate", lambda cfg, **kw: seen.append(cfg.regenerate))
    path = tmp_path / "run.yaml"
    path.write_text("regenerate:\n  out: from-config.jsonl\n  max_new_tokens: 64\n  engine: continuous\n")
    assert cli.main(["regenerate", str(path)]) == 0
    assert cli.main(["regenerate", str(path), "--out", "flag.jsonl", "--max-new-tokens", "8", "--shard", "1/4",
                     "--temperature", "0.5"]) == 0
    (a, b) = seen
    assert (a.out, a.max_new_tokens, a.engine, a.shard) == ("from-config.jsonl", 64, "continuous", None)
    assert (b.out, b.max_new_tokens, b.engine, b.shard, b.temperature) == ("flag.jsonl", 8, "continuous", "1/4", 0.5)
    assert cli.main(["regenerate", str(path), "--engine", "fast"]) == 2  # a value the section does not take
    with pytest.raises(ConfigError, match="regenerate.out"):
        regenerate.run_regenerate(load_config(None))
