"""eaglet.draft.optim: AdamW from the unroll's bf16 gradient accumulators, against torch's AdamW
given the same gradients as fp32 .grad; and the unroll's use of the persistent copies."""

import os
import shutil

import pytest
import torch
from torch import nn

from conftest import tiny_pipeline_upto_vocab, train_on_copy
from eaglet.draft.casts import cast_linears
from eaglet.draft.optim import UnrollAdamW, adamw_from_low_precision_grads, attach_unroll_copies


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    a = nn.Sequential(nn.Linear(24, 40), nn.LayerNorm(40), nn.Linear(40, 16, bias=False))
    b = nn.Sequential(nn.Linear(24, 40), nn.LayerNorm(40), nn.Linear(40, 16, bias=False))
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    not os.environ.get("EAGLET_PERF_FULL"), reason="set EAGLET_PERF_FULL=1 (inductor's C++ build)"))])
def test_unroll_adamw_is_adamw_on_the_same_gradients(clip, compiled):
    """Three steps, the learning rate changing, weight decay on, the gradient divided by a
    clipping divisor: the weights, moments and step counts of torch's fused AdamW given the
    accumulated bf16 gradients as fp32 .grad (the plain path's hand-off); the bf16 copies are
    the new weights cast, the accumulators zero, the other parameters stepped by AdamW itself;
    and the state dict loads into torch's AdamW."""
    torch._dynamo.reset()
    ref_m, m = _pair()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    ref = torch.optim.AdamW(ref_m.parameters(), fused=True, **kw)
    copies = attach_unroll_copies(m.modules())
    assert set(copies) == {m[0].weight, m[2].weight}  # the linears' weights; biases and the norm keep .grad
    opt = UnrollAdamW(m.parameters(), copies, compile=compiled, **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for (name, p), q in zip(m.named_parameters(), ref_m.parameters(), strict=True):
            grad = torch.randn(p.shape, generator=g) * 0.1
            if p in copies:
                copies[p].grad.copy_(grad)
                q.grad = copies[p].grad.float()  # what the plain path hands to .grad
            else:
                p.grad, q.grad = grad.clone(), grad.clone()
        if clip:
            opt.grad_scale = ref.grad_scale = torch.tensor(1.7 + step)
        for o in (opt, ref):
            o.param_groups[0]["lr"] = 1e-2 / (step + 1)
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, p), q in zip(m.named_parameters(), ref_m.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], ref.state[q][key], rtol=1e-6, atol=1e-9, msg=f"{name} {key}")
        if p in copies:
            assert torch.equal(copies[p].weight, p.detach().to(torch.bfloat16))
            assert not copies[p].grad.any()
    again = torch.optim.AdamW(m.parameters(), fused=True, **kw)
    again.load_state_dict(opt.state_dict())
    assert torch.equal(again.state[m[0].weight]["exp_avg"], opt.state[m[0].weight]["exp_avg"])
    torch._dynamo.reset()


def test_unroll_uses_the_persistent_copy_and_accumulator():
    """cast_linears gives the attached copy (re-cast after the weight changes in place, as a
    loaded checkpoint changes it) and its accumulator; a product's backward adds its weight
    gradient there, and the parameter gets no .grad."""
    _, m = _pair()
    copies = attach_unroll_copies(m.modules())
    w = cast_linears(m.named_modules(), torch.bfloat16)
    assert w["0"] is copies[m[0].weight].weight and w["0.grad"] is copies[m[0].weight].grad
    assert w["0.link"].requires_grad and w["0.link"].is_leaf
    from eaglet.draft.casts import linear

    x = torch.randn(5, 24, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(m[0], "0", x, w)
    y.float().sum().backward()
    assert m[0].weight.grad is None
    want = torch.ones(5, 40, dtype=torch.bfloat16).t() @ x.detach()
    torch.testing.assert_close(copies[m[0].weight].grad, want)
    with torch.no_grad():
        m[0].weight.mul_(2)
    assert torch.equal(cast_linears(m.named_modules(), torch.bfloat16)["0"], m[0].weight.detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match="accumulate=False"):
        cast_linears(m.named_modules(), torch.bfloat16, accumulate=False)
    for mod in m.modules():  # without the copies: the per-unroll buffers again
        mod.__dict__.pop("unroll_copy", None)
    assert "0.grad" in cast_linears(m.named_modules(), torch.bfloat16)  # the per-unroll buffer again
    assert cast_linears(m.named_modules(), torch.bfloat16)["0.grad"] is not copies[m[0].weight].grad


def test_the_update_function_is_adamws_arithmetic():
    """adamw_from_low_precision_grads on one tensor, against the formula written out in fp64."""
    torch.manual_seed(0)
    p = torch.randn(64)
    g16 = (torch.randn(64) * 0.3).to(torch.bfloat16)
    m, v, w = torch.randn(64) * 0.01, torch.rand(64) * 0.01, torch.empty(64, dtype=torch.bfloat16)
    step = torch.tensor(4.0)
    p0, m0, v0, g = p.double(), m.double(), v.double(), g16.double() / 2.0
    lr, b1, b2, eps, wd = 3e-3, 0.9, 0.95, 1e-8, 0.05
    adamw_from_low_precision_grads([p], [g16], [m], [v], [w], [step], torch.tensor(lr), torch.tensor(2.0),
                                   b1, b2, eps, wd)
    m1 = b1 * m0 + (1 - b1) * g
    v1 = b2 * v0 + (1 - b2) * g * g
    want = p0 * (1 - lr * wd) - lr / (1 - b1**5) * m1 / ((v1 / (1 - b2**5)).sqrt() + eps)
    torch.testing.assert_close(p.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m.double(), m1, rtol=1e-6, atol=1e-9)
    assert step.item() == 5 and not g16.any() and torch.equal(w, p.to(torch.bfloat16))


# ---- in the trainer ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uopt")
    return tmp, tiny_pipeline_upto_vocab(tmp, 32, 3, [
        "run.seed=5", "extract.store_dtype=float32", "vocab.size=150", "train.max_tokens=256", "train.ttt_steps=3",
        "train.log_every=1", "train.eval_every=0", "train.attn_impl=chunked", "train.eval_fraction=0.1",
        "train.precision=bf16", "train.warmup_steps=1", "train.min_lr_ratio=1.0", "train.lr=0.003",
        "train.grad_clip=0.05", "train.tensorboard=false"])


def _train(tmp, base, name, monkeypatch, *extra, fresh=True):
    steps = {"unroll": 0}
    real = UnrollAdamW.step

    def counting(self, *a, **k):
        steps["unroll"] += 1
        return real(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(UnrollAdamW, "step", counting)
        run, log = train_on_copy(tmp, base, name, *extra, fresh=fresh)
    from safetensors.torch import load_file

    last = sorted((run / "train" / "checkpoints").glob("step-*"))[-1]
    return [r for r in log if r["split"] == "train"], steps["unroll"], load_file(str(last / "model.safetensors"))


def test_trainer_with_unroll_adamw_trains_as_with_adamw(store_run, monkeypatch):
    """One process, bf16 (CPU autocast), clipping on (0.05: every step clips): six steps with
    the unroll optimizer and with torch's AdamW give the same losses and weights, up to the
    float32 rounding of two AdamW implementations (the gradients are the same bf16 sums); and
    a run stopped after three steps and resumed from its checkpoint gives the uninterrupted
    run's losses exactly (the bf16 copies made again from the loaded weights)."""
    tmp, base = store_run
    # lr 1e-4, not auto's 1.1e-2 at this width: Adam moves a weight whose gradient is near zero by
    # about +-lr on the gradient's sign, which two implementations' rounding may flip
    six = ["train.max_steps=6", "train.ckpt_every=3", "train.lr=0.0001"]
    plain, n_plain, w_plain = _train(tmp, base, "plain", monkeypatch, *six, "train.unroll_optimizer=false")
    fast, n_fast, w_fast = _train(tmp, base, "fast", monkeypatch, *six)
    assert n_plain == 0 and n_fast == 6
    assert [r["step"] for r in fast] == [r["step"] for r in plain] == list(range(1, 7))
    for a, b in zip(fast, plain, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3), (a, b)
    assert fast[-1]["loss"] < fast[0]["loss"]  # it trains
    for k, w in w_plain.items():
        if w.is_floating_point():
            torch.testing.assert_close(w_fast[k], w, rtol=0, atol=2e-3 * w.abs().max().item(), msg=k)
        else:  # the vocabulary maps
            assert torch.equal(w_fast[k], w)
    _train(tmp, base, "resumed", monkeypatch, *six)  # then what a kill just after the checkpoint of step 3 leaves:
    train = tmp / "resumed" / "train"
    shutil.rmtree(train / "checkpoints" / "step-0000006")
    shutil.rmtree(train / "final")
    (train / "manifest.json").unlink()
    both, n_rest, w_rest = _train(tmp, base, "resumed", monkeypatch, *six, fresh=False)  # the log holds both runs
    assert n_rest == 3 and [r["step"] for r in both] == list(range(1, 7))
    assert [r["loss"] for r in both] == [r["loss"] for r in fast]
    assert all(torch.equal(w_rest[k], w_fast[k]) for k in w_fast)


@pytest.mark.parametrize("hidden", [64, 576, 1024])
def test_auto_learning_rate_is_the_measured_rate_scaled_by_width(hidden):
    """train.lr auto (the default): 1.2e-3 at width 576, where the A/B measured it, scaled as
    1/width; a number is used as given."""
    from eaglet.config import TrainSection, load_config
    from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft
    from eaglet.draft.step import build_optimizer, peak_lr

    draft = Eagle3Draft(DraftConfig(hidden_size=hidden, target_hidden_size=hidden, intermediate_size=32,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=40,
                                    draft_vocab_size=16))
    cpu = torch.device("cpu")
    assert TrainSection().lr == "auto"
    auto = build_optimizer(draft, TrainSection(), "none", cpu, bf16=False, compiled=False)
    assert auto.param_groups[0]["lr"] == pytest.approx(1.2e-3 * 576 / hidden, rel=1e-12)
    assert peak_lr(TrainSection(), 576) == pytest.approx(1.2e-3, rel=1e-12)
    given = build_optimizer(draft, TrainSection(lr=3e-4), "none", cpu, bf16=False, compiled=False)
    assert given.param_groups[0]["lr"] == 3e-4
    assert load_config(None, ["train.lr=auto"]).train.lr == "auto"
    assert load_config(None, ["train.lr=0.0012"]).train.lr == 0.0012


# ---- a step whose gradient is not finite -----------------------------------------------------------


def _stepped(kind: str, clip: float, grads: list[dict[str, torch.Tensor]], skipped):
    """A fresh `_pair` model stepped once per entry of `grads` (parameter name -> gradient) by
    optimizer_step with `kind` ('fused', 'plain': torch's AdamW; 'unroll': UnrollAdamW, the linears'
    gradients in their accumulators); returns (model, optimizer, scheduler)."""
    import types

    from eaglet.config import TrainSection
    from eaglet.draft.step import optimizer_step

    _, m = _pair()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    copies = attach_unroll_copies(m.modules()) if kind == "unroll" else {}
    opt = (UnrollAdamW(m.parameters(), copies, **kw) if kind == "unroll"
           else torch.optim.AdamW(m.parameters(), fused=kind == "fused", **kw))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    par = types.SimpleNamespace(draft=m, strategy="none")
    for g in grads:
        for name, p in m.named_parameters():
            if p in copies:
                copies[p].grad.copy_(g[name])
            else:
                p.grad = g[name].clone()
        optimizer_step(par, opt, sched, TrainSection(grad_clip=clip), skipped=skipped)
    return m, opt, sched


@pytest.mark.parametrize("kind", ["fused", "plain", "unroll"])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_a_step_whose_gradient_is_not_finite_is_skipped_by_every_optimizer(kind, clip):
    """Three steps, the second's gradient holding one NaN (in a linear's accumulator for the
    unroll optimizer): the weights, AdamW's moments and step counts come out exactly as two steps
    of the first and third gradients; the skip is counted; the schedule took all three steps."""
    from eaglet.draft.step import SkippedSteps

    _, ref = _pair()
    g = torch.Generator().manual_seed(3)
    grads = [{n: torch.randn(p.shape, generator=g) * 0.1 for n, p in ref.named_parameters()} for _ in range(3)]
    grads[1]["0.weight"][2, 3] = float("nan")
    skipped = SkippedSteps(torch.device("cpu"))
    m, opt, sched = _stepped(kind, clip, grads, skipped)
    want, want_opt, _ = _stepped(kind, clip, [grads[0], grads[2]], None)
    for (name, p), q in zip(m.named_parameters(), want.parameters(), strict=True):
        assert torch.isfinite(p).all() and torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], want_opt.state[q][key]), f"{name} {key}"
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    assert sched.last_epoch == 3
    seen = skipped.look()
    assert (seen["total"], seen["new"], seen["longest"], seen["from"], seen["to"]) == (1, 1, 1, 2, 2)


class _Syncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that make the host wait for the device (a value read back, a size that
    depends on the data)."""

    SYNC = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.equal"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in self.SYNC:
            self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["fused", "unroll", "plain"])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_skipping_adds_no_host_sync_to_a_fused_step(kind, clip):
    """The fused optimizers (the GPU's) skip on the device: a step, a skipped one included, reads
    nothing back (the counts are read only when the trainer looks). torch's plain AdamW, which
    takes no found_inf and is built only off the GPU, reads the flag: the mode sees that."""
    from eaglet.draft.step import SkippedSteps

    _, ref = _pair()
    grads = [{n: torch.full(p.shape, v) for n, p in ref.named_parameters()} for v in (0.1, float("inf"))]
    skipped = SkippedSteps(torch.device("cpu"))
    with _Syncs() as mode:
        _stepped(kind, clip, grads, skipped)
    assert (mode.seen == []) == (kind != "plain"), mode.seen
    assert skipped.look()["total"] == 1


def test_skipped_steps_count_runs_in_a_row_across_looks():
    """A run of skips that a good step ends between two looks is still seen at the next; a run
    that goes on past a look is counted whole, from its first step."""
    from eaglet.draft.step import SkippedSteps

    s = SkippedSteps(torch.device("cpu"), first_step=11)
    flags = [0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    looks = {}
    for i, bad in enumerate(flags):
        found = s.flag(torch.tensor(float("nan") if bad else 2.0))
        assert found.item() == bad and found.dtype == torch.float32
        if (i + 1) % 10 == 0:
            looks[11 + i] = s.look()
    looks["end"] = s.look()
    assert looks[20] == {"total": 4, "new": 4, "run": 0, "longest": 3, "from": 12, "to": 14, "first": 12}
    assert looks[30] == {"total": 10, "new": 6, "run": 4, "longest": 4, "from": 27, "to": 30, "first": 22}
    assert looks["end"] == {"total": 12, "new": 2, "run": 6, "longest": 6, "from": 27, "to": 32, "first": 31}
