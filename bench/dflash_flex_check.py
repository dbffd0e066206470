"""The DFlash training path on one GPU: flex against dense (values and gradients), and
micro-batches of a Qwen3-8B-sized draft (16k tokens, up to 512 anchors x 16 per document):
forward+backward time, peak memory, and the graphs the compiled flex_attention traced (one).

    python bench/dflash_flex_check.py

Not yet run on a GPU (the DFlash package was written without one); its numbers belong in
docs/performance.md once it has."""
import time, torch
from torch._dynamo.utils import counters
from eaglet.draft.dflash import DFlashConfig, DFlashDraft
from eaglet.draft.dflash.loss import select_anchors, block_loss

dev = torch.device("cuda")
print(torch.__version__, torch.cuda.get_device_name())

def batch(N, doc, A, vocab, share=0.6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [doc] * (N // doc)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    mask = (pos % 512 >= 200)
    rows = select_anchors(mask, docs, 16, 512, seed)
    aux = torch.randn(1, N, A, generator=g).to(dev, torch.bfloat16)
    ids = torch.randint(0, vocab, (1, N), generator=g).to(dev)
    return aux, ids, pos.to(dev), docs.to(dev), mask.to(dev), {k: v.to(dev) for k, v in rows.items()}

# 1. correctness: flex vs dense, values and gradients (fp32, small dims)
torch.manual_seed(0)
c = DFlashConfig(hidden_size=256, target_hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                 intermediate_size=512, vocab_size=1000, draft_vocab_size=500, mask_token_id=999, target_layers=[1, 3],
                 num_aux=2, num_layers=2, block_size=16)
d = DFlashDraft(c).to(dev)
aux, ids, pos, docs, mask, rows = batch(3000, 700, 512, 1000)
aux = aux.float()
out = {}
for impl in ("dense", "flex"):
    d.zero_grad()
    lg = d.block_logits(aux, ids, pos, rows["anchors"], rows["starts"], attn_impl=impl)
    (lg.float().square().mean()).backward()
    out[impl] = (lg.detach(), d.layers[0].self_attn.q_proj.weight.grad.clone(), d.fc.weight.grad.clone())
for a, b in zip(out["dense"], out["flex"]):
    print("flex vs dense max diff", float((a - b).abs().max()), "scale", float(a.abs().max()))

# 2. 8B-sized micro-batches: time, memory, graphs traced
torch.manual_seed(0)
c = DFlashConfig(hidden_size=4096, target_hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=12288, vocab_size=151936, draft_vocab_size=32000, mask_token_id=151935,
                 target_layers=[2, 10, 18, 26, 34], num_aux=5, num_layers=5, block_size=16, rope_theta=1e6)
d = DFlashDraft(c).to(dev)
d.embed_tokens.to(torch.bfloat16)
counters.clear()
for i, (N, doc) in enumerate([(16384, 2048), (12288, 3000), (16384, 4096), (16000, 1600)]):
    aux, ids, pos, docs, mask, rows = batch(N, doc, 5 * 4096, 151936, seed=i)
    teacher = torch.softmax(torch.randn(1, N, 32000, device=dev), -1)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); t = time.time()
    with torch.autocast("cuda", torch.bfloat16):
        lg = d(aux, ids, pos, rows["anchors"], rows["starts"])
        loss = block_loss(lg, rows["anchors"], teacher, torch.ones_like(mask), mask, docs, 7.0)
    loss.total.backward()
    torch.cuda.synchronize()
    print(f"N={N} anchors={rows['anchors'].numel()} fwd+bwd {time.time() - t:.2f}s peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB "
          f"loss {float(loss.total):.3f} graphs {dict(counters['stats'])}", flush=True)
    d.zero_grad(set_to_none=True)
    del lg, loss, teacher
