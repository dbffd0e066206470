"""Once-cast weights and accumulating weight-gradient GEMMs: how the fast TTT unroll
(eaglet/draft/eagle3/unroll.py) uses the draft's linear weights under bf16 autocast.

Under autocast each of the k steps' products would cast the fp32 weight itself; compiled,
every step's graph repeats that cast, and the backward turns each step's bf16 gradient into
fp32 and adds it to the parameter's: per weight, 7 casts forward, 7 back and 6 fp32 adds at
k = 7, all memory-bound and all as large as the weights. Here each weight is cast once per
unroll (`cast_linears`), and:
- accumulate (the default): each step's weight-gradient GEMM adds into one bf16 buffer per
  weight (beta = 1: the add rides in the GEMM's epilogue; `_AccumulatingLinear` and the
  `eaglet::accumulate_weight_grad_` op), handed to the parameter once, cast to fp32, when the
  backward is done with the copy (`_UnrollWeight`);
- accumulate False: the steps' gradients meet in the cast's own (bf16) gradient, summed by
  autograd: the gradients eager autocast computes, which caches the cast the same way.
`UnrollCopy` keeps a weight's bf16 copy and accumulator between steps for UnrollAdamW
(eaglet/draft/optim.py), which reads the accumulated gradient itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = None


# A decoder layer's linear weights (and biases) as one TTT unroll uses them: the linear's own
# name ("q_proj", "q_proj.bias", ...) -> the weight cast to the autocast dtype, and, when the
# unroll's products accumulate their weight gradients themselves, "q_proj.grad" -> the buffer
# they accumulate into and "q_proj.link" -> the scalar that ties them to the hand-off of that
# buffer to the parameter. See `cast_linears`.
Weights = dict[str, Tensor]


def _accumulate_weight_grad(acc: Tensor, grad_out: Tensor, x: Tensor, col0: int = 0) -> None:
    x2 = x.reshape(-1, x.shape[-1])
    acc.narrow(1, col0, x2.shape[1]).addmm_(grad_out.reshape(-1, grad_out.shape[-1]).t(), x2)


def _accumulate_weight_grad_fake(acc: Tensor, grad_out: Tensor, x: Tensor, col0: int = 0) -> None:
    return None


# acc[:, col0 : col0 + in] += grad_out^T x over all rows: one GEMM whose epilogue adds into `acc`
# (beta = 1), written in place also when it is a band of acc's columns (a product that uses
# part of the weight's inputs). An opaque op, so that a compiled backward calls it in place on
# `acc` (inductor turns an in-place addmm_ on a graph input into an out-of-place addmm and a
# copy back). Defined through torch.library's low-level API, with one kernel for every backend:
# the backward calls it once per weight and TTT step (59 times a step at the 8B dims, k = 7), and
# `torch.library.custom_op`'s Python wrappers around each call (autograd, in-place views, its
# checks) cost tens of microseconds of host time each, which at the single-sequence 8B shape is
# time the GPU waits. No autograd formula: it runs in the backward, where grad mode is off.
ACCUMULATE_OP = "eaglet::accumulate_weight_grad_"
_EAGLET_LIB = torch.library.Library("eaglet", "FRAGMENT")  # the registrations live as long as this module
_EAGLET_LIB.define("accumulate_weight_grad_(Tensor(a!) acc, Tensor grad_out, Tensor x, int col0=0) -> ()")
_EAGLET_LIB.impl("accumulate_weight_grad_", _accumulate_weight_grad, "CompositeExplicitAutograd")
torch.library.register_fake(ACCUMULATE_OP, _accumulate_weight_grad_fake, lib=_EAGLET_LIB)
accumulate_weight_grad_ = torch.ops.eaglet.accumulate_weight_grad_.default


class _AccumulatingLinear(torch.autograd.Function):
    """F.linear(x, w, b) whose backward adds the weight gradient into `acc` in the GEMM that
    computes it, instead of handing it to autograd, which would sum the TTT steps' gradients of
    the shared weight with one full-size add per step. `link` (`_UnrollWeight`'s) gets a zero:
    the edge that makes the hand-off to the parameter wait for this product's backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, acc: Tensor, link: Tensor, b: Tensor | None, col0: int = 0
                ) -> Tensor:
        x = x.to(w.dtype)  # what autocast's linear does; the weight gradient needs it in w's dtype
        ctx.save_for_backward(x, w)
        # acc is not saved: the other steps' backward mutate it. col0: w is acc's columns col0...
        ctx.acc, ctx.col0, ctx.has_bias = acc, col0, b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, Tensor, Tensor | None, None]:
        x, w = ctx.saved_tensors
        accumulate_weight_grad_(ctx.acc, g, x, ctx.col0)
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        return g @ w, None, None, g.new_zeros(()), gb, None


class _UnrollWeight(torch.autograd.Function):
    """param -> (its copy in `dtype` for one TTT unroll, a scalar `link`). The products that
    use the copy add their weight gradients into `acc` (`_AccumulatingLinear`) and hand none
    to autograd; they hand a zero to `link`. This node, which therefore runs after all of
    them, hands `acc` to the parameter, cast to its dtype: where the gradient hooks of DDP
    and of gradient accumulation see it. (The copy itself is not differentiable: a compiled
    graph that gives it no gradient drops its edge, and with it the wait.)"""

    @staticmethod
    def forward(ctx: Any, param: Tensor, acc: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)  # no full-size zeros for the copy's (absent) gradient
        ctx.acc, ctx.param_dtype = acc, param.dtype
        w = param.to(dtype)
        ctx.mark_non_differentiable(w)
        return w, param.new_zeros((), dtype=dtype)

    @staticmethod
    def backward(ctx: Any, _w: Tensor | None, _link: Tensor | None) -> tuple[Tensor, None, None]:
        grad, ctx.acc = ctx.acc.to(ctx.param_dtype), None
        return grad, None, None


@dataclass
class UnrollCopy:
    """A linear weight's persistent low-precision copy for the TTT unroll, and the buffer its
    products accumulate the weight gradient into (zero between optimizer steps). Kept on the
    nn.Linear as `unroll_copy` by eaglet.draft.optim.attach_unroll_copies; the optimizer
    (eaglet.draft.optim.UnrollAdamW) reads `grad`, updates the parameter and writes `weight`."""

    weight: Tensor
    grad: Tensor
    version: int  # the parameter's version counter when `weight` was last made from it

    def fresh(self, param: Tensor) -> Tensor:
        """The copy, cast again first if the parameter was changed in place since (a checkpoint
        loaded, an initialisation): its version counter moved."""
        if param._version != self.version:
            with torch.no_grad():
                self.weight.copy_(param)
            self.version = param._version
        return self.weight


def sharded(t: Tensor) -> bool:
    """A DTensor: FSDP2 holds a unit's parameters whole only inside that unit's own forward."""
    return DTensor is not None and isinstance(t, DTensor)


def cast_linears(modules: Iterable[tuple[str, nn.Module]], dtype: torch.dtype, accumulate: bool = True
                 ) -> Weights | None:
    """The weight (and bias) of every nn.Linear among `modules` ((path, module) pairs, as
    `named_modules()` gives them), cast to `dtype`, keyed by the last part of its path (unique
    within a decoder layer). None when they are sharded (an FSDP2 unit outside its forward):
    the products then cast as before.

    accumulate: where a weight gets a gradient, its products accumulate it into a zeroed
    buffer ("<name>.grad", in `dtype`) inside their weight-gradient GEMMs (`_AccumulatingLinear`),
    handed to the parameter once when the backward is done with the copy (`_UnrollWeight`).
    False: autograd sums the products' gradients of the copy, one add per product.

    A linear with an `unroll_copy` (`UnrollCopy`, set by eaglet.draft.optim.attach_unroll_copies for
    the single-process optimizer) gives that persistent copy instead, re-cast only when the
    parameter changed since, and, with grad, its persistent accumulator: the products add into
    it, nothing is handed to the parameter (its .grad stays None), and the optimizer reads it.
    The "link" is then a fresh leaf that only keeps the products' backward running."""
    out: Weights = {}
    for name, mod in modules:
        if isinstance(mod, nn.Linear):
            if sharded(mod.weight):
                return None
            key, weight = name.rsplit(".", 1)[-1], mod.weight
            kept: UnrollCopy | None = getattr(mod, "unroll_copy", None)
            if kept is not None and kept.weight.dtype == dtype:  # eaglet.draft.optim's copy and accumulator
                out[key] = kept.fresh(weight)
                if torch.is_grad_enabled() and weight.requires_grad:
                    if not accumulate:
                        raise ValueError(f"{name}: its gradient goes to unroll_copy.grad; accumulate=False needs "
                                         "the plain optimizer (no unroll copies)")
                    out[key + ".grad"] = kept.grad
                    out[key + ".link"] = torch.zeros((), dtype=dtype, device=weight.device, requires_grad=True)
            elif accumulate and torch.is_grad_enabled() and weight.requires_grad and weight.dtype != dtype:
                out[key + ".grad"] = acc = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
                out[key], out[key + ".link"] = _UnrollWeight.apply(weight, acc, dtype)
            else:
                out[key] = weight.to(dtype)
            if mod.bias is not None:
                out[key + ".bias"] = mod.bias.to(dtype)
    return out


def linear(mod: nn.Linear, name: str, x: Tensor, w: Weights | None, cols: tuple[int, int] | None = None,
           bias: bool = True) -> Tensor:
    """mod(x); with `w`, the same product through w's copy of the weights.
    cols (a, b): the product with the weight's input columns a..b-1 only (x has b - a
    features; a view of the weight, no copy); bias False: without the bias."""
    if w is None and cols is None and bias:
        return mod(x)  # the module itself, its hooks included (inference, and the layers FSDP2 shards)
    if w is None:
        weight, b, acc = mod.weight, mod.bias, None
    else:
        weight, b, acc = w[name], w.get(name + ".bias"), w.get(name + ".grad")
    if cols is not None:
        weight = weight[:, cols[0]:cols[1]]
    if not bias:
        b = None
    if acc is None:
        return F.linear(x, weight, b)
    return _AccumulatingLinear.apply(x, weight, acc, w[name + ".link"], b, 0 if cols is None else cols[0])
