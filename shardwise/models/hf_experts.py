"""How a Hugging Face mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, OLMoE, as installed
transformers builds them) trains under expert parallelism: its hook, beside the models, so that
`shardwise.parallel.experts` knows no model. Nothing of the model's source is edited; its router, its shared experts and its auxiliary loss stay its own.

    shard_hf_experts(model, groups)      # after building the whole model the same on every rank, before initialize

transformers keeps a sparse block's E experts in one module (`MixtralExperts`, ...) of stacked weights, e.g.
gate_up_proj [E, 2I, H] and down_proj [E, H, I], called by the block as experts(x [S, H], top_k_index [S, k],
top_k_weights [S, k]) -> y [S, H]. Each such module is changed in place:

- its stacked weights keep the E / ep experts of this rank's ep rank, under the same names (a parameter's first
  dimension is the expert), marked with the expert-dp group (`parallel/replicas.py`) like the built-in experts;
- its class becomes a subclass of its own (`ExpertParallel<Name>`) whose forward sends each (token, choice) pair
  to the rank holding its expert with the all-to-all exchange of `parallel/experts/dispatch.py`, runs there the
  module's own expert arithmetic (the class's forward, on rows that all chose one local expert with weight 1: so
  every layout transformers knows, fused or biased or transposed, and its chosen experts implementation, compute
  as in the model) and brings the rows back, weighted by the router's top-k weights, into their tokens.

The router's logits are recorded by transformers as before, so `output_router_logits` and
`router_aux_loss_coef` add its load-balancing loss, over this rank's tokens, to the loss as transformers does. No
token is dropped (transformers' sparse blocks drop none); a choice whose index is E or more (a masked choice) is
skipped, as transformers' eager experts skip it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, cast

import torch
from torch import Tensor, nn

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.comm.topology import SoloComm
from shardwise.errors import UserError
from shardwise.parallel.experts.config import check_expert_split
from shardwise.parallel.experts.dispatch import dispatch_and_combine
from shardwise.parallel.experts.groups import ExpertGroups
from shardwise.parallel.experts.router import Routing
from shardwise.parallel.replicas import mark_replicas


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module of stacked weights (its class made by `use_experts_implementation`)."""
    return hasattr(module, "is_concatenated") and isinstance(getattr(module, "num_experts", None), int) and \
        isinstance(getattr(module, "down_proj", None), nn.Parameter)


def hf_experts_modules(model: nn.Module) -> Iterator[nn.Module]:
    return (m for m in model.modules() if is_hf_experts(m))


class _ByReference:
    """The ep `Comm`, shared by a deep copy of the model (a process group and a ledger's lock are no values)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def __deepcopy__(self, memo: dict) -> "_ByReference":
        return self


class _OneExpert(nn.Module):
    """Local expert `index` of `owner`, run by the owner's own class forward on rows [R, H] that all chose it."""

    def __init__(self, run: Any, index: int) -> None:
        super().__init__()
        self.run, self.index = run, index

    def forward(self, rows: Tensor) -> Tensor:
        n = rows.shape[0]
        index = torch.full((n, 1), self.index, dtype=torch.long, device=rows.device)           # [R, 1]
        ones = torch.ones((n, 1), dtype=torch.float32, device=rows.device)                      # [R, 1]
        out: Tensor = self.run(rows, index, ones)
        return out


class ExpertParallelExperts(nn.Module):
    """The mixin of the class a transformers experts module becomes; `num_experts` is then this rank's count,
    `num_global_experts` the model's, `first_expert` the global index of the first local one."""

    num_experts: int
    num_global_experts: int
    first_expert: int
    _ep: _ByReference

    @property
    def ep_comm(self) -> Comm:
        return self._ep.comm

    def record_into(self, ledger: CommLedger) -> None:
        """The all-to-alls go into `ledger` from now on (the engine's: `RecordsCollectives`)."""
        self._ep = _ByReference(dataclasses.replace(self.ep_comm, ledger=ledger))

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """hidden_states [S, H], top_k_index [S, k] (global experts), top_k_weights [S, k] -> y [S, H]."""
        expert = top_k_index.long()
        kept = expert < self.num_global_experts                                           # [S, k]
        expert = torch.where(kept, expert, 0)
        counts = torch.zeros(self.num_global_experts, dtype=torch.int64, device=expert.device)
        counts.scatter_add_(0, expert[kept], torch.ones_like(expert[kept]))
        zero = hidden_states.new_zeros((), dtype=torch.float32)
        # The auxiliary losses are the model's own (from the router logits transformers records): none here.
        routing = Routing(expert, top_k_weights.float(), kept, counts, zero, zero)
        run = super().forward               # the original class's expert arithmetic, on local expert ids
        experts = [_OneExpert(run, e) for e in range(self.num_experts)]
        return dispatch_and_combine(hidden_states, routing, experts, self.ep_comm, self.num_global_experts)

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_experts - 1} of "
                f"{self.num_global_experts}, ep {self.ep_comm.size}")


_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls), {})
    return _CLASSES[cls]


@torch.no_grad()
def shard_hf_experts(model: nn.Module, groups: ExpertGroups | None, ledger: CommLedger | None = None) -> int:
    """Cut every experts module of the transformers MoE `model` (built whole, the same on every rank) to the
    experts of this rank's ep rank and exchange its tokens over `groups.ep_group`; `groups` None: ep 1 (every
    expert here, through the same exchange with a group of one). Returns the number of modules changed."""
    modules = list(hf_experts_modules(model))
    if not modules:
        raise UserError(f"{type(model).__name__} has no transformers experts module of stacked weights (Mixtral, "
                        f"Qwen2-MoE, Qwen3-MoE, gpt-oss of transformers >= 5 have one); expert parallelism cannot "
                        f"split it: train it without expert parallelism")
    ledger = ledger or CommLedger()
    if groups is None:
        comm: Comm = SoloComm(None, ledger, name="ep")
    else:
        comm = Comm(groups.ep_group, ledger, name=f"ep:{groups.name}")
    ep, ep_rank = comm.size, comm.rank
    for module in modules:
        if isinstance(module, ExpertParallelExperts):
            raise ValueError("shard_hf_experts: the model's experts are already cut; build the model whole first")
        total = int(module.num_experts)          # type: ignore[arg-type]
        per_rank = check_expert_split(total, ep)
        first = ep_rank * per_rank
        kept: list[nn.Parameter] = []
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() >= 1 and param.shape[0] == total:        # [E, ...]: one slice per expert
                local = nn.Parameter(param[first:first + per_rank].clone(), requires_grad=param.requires_grad)
                setattr(module, name, local)
                kept.append(local)
        module.__class__ = _expert_parallel_class(type(module))
        ep_module = cast(ExpertParallelExperts, module)
        ep_module.num_experts = per_rank
        ep_module.num_global_experts = total
        ep_module.first_expert = first
        ep_module._ep = _ByReference(comm)
        if groups is not None:
            mark_replicas(kept, groups.replicas)
    return len(modules)
