"""The optimizer step of replicated (ZeRO stage 0) training, with optional fp32 master weights.

fp32: the torch optimizer steps the model's own parameters.
bf16 / fp16: the model holds low-precision parameters; the optimizer steps fp32 master copies
(`masters[i]` pairs with `model_params[i]`, same shape). Each step copies the synchronised low-precision
gradients into the masters' fp32 .grad (dividing out the loss scale), checks fp16 overflow, clips the global
norm, steps, and casts the masters back into the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

from shardwise.precision import LossScaler, grads_have_inf_or_nan

if TYPE_CHECKING:
    from shardwise.parallel.tensor_parallel.grads import TensorParallelGrads


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in the optimizer's per-parameter state (Adam's m, v and step counters...)."""
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
               if torch.is_tensor(t))


def param_groups_of(model_parameters: Iterable[Any]) -> list[dict]:
    """Normalise DeepSpeed's `model_parameters` (an iterable of tensors or of param-group dicts) into
    param-group dicts, keeping only parameters that require grad."""
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in items]
    else:
        groups = [{"params": [p for p in items if p.requires_grad]}]
    return [g for g in groups if g["params"]]


class ReplicatedOptimizer:
    """Owns the step of stage-0 training: unscale, overflow check, clip, step, copy back."""

    checkpoint_per_rank = False     # every rank holds the same state: rank 0 saves it

    def __init__(self, optimizer: torch.optim.Optimizer, *, model_params: list[torch.nn.Parameter],
                 masters: list[torch.nn.Parameter] | None, scaler: LossScaler, clip: float,
                 check_overflow: bool, tp_grads: TensorParallelGrads | None = None):
        self.optimizer = optimizer
        self.model_params = model_params
        self.masters = masters
        self.scaler = scaler
        self.clip = clip
        self.check_overflow = check_overflow
        # Tensor parallelism: the norm and the overflow verdict span the TP group (each rank holds slices).
        self.tp_grads = tp_grads
        self.last_grad_norm: float | None = None

    @property
    def stepped_params(self) -> list[torch.nn.Parameter]:
        return self.masters if self.masters is not None else self.model_params

    def step(self) -> bool:
        """Returns False when the step was skipped because fp16 gradients overflowed."""
        scale = self.scaler.loss_scale
        if self.masters is not None:
            for p, m in zip(self.model_params, self.masters):
                if m.grad is None:
                    m.grad = torch.empty_like(m)
                m.grad.copy_(p.grad)      # [shape] low precision -> fp32
        grads = [p.grad for p in self.stepped_params if p.grad is not None]
        overflow = self.check_overflow and grads_have_inf_or_nan(grads)
        if self.check_overflow and self.tp_grads is not None:
            overflow = self.tp_grads.any_overflow(overflow)
        if overflow:
            self.scaler.update(overflow=True)
            self.last_grad_norm = float("inf")
            return False
        if scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / scale)
        if self.clip > 0 and self.tp_grads is not None:
            self.last_grad_norm = self.tp_grads.clip_(self.stepped_params, self.clip)
        elif self.clip > 0:
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.stepped_params, self.clip))
        self.optimizer.step()
        if self.masters is not None:
            with torch.no_grad():
                for p, m in zip(self.model_params, self.masters):
                    p.copy_(m)    # fp32 -> low precision
        self.scaler.update(overflow=False)
        return True

    def zero_master_grads(self) -> None:
        if self.masters is not None:
            for m in self.masters:
                m.grad = None

    def param_bytes(self) -> int:
        """Model parameters held by this rank (all of them: stage 0 replicates)."""
        return sum(p.numel() * p.element_size() for p in self.model_params)

    def sync_masters_from_model(self) -> None:
        """After loading module weights only: restart the fp32 masters from them."""
        if self.masters is not None:
            with torch.no_grad():
                for p, m in zip(self.model_params, self.masters):
                    m.copy_(p)

    def state_bytes(self) -> int:
        """Optimizer states plus fp32 masters (the ZeRO paper's K*psi, with the masters inside K)."""
        total = optimizer_state_bytes(self.optimizer)
        if self.masters is not None:
            total += sum(m.numel() * m.element_size() for m in self.masters)
        return total

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                "masters": [m.detach().clone() for m in self.masters] if self.masters is not None else None}

    def load_state_dict(self, state: dict, *, load_optimizer_states: bool = True) -> None:
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
        if self.masters is not None and state.get("masters") is not None:
            with torch.no_grad():
                for m, saved in zip(self.masters, state["masters"]):
                    m.copy_(saved)


def make_masters(groups: list[dict]) -> tuple[list[dict], list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """fp32 master copies of every parameter, in param-group form for the optimizer.
    Returns (master groups, model params flat, masters flat) with matching order."""
    model_params, masters, master_groups = [], [], []
    for g in groups:
        ms = [torch.nn.Parameter(p.detach().to(torch.float32).clone()) for p in g["params"]]
        model_params += g["params"]
        masters += ms
        master_groups.append(dict(g, params=ms))
    return master_groups, model_params, masters
