"""The two trainers the tensor-parallel benchmark (`benchmarks.tp`) times side by side, and the one
meter that measures what each saves for backward.

Both start from the same full GPT (one seed on every rank) and train it with torch's AdamW (fp32, no fused or
foreach kernel on the CPU for either), without gradient clipping (torch's `clip_grad_norm_` refuses the mix of
DTensor and plain parameters `parallelize_module` leaves: the norms and biases it does not split), on the same
micro-batch, which every rank of the TP group feeds:

- shardwise: `shardwise.initialize` with ZeRO stage 0 and `tensor_parallel.size` = world (dp = 1), i.e. what a
  user runs; the engine splits the model with `gpt_tp_plan` (vocabulary-parallel embedding, head and loss).
- torch: a deep copy of the same full GPT, split by `parallelize_module` over a 1-D DeviceMesh with the plan
  torchtitan uses for its Llama: ColwiseParallel on q/k/v and fc_in, RowwiseParallel on o_proj and fc_out,
  RowwiseParallel(input_layouts=Replicate()) on the token table (vocabulary split), ColwiseParallel with
  sharded DTensor logits on the lm-head and `loss_parallel` around forward and backward, so neither gathers
  the full logits. The GPT's attention infers its head count from the projection widths, so the local
  projections [.., d/t] need no head-count adjustment. With `sequence_parallel`: SequenceParallel on the
  norms, the attention and MLP inputs all-gathered from sequence shards (PrepareModuleInput) and their
  outputs reduce-scattered (RowwiseParallel(output_layouts=Shard(1))), the embedding's replicated output split
  into sequence shards (PrepareModuleOutput): the same layout as shardwise's sequence-parallel plan.
"""

from __future__ import annotations

import argparse
import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.trainers import Memory, cycling, storage_bytes, token_batches

LR, WEIGHT_DECAY = 1e-4, 0.01


@dataclass
class TPTrainer:
    """`step(grads_out)` runs one optimizer step on the next micro-batch and returns the loss (a 0-dim tensor,
    not synchronised); given a dict, it first fills it with this rank's gradients (parameter name -> a copy of
    the local shard) as backward left them. `forward(ids, labels)` runs the model's forward alone, for the
    activation meter."""

    step: Callable[..., Tensor]
    forward: Callable[[Tensor, Tensor], Tensor]
    memory: Callable[[], Memory]
    params: Callable[[], list[Tensor]]


def full_gpt(args: argparse.Namespace) -> nn.Module:
    from shardwise.models import GPT
    torch.manual_seed(1234)
    return GPT(gpt_cfg(args))


def gpt_cfg(args: argparse.Namespace) -> Any:
    from shardwise.models import gpt_config
    return gpt_config("tiny", n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq,
                      vocab_size=args.vocab, dropout=0.0)


def batches(args: argparse.Namespace) -> list[tuple[Tensor, Tensor]]:
    """(input ids [B, L], labels [B, L]) of random tokens, the same on every rank (one seed)."""
    return token_batches(args.micro_batch, args.seq, args.vocab, seed=100)


def engine_config(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """The shardwise run: ZeRO stage 0, every rank in one TP group, torch's AdamW with the torch trainer's
    hyper-parameters, no clipping."""
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "gradient_clipping": 0.0,         # DeepSpeed's default is 1.0; the torch trainer does not clip
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"size": world, **({"sequence_parallel": True} if args.sequence_parallel else {})},
        "steps_per_print": 1 << 30,
    }


def build_shardwise(net: nn.Module, args: argparse.Namespace, data: list) -> TPTrainer:
    import shardwise
    logging.getLogger("shardwise").setLevel(logging.WARNING)
    engine, *_ = shardwise.initialize(model=net, model_parameters=net.parameters(),
                                      config=engine_config(args, dist.get_world_size()))
    next_batch = cycling(data)

    def step(grads_out: dict[str, Tensor] | None = None) -> Tensor:
        loss = engine(*next_batch())
        engine.backward(loss)
        if grads_out is not None:
            grads_out.update(local_grads(engine.module))
        engine.step()
        return loss.detach()

    def memory() -> Memory:
        report = engine.memory_report()
        return {"params": report["params"], "grads": report["grads"], "optimizer": report["optimizer"]}
    return TPTrainer(step, lambda ids, labels: engine.module(ids, labels), memory,
                     lambda: list(engine.module.parameters()))


def torch_plan(sequence_parallel: bool) -> dict[str, Any]:
    """The DTensor plan of `shardwise.models.GPT` (module names as in `gpt_tp_plan`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel,
    )
    blocks = "blocks.*"
    if not sequence_parallel:
        return {
            "embed.tok": RowwiseParallel(input_layouts=Replicate()),
            f"{blocks}.attn.q_proj": ColwiseParallel(), f"{blocks}.attn.k_proj": ColwiseParallel(),
            f"{blocks}.attn.v_proj": ColwiseParallel(), f"{blocks}.attn.o_proj": RowwiseParallel(),
            f"{blocks}.mlp.fc_in": ColwiseParallel(), f"{blocks}.mlp.fc_out": RowwiseParallel(),
            "head.lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
    # The residual stream between blocks is [b, s/t, d] local tensors; norms run on DTensor sequence shards.
    enter = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "embed.tok": RowwiseParallel(input_layouts=Replicate()),
        # learned positions are added to the replicated token rows, then split (no communication forward)
        "embed": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        f"{blocks}.ln_1": SequenceParallel(), f"{blocks}.ln_2": SequenceParallel(),
        f"{blocks}.attn": enter, f"{blocks}.mlp": copy.deepcopy(enter),
        f"{blocks}.attn.q_proj": ColwiseParallel(), f"{blocks}.attn.k_proj": ColwiseParallel(),
        f"{blocks}.attn.v_proj": ColwiseParallel(), f"{blocks}.attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        f"{blocks}.mlp.fc_in": ColwiseParallel(), f"{blocks}.mlp.fc_out": RowwiseParallel(output_layouts=Shard(1)),
        "head.norm": SequenceParallel(),
        "head.lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def build_torch(net: nn.Module, args: argparse.Namespace, data: list) -> TPTrainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(net, mesh, torch_plan(args.sequence_parallel))
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    next_batch = cycling(data)

    def forward(ids: Tensor, labels: Tensor) -> Tensor:
        return net(ids, labels)       # GPT.loss: cross-entropy of the vocabulary-sharded DTensor logits

    def step(grads_out: dict[str, Tensor] | None = None) -> Tensor:
        with loss_parallel():         # forward and backward: the loss of sharded logits, none gathered
            loss = forward(*next_batch())
            loss.backward()
        if grads_out is not None:
            grads_out.update(local_grads(net))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().to_local().detach()

    probe: Memory = {}

    def memory() -> Memory:
        with loss_parallel():
            forward(*data[0]).backward()
        probe["grads"] = storage_bytes([p.grad for p in params])     # they live from backward to zero_grad
        opt.zero_grad(set_to_none=True)
        opt_bytes = storage_bytes([v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)])
        return {"params": storage_bytes(params), "grads": probe["grads"], "optimizer": opt_bytes}

    def forward_for_meter(ids: Tensor, labels: Tensor) -> Tensor:
        with loss_parallel():
            return forward(ids, labels)
    return TPTrainer(step, forward_for_meter, memory, lambda: params)


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor
    return t._local_tensor if isinstance(t, DTensor) else t


def local_grads(module: nn.Module) -> dict[str, Tensor]:
    """Parameter name -> a copy of this rank's gradient, laid out as its parameter (zeros where none). A DTensor
    gradient may come in another placement than its parameter: torch's vocabulary-split embedding gets a
    replicated [V, d] gradient; it is cut to the parameter's shard (a local slice) for the comparison."""
    from torch.distributed.tensor import DTensor
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is None:
            out[name] = torch.zeros_like(_local(p))
            continue
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            g = g.redistribute(placements=p.placements)
        out[name] = _local(g).detach().clone()
    return out


def saved_activation_bytes(trainer: TPTrainer, batch: tuple[Tensor, Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward of `trainer`'s model,
    parameters and the batch excluded; DTensors count by their local tensor. The same meter for both, so
    the two are compared on what they keep alive between forward and backward (the activation peak)."""
    skip = {_local(p).untyped_storage().data_ptr() for p in trainer.params()}
    skip |= {t.untyped_storage().data_ptr() for t in batch}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        try:
            s = _local(t).untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.forward(*batch)
    del loss
    return sum(seen.values())
