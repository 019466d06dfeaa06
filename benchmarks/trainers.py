"""The trainers the data-parallel benchmark (`benchmarks.dp`) times side by side.

Each builder takes the parsed options, the one DeepSpeed JSON every trainer follows and this rank's micro-batches,
and returns a `Built`: `step()` runs one optimizer step as three phases the benchmark can time apart
(`forward()` -> loss, `backward(loss)` with whatever gradient communication the trainer does there, `update()`:
clipping, optimizer step, parameter all-gather, zeroing); `memory()` reports this rank's model states in bytes,
each measured from the trainer's own tensors (parameters, gradient buffers, optimizer states with any separate
fp32 master copy). A figure that cannot be measured honestly is None, shown as "n/a".
"""

from __future__ import annotations

import argparse
import copy
import enum
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

MIB = 1 << 20
_DATA_BATCHES = 4          # distinct random micro-batches per rank, cycled

Memory = dict[str, "int | None"]     # keys: params, grads, optimizer


class Trainer(str, enum.Enum):
    SHARDWISE = "shardwise"
    DDP = "ddp"
    DEEPSPEED = "deepspeed"
    FSDP2 = "fsdp2"

    @property
    def stages(self) -> tuple[int, ...]:
        """The ZeRO stages at which this trainer has a counterpart (DDP replicates, FSDP2 shards everything)."""
        return {Trainer.DDP: (0,), Trainer.FSDP2: (3,)}.get(self, (0, 1, 2, 3))


@dataclass
class Built:
    """A trainer ready to time: `step()` runs one full optimizer step on the next micro-batch."""

    forward: Callable[[], torch.Tensor]         # the next micro-batch's loss
    backward: Callable[[torch.Tensor], None]
    update: Callable[[], None]
    memory: Callable[[], Memory]

    def step(self) -> None:
        self.backward(self.forward())
        self.update()


def model(args: argparse.Namespace) -> torch.nn.Module:
    from shardwise.models import GPT, gpt_config
    torch.manual_seed(1234)
    return GPT(gpt_config(args.model))


def token_batches(micro_batch: int, seq_len: int, vocab: int, *, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """_DATA_BATCHES micro-batches (input ids [B, L], labels [B, L]) of random tokens from `seed`."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g) for _ in range(_DATA_BATCHES)]
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


def batches(args: argparse.Namespace, seq_len: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches (each data-parallel rank its own)."""
    return token_batches(args.micro_batch, seq_len, vocab, seed=100 + dist.get_rank())


def cycling(items: list) -> Callable[[], Any]:
    """A callable returning items[0], items[1], ... and around again."""
    state = {"i": 0}

    def next_item() -> Any:
        item = items[state["i"] % len(items)]
        state["i"] += 1
        return item
    return next_item


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (FSDP2's sharded parameters, gradients and moments); a plain tensor as is."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; DTensors by local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = _local(t).untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return storage_bytes([v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)])


def _model_state_bytes(module: torch.nn.Module, opt: torch.optim.Optimizer) -> Memory:
    params = list(module.parameters())
    return {"params": storage_bytes(params), "grads": storage_bytes([p.grad for p in params]),
            "optimizer": _optimizer_bytes(opt)}


def build_shardwise(args: argparse.Namespace, config: dict, data: list) -> Built:
    import shardwise
    net = model(args)
    engine, *_ = shardwise.initialize(model=net, model_parameters=net.parameters(), config=copy.deepcopy(config))
    next_batch = cycling(data)

    def memory() -> Memory:
        report = engine.memory_report()
        return {"params": report["params"], "grads": report["grads"], "optimizer": report["optimizer"]}
    return Built(lambda: engine(*next_batch()), engine.backward, engine.step, memory)


def _torch_adamw(params: Any, config: dict) -> torch.optim.AdamW:
    hyper = config["optimizer"]["params"]
    return torch.optim.AdamW(params, lr=hyper["lr"], weight_decay=hyper["weight_decay"])


def build_ddp(args: argparse.Namespace, config: dict, data: list) -> Built:
    from torch.nn.parallel import DistributedDataParallel as DDP
    net = model(args)
    # Same bucket cap as shardwise; gradients as views into the buckets (no copy in or out), as shardwise does.
    ddp = DDP(net, bucket_cap_mb=config["zero_optimization"]["reduce_bucket_size"] * 4 / MIB,
              gradient_as_bucket_view=True)
    opt = _torch_adamw(net.parameters(), config)
    clip = config["gradient_clipping"]
    next_batch = cycling(data)

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=False)     # keep .grad as bucket views
    return Built(lambda: ddp(*next_batch()), lambda loss: loss.backward(), update,
                 lambda: _model_state_bytes(net, opt))


def build_fsdp2(args: argparse.Namespace, config: dict, data: list) -> Built:
    """torch FSDP2: `fully_shard` on every transformer block, then on the root (what ZeRO-3 units match, see
    tests/distributed/test_fsdp2_parity.py), torch AdamW on the sharded parameters, clip_grad_norm_."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = model(args)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = _torch_adamw(net.parameters(), config)
    clip = config["gradient_clipping"]
    next_batch = cycling(data)

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def memory() -> Memory:
        net(*next_batch()).backward()
        # sharded gradients live from backward until zero_grad frees them
        grads = storage_bytes([p.grad for p in net.parameters()])
        update()
        # Parameters between steps are the sharded DTensors (the gathered blocks are freed after use).
        return dict(_model_state_bytes(net, opt), grads=grads)
    return Built(lambda: net(*next_batch()), lambda loss: loss.backward(), update, memory)


def build_deepspeed(args: argparse.Namespace, config: dict, data: list) -> Built:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    # Its shared-memory kernel serves only inference_all_reduce; skip the C++ JIT build.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel(logging.WARNING)
    net = model(args)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=copy.deepcopy(config))
    stage = config["zero_optimization"]["stage"]
    next_batch = cycling(data)

    def memory() -> Memory:
        engine.backward(engine(*next_batch()))
        # stage 0 frees .grad in step(): they live from backward to step
        probe: Memory = {"grads": storage_bytes([p.grad for p in engine.module.parameters()]) if stage == 0 else None}
        engine.step()
        return _deepspeed_memory(engine, stage, probe)
    return Built(lambda: engine(*next_batch()), engine.backward, engine.step, memory)


def _deepspeed_memory(engine: Any, stage: int, probe: Memory) -> Memory:
    """DeepSpeed's model states on this rank. Optimizer: the inner optimizer's moments plus, at stages 1-3, the
    fp32 master partition ZeRO keeps beside the model's parameters even in fp32. Stage 3: parameters are the
    partitions (`ds_tensor`) plus whatever is still gathered between steps (the persistent small parameters);
    gradients are its one flat buffer of gradient partitions. Stages 1-2: gradients pass through reduce buckets
    and per-parameter partitions freed and refilled within a step, with no one buffer to count: None."""
    opt = engine.optimizer
    moments = _optimizer_bytes(engine.basic_optimizer)
    params = list(engine.module.parameters())
    if stage == 0:
        return {"params": storage_bytes(params), "grads": probe["grads"], "optimizer": moments}
    if stage in (1, 2):
        return {"params": storage_bytes(params), "grads": None,
                "optimizer": moments + storage_bytes(opt.single_partition_of_fp32_groups)}
    return {"params": storage_bytes([p.ds_tensor for p in params] + [p.data for p in params]),
            "grads": storage_bytes([opt.grad_partitions_flat_buffer]),
            "optimizer": moments + storage_bytes(opt.fp32_partitioned_groups_flat)}


BUILDERS: dict[Trainer, Callable[[argparse.Namespace, dict, list], Built]] = {
    Trainer.SHARDWISE: build_shardwise, Trainer.DDP: build_ddp, Trainer.DEEPSPEED: build_deepspeed,
    Trainer.FSDP2: build_fsdp2}
