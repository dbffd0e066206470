"""Compile time and steady state of the training step over varied packed micro-batches (CPU, inductor)."""
import os, sys, time, collections, json
import torch, torch._dynamo
DYN = os.environ.get("DYN") == "1"
real_compile = torch.compile
graphs = collections.Counter()
def patched(fn=None, **kw):
    if DYN: kw["dynamic"] = True
    return (lambda f: real_compile(f, **kw)) if fn is None else real_compile(fn, **kw)
torch.compile = patched
from eaglet.config import TrainSection
from eaglet.draft.model import Eagle3Draft, DraftConfig
from eaglet.draft.step import TeacherHead, micro_batch, Batch, device_head_rows
from eaglet.draft.parallelize import parallelize
import eaglet.draft.loss as L
L.compile_soft_ce()
torch.set_num_threads(1)
H = 256
cfg = DraftConfig(hidden_size=H, target_hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  intermediate_size=4 * H, vocab_size=4096, draft_vocab_size=2048)
torch.manual_seed(0)
model = Eagle3Draft(cfg)
teacher = TeacherHead(torch.randn(4096, H), torch.ones(H))
dev = torch.device("cpu")
par = parallelize(model, teacher, "none", dev, compile=True)
tc = TrainSection(max_tokens=1024, ttt_steps=4, attn_impl="chunked", compile="on")
g = torch.Generator().manual_seed(1)
def batch():
    lens, tot = [], 0
    while True:
        n = int(torch.randint(50, 500, (1,), generator=g))
        if tot + n > tc.max_tokens: break
        lens.append(n); tot += n
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lens)])[None]
    mask = torch.rand(1, tot, generator=g) < 0.6
    rows, active = device_head_rows(mask, docs, tc.ttt_steps, dev)
    return Batch(torch.randn(1, tot, 3 * H, generator=g), torch.randn(1, tot, H, generator=g),
                 torch.randint(0, 4096, (1, tot), generator=g), mask,
                 torch.cat([torch.arange(n) for n in lens])[None], docs, tot, lens=tuple(lens),
                 head_rows=rows, active_rows=active)
batches = [batch() for _ in range(16)]
opt = torch.optim.AdamW(model.parameters(), 1e-3)
ac = torch.autocast("cpu", enabled=False)
times = []
for b in batches:
    t = time.perf_counter()
    micro_batch(par, b, tc, ac, True); opt.step(); opt.zero_grad()
    times.append(time.perf_counter() - t)
warm = sum(times[:4]); steady = sorted(times[6:])[len(times[6:]) // 2]
tok = sum(b.tokens for b in batches[6:]) / len(batches[6:])
from torch._dynamo.utils import counters
print(json.dumps({"mode": os.environ.get("MODE"), "first4_s": round(warm, 1), "per_batch_s": [round(x, 2) for x in times],
                  "steady_median_s": round(steady, 3), "frames": dict(counters["stats"])}))
