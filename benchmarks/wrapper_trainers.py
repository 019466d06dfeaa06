"""The five trainers `benchmarks.fsdp` times side by side, each the seed's plain loop on one GPT preset:
shardwise's `fully_shard` against torch FSDP2's, shardwise's `DistributedDataParallel` (as it comes: here, ranks on
one host, its shared-memory all-reduce; and over gloo's all-reduce: `all_reduce="backend"`) against torch DDP.

Every trainer: the same model from one seed, torch AdamW (lr 3e-4, weight decay 0.1), gradient clipping at 1.0,
the same micro-batches; the FSDP pair with `fully_shard` on every block then on the root and the same mixed
precision policy (`--bf16`: bf16 parameters, fp32 reduction), the DDP pair with the same bucket cap and
gradients kept as bucket views (zero_grad(set_to_none=False)). Each returns a `benchmarks.trainers.Built`.
"""

from __future__ import annotations

import argparse
import enum
from typing import Callable

import torch
import torch.distributed as dist

from benchmarks.trainers import Built, Memory, _model_state_bytes, cycling, model, storage_bytes

CLIP = 1.0


class Wrapper(str, enum.Enum):
    SW_FSDP = "shardwise fully_shard"
    FSDP2 = "torch fully_shard"
    SW_DDP = "shardwise DDP"
    SW_DDP_GLOO = "shardwise DDP gloo"
    DDP = "torch DDP"

    @property
    def peer(self) -> "Wrapper":
        """The trainer this one is compared with (shardwise's against torch's and back)."""
        return {Wrapper.SW_FSDP: Wrapper.FSDP2, Wrapper.FSDP2: Wrapper.SW_FSDP, Wrapper.SW_DDP: Wrapper.DDP,
                Wrapper.SW_DDP_GLOO: Wrapper.DDP, Wrapper.DDP: Wrapper.SW_DDP}[self]


def _adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)


def _sharded_memory(net: torch.nn.Module, opt: torch.optim.Optimizer, step: Callable[[], None]) -> Memory:
    """Model states of a sharded trainer: its gradients counted between backward and the optimizer step."""
    forward, backward, update = step
    backward(forward())
    grads = storage_bytes([p.grad for p in net.parameters()])
    update()
    return dict(_model_state_bytes(net, opt), grads=grads)


def build_sw_fsdp(args: argparse.Namespace, data: list) -> Built:
    import shardwise
    policy = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
        else shardwise.MixedPrecisionPolicy()
    net = model(args)
    for block in net.blocks:
        shardwise.fully_shard(block, mp_policy=policy)
    shardwise.fully_shard(net, mp_policy=policy)
    opt = _adamw(net.parameters())
    next_batch = cycling(data)

    def update() -> None:
        net.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    forward = lambda: net(*next_batch())  # noqa: E731
    backward = lambda loss: loss.backward()  # noqa: E731
    return Built(forward, backward, update, lambda: _sharded_memory(net, opt, (forward, backward, update)))


def build_fsdp2(args: argparse.Namespace, data: list) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
        else MixedPrecisionPolicy()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = model(args)
    for block in net.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    opt = _adamw(net.parameters())
    next_batch = cycling(data)

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    forward = lambda: net(*next_batch())  # noqa: E731
    backward = lambda loss: loss.backward()  # noqa: E731
    return Built(forward, backward, update, lambda: _sharded_memory(net, opt, (forward, backward, update)))


def build_sw_ddp(args: argparse.Namespace, data: list, all_reduce: str = "auto") -> Built:
    import shardwise
    net = model(args)
    ddp = shardwise.DistributedDataParallel(net, bucket_cap_mb=args.bucket_mb, all_reduce=all_reduce)
    opt = _adamw(net.parameters())
    next_batch = cycling(data)

    def update() -> None:
        ddp.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return Built(lambda: ddp(*next_batch()), lambda loss: loss.backward(), update,
                 lambda: _model_state_bytes(net, opt))


def build_ddp(args: argparse.Namespace, data: list) -> Built:
    from torch.nn.parallel import DistributedDataParallel as DDP
    net = model(args)
    ddp = DDP(net, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    opt = _adamw(net.parameters())
    next_batch = cycling(data)

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return Built(lambda: ddp(*next_batch()), lambda loss: loss.backward(), update,
                 lambda: _model_state_bytes(net, opt))


BUILDERS: dict[Wrapper, Callable[[argparse.Namespace, list], Built]] = {
    Wrapper.SW_FSDP: build_sw_fsdp, Wrapper.FSDP2: build_fsdp2, Wrapper.SW_DDP: build_sw_ddp,
    Wrapper.SW_DDP_GLOO: lambda args, data: build_sw_ddp(args, data, all_reduce="backend"), Wrapper.DDP: build_ddp}
