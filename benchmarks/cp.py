"""Context parallelism: step time and stored activations per rank against the cp size, ring attention and Ulysses
side by side with the peers, and the longest sequence a per-rank memory budget trains at cp 1 and at the largest cp.

    shardwise bench cp --nproc 4 [--seq 1024 --micro-batch 1 --heads 8 --kv-heads 2 --rounds 6 --budget-mib 192
                                  --json out.json]

Every rank builds, from one seed, one engine per trainer on the small Llama preset (`--heads`/`--kv-heads` reshape
its attention: the preset's 6 heads do not spread over 4 Ulysses ranks), fp32, SGD, no clipping:

    cp1               no context parallelism (data parallel over all ranks)
    ring{C}           ring attention over C ranks (dp = ranks / C), for every C in 2, 4 dividing the ranks
    ulysses{C}        Ulysses over C ranks
    allgather{C}      the ring engine with every rank all-gathering all keys and values instead (Megatron's
                      all_gather mode; the stand-in for torch's context_parallel, which does not run on the CPU)
    deepspeed{C}      the Ulysses engine with DeepSpeed's DistributedAttention in place of ours (if installed)

Every rank is given the same micro-batch of `--seq` tokens; each engine takes its part. The engines take turns
step by step in an order that rotates every round, each step after a barrier; a step's time is the slowest rank's.
Then one layer's attention alone, forward + backward, ring against all-gather at every C (`attention_alone`): the
ring's own cost, without the rest of the step. Reported per trainer: the median step time, its spread, its ratio to ring or Ulysses at the same C (paired per
round too), `memory_report()["activations"]` (the largest over ranks) against the planner's prediction and
against 1/C of cp1's, and the first step's loss (the same for all: every trainer computes the same function).

The longest trainable sequence: the small Llama preset itself, ring attention, at cp 1 and at the largest C, with
a budget per rank on what the engine measures, model states + stored activations (`--budget-mib`). The planner
proposes a length; one training step at that length, then one more multiple of 16 C tokens up or down at a time,
finds the longest that fits, measured. Transient buffers (a ring block in flight, the scores of one block) are not
in the budget.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import args_meta, int_at_least, rotation, run_in_gloo_group, run_under_launcher, write_json

MAX_PROBES = 12
"""Training steps the longest-sequence search takes per cp size at most, after the planner's proposal."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise bench cp --nproc N",
                                description="Context parallelism: step time and stored activations against cp, "
                                            "against Megatron's all-gather mode and DeepSpeed's Ulysses; the "
                                            "longest sequence a memory budget trains.")
    p.add_argument("--seq", type=int_at_least(16), default=1024, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--micro-batch", type=int_at_least(1), default=1, help="sequences per step (default: %(default)s)")
    p.add_argument("--heads", type=int_at_least(1), default=8, help="query heads (default %(default)s; preset: 6)")
    p.add_argument("--kv-heads", type=int_at_least(1), default=2, help="key/value heads (default: %(default)s)")
    p.add_argument("--layers", type=int_at_least(1), default=None,
                   help="transformer blocks, for quick checks (default: the preset's 6; also in the longest-"
                        "sequence search)")
    p.add_argument("--rounds", type=int_at_least(1), default=6, help="timed steps of each (default: %(default)s)")
    p.add_argument("--warmup", type=int_at_least(1), default=1, help="untimed steps of each (default: %(default)s)")
    p.add_argument("--budget-mib", type=float, default=192.0,
                   help="per-rank budget of model states + stored activations for the longest sequence "
                        "(default: %(default)s MiB)")
    p.add_argument("--no-longest", action="store_true", help="skip the longest-sequence search")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed's DistributedAttention out")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results to OUT")
    return p


def cp_sizes(world: int) -> list[int]:
    """The cp sizes compared besides 1: 2 and 4 where they divide the ranks."""
    return [c for c in (2, 4) if c <= world and world % c == 0]


def check_options(args: argparse.Namespace, world: int) -> None:
    """Refuse, before any rank starts, what the engines would refuse: one line naming the option and the fix."""
    if world < 2:
        raise ValueError(f"--nproc {world}: context parallelism needs at least 2 ranks; use --nproc 2 or 4")
    top = max(cp_sizes(world))
    if args.seq % (2 * top):
        raise ValueError(f"--seq {args.seq} does not cut into 2 x {top} chunks (causal ring attention at cp {top}); "
                         f"use a multiple of {2 * top}")
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if 384 % args.heads:
        raise ValueError(f"--heads {args.heads} does not divide the preset's d_model 384")


def model_config(args: argparse.Namespace, seq: int) -> Any:
    """The compared model: the small Llama preset with `--heads` / `--kv-heads` (and `--layers`)."""
    return preset(args, seq, n_head=args.heads, n_kv_head=args.kv_heads)


def preset(args: argparse.Namespace, seq: int, **changes: Any) -> Any:
    """The small Llama preset at `seq` tokens (`--layers` blocks if given)."""
    from shardwise.models import gpt_config
    if args.layers is not None:
        changes["n_layer"] = args.layers
    return gpt_config("llama-small", seq_len=seq, **changes)


def trainers(world: int, heads: int, kv_heads: int, deepspeed: bool) -> list[tuple[str, int, str, str | None]]:
    """(name, cp, impl, replacement attention) of every trainer that can run on this model and world."""
    from shardwise.parallel.context.ulysses import check_heads
    out: list[tuple[str, int, str, str | None]] = [("cp1", 1, "ring", None)]
    for c in cp_sizes(world):
        out += [(f"ring{c}", c, "ring", None), (f"allgather{c}", c, "ring", "allgather")]
        try:
            check_heads(heads, kv_heads, c)
        except ValueError:
            continue
        out.append((f"ulysses{c}", c, "ulysses", None))
        if deepspeed:
            out.append((f"deepspeed{c}", c, "ulysses", "deepspeed"))
    return out


def _engine(cfg: Any, cp: int, impl: str, micro: int, replace: str | None) -> Any:
    import shardwise
    from shardwise.models import GPT
    from benchmarks.cp_attention import AllGatherAttention, DeepSpeedUlysses, replace_cp_attention
    torch.manual_seed(1234)
    model = GPT(cfg)
    dp = dist.get_world_size() // cp
    config: dict[str, Any] = {"train_batch_size": micro * dp, "train_micro_batch_size_per_gpu": micro,
                              "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 1e-4}}}
    if cp > 1:
        config["context_parallel"] = {"size": cp, "impl": impl}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    make: Callable[[Any, Any], Any] | None = {
        "allgather": AllGatherAttention,
        "deepspeed": DeepSpeedUlysses,
        None: None}[replace]
    if make is not None:
        assert replace_cp_attention(engine.module, make) == cfg.n_layer
    return engine


def _batch(cfg: Any, micro: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same micro-batch on every rank: ids [micro, seq], labels shifted before any split."""
    rows = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=torch.Generator().manual_seed(7))
    return rows[:, :-1], rows[:, 1:]


def predicted_activations(cfg: Any, seq: int, micro: int, cp: int, impl: str, world: int) -> float:
    """The planner's stored activations per rank (fused attention: no stored scores, as SDPA and the ring)."""
    from shardwise.planner import JobSpec, Plan, Precision, activation_bytes
    job = JobSpec(global_batch=micro * world // cp, seq_len=seq, precision=Precision.FP32, flash_attention=True)
    return activation_bytes(cfg, job, Plan(dp=world // cp, cp=cp, cp_impl=impl, micro_batch=micro)).total


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """The side-by-side part: every trainer's step time and stored activations."""
    world = dist.get_world_size()
    cfg = model_config(args, args.seq)
    specs = trainers(world, args.heads, args.kv_heads, not args.no_deepspeed and _has_deepspeed())
    if any(replace == "deepspeed" for *_, replace in specs):
        from benchmarks.cp_attention import init_deepspeed_comm
        init_deepspeed_comm()
    engines = {name: _engine(cfg, cp, impl, args.micro_batch, replace) for name, cp, impl, replace in specs}
    batch = _batch(cfg, args.micro_batch, args.seq)

    def step(name: str) -> tuple[float, float]:
        dist.barrier()
        t = time.perf_counter()
        loss = float(engines[name].train_batch(iter([batch])))
        return time.perf_counter() - t, loss

    first = {name: step(name)[1] for name in engines}
    for _ in range(args.warmup - 1):
        for name in engines:
            step(name)
    names = list(engines)
    times = torch.zeros(args.rounds, len(names), dtype=torch.float64)       # [rounds, trainers] seconds
    for i in range(args.rounds):
        for name in rotation(names, i):
            times[i, names.index(name)] = step(name)[0]
    dist.all_reduce(times, op=dist.ReduceOp.MAX)                           # a step lasts as long as its slowest rank
    stored = {name: _max_over_ranks(e.memory_report()["activations"]) for name, e in engines.items()}
    rows = []
    for j, (name, cp, impl, replace) in enumerate(specs):
        mine = times[:, j].tolist()
        base = times[:, names.index(f"{impl}{cp}" if cp > 1 else "cp1")].tolist()
        rows.append({"trainer": name, "cp": cp, "impl": impl, "attention": replace or "shardwise",
                     "median_ms": statistics.median(mine) * 1e3, "round_min_ms": min(mine) * 1e3,
                     "round_max_ms": max(mine) * 1e3,
                     "ratio_to_ours": statistics.median(mine) / statistics.median(base),
                     "paired_ratio_to_ours": statistics.median(a / b for a, b in zip(mine, base)),
                     "activations": stored[name],
                     "predicted": (predicted_activations(cfg, args.seq, args.micro_batch, cp, impl, world)
                                   if replace is None else float("nan")),
                     "times_cp1_over_c": stored[name] * cp / stored["cp1"],
                     "first_loss": first[name]})
    for e in engines.values():
        e.close()
    return {"rows": rows, "params": sum(p.numel() for p in engines["cp1"].module.parameters())}


ATTENTION_REPEATS = 3
"""Timed forward + backward passes of the attention alone per round of the step comparison."""


def attention_alone(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One layer's causal attention alone, forward + backward, ring attention against all-gathering the keys and
    values, at every cp size: what ring attention's blocks cost, without the rest of a step (its matmuls and the
    machine's other load dominate a step's spread). q viewed from [B, s, H, D] as a model's is; interleaved, the
    order rotating; each pass's time the slowest rank's."""
    from benchmarks.cp_attention import AllGatherAttention
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    from shardwise.parallel.context import RingAttention, SequenceLayout
    world, rank = dist.get_world_size(), dist.get_rank()
    head_dim = model_config(args, args.seq).d_model // args.heads
    g = torch.Generator().manual_seed(rank)
    rows = []
    for c in cp_sizes(world):
        groups = [dist.new_group(list(range(first, first + c))) for first in range(0, world, c)]
        comm = Comm(groups[rank // c], CommLedger(), name="cp")
        layout = SequenceLayout(c, rank % c, balanced=True)
        s, b = args.seq // c, args.micro_batch
        q = torch.randn(b, s, args.heads, head_dim, generator=g).transpose(1, 2)        # [B, H, s, D]
        k, v = (torch.randn(b, args.kv_heads, s, head_dim, generator=g) for _ in range(2))
        dout = torch.randn(b, args.heads, s, head_dim, generator=g)
        attentions: dict[str, Callable[..., torch.Tensor]] = {"ring": RingAttention(comm, layout),
                                                             "allgather": AllGatherAttention(comm, layout)}
        names = list(attentions)
        times = torch.zeros(args.rounds * ATTENTION_REPEATS + 1, len(names), dtype=torch.float64)
        for i in range(times.shape[0]):                                 # pass 0: warm-up, not counted
            for name in rotation(names, i):
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                dist.barrier()
                t = time.perf_counter()
                attentions[name](*leaves, causal=True).backward(dout)
                times[i, names.index(name)] = time.perf_counter() - t
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        ring, gathered = times[1:, 0].tolist(), times[1:, 1].tolist()
        rows.append({"cp": c, "passes": len(ring), "ring_ms": statistics.median(ring) * 1e3,
                     "allgather_ms": statistics.median(gathered) * 1e3,
                     "ratio": statistics.median(ring) / statistics.median(gathered),
                     "paired_ratio": statistics.median(a / b for a, b in zip(ring, gathered))})
    return rows


def _has_deepspeed() -> bool:
    import importlib.util
    return importlib.util.find_spec("deepspeed") is not None


def _fits(args: argparse.Namespace, cp: int, seq: int, budget: float) -> tuple[bool, float, float]:
    """One training step of the preset at `seq` tokens over cp ranks: (fits, model states, activations), the
    largest over ranks."""
    micro = args.micro_batch
    cfg = preset(args, seq)
    engine = _engine(cfg, cp, "ring", micro, None)
    engine.train_batch(iter([_batch(cfg, micro, seq)]))
    report = engine.memory_report()
    engine.close()
    states, stored = _max_over_ranks(report["model_states"]), _max_over_ranks(report["activations"])
    return states + stored <= budget, states, stored


def planner_longest(model: Callable[[int], Any], cp: int, micro: int, budget: float, states: float, quantum: int,
                    world: int) -> int:
    """The planner's longest multiple of `quantum` whose stored activations fit beside `states` in `budget`
    (`model(seq)`: the model at seq tokens)."""
    seq = quantum
    while True:
        nxt = seq + quantum
        if states + predicted_activations(model(nxt), nxt, micro, cp, "ring", world) > budget:
            return seq
        seq = nxt


Probe = tuple[int, bool, float]
"""(sequence length, fits the budget, stored activation bytes) of one measured step."""


def walk_to_boundary(start: int, quantum: int, fits: Callable[[int], tuple[bool, float]],
                     max_probes: int = MAX_PROBES) -> tuple[int, list[Probe]]:
    """From `start`, one `quantum` at a time (up while it fits, down while it does not), measure until two
    neighbouring lengths disagree; returns the longest that fits and the probes made."""
    ok, stored = fits(start)
    probes: list[Probe] = [(start, ok, stored)]
    seq, step = start, quantum if ok else -quantum
    while len(probes) < max_probes and seq + step >= quantum:
        nxt = seq + step
        nxt_ok, nxt_stored = fits(nxt)
        probes.append((nxt, nxt_ok, nxt_stored))
        if nxt_ok != ok:
            return (seq if ok else nxt), probes
        seq = nxt
    raise ValueError(f"no fit boundary within {len(probes)} measured steps of {start} tokens (steps of {quantum})")


def longest(args: argparse.Namespace) -> dict[str, Any]:
    """The longest sequence of the preset that trains within the budget at cp 1 and the largest cp, measured."""
    world = dist.get_world_size()
    top = max(cp_sizes(world))
    quantum = 16 * top                    # the ring's 2 * top chunks of 8 tokens; the same steps at every cp
    budget = args.budget_mib * 2 ** 20
    out: dict[str, Any] = {"budget_bytes": budget, "quantum": quantum, "sizes": {}}
    for cp in (1, top):
        fits, states, _ = _fits(args, cp, quantum, budget)
        if not fits:
            raise ValueError(f"--budget-mib {args.budget_mib}: the model states alone ({states / 2**20:.1f} MiB) "
                             f"and {quantum} tokens do not fit; give a larger budget")
        proposed = planner_longest(lambda n: preset(args, n), cp, args.micro_batch, budget, states, quantum, world)

        def measured(n: int, cp: int = cp) -> tuple[bool, float]:
            ok, _, stored = _fits(args, cp, n, budget)
            return ok, stored

        seq, probes = walk_to_boundary(proposed, quantum, measured)
        out["sizes"][str(cp)] = {"longest": seq, "planner": proposed, "model_states": states,
                                 "probes": [{"seq": s, "fits": f, "activations": a} for s, f, a in probes]}
    out["ratio"] = out["sizes"][str(top)]["longest"] / out["sizes"]["1"]["longest"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    world = dist.get_world_size()
    result: dict[str, Any] = {"config": args_meta(args) | {"ranks": world, "model": "llama-small",
                                                          "dtype": "fp32", "optimizer": "SGD"}}
    from benchmarks.cp_attention import TORCH_CONTEXT_PARALLEL_ON_CPU
    result["torch_context_parallel"] = TORCH_CONTEXT_PARALLEL_ON_CPU
    compared = compare(args)
    result["rows"], result["config"]["params"] = compared["rows"], compared["params"]
    result["attention_alone"] = attention_alone(args)
    if not args.no_longest:
        result["longest"] = longest(args)
    # The machine's 1-minute load average as the run ends: the figures' context on a shared machine.
    result["config"]["load_average"] = round(os.getloadavg()[0], 2)
    return result


def report_lines(result: dict[str, Any]) -> list[str]:
    """The tables as text: the trainers side by side, then the longest sequences."""
    c = result["config"]
    layers = f"{c['layers']} layers, " if c.get("layers") else ""
    lines = [f"Llama-small with {layers}{c['heads']} heads / {c['kv_heads']} kv heads ({c['params']:,} params), "
             f"{c['ranks']} ranks, micro-batch {c['micro_batch']} x {c['seq']} tokens, fp32, SGD, median of "
             f"{c['rounds']} rounds" + (f", load average {c['load_average']:g}" if "load_average" in c else ""),
             f"{'trainer':<13} {'cp':>3} {'step ms':>9} {'spread ms':>15} {'/ ours':>7} {'paired':>7} "
             f"{'act MiB':>9} {'planner':>8} {'x C / cp1':>9}  first loss"]
    for r in result["rows"]:
        planner = "" if r["predicted"] != r["predicted"] else f"{r['predicted'] / 2**20:.2f}"
        lines.append(f"{r['trainer']:<13} {r['cp']:>3} {r['median_ms']:>9.1f} "
                     f"{r['round_min_ms']:>7.1f}-{r['round_max_ms']:<7.1f} {r['ratio_to_ours']:>7.3f} "
                     f"{r['paired_ratio_to_ours']:>7.3f} {r['activations'] / 2**20:>9.2f} {planner:>8} "
                     f"{r['times_cp1_over_c']:>9.3f}  {r['first_loss']:.6f}")
    lines.append("'/ ours': against ring or Ulysses at the same cp (cp1: itself). " + result["torch_context_parallel"])
    for a in result.get("attention_alone", []):
        lines.append(f"Attention alone at cp {a['cp']} (one layer, forward + backward, median of {a['passes']}): "
                     f"ring {a['ring_ms']:.1f} ms, all-gather {a['allgather_ms']:.1f} ms, ring / all-gather "
                     f"{a['ratio']:.3f} (paired {a['paired_ratio']:.3f})")
    if "longest" in result:
        lg = result["longest"]
        lines.append(f"Longest trainable sequence of llama-small ({layers}6 heads / 2 kv heads, ring), budget "
                     f"{lg['budget_bytes'] / 2**20:.0f} MiB per rank of model states + stored activations, steps of "
                     f"{lg['quantum']} tokens:")
        for cp, s in lg["sizes"].items():
            lines.append(f"  cp {cp}: {s['longest']} tokens (planner {s['planner']}; model states "
                         f"{s['model_states'] / 2**20:.1f} MiB; {len(s['probes'])} measured steps)")
        lines.append(f"  ratio {lg['ratio']:.2f}x")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: shardwise bench cp --nproc 4", file=sys.stderr)
        return 2

    def run_and_report(args: argparse.Namespace) -> None:
        result = run(args)
        if dist.get_rank() == 0:
            print("\n".join(report_lines(result)))
            if args.json is not None:
                write_json(args.json, result)

    return run_in_gloo_group(run_and_report, args)      # one thread per rank, barrier before teardown


def launch(nproc: int, argv: Sequence[str] = ()) -> int:
    """Run on `nproc` local ranks through torch's elastic launcher; returns its exit code. Bad options are
    refused here, before any rank starts."""
    args = build_parser().parse_args(list(argv))
    check_options(args, nproc)
    return run_under_launcher("benchmarks.cp", nproc, argv)


if __name__ == "__main__":
    from shardwise.engine.initialize import exit_rank
    exit_rank(main())
