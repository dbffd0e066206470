"""Tiny stand-ins for real targets: tokenizers, chat templates, random models and chat data.

Tests, the shipped example and (later) the doctor's shadow run build these in code, so
nothing is downloaded. They have the structure of the real thing (a byte-level BPE
tokenizer with special tokens and a chat template; a transformers model class of the same
family) at a size that runs in milliseconds on a CPU.

    python -m eaglet.testing.tiny --out examples/tiny   # writes target/ and data.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from ..targets.families import TINY_BASE
from ..targets.families import tiny_config as family_tiny_config
from ..targets.load import model_from_config

# ---- chat templates (the shapes real targets use) -------------------------------------------

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# ChatML that injects a default system prompt when the conversation has none (as SmolLM2 does).
DEFAULT_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful AI assistant named Tiny.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Mistral-style: no header for the assistant; its turn ends with the EOS token.
INST_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)

# ChatML with generation markers, so transformers can return the assistant mask itself.
CHATML_GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEMPLATES = {
    "llama3": LLAMA3_TEMPLATE,
    "chatml": CHATML_TEMPLATE,
    "default_system": DEFAULT_SYSTEM_TEMPLATE,
    "inst": INST_TEMPLATE,
    "chatml_generation": CHATML_GENERATION_TEMPLATE,
}

SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_start|>", "<|im_end|>", "<pad>", "[INST]", "[/INST]",
]

# ---- chat data --------------------------------------------------------------------------------

_WORDS = (
    "the a model draft token layer state value train test speed fast slow target verify accept "
    "reject sample batch shard write read store index check sum cache tree chain step loss mask "
    "vocab head norm attention query key weight gradient learn rate warm decay seed data file "
    "record line row prompt answer question explain why how what when where which number one two "
    "three four five six seven eight nine ten hundred red green blue small large good bad new old"
).split()


def _sentence(rng: random.Random, lo: int = 3, hi: int = 12) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + rng.choice([".", "?", "!", "."])


def make_conversations(n: int, seed: int = 0, max_turns: int = 3) -> list[dict[str, Any]]:
    """`n` ShareGPT-style records with 1..max_turns exchanges; some have a system prompt.

    The assistant repeats and extends words of the question, so a draft has something to learn.
    """
    rng = random.Random(seed)
    out = []
    for i in range(n):
        conv = []
        if rng.random() < 0.2:
            conv.append({"from": "system", "value": "You answer briefly."})
        for _ in range(rng.randint(1, max_turns)):
            q = " ".join(_sentence(rng) for _ in range(rng.randint(1, 2)))
            words = q.rstrip(".?!").lower().split()
            a = "Answer: " + " ".join(words[: rng.randint(2, len(words))]) + ". " + _sentence(rng)
            conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        out.append({"id": f"tiny-{i}", "conversations": conv})
    return out


# ---- tokenizer ----------------------------------------------------------------------------------

def build_tokenizer(template: str = "chatml", vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE tokenizer (fast, with offsets) trained on tiny chat text, with the
    special tokens of the common templates and the named chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = []
    for rec in make_conversations(300, seed=seed):
        corpus += [t["value"] for t in rec["conversations"]]
    corpus += ["system user assistant", "You are a helpful AI assistant named Tiny."]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>" if "im_end" in TEMPLATES[template] else "<|end_of_text|>",
        pad_token="<pad>",
    )
    fast.chat_template = TEMPLATES[template]
    return fast


# ---- models -------------------------------------------------------------------------------------

def tiny_config(family: str = "llama", vocab_size: int = 512, **overrides: Any):
    """A small transformers config: "llama" (the plain tiny Llama most tests and the golden run
    use) or any family key of eaglet.targets.families (its `tiny` config)."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(**{**TINY_BASE, "vocab_size": vocab_size, **overrides})
    return family_tiny_config(family, vocab_size, **overrides)


def build_model(family: str = "llama", seed: int = 0, vocab_size: int = 512, remote_code: bool = False,
                **overrides: Any):
    """A random float32 model of `tiny_config(family)`. remote_code (family "kimi_k25" only): the
    checkpoint-style remote-code wrapper (eaglet/testing/remote_kimi_k25.py) instead of transformers' class."""
    import torch

    torch.manual_seed(seed)
    cfg = tiny_config(family, vocab_size=vocab_size, **overrides)
    if remote_code:
        if family != "kimi_k25":
            raise ValueError(f"remote_code: only the kimi_k25 family has a remote-code stand-in, not {family!r}")
        from . import remote_kimi_k25 as remote

        text = {k: v for k, v in cfg.get_text_config().to_dict().items() if k != "model_type"}
        rcfg = remote.KimiK25Config(text_config=text, auto_map=dict(remote.AUTO_MAP),
                                    architectures=["KimiK25ForConditionalGeneration"])
        return remote.KimiK25ForConditionalGeneration(rcfg).float().eval()
    return model_from_config(cfg, dtype=torch.float32).eval()


def save_target(out_dir: str | Path, family: str = "llama", template: str = "chatml", seed: int = 0,
                remote_code: bool = False, tokenizer: Any = None, **overrides: Any) -> Path:
    """Write a tiny target (model + tokenizer with chat template) to `out_dir`; with remote_code
    the model's code file is written beside it (load it with trust_remote_code). `tokenizer`:
    one already built (else `build_tokenizer(template, seed)`)."""
    import shutil

    out = Path(out_dir)
    tok = tokenizer if tokenizer is not None else build_tokenizer(template, seed=seed)
    vocab_size = overrides.pop("vocab_size", len(tok))  # a larger one pads the model's vocabulary
    model = build_model(family, seed=seed, vocab_size=vocab_size, remote_code=remote_code, **overrides)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if remote_code:
        shutil.copy(Path(__file__).with_name("remote_kimi_k25.py"), out / "modeling_kimi_k25.py")
    return out


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a tiny target model and chat dataset.")
    ap.add_argument("--out", required=True, help="Folder for target/ and data.jsonl.")
    ap.add_argument("--family", default="llama", help="Model family of the tiny target.")
    ap.add_argument("--template", default="default_system", choices=sorted(TEMPLATES), help="Chat template.")
    ap.add_argument("--records", type=int, default=400, help="Number of conversations.")
    args = ap.parse_args()
    save_target(Path(args.out) / "target", family=args.family, template=args.template)
    write_jsonl(Path(args.out) / "data.jsonl", make_conversations(args.records, seed=1))


if __name__ == "__main__":
    main()
