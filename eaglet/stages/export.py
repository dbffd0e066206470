"""The `export` stage: the trained draft in the formats vLLM and SGLang load, each checked.

    eaglet export CONFIG [--format vllm|sglang]     # or as a stage of `eaglet run`

Reads the trained draft (`<train>/final/`, eaglet/formats/draft.py: its files checked against
their checksums.json, and refused when a weight is not finite) and writes each format of
`export.formats` that the draft's type writes (its SERVING_FORMATS: a P-EAGLE draft has no SGLang
export, and a note says so) into `<export>/<format>/` with its checksums.json
(eaglet/formats/serving.py says what each holds).
Every export is then read back through the same reader `train.init_from` uses and must give
the trained draft's logits (within bf16 rounding for a bf16 export), and must hold exactly what
its engine's loader reads (eaglet/formats/loaders.py: every weight matched to a
parameter, none missing, every config key it reads), or the stage fails. It ends by logging
each export's folder and the command that serves the target with it; the stage's result (its
manifest's stats) holds them too: {format: {path, reload_max_logit_error, dtype, serve_command}}.

The vLLM export names the target (speculators_config.verifier) by export.verifier_name_or_path,
else target.path; its architectures are the target's config.json's, else the store's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import Config
from ..errors import ConfigError
from ..draft import draft_type, draft_type_of
from ..formats.draft import FINAL_DIR, load_final
from ..formats.serving import export_draft, load_draft
from ..formats.loaders import ENGINES, PROBLEMS, read_config, serve_commands, speculators_verifier_problem
from ..formats.store import StoreReader, read_target_config
from ..targets.load import local_folder
from ..utils import log
from ..context import StageContext


def run_export(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    """Stage `export`: write every format of `export.formats` into `<run>/export/<format>/`,
    read each back with `load_draft` and check that it gives the trained draft's logits and
    holds what its engine's loader reads; then log the commands that serve them."""
    model, aux_layers = load_final(ctx.upstream["train"] / FINAL_DIR)
    model.eval()
    verifier = cfg.export.verifier_name_or_path or cfg.target.path
    architectures = target_architectures(cfg, ctx.upstream["extract"])
    include_embed = cfg.export.include_embed
    embed_scale = float(StoreReader(ctx.upstream["extract"], verify=False).meta.get("embed_scale") or 1.0)
    if embed_scale != 1.0 and not include_embed:
        # The engines give a draft without embed_tokens the target's raw table, which lacks
        # the family's scale (Gemma: sqrt(H)); the draft's own, scaled, copy is exported.
        include_embed = True
        log(f"[export] the target scales its embedding by {embed_scale:g}: exporting the draft's (scaled) "
            "embed_tokens although export.include_embed is off")
    out: dict[str, Any] = {}
    for fmt in export_formats(cfg, draft_type_of(model)):
        folder = export_draft(
            model, ctx.out_dir / fmt, fmt, aux_layer_ids=aux_layers, verifier_name_or_path=verifier,
            verifier_architectures=architectures, num_speculative_tokens=cfg.export.speculative_tokens,
            include_embed=include_embed, dtype=cfg.export.dtype,
        )
        dcfg, state, meta = load_draft(folder, own=True)
        back = draft_type(meta["algorithm"]).from_config(dcfg.to_dict())
        back.load_state_dict({**state, "embed_tokens.weight": model.embed_tokens.weight}, strict=True)
        err = _reload_error(model, back.eval())
        tol = 1e-4 if cfg.export.dtype == "float32" else 0.1
        if err > tol:
            raise RuntimeError(f"export {fmt}: the reloaded draft's logits differ from the trained draft's by {err:.3g}")
        problems = PROBLEMS[meta["algorithm"]][fmt](folder)
        if problems:
            raise RuntimeError(f"export {fmt}: {folder} would not load as {ENGINES[meta['algorithm']][fmt]} loads it: "
                               + "; ".join(problems))
        out[fmt] = {"path": str(folder), "reload_max_logit_error": err, "dtype": meta.get("dtype")}
        log(f"[export] {fmt}: {folder} (reloaded, max logit error {err:.2e}; matches its engine's loader)")
    # Only the speculators format names the verifier (an MLA draft's export has no such field).
    _warn_about_the_verifier(cfg, verifier, "vllm" in out and "speculators_model_type" in read_config(out["vllm"]["path"]))
    commands = serve_commands(draft_type_of(model).NAME, verifier, {fmt: v["path"] for fmt, v in out.items()},
                              cfg.export.speculative_tokens)
    for fmt, command in commands.items():
        out[fmt]["serve_command"] = command
        log(f"[export] serve with {'vLLM' if fmt == 'vllm' else 'SGLang'}: {command}")
    return out


def export_formats(cfg: Config, kind: Any) -> list[str]:
    """The formats of export.formats that the draft's type writes (its SERVING_FORMATS), a
    one-line note naming the others; a ConfigError when it writes none of them."""
    wanted = list(cfg.export.formats)
    formats = [fmt for fmt in wanted if fmt in kind.SERVING_FORMATS]
    if not formats:
        raise ConfigError(f"export.formats {wanted}: a {kind.TITLE} draft exports only as {list(kind.SERVING_FORMATS)}",
                          fix=f"set export.formats to {list(kind.SERVING_FORMATS)}")
    others = [fmt for fmt in wanted if fmt not in formats]
    if others:
        log(f"[export] note: no {', '.join(others)} export: the {kind.TITLE} draft type has none "
            f"(it exports as {list(kind.SERVING_FORMATS)})")
    return formats


def target_architectures(cfg: Config, store: Path) -> list[str]:
    """The target's `architectures`: its own config.json's (what speculators and vLLM read of the
    verifier), else those of the text config the store kept, which a multimodal target's and
    the vLLM extraction's lack."""
    folder = local_folder(cfg.target.path, cfg.target.revision)
    if folder is not None and (folder / "config.json").is_file():
        archs = json.loads((folder / "config.json").read_text()).get("architectures")
        if archs:
            return list(archs)
    return list(read_target_config(store).get("architectures") or [])


def _warn_about_the_verifier(cfg: Config, verifier: str, vllm: bool) -> None:
    """`vllm`: a speculators-format vLLM export was written. A warning where it would not load: a local verifier checkpoint that
    speculators cannot take the embedding from (the doctor warns too). A local verifier path,
    the default for a local target, serves on this machine: a note says how to serve elsewhere."""
    if not vllm:
        return
    folder = local_folder(verifier, cfg.target.revision)
    problem = speculators_verifier_problem(folder) if folder is not None else None
    if problem:
        log(f"[export] warning: {problem}")
    if not cfg.export.verifier_name_or_path and Path(verifier).is_absolute():
        log(f"[export] the vLLM export names the target by its local path {verifier}, as the serve commands below "
            "do, for this machine; to serve it elsewhere, set export.verifier_name_or_path to the target's hub id "
            "(or its path there)")


@torch.no_grad()
def _reload_error(a: nn.Module, b: nn.Module) -> float:
    """Max |logit difference| of two drafts of one type on the same random input (its type's
    `reload_logits`), compared in fp32."""
    logits = draft_type_of(a).reload_logits
    return max(float((x - y).abs().max()) for x, y in zip(logits(a.float()), logits(b.float())))
