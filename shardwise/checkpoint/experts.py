"""Where a checkpoint puts the experts of an MoE model (DeepSpeed's files, one per expert):

    layer_L_expert_E_mp_rank_MM_model_states.pt   global expert E of MoE layer L: its module tensors, under the
                                                  whole model's names (written by the first rank of the expert's
                                                  expert-data-parallel group, the only ranks holding it)
    expp_rank_R_mp_rank_MM_optim_states.pt        without ZeRO: the optimizer state of expert-parallel rank R
                                                  (its experts' entries point there; ZeRO keeps expert shards in
                                                  each rank's own optimizer file, as DeepSpeed's does)

The rest of the model goes where it always goes (`save_load.py`); the index records which file holds which
expert, under its global name (`parallel/experts/naming.py`), so a tag loads at any ep size through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint.context import CheckpointContext
from shardwise.parallel.experts import moe_layers
from shardwise.parallel.experts.naming import expert_places
from shardwise.parallel.replicas import replicas_of


@dataclass(frozen=True)
class ExpertFiles:
    """This rank's expert tensors and who writes them."""

    files: dict[str, str]
    """Local state key of each expert tensor -> its expert file."""
    params: frozenset[int]
    """ids of this rank's expert parameters."""
    writer: bool
    """Whether this rank writes its experts: the first rank of their expert-data-parallel group (dp rank 0 when
    every rank holds every expert)."""
    optim_file: str | None
    """Without ZeRO, the file of this rank's expert optimizer entries; None with ZeRO or without experts."""

    def __bool__(self) -> bool:
        return bool(self.files)


def expert_files(ctx: CheckpointContext, mp_rank: int) -> ExpertFiles:
    places = expert_places(ctx.module)
    files = {k: ckpt.expert_file_name(p.layer, p.expert, mp_rank) for k, p in places.items()}
    params = [p for n, p in ctx.module.named_parameters() if n in files]
    groups = {id(g): g for g in (replicas_of(p) for p in params) if g is not None}
    # Every expert of one rank shares one expert-dp group (the model's one ep size); its first rank writes.
    writer = all(dist.get_rank(g.group) == 0 for g in groups.values()) if groups else ctx.dp_rank == 0
    ep_rank = next((layer.ep_comm.rank for layer in moe_layers(ctx.module)), 0)
    optim = ckpt.expert_optim_states_name(ep_rank, mp_rank) if files and not ctx.state.checkpoint_per_rank else None
    return ExpertFiles(files, frozenset(id(p) for p in params), writer, optim)

