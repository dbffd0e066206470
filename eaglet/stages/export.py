"""The `export` stage: the trained draft in the formats vLLM and SGLang load, each checked.

    eaglet export CONFIG [--format vllm|sglang]     # or as a stage of `eaglet run`

Reads the trained draft (`<train>/final/`, eaglet/formats/draft.py) and writes each format of
`export.formats` into `<export>/<format>/` (eaglet/formats/serving.py says what each holds).
Every export is then read back through the same reader `train.init_from` uses and must give
the trained draft's logits (within bf16 rounding for a bf16 export), or the stage fails.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import Config
from ..draft.model import Eagle3Draft
from ..formats.draft import FINAL_DIR, load_final
from ..formats.serving import export_draft, load_draft
from ..formats.store import StoreReader, read_target_config
from ..utils import log
from .context import StageContext


def run_export(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    """Stage `export`: write every format of `export.formats` into `<run>/export/<format>/`,
    then read each back with `load_draft` and check that it gives the trained draft's logits."""
    model, aux_layers = load_final(ctx.upstream["train"] / FINAL_DIR)
    model.eval()
    target_cfg = read_target_config(ctx.upstream["extract"])
    architectures = target_cfg.get("architectures") or []
    include_embed = cfg.export.include_embed
    embed_scale = float(StoreReader(ctx.upstream["extract"], verify=False).meta.get("embed_scale") or 1.0)
    if embed_scale != 1.0 and not include_embed:
        # The engines give a draft without embed_tokens the target's raw table, which lacks
        # the family's scale (Gemma: sqrt(H)); the draft's own, scaled, copy is exported.
        include_embed = True
        log(f"[export] the target scales its embedding by {embed_scale:g}: exporting the draft's (scaled) "
            "embed_tokens although export.include_embed is off")
    out: dict[str, Any] = {}
    for fmt in cfg.export.formats:
        folder = export_draft(
            model, ctx.out_dir / fmt, fmt, aux_layer_ids=aux_layers, verifier_name_or_path=cfg.target.path,
            verifier_architectures=architectures, num_speculative_tokens=cfg.export.speculative_tokens,
            include_embed=include_embed, dtype=cfg.export.dtype,
        )
        dcfg, state, meta = load_draft(folder)
        back = Eagle3Draft(dcfg)
        back.load_state_dict({**state, "embed_tokens.weight": model.embed_tokens.weight}, strict=True)
        err = _reload_error(model, back.eval())
        tol = 1e-4 if cfg.export.dtype == "float32" else 0.1
        if err > tol:
            raise RuntimeError(f"export {fmt}: the reloaded draft's logits differ from the trained draft's by {err:.3g}")
        out[fmt] = {"path": str(folder), "reload_max_logit_error": err, "dtype": meta.get("dtype")}
        log(f"[export] {fmt}: {folder} (reloaded; max logit error {err:.2e})")
    return out


@torch.no_grad()
def _reload_error(a: Eagle3Draft, b: Eagle3Draft) -> float:
    """Max |logit difference| of two drafts on one random input, compared in fp32."""
    g = torch.Generator().manual_seed(0)
    c = a.config
    aux = torch.randn(1, 16, c.num_aux * c.target_hidden_size, generator=g)
    ids = torch.randint(0, c.vocab_size, (1, 16), generator=g)
    la = a.float().ttt_forward(aux, ids, num_steps=2, attn_impl="naive")
    lb = b.float().ttt_forward(aux, ids, num_steps=2, attn_impl="naive")
    return max(float((x - y).abs().max()) for x, y in zip(la, lb))
