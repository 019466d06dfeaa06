"""DeepSpeed's `MoE` layer over shardwise's (`parallel/experts`): the same arguments, the same routing rule and
the same `(output, l_aux, exp_counts)`.

DeepSpeed's semantics kept here: each rank holds `num_experts / ep_size` deep copies of `expert`; the gate is a
bias-free Linear in fp32; k = 1 keeps raw softmax weights and picks which tokens an over-full expert keeps at
random (`use_rts`) or in token order, k = 2 renormalises the two weights and drops by position (first choices
first), samples the second expert with Gumbel noise (`top2_2nd_expert_sampling`), k > 2 drops the lowest
scores; capacity per expert and rank is max(ceil(S / E * capacity_factor * k), min_capacity); `drop_tokens=False`
drops nothing; `l_aux` is the load-balancing loss without a coefficient (the script scales and adds it);
`exp_counts` the tokens this rank routed to each expert before capacity. The groups are DeepSpeed's layout
(`shardwise.utils.groups`), made when the layer is built, so torch.distributed must be initialised first when
ep_size > 1. Tokens are exchanged with variable splits (only the kept ones) instead of DeepSpeed's padded
[E, capacity, H] buffers: the same results, fewer bytes.
"""

from __future__ import annotations

import copy
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.errors import UserError
from shardwise.parallel.experts import BalanceCount, DropPolicy, MoEConfig, MoELayer, NoisyGate
from shardwise.parallel.experts.config import check_expert_split
from shardwise.parallel.replicas import ReplicaGroup, mark_replicas


class Experts(nn.Module):
    """DeepSpeed's container of a rank's experts (`deepspeed_experts`, its state-dict names), iterable as a list."""

    def __init__(self, expert: nn.Module, num_local_experts: int) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.deepspeed_experts)

    def __len__(self) -> int:
        return len(self.deepspeed_experts)


class MoE(nn.Module):
    """DeepSpeed's `deepspeed.moe.layer.MoE`, with its state-dict names (`deepspeed_moe.gate.wg`,
    `deepspeed_moe.experts.deepspeed_experts.N`). `forward(hidden_states, used_token=None)` returns
    `(output, l_aux, exp_counts)`; `used_token` is not supported (a mask of tokens to route)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if enable_expert_tensor_parallelism:
            raise UserError("MoE(enable_expert_tensor_parallelism=True) is not supported: leave it False")
        try:
            noisy = NoisyGate(noisy_gate_policy or "None")
        except ValueError:
            raise UserError(f"noisy_gate_policy = {noisy_gate_policy!r}: use None, 'None', 'Jitter' or 'RSample'") \
                from None
        local = check_expert_split(num_experts, ep_size)
        cfg = MoEConfig(num_experts=num_experts, top_k=k, normalize_weights=k > 1, noisy_gate=noisy,
                        second_choice_noise=top2_2nd_expert_sampling, capacity_factor=capacity_factor,
                        eval_capacity_factor=eval_capacity_factor, min_capacity=min_capacity,
                        drop_tokens=drop_tokens,
                        drop_policy=(DropPolicy.PROBABILITY if k > 2 else DropPolicy.POSITION if k == 2 or not use_rts
                                     else DropPolicy.RANDOM),
                        balance_count=BalanceCount.ALL_CHOICES if k > 2 else BalanceCount.FIRST_CHOICE)
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = local
        self.expert_group_name = f"ep_size_{ep_size}"
        self.use_residual = use_residual
        experts = Experts(expert, local)
        ep_comm = None
        if ep_size > 1:
            from shardwise.utils import groups
            groups._create_expert_and_data_parallel(ep_size)
            ep_comm = Comm(groups._get_expert_parallel_group(self.expert_group_name), CommLedger(),
                           name=f"ep:{self.expert_group_name}")
            mark_replicas(experts.parameters(),
                          ReplicaGroup(groups._get_expert_data_parallel_group(self.expert_group_name),
                                       self.expert_group_name))
        else:
            for p in experts.parameters():          # DeepSpeed marks them whatever the ep size
                p.allreduce = False                 # type: ignore[attr-defined]
                p.group_name = self.expert_group_name   # type: ignore[attr-defined]
        self.deepspeed_moe = MoELayer(hidden_size, cfg, experts=experts, ep_comm=ep_comm)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)      # mixes the MoE and the dense MLP per token

    def forward(self, hidden_states: Tensor, used_token: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        if used_token is not None:
            raise UserError("MoE.forward(used_token=...) is not supported: pass the hidden states alone")
        output = self.deepspeed_moe(hidden_states)
        routing = self.deepspeed_moe.routing
        assert routing is not None           # set by the forward above
        self.deepspeed_moe.loss = None       # DeepSpeed's scripts add l_aux themselves
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, routing.aux_loss, routing.counts
