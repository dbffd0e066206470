"""Shared test fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: OpenMP threads only add overhead (and stall badly on a busy 2-core box).
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """Training runs gc.freeze() what survives their first steps (train.freeze_survivors);
    hand those objects back to the collector after each test, so that a test session does
    not keep every finished run's objects."""
    yield
    import gc

    gc.unfreeze()


def tiny_pipeline_upto_vocab(tmp, conversations: int, seed: int, overrides: list[str]) -> list[str]:
    """A tiny Llama target and `conversations` chat records in `tmp`, run through prepare,
    extract and vocab into tmp/run; returns the overrides (target, data and `overrides`) that
    later runs on a copy of tmp/run take."""
    from eaglet import pipeline
    from eaglet.testing import tiny
    from eaglet.config import load_config

    target = tiny.save_target(tmp / "target", family="llama", template="llama3")
    data = tiny.write_jsonl(tmp / "data.jsonl", tiny.make_conversations(conversations, seed=seed))
    base = [f"target.path={target}", "target.dtype=float32", f"prepare.data=[{data}]", *overrides]
    pipeline.run_all(load_config(None, [f"run.dir={tmp / 'run'}", *base]), upto="vocab")
    return base


def train_on_copy(tmp, base: list[str], name: str, *extra: str, fresh: bool = True) -> tuple:
    """Train on a copy (tmp/name) of `tiny_pipeline_upto_vocab`'s tmp/run with `base` and `extra`
    overrides (fresh False: in tmp/name as it is, e.g. to resume it); returns (the run folder,
    its train/log.jsonl records)."""
    import json
    import shutil

    from eaglet import pipeline
    from eaglet.config import load_config

    run = tmp / name
    if fresh:
        shutil.copytree(tmp / "run", run)
    pipeline.run_all(load_config(None, [f"run.dir={run}", *base, *extra]), upto="train")
    return run, [json.loads(x) for x in (run / "train" / "log.jsonl").read_text().splitlines()]


def killed_copy(src, dst, after: int):
    """Run folder `src` copied to `dst` as a kill just after its checkpoint of step `after`
    would have left it: later checkpoints, the final draft and the manifest removed."""
    import shutil

    from eaglet.formats import checkpoints as ck

    shutil.copytree(src, dst)
    for p in ck.checkpoints(dst / "train" / "checkpoints"):
        if int(p.name.split("-")[1]) > after:
            shutil.rmtree(p)
    shutil.rmtree(dst / "train" / "final")
    (dst / "train" / "manifest.json").unlink()
    return dst


def run_script(path, args: list[str]) -> None:
    """Run the script `path` with command-line `args` in this process, as `python path args`
    would (its `__main__` block runs; nothing is imported from it): the benchmarks' tests, without
    a new interpreter's start for each."""
    import runpy
    import sys

    argv = sys.argv
    sys.argv = [str(path), *args]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        assert not e.code, f"{path} {args}: exit {e.code}"
    finally:
        sys.argv = argv
