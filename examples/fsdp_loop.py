"""The PyTorch way in: a plain training loop, the model wrapped by shardwise's FSDP2-style `fully_shard`, its
FSDP1-style `FullyShardedDataParallel` or its `DistributedDataParallel`, and any torch optimizer.

    torchrun --nproc-per-node 2 examples/fsdp_loop.py                          # fully_shard per block, then root
    torchrun --nproc-per-node 2 examples/fsdp_loop.py --wrapper fsdp --bf16    # FSDP1 spelling, bf16 compute
    torchrun --nproc-per-node 2 examples/fsdp_loop.py --wrapper ddp           # replicated, bucketed all-reduce
    torchrun --nproc-per-node 2 examples/fsdp_loop.py --save ckpt.pt          # model + optimizer, whole tensors
    torchrun --nproc-per-node 4 examples/fsdp_loop.py --resume ckpt.pt        # ... resumed at another world size
"""

import argparse
import contextlib
import json

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import shardwise
from shardwise.data import load_corpus
from shardwise.models import GPT, gpt_config


class Windows(Dataset):
    """Fixed, non-overlapping windows of a token array: item i -> {"input_ids": [seq], "labels": [seq]}."""

    def __init__(self, tokens, seq_len: int, count: int):
        self.tokens, self.seq_len, self.count = tokens, seq_len, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        start = i * (self.seq_len + 1)
        window = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype("int64"))
        return {"input_ids": window[:-1], "labels": window[1:]}


def wrap(model: torch.nn.Module, wrapper: str, bf16: bool) -> torch.nn.Module:
    if wrapper == "ddp":
        return shardwise.DistributedDataParallel(model, bucket_cap_mb=25)
    if wrapper == "fsdp":
        mp = shardwise.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      buffer_dtype=torch.float32) if bf16 else None
        return shardwise.FullyShardedDataParallel(model, mixed_precision=mp)   # each transformer block a unit
    policy = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    for block in model.blocks:
        shardwise.fully_shard(block, mp_policy=policy)
    return shardwise.fully_shard(model, mp_policy=policy)


@contextlib.contextmanager
def no_sync(model: torch.nn.Module, wrapper: str):
    """Backwards inside accumulate gradients locally; the next one outside communicates their sum."""
    if wrapper != "fully_shard":
        with model.no_sync():                  # torch DDP's and FSDP1's spelling
            yield
        return
    model.set_requires_gradient_sync(False)    # FSDP2's
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrapper", choices=["fully_shard", "fsdp", "ddp"], default="fully_shard")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters in compute, fp32 reduction")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--summary", default=None, help="write a JSON summary here (rank 0)")
    parser.add_argument("--save", default=None, help="save the full model and optimizer state here at the end")
    parser.add_argument("--resume", default=None, help="start from a state saved with --save (any world size)")
    args = parser.parse_args()

    shardwise.init_distributed()                   # NCCL if CUDA, else gloo; torchrun or one process
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)                           # the same full model on every rank before it is wrapped
    model = wrap(GPT(gpt_config("tiny", n_layer=2, d_model=64, n_head=4, seq_len=32)), args.wrapper, args.bf16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)     # built after wrapping: it steps the shards
    if args.resume:                                # whole tensors, read on every rank; each keeps its part
        ckpt = torch.load(args.resume)
        shardwise.set_state_dict(model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"],
                                 full_state_dict=True)
    dataset = Windows(load_corpus("stdlib", max_bytes=1 << 20), seq_len=32, count=args.samples)
    loader = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, world, rank, shuffle=False))

    losses = []
    for i, batch in enumerate(loader):
        last = (i + 1) % args.accumulate == 0
        with contextlib.nullcontext() if last else no_sync(model, args.wrapper):
            loss = model(**batch)
            (loss / args.accumulate).backward()
        losses.append(float(loss.detach()))
        if last:
            model.clip_grad_norm_(1.0)           # the whole model's norm, over the shards
            optimizer.step()
            optimizer.zero_grad()

    # whole tensors keyed by the unwrapped model's names, on rank 0 only (on the CPU); the other ranks get {}
    state, optim_state = shardwise.get_state_dict(model, optimizer, full_state_dict=True, cpu_offload=True)
    if rank == 0 and args.save:
        torch.save({"model": state, "optim": optim_state}, args.save)
    if rank == 0:
        print(f"{args.wrapper}: {len(losses)} micro-batches, first loss {losses[0]:.3f}, last {losses[-1]:.3f}, "
              f"{sum(v.numel() for v in state.values()):,} values in the full state dict")
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump({"losses": losses, "world": world, "state_numel": sum(v.numel() for v in state.values())}, f)


if __name__ == "__main__":
    main()
    # torch asks every process to destroy its groups before exiting: gloo's worker threads may otherwise still
    # hold finished work when the interpreter shuts down, which aborts the process
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
