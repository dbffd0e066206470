"""The performance benchmarks at tiny shapes on the CPU: bench/perf.sh running bench/train_throughput.py
(eaglet's step with its per-phase breakdown, profile and compiled-vs-eager check; speculators'
step when .venv-speculators exists) and writing its summary; bench/extract_throughput.py; the
FLOP count against the anchor script's (skipped, saying so, without ../shared/anchors beside the
checkout); the synthetic batches they train on (eaglet.testing.synthetic). EAGLET_PERF_FULL=1 with
.venv-speculators also runs speculators' side of the driver (15 s more; skipped, saying so,
otherwise). The bench scripts run as scripts (`bench/x.py ... --out FILE`, in this process:
conftest.run_script), their JSON read back."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_script

from eaglet.draft.eagle3.model import DraftConfig
from eaglet.testing.synthetic import LOSS_SHARE, PRESETS, draft_shape, packed_doc_lens, synthetic_batch

REPO = Path(__file__).resolve().parents[1]
TRAIN_BENCH = REPO / "bench" / "train_throughput.py"
EXTRACT_BENCH = REPO / "bench" / "extract_throughput.py"
SMALL_TRAINER = REPO / "bench" / "small_trainer.py"
ANCHOR = REPO.parent / "shared" / "anchors" / "speculators_train_step.py"
SPECULATORS_PYTHON = REPO / ".venv-speculators" / "bin" / "python"
if not SPECULATORS_PYTHON.exists():  # a worktree: the main checkout's side environment
    SPECULATORS_PYTHON = Path("/work/main/.venv-speculators/bin/python")

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--preset", "tiny", "--device", "cpu", "--tokens", "256", "--doc-tokens", "64", "--warmup", "1", "--steps", "2"]


def run_bench(script: Path, args: list[str], out: Path) -> dict:
    """`python bench/SCRIPT ARGS --out OUT`, run in this process (conftest.run_script); its JSON."""
    run_script(script, [*args, "--out", str(out)])
    return json.loads(out.read_text())


def flop_figures(tmp_path: Path) -> dict:
    """The bench's own FLOP figures, nothing built: the preset's, and every real preset's at 2048 and 4096."""
    return run_bench(TRAIN_BENCH, ["--flops-only", "--preset", "llama3-8b", "--tokens", "2048", "--doc-tokens", "2048",
                                   "--ttt-steps", "7"], tmp_path / "flops.json")


def test_flop_count(tmp_path):
    got = flop_figures(tmp_path)
    assert got["gflop_per_token"] == pytest.approx(16.64, abs=0.01)
    assert got["presets"]["llama3-8b"]["2048"] == got["flop_per_token"]


@pytest.mark.skipif(not ANCHOR.exists(), reason="a developers' check against speculators_train_step.py, a reference "
                    "script that is not in this repository; nothing to install (test_flop_count checks the count)")
def test_flop_count_is_the_anchors(tmp_path):
    got = flop_figures(tmp_path)
    # the function itself, from the anchor script (which needs speculators to import)
    tree = ast.parse(ANCHOR.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train_flops_per_token")
    ns: dict = {}
    exec(compile(ast.Module([fn], []), str(ANCHOR), "exec"), ns)
    for seq in (2048, 4096):
        for preset in ("llama3-8b", "kimi-k2"):  # the anchor's FLOPs of the preset's anchor dims
            dims = {k: v for k, v in zip(("hidden", "heads", "kv", "inter", "vocab", "draft_vocab"), (
                PRESETS[preset][k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                             "intermediate_size", "vocab_size", "draft_vocab_size")))}
            assert ns["train_flops_per_token"](dims, seq, 7) == got["presets"][preset][str(seq)]


def test_synthetic_batch_trains_on_the_loss_share_asked_for():
    """The training benches' batches carry a loss mask with the share of trained tokens asked
    for (prompt spans at the start of each turn), the rows each TTT step's loss can count, and
    the rows TTT steps 1.. run over."""
    import torch

    from eaglet.draft.eagle3.loss import active_rows, head_rows
    from eaglet.draft.eagle3.model import DraftConfig

    shape = PRESETS["tiny"]
    cfg = DraftConfig(target_hidden_size=shape["hidden_size"], **shape)
    for share in (LOSS_SHARE, 0.5, 1.0):
        b = synthetic_batch(cfg, 2048, 1024, torch.device("cpu"), torch.float32, seed=1, loss_share=share, ttt_steps=3)
        assert b.loss_mask.float().mean().item() == pytest.approx(share, abs=0.01)
        assert not b.loss_mask[0, 0] or share == 1.0  # a turn starts with its prompt
        want = head_rows(b.loss_mask, b.doc_ids, 3)
        assert [b.rows[f"head_rows_{j}"].tolist() for j in range(3)] == [r.tolist() for r in want]
        assert b.rows["active_rows"].tolist() == active_rows(want).tolist()
        assert len(want[0]) < 2048


@pytest.mark.parametrize("wide", [False, True])  # True: the 8B target's and draft's vocabularies
def test_synthetic_batch_keeps_the_in_vocabulary_share_asked_for(wide):
    """The training benches' synthetic final states point the teacher's argmax at a draft
    token for the share of rows asked for (the rows the out-of-vocabulary mask keeps), not at
    a uniformly random token (about draft/target vocabulary: a quarter at the 8B dims)."""
    import torch

    from eaglet.draft.loss import teacher_targets
    from eaglet.draft.eagle3.model import DraftConfig

    shape = dict(PRESETS["tiny"])
    if wide:
        shape.update(vocab_size=128256, draft_vocab_size=32000, hidden_size=256)
    cfg = DraftConfig(target_hidden_size=shape["hidden_size"], **shape)
    t2d = torch.arange(cfg.vocab_size) < cfg.draft_vocab_size  # a new draft's identity maps
    d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    torch.manual_seed(0)
    head = torch.randn(cfg.vocab_size, cfg.target_hidden_size) * 0.02  # fp32: CPU bf16 products are slow
    tokens = 512
    for share in (0.95, 0.5):
        b = synthetic_batch(cfg, tokens, tokens, torch.device("cpu"), torch.float32, seed=1, head=head, in_vocab=share)
        got = teacher_targets(b.final, head, t2d, d2t)[1].float().mean().item()
        assert abs(got - share) < 0.05, (share, got)
    b = synthetic_batch(cfg, tokens, tokens, torch.device("cpu"), torch.float32, seed=1)  # random states
    assert teacher_targets(b.final, head, t2d, d2t)[1].float().mean().item() < 0.5


def test_packed_documents_of_varying_lengths():
    """packed_doc_lens: documents of varying lengths up to the micro-batch's tokens, different
    per seed; synthetic_batch over them gives each document its own positions, id and turns,
    and over equal lengths exactly the batch of fixed documents."""
    packs = [packed_doc_lens(2048, 256, seed) for seed in range(4)]
    assert all(1 < len(p) and sum(p) <= 2048 and min(p) >= 16 for p in packs)
    assert len({tuple(p) for p in packs}) == 4 and len({n for p in packs for n in p}) > 8
    cfg = DraftConfig(target_hidden_size=64, **PRESETS["tiny"])
    lens = packs[0]
    b = synthetic_batch(cfg, sum(lens), 256, torch.device("cpu"), torch.float32, seed=1, ttt_steps=3, doc_lens=lens)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    assert b.position_ids[0, starts].tolist() == [0] * len(lens)
    assert b.doc_ids[0, starts].tolist() == list(range(len(lens))) and b.doc_ids[0, -1] == len(lens) - 1
    assert abs(b.loss_mask.float().mean().item() - LOSS_SHARE) < 0.05
    fixed = synthetic_batch(cfg, 1024, 256, torch.device("cpu"), torch.float32, seed=1, ttt_steps=3)
    same = synthetic_batch(cfg, 1024, 256, torch.device("cpu"), torch.float32, seed=1, ttt_steps=3, doc_lens=[256] * 4)
    for k in ("aux", "final", "input_ids", "loss_mask", "position_ids", "doc_ids"):
        assert torch.equal(getattr(fixed, k), getattr(same, k)), k
    assert fixed.rows.keys() == same.rows.keys() and all(torch.equal(fixed.rows[k], same.rows[k]) for k in same.rows)
    with pytest.raises(ValueError, match="sum to"):
        synthetic_batch(cfg, 1000, 256, torch.device("cpu"), torch.float32, seed=1, doc_lens=[256] * 4)


def test_packed_bench_times_each_warmup_step_and_counts_later_graphs(tmp_path):
    """--packed N: N micro-batches of different shapes cycled; every warm-up step timed, tokens/s
    over the tokens present, and graphs counted in the timed steps (the pieces compiled through
    dynamo's capture alone, --compile-backend eager). With eaglet's marked data dims one warm-up
    step makes every graph; with torch.compile's default (--dynamic auto) the second shape,
    met in the timed steps, compiles again."""
    args = ["--preset", "tiny", "--device", "cpu", "--tokens", "512", "--doc-tokens", "64", "--packed", "2",
            "--ttt-steps", "2", "--warmup", "1", "--steps", "2", "--compile", "on", "--compile-backend", "eager"]
    torch._dynamo.reset()  # the runs share this process: each compiles afresh
    r = run_bench(TRAIN_BENCH, args, tmp_path / "p.json")
    sizes = [sum(p) for p in r["doc_lens"]]
    assert len(set(sizes)) > 1 or len({len(p) for p in r["doc_lens"]}) > 1
    assert r["tokens_per_step"] == pytest.approx(sum(sizes) / 2)
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / (r["step_ms"] / 1000))
    assert len(r["warmup_step_s"]) == 1 and r["graphs_in_timed_steps"] == 0 and r["dynamic"] == "marked"
    assert "_compile.compile_inner" in r["compile_times"]  # torch.compile's seconds by phase, for the cold start
    torch._dynamo.reset()
    auto = run_bench(TRAIN_BENCH, args + ["--dynamic", "auto"], tmp_path / "a.json")
    torch._dynamo.reset()
    assert auto["doc_lens"] == r["doc_lens"] and auto["graphs_in_timed_steps"] > 0 and auto["dynamic"] == "auto"


def test_host_profile_lists_where_a_steps_host_time_goes(tmp_path):
    """--host-profile N: cProfile over N steps; the step function itself takes the whole host
    time (cumulative), and the unroll's step and the backward are among the listed functions."""
    res = run_bench(TRAIN_BENCH, TINY + ["--compile", "off", "--host-profile", "2", "--top", "60"], tmp_path / "t.json")
    hp = res["host_profile"]
    assert hp["host_ms_per_step"] > 0 and len(hp["by_own"]) == len(hp["by_cum"]) == 60
    top = hp["by_cum"][0]
    assert top["fn"].endswith("(step)") and top["calls_per_step"] == 1
    assert top["cum_ms"] == pytest.approx(hp["host_ms_per_step"], rel=0.2)
    names = [r["fn"] for r in hp["by_cum"]]
    assert any("eagle3/unroll.py" in n and n.endswith("(__call__)") for n in names), names  # the TTT unroll
    assert any("run_backward" in n for n in names), names
    assert sorted((r["own_ms"] for r in hp["by_own"]), reverse=True) == [r["own_ms"] for r in hp["by_own"]]


def test_extract_bench(tmp_path):
    out = tmp_path / "e.json"
    r = run_bench(EXTRACT_BENCH, ["--preset", "tiny", "--device", "cpu", "--batches", "2", "--dir", str(tmp_path)], out)
    assert json.loads(out.read_text())["tokens"] == r["tokens"] == 2 * 8 * 64
    assert r["aux_layers"] == [2, 4, 5] and r["store_bytes_per_token"] == 4 * 64 * 2 + 5
    assert r["forward"]["tokens_per_s"] > 0 and r["extract"]["vs_forward"] > 0
    # every byte written: 3 aux + final states, ids and mask, plus the shards' headers
    assert r["extract"]["bytes"] >= r["tokens"] * r["store_bytes_per_token"]
    assert r["write"]["bytes"] >= r["tokens"] * r["store_bytes_per_token"]
    assert not list(tmp_path.glob("eaglet-extract-bench-*"))  # the stores are deleted


def run_perf_sh(out: Path, spec_python: Path | None) -> list[dict]:
    """bench/perf.sh at tiny shapes (PERF_TINY) on eaglet's packed part and speculators' (with
    `spec_python`; else skipped as without wheels); its train.json."""
    env = {**os.environ, "PERF_TINY": "1", "PY": sys.executable, "STEPS": "1", "WARMUP": "1",
           "WHL": str(out.parent / "no-wheels"), "OMP_NUM_THREADS": "1"}
    env.pop("SPEC_PY", None)
    if spec_python is not None:
        env["SPEC_PY"] = str(spec_python)
    p = subprocess.run(["bash", str(REPO / "bench" / "perf.sh"), str(out), "e8p,s8p"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(f.name for f in out.iterdir()) == ["perf.log", "profile.txt", "summary.md", "train.json"]
    return json.loads((out / "train.json").read_text())


def summary_row(out: Path) -> list[str]:
    summary = (out / "summary.md").read_text()
    return next(line for line in summary.splitlines()
                if line.startswith("| Llama-3.1-8B draft dims, 4 x 2048 packed")).split("|")


@pytest.mark.skipif(not os.environ.get("EAGLET_PERF_FULL"),
                    reason="bench/perf.sh end to end needs EAGLET_PERF_FULL=1 (about 20 s: a benchmark harness, "
                           "kept out of the default suite's 15 minutes)")
def test_perf_sh_tiny(tmp_path):
    """The driver end to end on eaglet's packed part (breakdown, profile, compiled-vs-eager
    check: dynamo's capture, eager backend), speculators' part skipped as without wheels, and
    the summary."""
    out = tmp_path / "out"
    train = run_perf_sh(out, None)
    assert [r["part"] for r in train] == ["e8p"]
    e = train[0]
    assert e["system"] == "eaglet" and e["docs"] == 4 and e["compile"] and e["attn_impl"] == "chunked"
    # forward_loss runs the draft's forward (all steps), then the loss of each step
    phases = (["teacher"] + [f"step{j}_forward" for j in range(7)] + [f"step{j}_loss" for j in range(7)]
              + ["backward", "optimizer"])
    assert list(e["breakdown_ms"]) == phases
    # The phases tile the step: on the CPU each runs from the previous wall-clock mark to its own,
    # from the step's first mark to its last, inside the timed step. What they leave out is the
    # step call's own entry and return (measured: 0.8-1.0 ms of 163-230 ms steps, phases 99.5% of
    # the step in 3 runs on a shared 2-core CPU); 3% allows six times that.
    covered = sum(e["breakdown_ms"].values())
    assert 0.97 * e["step_ms"] <= covered <= e["step_ms"], (covered, e["step_ms"])
    assert e["check"]["max_rel_diff"] < 1e-5  # the compiled pieces give the eager losses
    assert len(e["profile"]["top"]) == 25 and "aten::" in (out / "profile.txt").read_text()
    row = summary_row(out)
    assert "tok/s" in row[2] and "no speculators wheels" in row[3]
    summary = (out / "summary.md").read_text()
    assert "- e8p (" in summary and "max relative difference" in summary


@pytest.mark.skipif(not (SPECULATORS_PYTHON.exists() and os.environ.get("EAGLET_PERF_FULL")),
                    reason="speculators' side of bench/perf.sh needs EAGLET_PERF_FULL=1 (15 s more: its import) and "
                           ".venv-speculators (`bash scripts/speculators_venv.sh`)")
def test_perf_sh_tiny_beside_speculators(tmp_path):
    """The driver with speculators 0.9.0 at the same tiny shape: both columns of the summary and
    their ratio."""
    out = tmp_path / "out"
    train = run_perf_sh(out, SPECULATORS_PYTHON)
    assert [r["part"] for r in train] == ["e8p", "s8p"]
    assert train[1]["system"] == "speculators" and train[1]["speculators_version"] == "0.9.0"
    row = summary_row(out)
    assert "tok/s" in row[2] and "tok/s" in row[3] and "x" in row[4]


def test_extract_loop_reports_where_the_host_waited(tmp_path):
    """A store writer slower than the forwards shows as 'writer_wait_s' (the host blocked on its
    queue), within the loop's own time; nothing is charged to pinned buffers on a CPU."""
    import time

    import torch

    from eaglet.engines.hf.extract import extract_samples
    from eaglet.targets.families import resolve_layers
    from eaglet.targets.load import TargetParts
    from eaglet.testing import tiny
    from eaglet.testing.synthetic import SyntheticSamples

    model = tiny.build_model("llama")  # a random float32 Llama of 8 layers (what the bench's tiny preset is)
    parts = TargetParts.of(model)
    layers = resolve_layers(None, parts.num_layers)
    data = SyntheticSamples(6, 16, model.config.vocab_size, seed=0)

    class SlowWriter:  # takes 50 ms per sample, as a writer behind on its disk would
        added: list[int] = []

        def add(self, sample_id, aux, final, ids, mask):
            time.sleep(0.05)
            self.added.append(int(sample_id))

        def drop(self, sample_id, reason):
            raise AssertionError(f"{sample_id} dropped: {reason}")

    waits: dict[str, float] = {}
    writer = SlowWriter()
    tokens = extract_samples(data, list(range(6)), parts, layers, torch.float32, writer, batch_tokens=32,
                             max_batch_size=2, show=False, waits=waits)
    assert tokens == 6 * 16 and sorted(writer.added) == sorted(int(i) for i in data.sample_ids)
    assert set(waits) == {"pin_alloc_s", "copy_wait_s", "writer_wait_s", "loop_s"}
    assert 0.3 <= waits["writer_wait_s"] <= waits["loop_s"]
    assert waits["pin_alloc_s"] == 0.0


def test_deepseek_v3_preset_is_the_draft_of_deepseek_v3():
    """The `deepseek-v3` preset (the bench's side of bench/fullwidth.py, whose target has
    DeepSeek-V3's width) is the draft eaglet makes for DeepSeek-V3's config (transformers'
    DeepseekV3Config defaults are its published sizes), at a 32k draft vocabulary."""
    from transformers import DeepseekV3Config

    draft = DraftConfig.from_target_config(DeepseekV3Config(), draft_vocab_size=32000)
    assert {k: getattr(draft, k) for k in PRESETS["deepseek-v3"]} == PRESETS["deepseek-v3"]
    assert PRESETS["deepseek-v3"] != PRESETS["kimi-k2"]


@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2"])
def test_mla_presets_are_the_mla_drafts_of_their_targets(preset):
    """`draft_shape(preset, "mla")` is the MLA draft eaglet makes for the preset's target (its own
    MLA sizes: DeepSeek-V3's 128 heads, Kimi-K2.5's 64, from examples/kimi-k25's config)."""
    from transformers import AutoConfig, DeepseekV3Config

    target = DeepseekV3Config() if preset == "deepseek-v3" else AutoConfig.from_pretrained(REPO / "examples" / "kimi-k25")
    draft = DraftConfig.from_target_config(target, draft_vocab_size=32000, attention="mla")
    shape = draft_shape(preset, "mla")
    assert {k: getattr(draft, k) for k in shape} == shape
    assert shape["mla_heads"] == (128 if preset == "deepseek-v3" else 64)


def test_train_bench_times_an_mla_draft(tmp_path):
    """--draft-attention mla: the MLA draft trained (its parameters, not the dense one's), and
    its FLOPs from its own projections and heads: at Kimi-K2.5's dims, written out here."""
    import torch

    from eaglet.draft.eagle3.model import Eagle3Draft

    got = run_bench(TRAIN_BENCH, [*TINY, "--draft-attention", "mla"], tmp_path / "mla.json")
    with torch.device("meta"):
        draft = Eagle3Draft(DraftConfig(target_hidden_size=64, **draft_shape("tiny", "mla")))
    trainable = sum(q.numel() for q in draft.parameters() if q.requires_grad)
    assert got["draft_attention"] == "mla" and got["trainable_params_m"] == trainable / 1e6
    assert got["flops_formula"] == "mla_flops_per_token" and got["peak_mem_gib"] is None  # a CPU: no peak
    flops = run_bench(TRAIN_BENCH, ["--flops-only", "--preset", "kimi-k2", "--tokens", "4096", "--ttt-steps", "7",
                                    "--draft-attention", "mla"], tmp_path / "flops.json")
    H, inter, vocab, heads, q_rank, kv_rank, nope, rope, v = 7168, 18432, 32000, 64, 1536, 512, 128, 64, 128
    step = (2 * H * q_rank + q_rank * heads * (nope + rope) + 2 * H * (kv_rank + rope) + kv_rank * heads * (nope + v)
            + heads * v * H + 3 * H * inter + H * vocab)
    attn = 4096 / 2 * heads * (nope + rope + v)
    assert flops["flop_per_token"] == 6 * 3 * H * H + 7 * (6 * step + 6 * attn) + 2 * H * vocab


def test_smollm2_preset_is_the_draft_of_smollm2_135m():
    """The `smollm2-135m` preset (bench/ab.py's target, the embedded default) is the draft eaglet
    makes for SmolLM2-135M-Instruct's config, at a 32k draft vocabulary."""
    from transformers import LlamaConfig

    smollm2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    draft = DraftConfig.from_target_config(smollm2, draft_vocab_size=32000)
    assert {k: getattr(draft, k) for k in PRESETS["smollm2-135m"]} == PRESETS["smollm2-135m"]


def test_small_trainer_online_and_offline_train_alike(tmp_path):
    """bench/small_trainer.py (--smoke): `eaglet train` on online states and on an offline store
    of the same random target logs the same losses, step by step (the same samples in the same
    order; online states differ only by a differently composed forward's rounding)."""
    args = ["--out", str(tmp_path), "--smoke", "--steps", "3", "--log-every", "1", "--conversations", "40",
            *(f"--set={s}" for s in ["train.compile=off", "vocab.size=256", "train.max_tokens=512",
                                     "prepare.num_workers=1"])]
    runs = {}
    for mode in ("online", "offline"):
        run_script(SMALL_TRAINER, [*args, "--mode", mode])
        runs[mode] = json.loads((tmp_path / f"small-{mode}.json").read_text())
    online, offline = runs["online"]["train"], runs["offline"]["train"]
    assert online["steps_logged"] == offline["steps_logged"] == [1, 2, 3]
    assert online["loss"] == pytest.approx(offline["loss"], rel=1e-5)
    assert all(t > 0 for t in online["tokens_per_s"] + offline["tokens_per_s"])
    assert (tmp_path / "run-online" / "extract").is_dir() and (tmp_path / "run-offline" / "extract").is_dir()


def test_load_ahead_bench_times_both_ways_on_the_micro_batches_it_packs(tmp_path):
    """bench/load_ahead.py writes a store at the width asked for, packs micro-batches of the
    tokens asked for, and times reading them with and without train.prefetch; its bytes per
    micro-batch are those of the states it packed."""
    out = tmp_path / "la.json"
    run_script(REPO / "bench" / "load_ahead.py", ["--hidden", "32", "--tokens", "512", "--batches", "5",
                                                  "--step-ms", "1", "--repeats", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"prefetch 0", "prefetch 2"} and res["micro_batches"] == 4
    per_token = 4 * 32 * 2  # three captured states and the final one, bf16
    assert 0.5 * 512 * per_token / 2**20 < res["mib_per_micro_batch"] <= 512 * per_token / 2**20
    for run in res["runs"].values():
        assert len(run["ms_per_micro_batch"]) == 1 and 0 <= run["ms_loading"][0] < run["ms_per_micro_batch"][0]
