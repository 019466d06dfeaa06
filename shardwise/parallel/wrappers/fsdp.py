"""`FullyShardedDataParallel`: FSDP1's wrapper spelling, a thin layer over `fully_shard`.

    model = FullyShardedDataParallel(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                     reduce_dtype=torch.float32, buffer_dtype=torch.float32))

`fully_shard` is applied to every module the `auto_wrap_policy` picks (default: each child of the model's
largest ModuleList, the transformer blocks, as the engine's ZeRO-3 cuts units), then to the model itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from shardwise.errors import UserError
from shardwise.parallel.wrappers.fully_shard import fully_shard
from shardwise.parallel.wrappers.policies import CPUOffloadPolicy, as_policy, groups_of
from shardwise.parallel.zero.params import default_unit_modules

_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
"""FSDP1 sharding strategies and what they mean for `reshard_after_forward`."""


def wrap_targets(model: nn.Module, policy: Any) -> list[nn.Module]:
    """The modules to wrap below `model`, inner ones first (the order `fully_shard` needs). `policy`: None (the
    transformer blocks), a set of module classes, or torch's auto-wrap callables (`ModuleWrapPolicy`,
    `transformer_auto_wrap_policy` / `size_based_auto_wrap_policy` bound with functools.partial, any
    `policy(module=, recurse=, nonwrapped_numel=) -> bool`), walked as torch's FSDP1 walks them: children before
    their parent, which is asked with the parameters its wrapped children left. Containers without a forward of
    their own (ModuleList, ModuleDict) are never wrapped: their hooks would never run."""
    if policy is None:
        return [m for _, m in default_unit_modules(model)]
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        decide: Callable[..., bool] = lambda module, recurse, nonwrapped_numel: (  # noqa: E731
            recurse or isinstance(module, classes))
    elif callable(policy):
        decide = policy
    else:
        raise UserError(f"auto_wrap_policy = {policy!r}: give None (the transformer blocks), a set of module "
                        f"classes, or a torch auto-wrap policy")
    chosen: list[nn.Module] = []

    def visit(m: nn.Module, *, is_root: bool) -> int:
        """Wrap below and maybe m; returns the parameters m's subtree put in wrapped modules."""
        numel = sum(p.numel() for p in m.parameters())
        if not decide(module=m, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(visit(child, is_root=False) for child in m.children())
        container = isinstance(m, (nn.ModuleList, nn.ModuleDict))
        if not is_root and not container and decide(module=m, recurse=False, nonwrapped_numel=numel - wrapped):
            chosen.append(m)
            return numel
        return wrapped
    visit(model, is_root=True)
    return chosen


class FullyShardedDataParallel(nn.Module):
    """FSDP1's wrapper: `self.module` is the model, wrapped by `fully_shard` per block and at its root; the
    parameters it exposes are this rank's shards. `no_sync()`, `clip_grad_norm_`, `full_state_dict()`,
    `load_full_state_dict()`, `sharded_state_dict()` and `comm_report()` act on the whole model; the static
    `optim_state_dict` / `optim_state_dict_to_load` are FSDP1's for the optimizer."""

    def __init__(self, module: nn.Module, process_group: Any = None, sharding_strategy: Any = None,
                 cpu_offload: Any = None, auto_wrap_policy: Any = None, mixed_precision: Any = None,
                 device_id: Any = None, sync_module_states: bool = False, *, device_mesh: Any = None,
                 **ignored: Any):
        super().__init__()
        strategy = getattr(sharding_strategy, "name", sharding_strategy) or "FULL_SHARD"
        if strategy not in _RESHARD:
            raise UserError(f"sharding_strategy = {strategy}: FULL_SHARD and SHARD_GRAD_OP are supported; for "
                            f"NO_SHARD use shardwise.DistributedDataParallel")
        unknown = sorted(k for k in ignored if k not in ("use_orig_params", "limit_all_gathers", "forward_prefetch",
                                                         "backward_prefetch"))
        if unknown:
            raise UserError(f"FullyShardedDataParallel: unknown argument(s) {unknown}")
        if device_id is not None and torch.cuda.is_available():
            torch.cuda.set_device(device_id)
        mesh = device_mesh if device_mesh is not None else process_group
        if sync_module_states:           # every rank starts from rank 0's weights, before anything is sharded
            dp = groups_of(mesh).dp
            with torch.no_grad():
                for t in [*module.parameters(), *module.buffers()]:
                    dp.broadcast(t)
        policy = as_policy(mixed_precision)
        offload = CPUOffloadPolicy() if getattr(cpu_offload, "offload_params", False) else None
        reshard = _RESHARD[strategy]
        for block in wrap_targets(module, auto_wrap_policy):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
        # FSDP1 keeps the root gathered after forward under FULL_SHARD too (its backward starts at once): None
        self.module = fully_shard(module, mesh=mesh, reshard_after_forward=None if reshard else False,
                                  mp_policy=policy, offload_policy=offload)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients without communicating; the next one outside reduces the sum."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.module.clip_grad_norm_(max_norm, norm_type)

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The unwrapped model's full state dict (its own key names). Collective."""
        return self.module.full_state_dict(rank0_only=rank0_only)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.module.load_full_state_dict(state_dict)

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.sharded_state_dict()

    def comm_report(self, step: int | None = None) -> list[dict[str, Any]]:
        return self.module.comm_report(step)

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
        """torch FSDP1's default: the whole optimizer state keyed by parameter name, on the CPU, on every rank.
        `optim_state_dict`: the optimizer's own `state_dict()` to convert (default: taken now). Collective."""
        from shardwise.parallel.wrappers.state_dict import optim_state
        return optim_state(model, optim, full=True, to_cpu=True, rank0_only=False,
                           natives=None if optim_state_dict is None else [optim_state_dict],
                           fn="optim_state_dict")

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any],
                                 *, load_directly: bool = False) -> dict[str, Any]:
        """What `optim.load_state_dict` takes on this rank, from `optim_state_dict()`'s whole state (given on every
        rank, saved at any world size); `load_directly` loads it too. Not collective."""
        from shardwise.parallel.wrappers.state_dict import optim_state_to_load
        osd = optim_state_to_load(model, optim, optim_state_dict, full=True, fn="optim_state_dict_to_load")
        if load_directly:
            optim.load_state_dict(osd)
        return osd
