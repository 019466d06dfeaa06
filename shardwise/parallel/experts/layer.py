"""The MoE layer: a router, this rank's experts, optional shared experts, and the token exchange.

    x [..., H] -> tokens [S, H] -> Router -> dispatch_and_combine over the ep group -> y [..., H] (+ shared(x))

A layer is built with all E experts (`MoELayer(...)`, the single-process model), then cut for expert
parallelism by `shard_experts(model, groups)`: each rank keeps the experts of its ep rank, taken from the full
model (so a sharded run starts from the single-process model's weights), and marks them with their expert-dp
group. DeepSpeed's API builds the layer with its local experts directly (`MoELayer(..., experts=...)`).

After each forward the layer holds `routing` (the last `Routing`) and `loss` (aux_loss_coef * load-balancing
loss + z_loss_coef * z-loss, a 0-dim fp32 tensor in the graph) for the model to add to its training loss.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.comm.topology import SoloComm
from shardwise.parallel.experts.config import MoEConfig, check_expert_split
from shardwise.parallel.experts.dispatch import dispatch_and_combine
from shardwise.errors import UserError
from shardwise.parallel.experts.groups import ExpertGroups, build_expert_groups_over
from shardwise.parallel.experts.router import Router, Routing
from shardwise.parallel.replicas import mark_replicas


class _ByReference:
    """The layer's ep `Comm`, held by reference: a deep copy of the model (a reference copy, an EMA) shares the
    process group and its ledger, which are no values to copy (the ledger holds a lock)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def __deepcopy__(self, memo: dict) -> "_ByReference":
        return self


class MoELayer(nn.Module):
    """`experts` holds this rank's experts (all E until `shard_experts` cuts them): a ModuleList, or any module
    iterating over them with a length (DeepSpeed's `Experts`); `first_expert` is the global index of the first."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, *, make_expert: Callable[[], nn.Module] | None = None,
                 experts: nn.Module | None = None, shared: nn.Module | None = None,
                 ep_comm: Comm | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(hidden_size, cfg)     # DeepSpeed's name (gate.wg)
        if experts is None:
            if make_expert is None:
                raise TypeError("MoELayer needs make_expert (to build all experts) or experts (this rank's)")
            experts = nn.ModuleList(make_expert() for _ in range(cfg.num_experts))
        self.experts: nn.Module = experts
        self.shared = shared
        self._ep = _ByReference(ep_comm if ep_comm is not None else SoloComm(None, CommLedger(), name="ep"))
        check_expert_split(cfg.num_experts, self.ep_comm.size)
        local = len(experts)        # type: ignore[arg-type]  # a ModuleList or DeepSpeed's Experts
        if local * self.ep_comm.size != cfg.num_experts:
            raise ValueError(f"MoELayer: {local} local experts x ep {self.ep_comm.size} != {cfg.num_experts} experts")
        self.first_expert = self.ep_comm.rank * local
        self.routing: Routing | None = None
        self.loss: Tensor | None = None
        self._step_stats: Tensor | None = None
        """Sums over this step's training forwards, [E + 3] fp64: kept choices per expert, dropped choices, the
        load-balancing loss and the z-loss (without coefficients). Summed on the device: no host read per forward."""
        self._forwards = 0

    def local_experts(self) -> list[nn.Module]:
        return list(self.experts)          # type: ignore[call-overload]  # a ModuleList or DeepSpeed's Experts

    def record_into(self, ledger: CommLedger) -> None:
        """The all-to-alls go into `ledger` from now on (the engine's: `RecordsCollectives`)."""
        comm = self.ep_comm
        self.ep_comm = dataclasses.replace(comm, ledger=ledger)

    @property
    def ep_comm(self) -> Comm:
        """The ep group the tokens are exchanged over (a group of one: every expert is here)."""
        return self._ep.comm

    @ep_comm.setter
    def ep_comm(self, comm: Comm) -> None:
        self._ep = _ByReference(comm)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])                                   # [S, H]
        routing = self.gate(tokens)
        y = dispatch_and_combine(tokens, routing, self.local_experts(), self.ep_comm, self.cfg.num_experts)
        if self.shared is not None:
            y = y + self.shared(tokens)
        self.routing = routing
        self.loss = self.cfg.aux_loss_coef * routing.aux_loss + self.cfg.z_loss_coef * routing.z_loss
        if self.training:
            self._record(routing)
        return y.reshape(x.shape)

    @torch.no_grad()
    def _record(self, routing: Routing) -> None:
        kept = routing.kept.reshape(-1).to(torch.float64)                                    # [S * k]
        per_expert = torch.zeros(self.cfg.num_experts, dtype=torch.float64, device=kept.device)
        per_expert.scatter_add_(0, routing.expert.reshape(-1), kept)                          # [E]
        row = torch.cat([per_expert, (kept.numel() - kept.sum()).reshape(1),
                         routing.aux_loss.detach().double().reshape(1), routing.z_loss.detach().double().reshape(1)])
        self._step_stats = row if self._step_stats is None else self._step_stats + row
        self._forwards += 1

    def take_step_stats(self) -> tuple[Tensor, int]:
        """(sums [E + 3] fp64, training forwards) since the last call, and start again (zeros when none ran)."""
        stats, forwards = self._step_stats, self._forwards
        self._step_stats, self._forwards = None, 0
        if stats is None:
            stats = torch.zeros(self.cfg.num_experts + 3, dtype=torch.float64, device=self.gate.wg.weight.device)
        return stats, forwards

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + len(self.experts) - 1} of "  # type: ignore[arg-type]
                f"{self.cfg.num_experts}, top-{self.cfg.top_k}")


def moe_layers(model: nn.Module) -> Iterator[MoELayer]:
    return (m for m in model.modules() if isinstance(m, MoELayer))


def moe_loss(model: nn.Module) -> Tensor | None:
    """The sum of the auxiliary losses of the MoE layers that ran in the model's last forward (None: none did)."""
    losses = [m.loss for m in moe_layers(model) if m.loss is not None]
    for m in moe_layers(model):
        m.loss = None                   # each forward's losses are added once
    return torch.stack(losses).sum() if losses else None


@torch.no_grad()
def shard_experts(model: nn.Module, groups: ExpertGroups, ledger: CommLedger | None = None) -> None:
    """Cut every MoE layer of `model` (built whole, the same on every rank) to the experts of this rank's ep rank,
    exchange tokens over `groups.ep_group` and mark the kept experts' parameters with the expert-dp group."""
    ep = groups.ep_size
    ep_comm = Comm(groups.ep_group, ledger or CommLedger(), name=f"ep:{groups.name}")
    ep_rank = ep_comm.rank
    for layer in moe_layers(model):
        per_rank = check_expert_split(layer.cfg.num_experts, ep)
        if len(layer.experts) != layer.cfg.num_experts:          # type: ignore[arg-type]
            raise ValueError("shard_experts: the layer's experts are already cut; build the model whole first")
        layer.experts = nn.ModuleList(list(layer.experts)[ep_rank * per_rank:(ep_rank + 1) * per_rank])  # type: ignore[call-overload]
        layer.ep_comm = ep_comm
        layer.first_expert = ep_rank * per_rank
        mark_replicas(layer.experts.parameters(), groups.replicas)


def apply_expert_parallel(model: nn.Module, ep_size: int, dp_groups: Sequence[Sequence[int]],
                          ledger: CommLedger) -> None:
    """The config's expert parallelism on a model built whole: its MoE layers' experts split over groups of
    `ep_size` ranks of each data-parallel group in `dp_groups` (all of the run's, alike on every rank). A model
    whose layers were already cut by `shard_experts` at this size is left as it is; ep 1 changes nothing."""
    if ep_size == 1:
        return
    layers = list(moe_layers(model))
    if not layers:
        raise UserError(f'"expert_parallel.size" = {ep_size} but the model has no MoE layer (a built-in GPT with '
                        f'moe_experts > 0, or shardwise.moe.layer.MoE); remove the block or train an MoE model')
    sizes = {layer.ep_comm.size for layer in layers}
    if sizes == {ep_size} and all(len(layer.experts) * ep_size == layer.cfg.num_experts  # type: ignore[arg-type]
                                  for layer in layers):
        return
    if sizes != {1}:
        raise UserError(f'"expert_parallel.size" = {ep_size} but the model\'s MoE layers were already split with '
                        f'ep_size {sorted(sizes)}: build the model whole and let the config split it, or give the '
                        f'same size in both places')
    for layer in layers:
        check_expert_split(layer.cfg.num_experts, ep_size)
    shard_experts(model, build_expert_groups_over(ep_size, dp_groups), ledger)
