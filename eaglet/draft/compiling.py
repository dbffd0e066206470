"""torch.compile for the training step's pieces, shaped for packed micro-batches.

    fn = compile_piece(fn)            # torch.compile(fn), PIECE_OPTIONS, kwargs override

Packed micro-batches change their sizes from one step to the next (the packed tokens, the rows
each TTT step's head and loss count, the rows steps 1.. run over), and that meets dynamo in
three places:

- dynamo keeps its graphs per code object, at most `recompile_limit` (8) of them, and past the
  limit runs the function eager with one warning in the log. Pieces compiled as `partial`s all
  sit behind one wrapper's code object, so their graphs share those 8: compile the function
  itself and bind its module afterwards (`partial(compile_piece(fn), module)`). Each piece gets
  a larger limit: its own where torch takes one per call, else the global one raised.
- Duck shaping gives sizes that happen to be equal one symbol: a data size equal to a model
  size would be fixed with it, and compiled again when it moves (`distinct_sizes`).
- dynamo compiles a function for the sizes of its first call, then once more with the sizes
  that changed made symbolic (torch.compile's default). A piece given `data_dims` (argument
  name -> the dims that follow the data) has those dims marked symbolic before every call, so
  its first compile is already the graph the default's second compile makes: one compile, and
  every other size (the model's) still specialised. `dynamic=True` (`PIECE_OPTIONS`) would
  make every size symbolic, the model's too; on a CPU its steps ran at 0.85x the rate
  (docs/performance.md). `MARK_DATA_DIMS = False` turns the marks off
  (`bench/train_throughput.py --dynamic auto`).

`CompileWatch` reads dynamo's counters, so the trainer can say when graphs are still being
made after the warm-up, or a function was given up on.

`use_compile_cache(folder)` keeps inductor's cache (its compiled graphs, kernels and autotuning)
in `folder` for the process: a run that finds the graphs of an earlier one there compiles
nothing, and only dynamo's tracing is left of the warm-up (docs/performance.md).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

PIECE_OPTIONS: dict[str, Any] = {}  # e.g. {"dynamic": True} (module doc)
MARK_DATA_DIMS = True  # the pieces' `data_dims` marked symbolic before their first compile (module doc)
# Each piece's recompile limit: its own where torch.compile takes one per call (torch 2.13 on),
# else the global one raised to it. A layer's halves keep graphs per layer, and evaluation's
# no-grad graphs (under fsdp: elsewhere it runs the training graphs) count too.
PIECE_RECOMPILE_LIMIT = 32
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # inductor reads it when it first needs its cache


def use_compile_cache(folder: str | Path | None, default: Path) -> tuple[Path, bool]:
    """Point inductor's cache at `folder` for this process, before its first compile: a set
    `folder` wins; else $TORCHINDUCTOR_CACHE_DIR where set; else `default`. (The folder in use,
    whether it held anything already.) Made if missing."""
    chosen = Path(folder).expanduser() if folder else Path(_cache_env_set() or default)
    chosen.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(chosen.resolve())
    with os.scandir(chosen) as entries:
        return chosen, any(True for _ in entries)


def _cache_env_set() -> str | None:
    """$TORCHINDUCTOR_CACHE_DIR as someone set it: importing dynamo fills it with torch's own
    default (under the temp folder), which therefore counts as unset."""
    value = os.environ.get(CACHE_ENV)
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return value
    return None if value and os.path.abspath(value) == os.path.abspath(default_cache_dir()) else value


def takes_recompile_limit() -> bool:
    """Whether this torch's torch.compile takes `recompile_limit` (per call; older ones: only
    the global torch._dynamo.config.recompile_limit)."""
    return "recompile_limit" in inspect.signature(torch.compile).parameters


def distinct_sizes() -> None:
    """Give every symbolic size its own symbol (no duck shaping), for this process: dynamo would
    otherwise give sizes that happen to be equal at the first compile one symbol, and a data
    size equal to a model size (64 trained rows in a draft of hidden size 64) would be fixed at
    it, to be compiled again at the next micro-batch. A torch without the setting keeps its own."""
    try:
        import torch.fx.experimental._config as fx_config
    except ImportError:
        return
    if hasattr(fx_config, "use_duck_shape"):
        fx_config.use_duck_shape = False


def compile_piece(fn: Callable[..., Any], data_dims: Mapping[str, tuple[int, ...]] | None = None,
                  **compile_kwargs: Any) -> Callable[..., Any]:
    """torch.compile(fn) with `PIECE_OPTIONS` (and `PIECE_RECOMPILE_LIMIT`, where this torch
    takes one per call) under `compile_kwargs` (e.g. a test's backend), sizes kept distinct
    (`distinct_sizes`). data_dims: fn's argument name -> the dims of that tensor (or of each
    tensor in that tuple) that follow the data, marked symbolic before each call while
    `MARK_DATA_DIMS` holds (module doc)."""
    distinct_sizes()  # lazily, at the first compile: eaglet's training process, not its importers
    options = {**PIECE_OPTIONS, **compile_kwargs}
    if takes_recompile_limit():
        options.setdefault("recompile_limit", PIECE_RECOMPILE_LIMIT)
    else:  # only the global limit: raised to the pieces' (this process compiles eaglet's step)
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, PIECE_RECOMPILE_LIMIT)
    where = _positions(fn, data_dims or {})
    compiled = torch.compile(fn, **options)
    if not where or not MARK_DATA_DIMS or options.get("dynamic") is not None:
        return compiled
    return _marking(compiled, fn, where)


def _positions(fn: Callable[..., Any], data_dims: Mapping[str, tuple[int, ...]]
               ) -> list[tuple[int, str, tuple[int, ...]]]:
    """(position, name, dims) of each argument data_dims names; a name fn does not take is refused."""
    names = list(inspect.signature(fn).parameters)
    unknown = sorted(set(data_dims) - set(names))
    if unknown:
        raise TypeError(f"data_dims names {unknown}, not arguments of {getattr(fn, '__qualname__', fn)}")
    return [(names.index(name), name, dims) for name, dims in data_dims.items()]


def _marking(compiled: Callable[..., Any], fn: Callable[..., Any],
             where: list[tuple[int, str, tuple[int, ...]]]) -> Callable[..., Any]:
    """`compiled`, the data dims at `where` (`_positions`) marked symbolic first
    (maybe_mark_dynamic: a size of 0 or 1, or one the function's code fixes, stays specialised
    without an error)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        for i, name, dims in where:
            mark_data_dims(args[i] if i < len(args) else kwargs.get(name), dims)
        return compiled(*args, **kwargs)

    return call


def mark_data_dims(x: Any, dims: tuple[int, ...]) -> None:
    """Mark `dims` of tensor x (or of each tensor in a tuple or list) symbolic for dynamo."""
    if isinstance(x, torch.Tensor):
        for d in dims:
            if d < x.dim():
                torch._dynamo.maybe_mark_dynamic(x, d)
    elif isinstance(x, (tuple, list)):
        for t in x:
            mark_data_dims(t, dims)


class CompileWatch:
    """What torch.compile did since the last look (`since_last`): the graphs dynamo made, and
    the functions it gave up on at its recompile limit, which run eager from then on. From
    dynamo's own counters; zeros on a torch without them."""

    def __init__(self) -> None:
        self._last = self._now()

    @staticmethod
    def _now() -> tuple[int, int]:
        try:
            from torch._dynamo.utils import counters
        except ImportError:
            return 0, 0
        graphs = int(counters["stats"].get("unique_graphs", 0))
        gave_up = sum(int(n) for k, n in counters["unimplemented"].items() if "recompile limit" in str(k).lower())
        return graphs, gave_up

    def since_last(self) -> tuple[int, int]:
        """(graphs made, functions given up on) since the last call or the watch's start."""
        now = self._now()
        made, self._last = (now[0] - self._last[0], now[1] - self._last[1]), now
        return made
