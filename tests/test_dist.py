"""torchrun on the CPU: two processes, the gloo backend, the tiny target.

One torchrun job (tests/torchrun_steps.py) runs every two-rank step; the references run in
this process with one rank:
- extraction with two ranks (data parallel) stores exactly what one rank stores, in shards
  of both ranks under one index; killed (debris of both ranks) and rerun, it resumes; a
  rerun with one rank resumes a two-rank store;
- DDP training with grad_accum 1 on two ranks logs the same losses as one process with
  grad_accum 2 (the same micro-batches in the same steps); FSDP2 too, and it holds the frozen
  embedding and teacher head sharded;
- checkpoints resume on two ranks and in one process, under DDP, FSDP2 or neither, with the
  same micro-batches per step (the resumed process runs only the steps after the checkpoint),
  and are refused, naming the grad_accum to use, with another;
- tensor-parallel extraction (transformers' tp_plan) matches one rank;
- bench/scaling.py runs;
- a step whose gradient is not finite on one rank is skipped by every rank (ddp, fsdp);
- a rank destroys its process group at exit, unless it failed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from eaglet import pipeline
from eaglet.testing import tiny
from eaglet.config import load_config
from eaglet.distributed import DistEnv
from eaglet.draft.parallelize import resolve_strategy
from eaglet.errors import ResumeError
from eaglet.formats.store import StoreReader

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
REPO = Path(__file__).resolve().parent.parent
STEPS = Path(__file__).resolve().parent / "torchrun_steps.py"


def _config(root: Path, name: str, target: Path, data: Path, **sections) -> Path:
    cfg = {
        "run": {"dir": str(root / name), "seed": 0},
        "target": {"path": str(target), "dtype": "float32", "device": "cpu"},
        "prepare": {"data": [str(data)], "max_length": 256},
        "extract": {"batch_tokens": 1024, "shard_mb": 0.05, "store_dtype": "float32", "fsync": False},
        "vocab": {"size": 128},
        # A constant learning rate after warmup: runs of other lengths train the same steps.
        "train": {"max_steps": 4, "max_tokens": 256, "ttt_steps": 2, "log_every": 1, "eval_every": 4,
                  "ckpt_every": 4, "warmup_steps": 2, "min_lr_ratio": 1.0, "lr": 1e-3, "tensorboard": False,
                  "device": "cpu"},
    }
    for section, values in sections.items():
        cfg[section].update(values)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _torchrun(*groups: list[str]) -> None:
    args = [a for g in groups for a in ["---", *g]][1:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(STEPS), *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _copy_stages(src: Path, dst: Path, stages: list[str]) -> None:
    for s in stages:
        shutil.copytree(src / s, dst / s)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    target = tiny.save_target(root / "target", family="llama", template="chatml")
    data = tiny.write_jsonl(root / "data.jsonl", tiny.make_conversations(120, seed=3))
    cfgs = {
        "one": _config(root, "one", target, data, train={"grad_accum": 2, "max_steps": 8}),
        "ddp": _config(root, "ddp", target, data),
        "fsdp": _config(root, "fsdp", target, data, train={"parallel": "fsdp"}),
        "tp": _config(root, "tp", target, data, extract={"tp_plan": "auto"}),
        "killed": _config(root, "killed", target, data),
    }
    pipeline.run_all(load_config(cfgs["one"]), upto="train", preflight=False)  # the one-rank reference
    _copy_stages(root / "one", root / "fsdp", ["prepare", "extract", "vocab"])
    _copy_stages(root / "one", root / "tp", ["prepare"])
    killed = root / "killed" / "extract"
    _torchrun(
        ["run", str(cfgs["ddp"]), "--until", "train", "--skip-preflight"],
        ["cp", str(root / "ddp"), str(root / "killed")],
        # What a kill of both ranks can leave: no index or manifest, a shard of rank 1 without its
        # sidecar (unfinished), a sidecar of rank 0 without its shard.
        ["rm", *(str(killed / f) for f in ("manifest.json", "index.json", "shard-r1-000001.json",
                                           "shard-r0-000002.safetensors"))],
        ["extract", str(cfgs["killed"]), "--skip-preflight"],
        # The same two ranks resume the DDP checkpoint of step 4, under FSDP2, to step 6.
        ["train", str(cfgs["killed"]), "--skip-preflight", "--extend", "--set", "train.max_steps=6", "--set",
         "train.parallel=fsdp"],
        ["train", str(cfgs["fsdp"]), "--skip-preflight"],
        ["extract", str(cfgs["tp"]), "--skip-preflight"],
        ["bench", "--device", "cpu", "--preset", "tiny", "--max-tokens", "128", "--ttt-steps", "2", "--warmup", "1",
         "--steps", "1", "--out", str(root / "scaling.json")],
    )
    return root, cfgs


def _log(run: Path, split: str = "train") -> list[dict]:
    lines = [json.loads(ln) for ln in (run / "train" / "log.jsonl").read_text().splitlines()]
    return [r for r in lines if r["split"] == split]


def _stats(run: Path) -> dict:
    return json.loads((run / "train" / "manifest.json").read_text())["stats"]


def _ran_after(stats: dict, step: int, steps: int) -> None:
    """The run resumed the checkpoint of `step` and took `steps` optimizer steps itself."""
    assert stats["resumed"]["from_step"] == stats["started_at_step"] == step
    assert stats["steps_run"] == steps and stats["steps"] == step + steps


def _same_losses(got: list[dict], want: list[dict], rel: float, acc: float = 1e-9) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for k in ("loss", "loss_0", "loss_1"):
            assert g[k] == pytest.approx(w[k], rel=rel), (g["step"], k)
        for k in ("acc_0", "acc_1"):
            assert g[k] == pytest.approx(w[k], abs=acc), (g["step"], k)


def _stores_equal(a: StoreReader, b: StoreReader, exact: bool) -> None:
    assert a.sample_ids.tolist() == b.sample_ids.tolist()
    for sid in a.sample_ids.tolist():
        x, y = a.get(sid), b.get(sid)
        for k in x:
            if exact or k in ("input_ids", "loss_mask"):
                assert torch.equal(x[k], y[k]), (sid, k)
            else:  # other batches or a split model: fp32 sums in another order
                torch.testing.assert_close(x[k], y[k], rtol=1e-5, atol=1e-5)


def test_two_rank_extraction_stores_exactly_what_one_rank_stores(runs):
    root, _ = runs
    store = StoreReader(root / "ddp" / "extract")
    assert store.verify_all()["bad"] == []
    files = [s["file"] for s in store.index["shards"]]
    assert any(f.startswith("shard-r0-") for f in files) and any(f.startswith("shard-r1-") for f in files)
    stats = json.loads((root / "ddp" / "extract" / "manifest.json").read_text())["stats"]
    assert stats["world_size"] == 2 and stats["parallel"] == "data"
    # Every sample went through the same batch as with one rank: bit for bit the same states.
    _stores_equal(store, StoreReader(root / "one" / "extract"), exact=True)


def test_two_rank_extraction_killed_then_rerun_resumes_each_rank(runs):
    root, _ = runs
    store = StoreReader(root / "killed" / "extract")
    assert store.verify_all()["bad"] == []
    stats = json.loads((root / "killed" / "extract" / "manifest.json").read_text())["stats"]
    assert 0 < stats["resumed_samples"] < stats["samples"]  # the rerun kept finished shards of both ranks
    assert stats["new_tokens"] < stats["tokens"]
    # A resume recomputes whole batches of the one plan: bit for bit a fresh run's states.
    _stores_equal(store, StoreReader(root / "one" / "extract"), exact=True)


def test_two_rank_store_resumed_by_one_rank(runs, tmp_path):
    # World sizes may change between runs: finished shards of any rank count as done.
    root, cfgs = runs
    shutil.copytree(root / "ddp", tmp_path / "ddp")
    store = tmp_path / "ddp" / "extract"
    for f in ("manifest.json", "index.json", "shard-r1-000000.json"):
        (store / f).unlink()
    cfg = load_config(cfgs["ddp"], [f"run.dir={tmp_path / 'ddp'}"])
    stats = pipeline.run_stage(cfg, "extract", preflight=False)["stats"]
    assert 0 < stats["resumed_samples"] < stats["samples"] and stats["world_size"] == 1
    _stores_equal(StoreReader(store), StoreReader(root / "one" / "extract"), exact=True)


def test_ddp_two_ranks_train_like_one_process_with_the_same_global_batch(runs):
    root, _ = runs
    one, ddp = _log(root / "one"), _log(root / "ddp")
    _same_losses(ddp, one[:4], rel=1e-6)
    _same_losses(_log(root / "ddp", "eval"), [r for r in _log(root / "one", "eval") if r["step"] == 4], rel=1e-5)
    stats = json.loads((root / "ddp" / "train" / "manifest.json").read_text())["stats"]
    assert stats["parallel"] == "ddp" and stats["world_size"] == 2
    assert ddp[-1]["tokens_per_s"] > 0


def test_fsdp_two_ranks_train_like_one_process_and_shard_the_frozen_parts(runs):
    root, _ = runs
    _same_losses(_log(root / "fsdp"), _log(root / "one")[:4], rel=1e-5)
    stats = json.loads((root / "fsdp" / "train" / "manifest.json").read_text())["stats"]
    held, full = stats["held_parameters_rank0"], stats["parameters_trainable"]
    assert stats["parallel"] == "fsdp"
    assert held["trained"] < 0.6 * full  # half of every weight, plus padding of odd row counts
    assert held["embedding"] == held["teacher_head"] == 512 * 64 // 2  # at rest, sharded over 2 ranks
    final = json.loads((root / "fsdp" / "train" / "final" / "draft_config.json").read_text())
    assert final["draft"]["hidden_size"] == 64  # final/ is the full draft, written once


def test_two_rank_checkpoint_resumes_in_one_process_with_the_same_global_batch(runs, tmp_path):
    root, cfgs = runs
    shutil.copytree(root / "ddp", tmp_path / "ddp")
    cfg = load_config(cfgs["ddp"], [f"run.dir={tmp_path / 'ddp'}", "train.grad_accum=2", "train.max_steps=8"])
    stats = pipeline.run_stage(cfg, "train", preflight=False, extend=True)["stats"]
    _ran_after(stats, 4, 4)
    assert stats["resumed"]["changed"] == {"world_size": [2, 1]}
    _same_losses(_log(tmp_path / "ddp"), _log(root / "one"), rel=1e-6)  # steps 1-4 on 2 ranks, 5-8 on one


def test_checkpoints_move_between_strategies_and_world_sizes(runs, tmp_path):
    # ddp on 2 ranks (steps 1-4) -> fsdp on 2 ranks (5-6) -> one process (7-8): the same run.
    # Its store was re-extracted after the kill, so values agree to float rounding only.
    root, cfgs = runs
    two = _log(root / "killed")
    assert [r["step"] for r in two] == list(range(1, 7))
    _ran_after(_stats(root / "killed"), 4, 2)
    assert _stats(root / "killed")["resumed"]["changed"] == {"train.parallel": ["auto", "fsdp"]}
    shutil.copytree(root / "killed", tmp_path / "killed")
    cfg = load_config(cfgs["killed"], [f"run.dir={tmp_path / 'killed'}", "train.grad_accum=2", "train.max_steps=8"])
    _ran_after(pipeline.run_stage(cfg, "train", preflight=False, extend=True)["stats"], 6, 2)
    _same_losses(_log(tmp_path / "killed"), _log(root / "one"), rel=1e-5, acc=0.02)


def test_resume_on_another_global_batch_is_refused_with_the_grad_accum_to_use(runs, tmp_path):
    root, cfgs = runs
    shutil.copytree(root / "ddp", tmp_path / "ddp")
    cfg = load_config(cfgs["ddp"], [f"run.dir={tmp_path / 'ddp'}", "train.max_steps=6"])
    with pytest.raises(ResumeError, match=r"micro_batches_per_step: 2 -> 1, train\.max_steps: 4 -> 6\); the "
                                          r"checkpoint was written by 2 rank.*set train\.grad_accum=2"):
        pipeline.run_stage(cfg, "train", preflight=False, extend=True)


def test_tensor_parallel_extraction_matches_one_rank(runs):
    root, _ = runs
    stats = json.loads((root / "tp" / "extract" / "manifest.json").read_text())["stats"]
    assert stats["parallel"] == "tensor"
    _stores_equal(StoreReader(root / "tp" / "extract"), StoreReader(root / "one" / "extract"), exact=False)
    head_tp = StoreReader(root / "tp" / "extract").folder / "head.safetensors"
    from safetensors.torch import load_file

    a, b = load_file(str(head_tp)), load_file(str(root / "one" / "extract" / "head.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b)  # the sharded weights, gathered whole


def test_scaling_bench_runs_on_two_cpu_ranks(runs):
    root, _ = runs
    report = json.loads((root / "scaling.json").read_text())
    assert report["world_size"] == 2 and report["all"]["strategy"] == "ddp"
    assert report["one"]["finite"] and report["all"]["finite"] and report["efficiency"] > 0


def test_every_rank_skips_a_step_whose_gradient_is_not_finite():
    """ddp and fsdp, with torch's fused AdamW (the GPU's path, found_inf) and its plain one: a
    non-finite gradient on rank 1 alone (ddp: in its micro-batch, fsdp: in its gradient shard
    after the reduce-scatter) is skipped by both ranks, which take the steps around it
    (tests/torchrun_steps.py check_skip)."""
    _torchrun(["skip", "ddp", "fused"], ["skip", "ddp", "plain"], ["skip", "fsdp", "fused"], ["skip", "fsdp", "plain"])


def test_strategy_choice():
    assert resolve_strategy("auto", 1) == "none" and resolve_strategy("auto", 4) == "ddp"
    assert resolve_strategy("fsdp", 2) == "fsdp"
    with pytest.raises(ValueError, match="every rank would train its own draft"):
        resolve_strategy("none", 2)
    assert DistEnv().is_main and not DistEnv().active


_EXIT_SCRIPT = """
import atexit, sys
import torch, torch.distributed as dist
# registered before eaglet's handler, so it runs after it (atexit runs last in, first out)
atexit.register(lambda: print("kept" if dist.is_initialized() else "destroyed", flush=True))
from eaglet.distributed import all_reduce_sum, init_distributed, keep_group_at_exit
init_distributed(1.0)
assert float(all_reduce_sum(torch.ones(1))) == 2.0
if sys.argv[1] == "keep":
    keep_group_at_exit()
"""


@pytest.mark.parametrize("how", ["done", "keep"])
def test_a_rank_destroys_its_group_at_exit_unless_it_failed(tmp_path, how):
    """A rank that ends destroys the process group while its interpreter is whole (left to the
    interpreter's teardown, gloo's threads can abort a rank whose work is done); after a failure
    (`keep_group_at_exit`, which the CLI calls) it leaves the group as it is."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT, how], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    want = "destroyed" if how == "done" else "kept"
    for p, (out, err) in zip(procs, outs):
        assert out.strip().splitlines()[-1:] == [want], out + err[-2000:]
        if how == "done":
            assert p.returncode == 0, err[-2000:]
