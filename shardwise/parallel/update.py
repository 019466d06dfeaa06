"""The optimizer update every data-parallel strategy shares, and what its builders are given.

Whatever holds the gradients (whole replicated tensors, ZeRO shards, offloaded masters), one step is

    load grads into what the optimizer steps -> sum tied copies over the stages sharing them -> overflow verdict
    (every rank holding part of the model agrees) -> unscale -> clip by the whole model's norm -> optimizer.step()
    -> publish the new values to the model -> update the loss scale

`Update.step` is that skeleton; a strategy supplies only `_load_grads` and `_publish` (and its checkpoint
state). The norm and the overflow verdict come from a `GradNormReducer` bound to the stepped tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from shardwise.parallel.grad_norm import GradNormReducer, ExtraSums
from shardwise.parallel.interfaces import HeldBytes, Piece, SteppedEntry
from shardwise.parallel.tied import TiedSlot, sum_tied_grads
from shardwise.parallel.precision import LossScaler


@dataclass(frozen=True)
class UpdateRecipe:
    """What every update strategy needs beyond its own config section, decided once by `initialize`."""

    make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]
    """Builds the user's optimizer (config block or client object) over the param groups of what is stepped."""
    scaler: LossScaler
    clip: float
    """gradient_clipping: the global norm bound, 0 = off."""
    check_overflow: bool
    """Skip a step whose gradients hold inf/nan (fp16 always; bf16 unless bf16_check_grad_overflow is off)."""
    dtype: torch.dtype
    """The model's dtype: below fp32 the optimizer steps separate fp32 masters."""
    compute_norm: bool = True
    """Report the global gradient norm also when not clipping (DeepSpeed's zero_optimization.compute_grad_norm)."""


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


class Update:
    """The step skeleton. `stepped`: the tensors the optimizer updates (the model's own parameters, or
    `masters`: fp32 copies or shards that the strategy keeps apart from the model)."""

    checkpoint_per_rank = False
    """Whether each rank saves its own optimizer state (ZeRO shards) or rank 0 saves everyone's (replicated)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, stepped: list[torch.nn.Parameter],
                 masters: list[torch.nn.Parameter], separate_masters: bool, recipe: UpdateRecipe,
                 norms: GradNormReducer, tied: tuple[TiedSlot, ...] = ()):
        self.optimizer = optimizer
        self.tied = tied
        """Stepped tensors that are copies of a weight other stages hold (`parallel/tied.py`)."""
        self.stepped = stepped
        self.masters = masters
        self.separate_masters = separate_masters
        self.scaler = recipe.scaler
        self.clip = recipe.clip
        self.check_overflow = recipe.check_overflow
        self.norms = norms
        self.compute_norm = recipe.compute_norm
        self.last_grad_norm: float | None = None

    def step(self, extra: ExtraSums | None = None) -> bool:
        """One update; False when it was skipped because some rank's gradients overflowed. `extra`: metrics
        summed over their group with the verdict and read with it (`grad_norm.py`, [Note: one host read per step]).

        Everything up to the verdict's read stays on the device: unscale, the overflow count and the norm (one
        all-reduce per group), clipping by a device coefficient (harmless when the step is then skipped: the
        gradients are zeroed after it). The read is the step's one host sync."""
        self._load_grads()
        sum_tied_grads(self.stepped, self.tied)
        grads = [p.grad for p in self.stepped if p.grad is not None]
        scale = self.scaler.loss_scale
        if scale != 1.0:             # inf/nan stay inf/nan: the overflow verdict is unchanged by unscaling first
            torch._foreach_mul_(grads, 1.0 / scale)
        want_norm = self.clip > 0 or self.compute_norm     # DeepSpeed reports the norm without clipping too
        verdict = self.norms.agree(self.stepped, check_overflow=self.check_overflow, want_norm=want_norm,
                                   extra=extra)
        if self.clip > 0 and verdict.norm is not None:
            self.norms.clip_with_norm_(self.stepped, self.clip, verdict.norm)
        overflow, norm, extra_sums = verdict.read()
        if extra is not None:
            extra.values = extra_sums
        if overflow:
            self.scaler.update(overflow=True)
            self.last_grad_norm = float("inf") if want_norm else None
            return False
        self.last_grad_norm = norm
        self.optimizer.step()
        self._publish()
        self.scaler.update(overflow=False)
        return True

    def _load_grads(self) -> None:
        """Give every stepped tensor its synchronised gradient (`.grad`), cast to its dtype and device."""
        raise NotImplementedError

    def _publish(self) -> None:
        """Make the updated stepped tensors the model's parameters (cast back, all-gather...)."""
        raise NotImplementedError

    def zero_master_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    def state_bytes(self) -> int:
        """Optimizer states plus separate fp32 masters (the ZeRO paper's K*psi, with the masters inside K)."""
        total = optimizer_state_bytes(self.optimizer)
        if self.separate_masters:
            total += sum(m.numel() * m.element_size() for m in self.masters)
        return total

    def staging_bytes(self) -> int:
        """Host buffers that only stage copies between host and device (none unless offloading)."""
        return 0

    def param_bytes(self) -> int:
        """The model's parameters as this rank holds them."""
        raise NotImplementedError

    def held_bytes(self) -> HeldBytes:
        return HeldBytes(params=self.param_bytes(), optimizer=self.state_bytes(), staging=self.staging_bytes())

    def state_dict_mismatch(self, state: dict[str, Any]) -> str | None:
        """Replicated state loads wherever the layout index matched it."""
        return None

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                "masters": [m.detach().clone() for m in self.masters] if self.masters else None}

    # -- layout-independent checkpoints: what each stepped tensor holds, and loading it piece by piece -----
    def pieces(self) -> list[list[Piece]]:
        """Per stepped tensor (the order of `stepped`): the parameter pieces it holds."""
        raise NotImplementedError

    def entries(self) -> list[SteppedEntry]:
        """Per stepped tensor: its pieces, its index in `optimizer.state_dict()["state"]` (torch numbers the
        parameters of the groups in order) and in `state_dict()["masters"]`, and its group's options."""
        order = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        group = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        masters = {id(m): i for i, m in enumerate(self.masters)}
        return [SteppedEntry(pieces=ps, optimizer_index=order[id(t)], master_index=masters.get(id(t)),
                             options={k: v for k, v in group[id(t)].items() if k != "params"})
                for t, ps in zip(self.stepped, self.pieces())]

    @torch.no_grad()
    def load_stepped(self, values: Sequence[torch.Tensor | None], states: Sequence[dict[str, Any]] | None,
                     options: Sequence[dict[str, Any]] | None, scaler: dict[str, Any] | None) -> None:
        """Set every stepped tensor from values assembled for this layout (None: keep it), and with `states`
        the optimizer's per-tensor state, each group's options (from its first tensor) and the loss scaler;
        then publish to the model as after a step."""
        for t, v in zip(self.stepped, values):
            if v is not None:
                t.copy_(v)
        if states is not None and options is not None:
            sd = self.optimizer.state_dict()
            for entry, st in zip(self.entries(), states):
                if st:
                    sd["state"][entry.optimizer_index] = st
            by_tensor = {id(t): o for t, o in zip(self.stepped, options)}
            for g, saved in zip(self.optimizer.param_groups, sd["param_groups"]):
                if g["params"] and id(g["params"][0]) in by_tensor:
                    saved.update(by_tensor[id(g["params"][0])])
            self.optimizer.load_state_dict(sd)
            if scaler is not None:
                self.scaler.load_state_dict(scaler)
        self._after_load()

    def _after_load(self) -> None:
        """Make loaded stepped tensors the model's parameters."""
        self._publish()

    @torch.no_grad()
    def _load_common(self, state: dict, load_optimizer_states: bool) -> None:
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
        if state.get("masters") is not None:
            for m, saved in zip(self.masters, state["masters"]):
                m.copy_(saved)
