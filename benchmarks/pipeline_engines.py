"""Pipeline training step, engine against engine: shardwise's `engine.train_batch` against DeepSpeed's
PipelineEngine (`deepspeed.pipe.PipelineModule`), same GPT, same micro-batches, 1F1B (DeepSpeed's TrainSchedule).

    shardwise bench pipeline_engines --nproc 2 [--microbatches 16 --rounds 10 --json out.json]

P = the number of ranks = pipeline stages (no data parallelism). Every rank builds the GPT from one seed twice:
shardwise splits one copy by its "pipeline" block; DeepSpeed gets the other as a PipelineModule whose layers are
the 8 blocks, the embedding glued to the first and the head to the last (so its "uniform" cut is shardwise's:
L / P blocks per stage, embedding and head with the end blocks), loss `GPT.loss`. Both run a whole
`train_batch` (M micro-batches forward and backward, the optimizer step: SGD at lr 0, so the weights never
change and every step sees the same model; no clipping). The two alternate round by round after a barrier; a
step's time is the slowest rank's. Reported: median step times, their ratio (< 1: shardwise faster), the median
of the per-round ratios ("paired"), and the first step's loss from each (they must agree).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import args_meta, int_at_least, run_under_launcher, write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise bench pipeline_engines --nproc P",
                                description="shardwise engine.train_batch vs DeepSpeed's PipelineEngine (1F1B).")
    p.add_argument("--microbatches", type=int_at_least(1), default=16, help="M (default: %(default)s)")
    p.add_argument("--d-model", type=int_at_least(8), default=256, help="(default: %(default)s)")
    p.add_argument("--layers", type=int_at_least(1), default=8, help="transformer blocks (default: %(default)s)")
    p.add_argument("--seq", type=int_at_least(1), default=128, help="sequence length (default: %(default)s)")
    p.add_argument("--rounds", type=int_at_least(1), default=10, help="timed steps of each (default: %(default)s)")
    p.add_argument("--warmup", type=int_at_least(1), default=2, help="untimed steps of each (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results to OUT")
    return p


def _engines(args: argparse.Namespace) -> tuple[Any, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from torch import nn

    import shardwise
    from shardwise.models import GPT, gpt_config
    p = dist.get_world_size()
    cfg = gpt_config("tiny", n_layer=args.layers, d_model=args.d_model, n_head=4, seq_len=args.seq, dropout=0.0,
                     tie_embeddings=False)

    def gpt() -> GPT:
        torch.manual_seed(1234)
        return GPT(cfg)

    config = {"train_batch_size": args.microbatches, "gradient_accumulation_steps": args.microbatches,
              "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
              "steps_per_print": 1 << 30}
    model = gpt()
    sw, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                  config={**config, "pipeline": {"stages": p, "schedule": "1f1b"}})
    deepspeed.init_distributed(dist_backend="gloo")     # joins the group already there
    twin = gpt()
    blocks = list(twin.blocks)
    layers = [nn.Sequential(twin.embed, blocks[0]), *blocks[1:-1], nn.Sequential(blocks[-1], twin.head)]
    net = PipelineModule(layers=layers, loss_fn=twin.loss, num_stages=p, partition_method="uniform")
    ds, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=config)
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(0, cfg.vocab_size, (args.microbatches, args.seq + 1), generator=g)   # [M, seq + 1]
    return sw, ds, [(r[:, :-1], r[:, 1:]) for r in rows.split(1)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    sw, ds, micro = _engines(args)
    steps = {"shardwise": lambda: sw.train_batch(iter(micro)), "deepspeed": lambda: ds.train_batch(iter(micro))}

    def timed(name: str) -> tuple[float, float]:
        dist.barrier()
        t = time.perf_counter()
        loss = float(steps[name]())
        return time.perf_counter() - t, loss

    first = {name: timed(name)[1] for name in steps}
    for _ in range(args.warmup - 1):
        for name in steps:
            timed(name)
    times = torch.zeros(args.rounds, 2, dtype=torch.float64)        # [rounds, (shardwise, deepspeed)] seconds
    for i in range(args.rounds):
        for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            times[i, list(steps).index(name)] = timed(name)[0]
    dist.all_reduce(times, op=dist.ReduceOp.MAX)                    # a step lasts as long as its slowest rank
    sw_s, ds_s = times[:, 0].tolist(), times[:, 1].tolist()
    result = {"config": args_meta(args)
              | {"stages": dist.get_world_size(), "schedule": "1f1b"},
              "shardwise_ms": statistics.median(sw_s) * 1e3, "deepspeed_ms": statistics.median(ds_s) * 1e3,
              "paired_ratio": statistics.median(a / b for a, b in zip(sw_s, ds_s)),
              "first_loss": first}
    result["ratio"] = result["shardwise_ms"] / result["deepspeed_ms"]
    sw.close()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: shardwise bench pipeline_engines --nproc 2",
              file=sys.stderr)
        return 2
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = run(args)
    if dist.get_rank() == 0:
        print(f"P = {result['config']['stages']} stages, 1F1B, GPT d={args.d_model} L={args.layers} seq={args.seq}, "
              f"M = {args.microbatches}: shardwise {result['shardwise_ms']:.1f} ms, DeepSpeed "
              f"{result['deepspeed_ms']:.1f} ms, shardwise / DeepSpeed {result['ratio']:.3f} (paired "
              f"{result['paired_ratio']:.3f}); first-step loss {result['first_loss']['shardwise']:.6f} vs "
              f"{result['first_loss']['deepspeed']:.6f}")
        if args.json is not None:
            write_json(args.json, result)
    dist.barrier()
    return 0


def launch(nproc: int, argv: Sequence[str] = ()) -> int:
    """Run on `nproc` local ranks (= stages) through torch's elastic launcher; returns its exit code."""
    args = build_parser().parse_args(list(argv))
    if nproc < 2:
        raise ValueError(f"--nproc must be >= 2 (one rank is no pipeline); got {nproc}")
    if args.layers < nproc:
        raise ValueError(f"--layers = {args.layers} is fewer than the {nproc} stages; every stage needs a block")
    if importlib.util.find_spec("deepspeed") is None:
        raise ValueError("DeepSpeed is not installed (pip install deepspeed): it is the peer here")
    return run_under_launcher("benchmarks.pipeline_engines", nproc, argv)


if __name__ == "__main__":
    from shardwise.engine.initialize import exit_rank
    exit_rank(main())
