"""DeepSpeed's Adam optimizers as torch's: `FusedAdam` (DeepSpeed's CUDA kernel) and `DeepSpeedCPUAdam` (its
CPU kernel) compute the same update as torch.optim.Adam, so both are torch's Adam with DeepSpeed's arguments:

    adam_w_mode / adamw_mode = True    decoupled weight decay: p -= lr * weight_decay * p (AdamW)
                             = False   L2: weight_decay * p added to the gradient (classic Adam)

DeepSpeed's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0) apply, not AdamW's 0.01. Like
DeepSpeed, `amsgrad=True` is refused; torch always corrects the moments' bias, so `bias_correction=False` is
refused too. The kernel is torch's fused one where it runs (fp32 tensors on CPU or CUDA), decided at the first
step, when `shardwise.initialize` has pointed the groups at what is really stepped (fp32 masters or shards);
else torch's default (foreach on CUDA). An explicit `foreach=` / `fused=` is kept.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, overload

import torch

from shardwise.errors import UserError

_FUSED_DEVICES = ("cpu", "cuda")


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's `deepspeed.ops.adam.FusedAdam` arguments over torch's Adam (see the module docstring).
    `set_grad_none` is accepted for DeepSpeed's call sites: zero_grad() sets gradients to None as torch's does."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True, *,
                 foreach: bool | None = None, fused: bool | None = None, prefer_fused: bool = True):
        """`prefer_fused=False` (ours) leaves an open kernel choice to torch's own default, so that the numbers
        are bit for bit those of torch.optim.AdamW / Adam built with the same arguments (the optimizer a config's
        "Adam" / "AdamW" builds: `engine.optim`)."""
        _refuse(type(self).__name__, amsgrad=amsgrad, bias_correction=bias_correction)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode, foreach=foreach, fused=fused)
        self.adam_w_mode = adam_w_mode
        self.prefer_fused = prefer_fused

    # torch's two signatures: a closure's loss is returned, no closure returns None.
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if not self.state and self.prefer_fused:
            _prefer_fused(self.param_groups)
        return super().step(closure)


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's `deepspeed.ops.adam.DeepSpeedCPUAdam` arguments (`adamw_mode`) over torch's Adam. Optimizer
    states are fp32 here (the masters are fp32); `fp32_optimizer_states=False` is refused."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True, *,
                 foreach: bool | None = None, fused: bool | None = None):
        if not fp32_optimizer_states:
            raise UserError("DeepSpeedCPUAdam(fp32_optimizer_states=False): shardwise keeps Adam's states in fp32 "
                            "(next to fp32 masters); drop the argument")
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=adamw_mode, weight_decay=weight_decay, amsgrad=amsgrad, foreach=foreach,
                         fused=fused)


def _refuse(name: str, *, amsgrad: bool, bias_correction: bool) -> None:
    if amsgrad:
        raise UserError(f"{name}(amsgrad=True) is not supported (DeepSpeed's kernel refuses it too); use "
                        f"torch.optim.Adam(amsgrad=True)")
    if not bias_correction:
        raise UserError(f"{name}(bias_correction=False) is not supported: torch's Adam always corrects the moments' "
                        f"bias; drop the argument")


def _prefer_fused(groups: list[dict]) -> None:
    """The fused kernel for groups that left the choice open and that it supports (one pass per tensor instead
    of the single-tensor loop's five on CPU)."""
    for group in groups:
        unspecified = group.get("fused") is None and group.get("foreach") is None
        supported = all(p.dtype == torch.float32 and p.device.type in _FUSED_DEVICES for p in group["params"])
        if unspecified and supported and group["params"] and not group.get("differentiable", False):
            group["fused"] = True
