"""ZeRO stage 0: every data-parallel rank holds the whole model (of its TP slice and pipeline stage).

Gradients are all-reduced in buckets over the dp group (`data_parallel.BucketedAllReduce`). The update:
fp32 steps the model's own parameters; bf16 / fp16 step fp32 master copies (`masters[i]` pairs with
`model_params[i]`, same shape): each step copies the synchronised low-precision gradients into the masters'
fp32 .grad, and after the step casts the masters back into the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm
from shardwise.config.resolved import DataParallelConfig
from shardwise.parallel.data_parallel import BucketedAllReduce
from shardwise.parallel.grad_norm import GradNormReducer, whole_tensor_layout
from shardwise.parallel.replicas import replicas_of
from shardwise.parallel.tied import TiedParams, TiedSlot, uncounted
from shardwise.parallel.update import Piece, Update, UpdateRecipe
from shardwise.parallel.zero.fused import prefer_fused_adam


class ReplicatedUpdate(Update):
    """Stage 0's step: every rank applies the same update to its whole copy."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, model_params: list[torch.nn.Parameter],
                 masters: list[torch.nn.Parameter] | None, recipe: UpdateRecipe, norms: GradNormReducer,
                 tied: tuple[TiedSlot, ...] = ()):
        super().__init__(optimizer, stepped=masters if masters is not None else model_params,
                         masters=masters or [], separate_masters=masters is not None, recipe=recipe,
                         norms=norms, tied=tied)
        self.model_params = model_params
        self._index = {id(p): i for i, p in enumerate(model_params)}
        self._numels = [m.numel() for m in self.masters]
        self._master_numel = sum(self._numels)
        # The same fused Adam/AdamW kernel as ZeRO's masters when the user left the implementation to torch.
        prefer_fused_adam(optimizer)

    def _load_grads(self) -> None:
        if not self.masters:
            return
        # One fp32 [sum of numels] allocation per step, freed after it (zero_master_grads drops .grad), so it
        # never coexists with the next forward's activations; each master's .grad is a view of it.
        flat = torch.empty(self._master_numel, dtype=torch.float32, device=self.masters[0].device)
        grads = [g.view(m.shape) for g, m in zip(flat.split(self._numels), self.masters)]
        for m, g in zip(self.masters, grads):
            m.grad = g
        # Low precision -> fp32 in one multi-tensor kernel launch (a per-parameter copy is a launch each).
        torch._foreach_copy_(grads, [_synchronised_grad(p) for p in self.model_params])

    @torch.no_grad()
    def _publish(self) -> None:
        if self.masters:
            torch._foreach_copy_(tuple(self.model_params), tuple(self.masters))      # fp32 -> low precision

    def param_bytes(self) -> int:
        """Model parameters held by this rank (all of them: stage 0 replicates)."""
        return sum(p.numel() * p.element_size() for p in self.model_params)

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """After loading module weights only: restart the fp32 masters from them."""
        if self.masters:
            torch._foreach_copy_(tuple(self.masters), tuple(self.model_params))

    def load_state_dict(self, state: dict, *, load_optimizer_states: bool = True) -> None:
        self._load_common(state, load_optimizer_states)

    def pieces(self) -> list[list[Piece]]:
        """Stepped tensor i is model parameter i (or its master), whole."""
        return [[Piece(p, tuple(p.shape), 0, p.numel(), 0)] for p in self.model_params]

    def full_master(self, param: torch.nn.Parameter) -> torch.Tensor:
        """A copy of the fp32 master (fp32 training: of the parameter itself, which the optimizer steps)."""
        i = self._index[id(param)]
        value = self.masters[i] if self.separate_masters else param
        return value.detach().to(torch.float32, copy=True)

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """A copy of .grad: the bucket's slot, averaged over dp after the boundary's backward."""
        return None if param.grad is None else param.grad.detach().clone()

    def full_shape(self, param: torch.nn.Parameter) -> tuple[int, ...]:
        return tuple(param.shape)

    def stepped_grads(self) -> list[torch.Tensor | None]:
        """Each parameter's .grad, which the step reads (and copies into its master's)."""
        return [p.grad for p in self.model_params]

    def sum_over_shards(self, t: torch.Tensor, param: torch.nn.Parameter) -> None:
        """Nothing: every rank holds the stepped tensors whole."""


def _synchronised_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """`p.grad` after the dp all-reduce: `BucketedAllReduce` keeps every .grad a view of its bucket slot."""
    if p.grad is None:
        raise RuntimeError("a parameter has no gradient at the step: was .grad reset between backward and step?")
    return p.grad


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


def build_replicated(groups: list[dict], *, section: DataParallelConfig, recipe: UpdateRecipe, dp_comm: Comm,
                     norms: GradNormReducer, tied: TiedParams = TiedParams()
                     ) -> tuple[ReplicatedUpdate, BucketedAllReduce]:
    """The update and the gradient all-reduce of stage 0 over `groups` (this rank's trainable parameters);
    `tied` copies are whole stepped tensors here, summed over the stages sharing them after the dp all-reduce."""
    model_params = [p for g in groups for p in g["params"]]
    masters = None
    if recipe.dtype != torch.float32:
        groups, model_params, masters = make_masters(groups)
    # Replicas hold equal gradients after the all-reduce: only other stages and TP slices hold other parts.
    slots = tuple(tied.slots({id(p): i for i, p in enumerate(model_params)}))
    # Parameters held by a dp subgroup only (experts) differ between dp ranks: the norm then sums over dp, each
    # rank counting 1 / (ranks holding its copy) of every tensor's squares.
    holders = [dp_comm.size if (r := replicas_of(p)) is None else dist.get_world_size(r.group) for p in model_params]
    shares = [1.0 / n for n in holders] if any(n != dp_comm.size for n in holders) else None
    bound = norms.for_tensors(whole_tensor_layout(model_params), dp_sharded=shares is not None,
                              uncounted=uncounted(slots), shares=shares)
    update = ReplicatedUpdate(recipe.make_optimizer(groups), model_params=model_params, masters=masters,
                              recipe=recipe, norms=bound, tied=slots)
    runtime = BucketedAllReduce(model_params, dp_comm, bucket_numel=section.bucket_numel, impl=section.all_reduce,
                                predivide_factor=section.predivide_factor, prescale=section.prescale,
                                comm_dtype=section.data_type.torch_dtype if section.data_type else None)
    return update, runtime
