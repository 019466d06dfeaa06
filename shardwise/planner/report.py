"""An `Analysis` as JSON, as rich tables, and as a memory-breakdown chart."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from shardwise.planner.analysis import Analysis
from shardwise.planner.comm import zero_paper_volume
from shardwise.planner.memory import GB, MemoryBreakdown
from shardwise.planner.presets import model_name
from shardwise.planner.search import Evaluation
from shardwise.planner.rule import Strategy, describe, strategy_of
from shardwise.planner.specs import PlannerError
from shardwise.planner.time import hfu, mfu

TOP_PLANS = 10
_SHORT = {Strategy.DP: "DP", Strategy.ZERO: "ZeRO", Strategy.ZERO_OFFLOAD: "ZeRO+offload",
          Strategy.MODEL_PARALLEL: "TP/PP/CP", Strategy.THREE_D: "3D"}
_PARTS = ("weights", "grads", "optimizer", "activations", "buffers", "reserved")
_STEP_PARTS = ("compute_s", "tp_comm_s", "pp_comm_s", "cp_comm_s", "ep_comm_s", "bubble_s", "dp_comm_s", "dp_exposed_s",
               "optimizer_s", "offload_s")


def flops_convention(a: Analysis) -> str:
    causal = "halved for the causal mask" if a.job.causal_flops else "not halved for causality (papers' convention)"
    return f"attention scores {causal}"


def _memory(m: MemoryBreakdown) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(m, k) for k in _PARTS}
    out.update(total=m.total, capacity=m.capacity, cpu=m.cpu, fits=m.fits)
    return out


def _evaluation(a: Analysis, e: Evaluation) -> dict[str, Any]:
    out: dict[str, Any] = {"label": e.plan.label(), "strategy": strategy_of(e.plan).value,
                           "description": describe(e.plan), "plan": e.plan.to_dict(), "feasible": e.feasible,
                           "problems": [{"reason": p.reason.value, "detail": p.detail} for p in e.problems]}
    if e.memory is not None:
        out["memory"] = _memory(e.memory)
    if e.time is not None:
        t = e.time
        out["step_time"] = {**{k: getattr(t, k) for k in _STEP_PARTS}, "total_s": t.total_s,
                            "microbatches": t.microbatches, "compute_share": t.compute_share}
        out["tokens_per_s"] = a.job.global_batch * a.job.sequence_length(a.model) / t.total_s
        # MFU counts the model's FLOPs (no recomputation); HFU those executed, the papers' "% of peak"
        out["mfu"] = mfu(t, a.cluster, a.job, a.cluster.num_gpus)
        out["hfu"] = hfu(t, a.cluster, a.job, a.cluster.num_gpus)
        out["hardware_flops"] = t.hardware_flops
    return out


def to_json(a: Analysis) -> dict[str, Any]:
    """Every figure of the report, JSON-ready (bytes, seconds, FLOPs)."""
    chosen = a.chosen
    out: dict[str, Any] = {
        "model": {"name": model_name(a.model), **dataclasses.asdict(a.model), "params": a.params.total,
                  "params_active": a.params.active, "params_non_embedding": a.params.non_embedding,
                  "params_narayanan_eq2": a.cost.params_narayanan},
        "cluster": a.cluster.to_dict(),
        "job": {**a.job.to_dict(), "tokens": a.cost.tokens, "seq_len": a.job.sequence_length(a.model)},
        "flops": {"convention": flops_convention(a), "six_nd": a.cost.flops_6nd,
                  "megatron_no_recompute": a.cost.flops_model, "megatron_full_recompute": a.cost.flops_full_recompute},
        "train": None if a.train is None else vars(a.train),
        "memory_by_strategy": [{"strategy": s.name, "plan": s.plan.label(), **_memory(s.memory)}
                               for s in a.strategies],
        "activations_per_layer_bytes": a.activations_per_layer,
        "plan": None if chosen is None else _evaluation(a, chosen),
        "reason": a.reason,
        "communication": [{"axis": c.axis.value, "op": c.op.value, "purpose": c.purpose, "group_size": c.group_size,
                           "link": c.link.value, "calls": c.calls, "payload_bytes": c.payload_bytes,
                           "sent_bytes": c.sent_bytes, "seconds": c.total_seconds} for c in a.collectives],
        "zero_paper_volume_elements": {f"stage{s}": zero_paper_volume(a.params.total, s) for s in range(4)},
        "bubble_fraction": a.bubble,
        "rule_of_thumb": {"strategy": a.rule.strategy.value, "tests": a.rule.lines(),
                          "comparison": list(a.rule_comparison)},
    }
    if a.result is not None:
        out["search"] = {
            "considered": a.result.considered, "feasible": len(a.result.ranked),
            "ranked": [_evaluation(a, e) for e in a.result.ranked[:TOP_PLANS]],
            "infeasible": [{"label": i.plan.label(), "reason": i.reason.value, "detail": i.detail}
                           for i in a.result.infeasible],
            "infeasible_counts": {r.value: n for r, n in a.result.counts.items()},
        }
    return out


def _gb(x: float) -> str:
    return f"{x / GB:,.2f}" if x < 100 * GB else f"{x / GB:,.0f}"


def _s(x: float) -> str:
    return f"{x:.3g}"


def _amount(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.3g}"


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400.0), ("hours", 3600.0), ("minutes", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.3g} s"


def render(a: Analysis, console: Any) -> None:
    """Print the report as rich tables on `console` (a rich.console.Console)."""
    from rich.table import Table

    m, c, j = a.model, a.cluster, a.job
    t = Table(title=f"Model {model_name(m)}", show_header=False)
    t.add_row("shape", f"{m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads ({m.n_kv_head} kv), d_ff {m.d_ff} "
                       f"{m.mlp}, vocab {m.vocab_size}, context {m.seq_len}")
    t.add_row("parameters", f"{a.params.total:,} (non-embedding {a.params.non_embedding:,})"
              + (f"; active per token {a.params.active:,} ({m.moe_top_k} of {m.moe_experts} experts"
                 f"{f' + {m.moe_shared_experts} shared' if m.moe_shared_experts else ''})" if m.moe_experts else ""))
    t.add_row("cluster", f"{c.num_gpus} x {c.name} in {c.num_nodes} node(s) of {c.gpus_per_node}: "
                         f"{c.peak_flops(j.precision) / 1e12:,.1f} TFLOP/s {j.precision.value} peak x "
                         f"{c.compute_efficiency:.2f} large-GEMM ceiling, {_gb(c.memory_bytes)} GB, links "
                         f"{c.intra_node_bw / 1e9:,.1f} / {c.inter_node_bw / 1e9:,.1f} GB/s intra / inter node")
    if c.source:
        t.add_row("figures from", c.source)
    if a.cost.params_narayanan is not None:
        t.add_row("Narayanan eq. 2", f"{a.cost.params_narayanan:,.0f}")
    t.add_row("training tokens", f"{a.cost.tokens:.3g}" + ("" if j.tokens else " (20 per parameter)"))
    t.add_row("FLOPs 6ND", f"{a.cost.flops_6nd:.3g}")
    t.add_row("FLOPs Megatron", f"{a.cost.flops_model:.3g} without recompute, {a.cost.flops_full_recompute:.3g} "
                                f"with full recompute; {flops_convention(a)}")
    if a.train is not None:
        tr = a.train
        t.add_row("time to train", f"{_duration(tr.seconds)} on {c.num_gpus} GPUs ({_amount(tr.gpu_days)} GPU-days, "
                                   f"MFU {100 * tr.mfu:.1f}%, HFU {100 * tr.hfu:.1f}%, {tr.steps:,.0f} steps)")
        t.add_row("cross-checks", f"Narayanan eq. 4: {_duration(tr.narayanan_days * 86400)}; 6ND at 100% of peak: "
                                  f"{_amount(tr.gpu_days_at_peak)} GPU-days")
    console.print(t)

    t = Table(title=f"Memory per GPU, GB: {c.num_gpus} x {c.name} ({_gb(c.memory_bytes)} GB), micro-batch "
                    f"{a.strategies[0].plan.micro_batch}, no recompute")
    for col in ("strategy", *_PARTS, "total", "host", "fits"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for s in a.strategies:
        mem = s.memory
        t.add_row(s.name, *(_gb(getattr(mem, k)) for k in _PARTS), _gb(mem.total), _gb(mem.cpu),
                  "yes" if mem.fits else f"no (+{_gb(mem.over_budget)})" if mem.over_budget > 0 else "no (host)")
    console.print(t)
    ref = a.chosen.plan if a.chosen is not None else a.strategies[0].plan
    console.print(f"Activations of one layer, micro-batch {ref.micro_batch}, tp {ref.tp}"
                  f"{' with sequence parallelism' if ref.sequence_parallel else ''}"
                  f"{f', cp {ref.cp} ({ref.cp_impl.value})' if ref.cp > 1 else ''} (GB), by recomputation: "
                  + ", ".join(f"{k} {_gb(v)}" for k, v in a.activations_per_layer.items()))

    if a.chosen is not None:
        _render_plan(a, a.chosen, console)
    if a.result is not None:
        _render_search(a, console)
    console.print("[bold]Rule of thumb (DP if it fits, else ZeRO-2/3, else ZeRO-3 + offload, else 3D)[/bold]: "
                  + "; ".join(a.rule.lines()))
    for line in a.rule_comparison:
        console.print(line)


def _render_plan(a: Analysis, e: Evaluation, console: Any) -> None:
    from rich.table import Table

    head = "Recommended plan" if a.result is not None else "Plan"
    console.print(f"[bold]{head}: {e.plan.label()}[/bold]")
    if a.reason is not None:
        console.print(f"Why: {a.reason}")
    for p in e.problems:
        console.print(f"  cannot run: {p.reason.value}: {p.detail}")
    if e.time is None:
        return
    st = e.time
    t = Table(title="Step time, s", show_header=True)
    for col in ("compute", "TP comm", "PP sends", "CP comm (exposed)", "EP all-to-all", "bubble", "DP comm (exposed)",
                "optimizer", "offload", "total"):
        t.add_column(col, justify="right")
    t.add_row(_s(st.compute_s), _s(st.tp_comm_s), _s(st.pp_comm_s), _s(st.cp_comm_s), _s(st.ep_comm_s),
              _s(st.bubble_s),
              f"{_s(st.dp_comm_s)} ({_s(st.dp_exposed_s)})", _s(st.optimizer_s), _s(st.offload_s), _s(st.total_s))
    console.print(t)
    n = a.cluster.num_gpus
    extra = (f"MFU {100 * mfu(st, a.cluster, a.job, n):.1f}%, HFU {100 * hfu(st, a.cluster, a.job, n):.1f}% "
             f"(with recomputation), compute share (scaling efficiency) {100 * st.compute_share:.1f}%")
    if a.bubble is not None:
        extra += f", pipeline bubble {100 * a.bubble:.1f}% of the step"
    console.print(extra)
    t = Table(title="Communication per step (payload = the ledger's bytes; sent = ring wire bytes per rank)")
    for col in ("axis", "op", "what", "group", "link", "calls", "payload GB", "sent GB", "time s"):
        t.add_column(col, justify="right")
    for c in a.collectives:
        t.add_row(c.axis.value, c.op.value, c.purpose, str(c.group_size), c.link.value, str(c.calls),
                  _gb(c.total_payload_bytes), _gb(c.sent_bytes), _s(c.total_seconds))
    console.print(t)
    console.print(f"ZeRO paper volume per step: {zero_paper_volume(a.params.total, 0):.3g} elements (DP, ZeRO-1/2 "
                  f"2 psi), {zero_paper_volume(a.params.total, 3):.3g} (ZeRO-3 3 psi)")


def _render_search(a: Analysis, console: Any) -> None:
    from rich.table import Table

    r = a.result
    assert r is not None
    t = Table(title=f"Fastest of {len(r.ranked)} feasible plans ({r.considered} considered)")
    for col in ("#", "plan", "strategy", "step s", "MFU %", "HFU %", "memory GB"):
        t.add_column(col, justify="left" if col == "plan" else "right")
    for i, e in enumerate(r.ranked[:TOP_PLANS], 1):
        assert e.time is not None and e.memory is not None
        n = a.cluster.num_gpus
        t.add_row(str(i), e.plan.label(), _SHORT[strategy_of(e.plan)], _s(e.time.total_s),
                  f"{100 * mfu(e.time, a.cluster, a.job, n):.1f}", f"{100 * hfu(e.time, a.cluster, a.job, n):.1f}",
                  _gb(e.memory.total))
    console.print(t)
    if r.infeasible:
        t = Table(title="Layouts that cannot run")
        for col in ("layout", "why"):
            t.add_column(col)
        for bad in r.infeasible:
            cp = f" cp{bad.plan.cp}:{bad.plan.cp_impl.value}" if bad.plan.cp > 1 else ""
            t.add_row(f"dp{bad.plan.dp} tp{bad.plan.tp} pp{bad.plan.pp}{cp}", bad.detail)
        console.print(t)


def plot(a: Analysis, path: str | os.PathLike) -> None:
    """Stacked bars of the memory per GPU by strategy (and the chosen plan), the GPU's memory as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(s.name, s.memory) for s in a.strategies]
    if a.chosen is not None and a.chosen.memory is not None:
        rows.append((f"chosen: {a.chosen.plan.label()}", a.chosen.memory))
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * len(rows)))
    left = [0.0] * len(rows)
    for part in _PARTS:
        values = [getattr(mem, part) / GB for _, mem in rows]
        ax.barh([name for name, _ in rows], values, left=left, label=part)
        left = [x + v for x, v in zip(left, values)]
    ax.axvline(a.cluster.memory_bytes / GB, color="black", linestyle="--", label="GPU memory")
    ax.set_xlabel("GB per GPU")
    ax.set_title(f"{model_name(a.model)} on {a.cluster.num_gpus} x {a.cluster.name}")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise PlannerError(f"--plot {os.fspath(path)!r}: cannot write: {e.strerror or e}") from None
    finally:
        plt.close(fig)
