"""Mixture-of-experts step time and all-to-all bytes: shardwise's `MoE` layer against DeepSpeed's, on one model.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.moe \\
        --hidden 64 --experts 4 --top-k 2 --layers 2 --seq 64 --micro-batch 4 --rounds 10 --steps 3 --json moe.json

P = the number of ranks = the expert-parallel size (dp = ep = P). Both trainers build the same network from one
seed: an embedding, `--layers` residual MoE layers (E GELU experts of width 2h, top-k, DeepSpeed's arguments),
a linear head, loss = cross-entropy + 0.01 x the layers' l_aux (as Megatron-DeepSpeed adds it). One is built with
`shardwise.moe.layer.MoE` and trained by `shardwise.initialize`, the other with `deepspeed.moe.layer.MoE` and
`deepspeed.initialize` (DeepSpeed 0.19, a reference only: DS_ACCELERATOR=cpu and torch's Adam, "torch_adam":
true), each with its parameters split by its own `split_params_into_different_moe_groups_for_optimizer`. Routing
is deterministic in both (no second-expert sampling, no noisy gate) and, unless `--capacity-factor` is given, no
token is dropped, so both compute the same thing: the warm-up steps' losses must agree within `--rtol`.

Then `--rounds` rounds each run `--steps` steps of either trainer, alternating which goes first; every step starts
after a barrier and lasts as long as its slowest rank. Per trainer: median step time, the spread of per-round
medians, tokens/s, shardwise / this (< 1: shardwise faster) and the paired ratio (median over rounds of the
ratio within a round).

All-to-all bytes of one step, the mean over ranks of the inputs of the all-to-alls that carry token rows:
shardwise's from its communication ledger (`engine.comm_report()`, float rows; the int64 per-expert counts it
exchanges first are given apart), DeepSpeed's by counting the inputs of `torch.distributed.all_to_all_single`
during one step. The formula (`shardwise.planner.comm.ep_collectives`): per MoE layer, dispatch and combine,
forward and backward, each tokens x k x hidden x bytes of input, of which (P - 1) / P leaves the rank. Shardwise
sends only the routed rows, so without dropping its mean equals the formula exactly; DeepSpeed pads every
expert's rows to one capacity, [E, capacity, h].
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import (
    TimedRow, add_side_by_side_args, args_meta, compare_times, int_at_least, positive_float, rotation, run_in_gloo_group,
    run_under_launcher, write_json,
)

AUX_LOSS_COEF = 0.01


class Impl(str, Enum):
    SHARDWISE = "shardwise"
    DEEPSPEED = "deepspeed"


@dataclass(frozen=True)
class Row(TimedRow):
    """One trainer's timing columns and its all-to-all bytes of one step (mean over ranks)."""

    all_to_all_bytes: float          # inputs of the all-to-alls that carry token rows
    all_to_all_count_bytes: float    # inputs of the all-to-alls that exchange per-expert counts (shardwise only)
    formula_ratio: float             # all_to_all_bytes / the formula's


@dataclass(frozen=True)
class Formula:
    """The planner's all-to-all figures of one step on one rank (`ep_collectives`)."""

    payload_bytes: float     # inputs of all the step's token all-to-alls (the ledger's convention)
    off_rank_bytes: float    # the share of it that goes to other ranks, (P - 1) / P with routing spread evenly
    calls: int


def formula(*, hidden: int, experts: int, top_k: int, layers: int, tokens: int, ep: int) -> Formula:
    """tokens x k x hidden x 4 bytes (fp32) per all-to-all, 4 per layer (dispatch and combine, forward and
    backward), from the planner's own accounting of this shape."""
    from shardwise.models.presets import GPTConfig
    from shardwise.planner import JobSpec, Plan, Precision, cluster_preset
    from shardwise.planner.comm import ep_collectives
    cfg = GPTConfig(n_layer=layers, n_head=1, d_model=hidden, seq_len=tokens, moe_experts=experts, moe_top_k=top_k)
    job = JobSpec(global_batch=ep, seq_len=tokens, precision=Precision.FP32)
    (a2a,) = ep_collectives(cfg, cluster_preset("a100-80gb", ep), job, Plan(dp=ep, ep=ep))
    return Formula(a2a.total_payload_bytes, a2a.sent_bytes, a2a.calls)


def summarize(times_s: dict[str, list[list[float]]], a2a_bytes: dict[str, tuple[float, float]], *,
              tokens_per_step: int, expected: Formula) -> list[Row]:
    """Rows from step times `times_s[trainer][round][step]` (seconds) and `a2a_bytes[trainer]` = (token rows,
    counts) bytes of one step. Needs a "shardwise" entry, the numerator of every ratio."""
    rows = []
    for name, t in compare_times(times_s, Impl.SHARDWISE.value).items():
        rows_bytes, count_bytes = a2a_bytes[name]
        rows.append(Row(**TimedRow.timing_fields(name, t, tokens_per_step), all_to_all_bytes=rows_bytes,
                        all_to_all_count_bytes=count_bytes, formula_ratio=rows_bytes / expected.payload_bytes))
    return rows


def round_order(round_index: int) -> list[Impl]:
    """Shardwise first in even rounds, DeepSpeed first in odd ones."""
    return rotation([Impl.SHARDWISE, Impl.DEEPSPEED], round_index)


def loss_mismatch(losses: Sequence[tuple[float, float]], rtol: float) -> tuple[float, str]:
    """The largest relative difference of the warm-up losses (shardwise, deepspeed), and a message naming the first
    step past `rtol` ("" when none is)."""
    worst, message = 0.0, ""
    for step, (ours, theirs) in enumerate(losses, 1):
        rel = abs(ours - theirs) / max(abs(theirs), 1e-30)
        worst = max(worst, rel)
        if rel > rtol and not message:
            message = (f"moe benchmark: warm-up step {step} loss {ours!r} vs DeepSpeed {theirs!r}, relative "
                       f"difference {rel:.2e} > --rtol {rtol:g}: the two layers do not compute the same model")
    return worst, message


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch.distributed.run --nproc-per-node P -m benchmarks.moe",
        description="MoE step time and all-to-all bytes of shardwise's MoE layer against DeepSpeed's at ep = P.")
    p.add_argument("--hidden", type=int_at_least(2), default=64, help="hidden size (default: %(default)s)")
    p.add_argument("--experts", type=int_at_least(1), default=4, help="experts per layer (default: %(default)s)")
    p.add_argument("--top-k", type=int_at_least(1), default=2, help="experts per token (default: %(default)s)")
    p.add_argument("--layers", type=int_at_least(1), default=2, help="MoE layers (default: %(default)s)")
    p.add_argument("--seq", type=int_at_least(1), default=64, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--vocab", type=int_at_least(2), default=256, help="vocabulary size (default: %(default)s)")
    p.add_argument("--micro-batch", type=int_at_least(1), default=4, help="sequences per rank per step "
                   "(default: %(default)s)")
    p.add_argument("--capacity-factor", type=positive_float("--capacity-factor"), default=None,
                   help="drop tokens past this capacity factor (default: drop none)")
    add_side_by_side_args(p, warmup=2, compared="losses")
    return p


def check_args(args: argparse.Namespace, nproc: int) -> None:
    """Reject what expert parallelism over `nproc` ranks cannot run."""
    if nproc < 2:
        raise ValueError(f"moe benchmark: --nproc must be >= 2 (expert parallelism over {nproc} rank exchanges "
                         f"nothing); got {nproc}. Use --nproc 2.")
    if args.experts % nproc:
        raise ValueError(f"--experts = {args.experts} must be a multiple of --nproc = {nproc} (each rank holds "
                         f"experts / {nproc}); e.g. --experts {nproc * max(1, args.experts // nproc)}")
    if args.top_k > args.experts:
        raise ValueError(f"--top-k = {args.top_k} > --experts = {args.experts}: a token picks k distinct experts; "
                         f"use --top-k {args.experts} or less")


# -- the model and its two trainers ---------------------------------------------------------------------------

class MoENet(torch.nn.Module):
    """Embedding -> `layers` x (x + MoE(x)) -> Linear head; [b, s] ids -> scalar loss with the layers' l_aux."""

    def __init__(self, moe_cls: Callable[..., torch.nn.Module], args: argparse.Namespace, ep: int) -> None:
        super().__init__()
        h = args.hidden
        self.vocab = args.vocab
        self.embed = torch.nn.Embedding(args.vocab, h)
        drop = args.capacity_factor is not None
        self.moes = torch.nn.ModuleList(
            moe_cls(hidden_size=h, expert=torch.nn.Sequential(torch.nn.Linear(h, 2 * h), torch.nn.GELU(),
                                                              torch.nn.Linear(2 * h, h)),
                    num_experts=args.experts, ep_size=ep, k=args.top_k, drop_tokens=drop,
                    capacity_factor=args.capacity_factor or 1.0, eval_capacity_factor=args.capacity_factor or 1.0,
                    min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
            for _ in range(args.layers))
        self.head = torch.nn.Linear(h, args.vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)                                  # [b, s, h]
        aux = torch.zeros(())
        for moe in self.moes:
            y, l_aux, _ = moe(x)
            x, aux = x + y, aux + l_aux
        logits = self.head(x)                                # [b, s, V]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab), labels.reshape(-1)) \
            + AUX_LOSS_COEF * aux


class Trainer:
    """One library's engine over its MoENet and this rank's fixed batches (cycled)."""

    def __init__(self, lib: Any, args: argparse.Namespace, batches: list[torch.Tensor]) -> None:
        world = dist.get_world_size()
        torch.manual_seed(0)             # the same weights in both trainers
        self.model = MoENet(lib.moe.layer.MoE, args, ep=world)
        groups = lib.moe.utils.split_params_into_different_moe_groups_for_optimizer(
            {"params": list(self.model.parameters()), "name": "dense"})
        config = {"train_batch_size": args.micro_batch * world, "train_micro_batch_size_per_gpu": args.micro_batch,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "gradient_clipping": 0.0, "steps_per_print": 1_000_000}
        self.engine, *_ = lib.initialize(model=self.model, model_parameters=groups, config=config)
        self.batches, self.i = batches, 0

    def step(self) -> float:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        loss = self.engine(batch[:, :-1], batch[:, 1:])
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())


def _batches(args: argparse.Namespace, count: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + dist.get_rank())      # each rank its own data
    return [torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g) for _ in range(count)]


def _import_deepspeed() -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False      # gloo's all-to-all, as shardwise's
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


# -- measurement ----------------------------------------------------------------------------------------------

def _check_warmup(trainers: dict[Impl, Trainer], warmup: int, rtol: float) -> dict[str, Any]:
    pairs = [(trainers[Impl.SHARDWISE].step(), trainers[Impl.DEEPSPEED].step()) for _ in range(warmup)]
    worst, message = loss_mismatch(pairs, rtol)
    failed = torch.tensor([float(bool(message))])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise RuntimeError(message or "moe benchmark: the warm-up differs on another rank (see its error)")
    return {"rtol": rtol, "loss_rel_diff": worst, "passed": True,
            "warmup_losses": [{"shardwise": a, "deepspeed": b} for a, b in pairs]}


def _time(trainers: dict[Impl, Trainer], rounds: int, steps: int) -> dict[str, list[list[float]]]:
    """Step times [trainer][round][step] in seconds, each the slowest rank's."""
    names = list(Impl)
    times = torch.zeros(rounds, len(names), steps, dtype=torch.float64)
    for r in range(rounds):
        for impl in round_order(r):
            j = names.index(impl)
            for s in range(steps):
                dist.barrier()          # start together: no rank's wait for a peer counts in the next step
                t0 = time.perf_counter()
                trainers[impl].step()
                times[r, j, s] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {impl.value: times[:, j, :].tolist() for j, impl in enumerate(names)}


def _mean_over_ranks(values: Sequence[float]) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _ledger_bytes(trainer: Trainer) -> tuple[float, float]:
    """Shardwise: (token rows, counts) bytes of the last step's all-to-alls, from the engine's ledger."""
    trainer.step()
    rows = [r for r in trainer.engine.comm_report() if r["op"] == "all_to_all"]
    counts = sum(r["bytes"] for r in rows if "int" in str(r["dtype"]))
    return float(sum(r["bytes"] for r in rows) - counts), float(counts)


def _counted_bytes(trainer: Trainer) -> tuple[float, float]:
    """DeepSpeed: the inputs of every torch.distributed.all_to_all_single of one step (it has no ledger)."""
    seen: list[int] = []
    original = dist.all_to_all_single

    def counting(output: torch.Tensor, input: torch.Tensor, *a: Any, **kw: Any) -> Any:
        seen.append(input.numel() * input.element_size())
        return original(output, input, *a, **kw)

    dist.all_to_all_single = counting
    try:
        trainer.step()
    finally:
        dist.all_to_all_single = original
    return float(sum(seen)), 0.0


def print_table(rows: Sequence[Row], *, title: str, expected: Formula, loss_check: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("trainer", "median step ms", "round medians ms", "tokens/s", "shardwise / this", "paired",
                "all-to-all bytes/step", "counts bytes", "/ formula"):
        table.add_column(col, justify="left" if col == "trainer" else "right")
    for r in rows:
        table.add_row(r.trainer, f"{r.median_ms:.2f}", f"{r.round_min_ms:.2f} - {r.round_max_ms:.2f}",
                      f"{r.tokens_per_s:,.0f}", f"{r.shardwise_ratio:.3f}", f"{r.paired_ratio:.3f}",
                      f"{r.all_to_all_bytes:,.0f}", f"{r.all_to_all_count_bytes:,.0f}", f"{r.formula_ratio:.3f}")
    console = Console() if sys.stdout.isatty() else Console(width=180)
    console.print(table)
    console.print(f"Warm-up agrees: {len(loss_check['warmup_losses'])} steps' losses within "
                  f"{loss_check['loss_rel_diff']:.1e} relative difference (rtol {loss_check['rtol']:g}). Formula: "
                  f"{expected.calls} token all-to-alls a step, {expected.payload_bytes:,.0f} bytes of input per rank "
                  f"(tokens x k x hidden x 4, dispatch and combine, forward and backward), "
                  f"{expected.off_rank_bytes:,.0f} of them to other ranks ((P - 1) / P). All-to-all bytes: the mean "
                  f"over ranks of one step's inputs. shardwise / this: ratio of median step times (< 1: shardwise "
                  f"faster); paired: median over rounds of the ratio within each round.")


def run(args: argparse.Namespace) -> None:
    """Build, check, time and report on the already initialized default group; rank 0 prints and writes JSON."""
    import shardwise
    deepspeed = _import_deepspeed()
    data = _batches(args)
    trainers = {Impl.SHARDWISE: Trainer(shardwise, args, data), Impl.DEEPSPEED: Trainer(deepspeed, args, data)}
    loss_check = _check_warmup(trainers, args.warmup, args.rtol)
    times = _time(trainers, args.rounds, args.steps)
    world = dist.get_world_size()
    a2a: dict[str, tuple[float, float]] = {}
    for impl, measure in ((Impl.SHARDWISE, _ledger_bytes), (Impl.DEEPSPEED, _counted_bytes)):
        rows_bytes, count_bytes = _mean_over_ranks(measure(trainers[impl]))
        a2a[impl.value] = (rows_bytes, count_bytes)
    expected = formula(hidden=args.hidden, experts=args.experts, top_k=args.top_k, layers=args.layers,
                       tokens=args.micro_batch * args.seq, ep=world)
    rows = summarize(times, a2a, tokens_per_step=args.micro_batch * args.seq * world, expected=expected)
    if dist.get_rank() == 0:
        dropping = f"capacity factor {args.capacity_factor}" if args.capacity_factor else "no dropping"
        title = (f"MoE at ep = {world}: {args.layers} layer(s) of {args.experts} GELU experts, top-{args.top_k}, "
                 f"hidden {args.hidden}, {dropping}, "
                 f"micro-batch {args.micro_batch} x {args.seq} tokens per rank, gloo, CPU, "
                 f"{torch.get_num_threads()} thread(s)/rank: median of {args.rounds} alternating rounds x "
                 f"{args.steps} steps")
        print_table(rows, title=title, expected=expected, loss_check=loss_check)
        if args.json is not None:
            meta = args_meta(args)
            meta.update(world_size=world, threads_per_rank=torch.get_num_threads(), torch_version=torch.__version__,
                        deepspeed_version=deepspeed.__version__)
            write_json(args.json, {"config": meta, "loss_check": loss_check, "formula": asdict(expected),
                                   "rows": [asdict(r) for r in rows], "step_times_s": times})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank under torch.distributed.run (it sets RANK, WORLD_SIZE, MASTER_ADDR)."""
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: python -m torch.distributed.run --nproc-per-node 2 "
              "-m benchmarks.moe (or `shardwise bench moe --nproc 2`)", file=sys.stderr)
        return 2
    check_args(args, int(os.environ["WORLD_SIZE"]))
    return run_in_gloo_group(run, args)


def launch(nproc: int, argv: Sequence[str] = ()) -> int:
    """Run this benchmark on `nproc` local ranks via torch's elastic launcher, one thread per rank; returns its
    exit code. `argv` are this module's own options (e.g. ["--experts", "4", "--json", "moe.json"])."""
    check_args(build_parser().parse_args(list(argv)), nproc)   # reject bad options here, not on every rank
    return run_under_launcher("benchmarks.moe", nproc, argv, threads_per_rank=1)


if __name__ == "__main__":
    from shardwise.engine.initialize import exit_rank
    exit_rank(main())
