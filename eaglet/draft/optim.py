"""The single-process optimizer path: AdamW over the TTT unroll's low-precision gradients.

Under bf16 autocast every TTT unroll uses each linear weight cast to bf16 once, and the 7
steps' weight-gradient GEMMs add into one bf16 buffer per weight (`casts.cast_linears`). On
the plain path that buffer is made and zeroed per unroll, cast to fp32 into the parameter's
.grad, its norm read for the clipping, and torch's fused AdamW reads the fp32 gradient; the
next unroll casts the weights again. Per weight and step that is, besides AdamW itself, a
bf16 -> fp32 copy of the gradient, a zero fill, an fp32 norm read and an fp32 -> bf16 cast, all
memory-bound and as large as the weights (docs/performance.md, `e8o`, measures what this
path saves).

`attach_unroll_copies` gives each trainable linear a persistent bf16 copy and accumulator
(`casts.UnrollCopy`), and `UnrollAdamW` updates those weights in one compiled kernel each that
reads the accumulated bf16 gradient (divided by the clipping divisor), updates the fp32
weight and AdamW's moments, writes the bf16 copy the next unroll uses, and zeroes the
accumulator. The other parameters (the norms, fc) take torch's fused AdamW as before. The
state is torch AdamW's (`exp_avg`, `exp_avg_sq`, `step` per parameter), so checkpoints move
between the two paths.

Only for one process with one micro-batch per optimizer step: DDP's and FSDP2's gradient
hooks see parameter gradients, which this path does not make, and accumulating several
micro-batches in bf16 would round more than their fp32 sum does. The trainer picks it then
(`train.unroll_optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .casts import UnrollCopy


def attach_unroll_copies(modules: Iterable[nn.Module], dtype: torch.dtype = torch.bfloat16
                         ) -> dict[nn.Parameter, UnrollCopy]:
    """Give every nn.Linear among `modules` with a trainable weight not already in `dtype` an
    `unroll_copy`; returns them by parameter. The TTT unroll (`cast_linears`) uses these; only
    the linears it casts may have one (the draft type's `unroll_linears(draft)`: a linear used
    otherwise would get a .grad, not its copy's)."""
    copies: dict[nn.Parameter, UnrollCopy] = {}
    for mod in modules:
        if isinstance(mod, nn.Linear) and mod.weight.requires_grad and mod.weight.dtype != dtype:
            w = mod.weight
            kept = UnrollCopy(weight=w.detach().to(dtype), grad=torch.zeros(w.shape, dtype=dtype, device=w.device),
                              version=w._version)
            mod.unroll_copy = kept
            copies[w] = kept
    return copies


def adamw_from_low_precision_grads(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    copies: list[Tensor], steps: list[Tensor], lr: Tensor, divisor: Tensor | None,
    beta1: float, beta2: float, eps: float, weight_decay: float, found_inf: Tensor | None = None,
) -> None:
    """AdamW (decoupled weight decay), in place, with the gradient read from a low-precision
    buffer and divided by `divisor` (the clipping's; None: 1); then the low-precision copy of
    the new weight is written and the buffer zeroed. The arithmetic of torch's fused AdamW:
    step + 1; p *= 1 - lr wd; m = lerp(m, g, 1 - b1); v = b2 v + (1 - b2) g^2;
    p -= lr / (1 - b1^step) * m / (sqrt(v) / sqrt(1 - b2^step) + eps).
    found_inf (a device scalar, 1.0 or 0.0, as torch's fused AdamW takes it): at 1.0 the weight,
    moments and step stay as they were (the buffer is still zeroed), decided on the device; at
    0.0 the same bits as without it. Compiled, each weight's update is one kernel."""
    if found_inf is not None:
        _skippable_update(params, grads, exp_avgs, exp_avg_sqs, copies, steps, lr, divisor, beta1, beta2, eps,
                          weight_decay, found_inf)
        return
    for p, g16, m, v, w, step in zip(params, grads, exp_avgs, exp_avg_sqs, copies, steps, strict=True):
        step.add_(1)
        g = g16.float()
        if divisor is not None:
            g = g / divisor
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = v.sqrt() / (1 - beta2**step).sqrt() + eps
        p.sub_(m / denom * (lr / (1 - beta1**step)))
        w.copy_(p)
        g16.zero_()


def _skippable_update(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    copies: list[Tensor], steps: list[Tensor], lr: Tensor, divisor: Tensor | None,
    beta1: float, beta2: float, eps: float, weight_decay: float, found_inf: Tensor,
) -> None:
    """adamw_from_low_precision_grads' update, multiplied out to nothing where `found_inf` is 1:
    each factor is the unskipped one times exactly 1.0 (the same bits), or leaves its tensor as
    it is; the gradient (non-finite, then) is replaced by zeros before it is read."""
    skip = found_inf > 0
    keep = 1 - found_inf  # exactly 1.0 or 0.0
    decay = 1 - lr * weight_decay * keep
    b2 = torch.where(skip, 1.0, beta2)
    for p, g16, m, v, w, step in zip(params, grads, exp_avgs, exp_avg_sqs, copies, steps, strict=True):
        step.add_(keep)
        g = g16.float()
        if divisor is not None:
            g = g / divisor
        g = torch.where(skip, 0.0, g)
        p.mul_(decay)
        m.lerp_(g, (1 - beta1) * keep)
        v.mul_(b2).addcmul_(g, g, value=1 - beta2)
        denom = v.sqrt() / (1 - beta2**step).sqrt() + eps
        p.sub_(torch.where(skip, 0.0, m / denom * (lr / (1 - beta1**step))))
        w.copy_(p)
        g16.zero_()


class UnrollAdamW(torch.optim.AdamW):
    """torch's AdamW (fused) for the parameters with a gradient, and for those with an
    `UnrollCopy` the update from its accumulated low-precision gradient
    (`adamw_from_low_precision_grads`, compiled when `compile`). `grad_scale` (set by
    step.optimizer_step for the clipping) divides both kinds of gradient; `found_inf` (set there
    for a step whose gradient norm is not finite) skips both kinds of update on the device."""

    def __init__(self, params: Iterable[nn.Parameter], copies: dict[nn.Parameter, UnrollCopy], compile: bool = False,
                 **kwargs: Any):
        super().__init__(params, fused=True, **kwargs)
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["differentiable"]:
                raise ValueError("UnrollAdamW: amsgrad, maximize and differentiable are not supported")
        self.copies = copies
        # per group, its parameters with a copy (fixed: load_state_dict keeps the parameters)
        self._kept = [[p for p in group["params"] if p in copies] for group in self.param_groups]
        self._update: Callable[..., None] = (
            torch.compile(adamw_from_low_precision_grads) if compile else adamw_from_low_precision_grads)

    def accumulated_grads(self) -> list[Tensor]:
        """The gradients this optimizer reads that are not parameter .grad (for the clipping norm)."""
        return [c.grad for c in self.copies.values()]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("UnrollAdamW.step takes no closure")
        super().step()  # the parameters with a .grad; those with a copy have none
        divisor = getattr(self, "grad_scale", None)
        for group, ps in zip(self.param_groups, self._kept, strict=True):
            if not ps:
                continue
            if any(p.grad is not None for p in ps):
                raise RuntimeError("UnrollAdamW: a parameter with an unroll copy also has a .grad (its products "
                                   "should accumulate into the copy's buffer only)")
            for p in ps:
                st = self.state[p]
                if not st:  # torch AdamW's (fused) state: a float32 step on the device
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            lr = group["lr"]
            lr_t = lr if isinstance(lr, Tensor) else torch.full((), lr, dtype=torch.float32, device=ps[0].device)
            kept = [self.copies[p] for p in ps]
            beta1, beta2 = group["betas"]
            self._update(ps, [k.grad for k in kept], [self.state[p]["exp_avg"] for p in ps],
                         [self.state[p]["exp_avg_sq"] for p in ps], [k.weight for k in kept],
                         [self.state[p]["step"] for p in ps], lr_t, divisor, float(beta1), float(beta2),
                         float(group["eps"]), float(group["weight_decay"]), getattr(self, "found_inf", None))
            for p, k in zip(ps, kept, strict=True):
                k.version = p._version  # the copy was written from this version
