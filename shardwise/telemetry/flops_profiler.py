"""DeepSpeed's "flops_profiler": parameters, forward FLOPs and latency of every module, for one forward.

FLOPs are counted below autograd by a dispatch mode (`_FlopCounter`) and charged to every module on the call stack,
so a module's count includes its children; latency is wall time between a module's forward hooks. The backward and
step latencies come from the engine's phase timers.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from shardwise.config.monitoring import FlopsProfilerConfig

_ATTENTION_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def _attention_formula(packet: Any) -> Callable[..., int]:
    """Attention priced by our own formula on every backend (torch's table has none for the CPU kernel):
    2 * s_q * s_k * (d + d_v) per batch and head, halved under a causal mask. That is the convention of
    `shardwise.models.presets.gpt_flops_per_token`, so a GPT's forward counts exactly 2 FLOPs per token for each
    matmul weight plus its attention term: the analytic count less 2 per token for each norm and bias parameter
    (elementwise work is not priced)."""
    names = [a.name for a in packet.default._schema.arguments]
    causal_at = names.index("is_causal")

    def flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, out_val: Any = None,
              **kwargs: Any) -> int:
        causal = kwargs.get("is_causal", args[causal_at - 3] if len(args) > causal_at - 3 else False)
        *batch, s_q, d = query.shape
        s_k, d_v = key.shape[-2], value.shape[-1]
        lead = 1
        for n in batch:
            lead *= n
        total = 2 * lead * s_q * s_k * (d + d_v)
        return total // 2 if causal else total

    return flops


def _formulas() -> dict[Any, Callable[..., int]]:
    table: dict[Any, Callable[..., int]] = dict(flop_registry)
    for name in _ATTENTION_OPS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            table[packet] = _attention_formula(packet)
    return table


class _FlopCounter(TorchDispatchMode):
    """Prices every aten op with torch's FLOP formulas (`torch.utils.flop_counter`: a matmul of [m, k] by [k, n]
    is 2mkn; attention by `_attention_formula`) and adds it to each module on `stack`."""

    def __init__(self, stack: list[str], flops: dict[str, int]):
        super().__init__()
        self._stack = stack
        self._flops = flops
        self._table = _formulas()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self._table.get(func._overloadpacket)
        if formula is not None and self._stack:
            count = int(formula(*args, **kwargs, out_val=out))
            for name in self._stack:
                self._flops[name] = self._flops.get(name, 0) + count
        return out


@dataclass(frozen=True)
class ModuleProfile:
    name: str            # "" for the model itself
    kind: str            # the module's class
    depth: int           # 0 for the model, 1 for its children, ...
    params: int          # parameters in the module and its children
    flops: int           # forward FLOPs of one micro-batch, children included
    latency_ms: float    # forward wall time, children included

    @property
    def flops_per_s(self) -> float:
        return self.flops / (self.latency_ms / 1e3) if self.latency_ms > 0 else 0.0


def si(x: float, unit: str = "") -> str:
    """2_162_688 -> '2.16 M'."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}".rstrip()


class _Session:
    """Forward hooks on every module of `module` and the counter; only forwards run inside `counting()` are
    recorded (a pipeline stage profiles its first micro-batch among the schedule's other forwards)."""

    def __init__(self, module: torch.nn.Module, now: Callable[[], float]):
        self.named = list(module.named_modules())
        self.stack: list[str] = []
        self.flops: dict[str, int] = {}
        self.latency: dict[str, float] = {}
        self._started: dict[str, list[float]] = {}
        self._now = now
        self._active = False
        self._handles = [h for name, m in self.named for h in (m.register_forward_pre_hook(self._pre(name)),
                                                                m.register_forward_hook(self._post(name)))]

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if self._active:
                self.stack.append(name)
                self._started.setdefault(name, []).append(self._now())
        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if self._active and name in self.stack:
                self.latency[name] = self.latency.get(name, 0.0) + (self._now() - self._started[name].pop()) * 1e3
                self.stack.remove(name)
        return hook

    @contextmanager
    def counting(self) -> Iterator[None]:
        self._active = True
        try:
            with _FlopCounter(self.stack, self.flops):
                yield
        finally:
            self._active = False

    def finish(self) -> list[ModuleProfile]:
        for h in self._handles:
            h.remove()
        return _assemble(self.named, self.flops, self.latency)


class FlopsProfiler:
    """Profiles the first training forward of optimizer step `profile_step` (counted from 0), once. Under a
    pipeline (`stage` = (s, P)) the first rank of each stage (dp and tp index 0) profiles its stage's modules on
    the first micro-batch (every chunk of it, under an interleaved schedule); its report names the stage, and
    `names` gives the full model's names of the stage's modules (for the printed rows).

    Latency is measured under the counter (which slows Python-heavy small models), the device synchronised on
    CUDA at each hook."""

    def __init__(self, section: FlopsProfilerConfig, module: torch.nn.Module, *, device: torch.device,
                 stage: tuple[int, int] | None = None, names: dict[str, str] | None = None):
        self.section = section
        self.module = module
        self.stage = stage
        self.names = dict(names or {})
        self._sync = device.type == "cuda"
        self._device = device
        self.profile: list[ModuleProfile] | None = None
        """The last profile, the model first, then its modules in registration order."""

    def wants(self, step: int) -> bool:
        return self.section.enabled and step == self.section.profile_step and self.profile is None

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    @contextmanager
    def session(self) -> Iterator[_Session]:
        """Hooks in place for the block; forwards inside `session.counting()` are counted. The result lands
        in `self.profile`."""
        session = _Session(self.module, self._now)
        try:
            yield session
        finally:
            self.profile = session.finish()

    @contextmanager
    def profiling(self) -> Iterator[None]:
        """Count and time the forward run inside; the result lands in `self.profile`."""
        with self.session() as session, session.counting():
            yield

    def _display(self, name: str) -> str:
        """A stage module's name in the full model ("chunks.0.layers.1.attn" -> "blocks.0.attn")."""
        for prefix in sorted(self.names, key=len, reverse=True):
            if name == prefix or name.startswith(prefix + "."):
                return self.names[prefix] + name[len(prefix):]
        return name

    def report_lines(self, *, step: int, micro_batch: int, world_size: int, dp_size: int, mp_size: int,
                     bwd_ms: float | None, step_ms: float | None) -> list[str]:
        assert self.profile is not None
        top = self.profile[0]
        fmt = "{:<60}{}"
        at = f" (stage {self.stage[0]} of {self.stage[1]})" if self.stage else ""
        part = (f"pipeline stage {self.stage[0]} of {self.stage[1]}: its layers, this rank's slice" if self.stage
                else "this rank's slice of the model")
        lines = ["", "-------------------------- shardwise flops profiler --------------------------",
                 f"profile of the first micro-batch of step {step} ({part})",
                 fmt.format("world size:", world_size), fmt.format("data parallel size:", dp_size),
                 fmt.format("model parallel size:", mp_size), fmt.format("batch size per GPU:", micro_batch),
                 fmt.format(f"params per GPU{at}:", f"{si(top.params)} ({top.params})"),
                 fmt.format(f"fwd MACs per GPU{at}:", si(top.flops / 2)),
                 fmt.format(f"fwd flops per GPU{at}:", f"{si(top.flops)} ({top.flops})"),
                 fmt.format(f"fwd latency{at}:", f"{top.latency_ms:.2f} ms"),
                 fmt.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency:", si(top.flops_per_s, "FLOPS"))]
        bwd_factor = 2 + self.section.recompute_fwd_factor
        if bwd_ms:
            lines += [fmt.format("bwd latency:", f"{bwd_ms:.2f} ms"),
                      fmt.format(f"bwd FLOPS per GPU = {bwd_factor:g} * fwd flops per GPU / bwd latency:",
                                 si(bwd_factor * top.flops / (bwd_ms / 1e3), "FLOPS"))]
            if step_ms is not None:
                iter_ms = top.latency_ms + bwd_ms + step_ms
                lines += [fmt.format("step latency:", f"{step_ms:.2f} ms"),
                          fmt.format("iter latency (fwd + bwd + step):", f"{iter_ms:.2f} ms"),
                          fmt.format(f"FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / iter latency:",
                                     si((bwd_factor + 1) * top.flops / (iter_ms / 1e3), "FLOPS"))]
        depth = self.section.module_depth
        shown = [p for p in self.profile if depth < 0 or p.depth <= depth]
        lines += ["", f"aggregated profile: top {self.section.top_modules} module(s) by fwd flops at each depth"]
        for d in sorted({p.depth for p in shown}):
            ranked = sorted((p for p in shown if p.depth == d), key=lambda p: -p.flops)[:self.section.top_modules]
            lines.append(f"depth {d}: " + "; ".join(
                f"{self._display(p.name) or '(model)'} [{p.kind}] params {si(p.params)}, flops {si(p.flops)}, "
                f"latency {p.latency_ms:.2f} ms" for p in ranked))
        if self.section.detailed:
            lines += ["", "per-module profile (children included):", _table_header()]
            lines += [_table_row(p, top, self._display(p.name)) for p in shown]
        lines.append("-" * 78)
        return lines

    def write_report(self, lines: list[str], out: Callable[[str], None]) -> None:
        """To `output_file` (under a pipeline stage s writes ``<stem>_stage<s><suffix>`` beside it), else out."""
        if self.section.output_file:
            path = Path(self.section.output_file)
            if self.stage:
                path = path.with_name(f"{path.stem}_stage{self.stage[0]}{path.suffix}")
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
        else:
            for line in lines:
                out(line)


def _assemble(named: list[tuple[str, torch.nn.Module]], flops: dict[str, int],
              latency: dict[str, float]) -> list[ModuleProfile]:
    """One row per module; a container never called itself (a ModuleList) sums its children."""
    children: dict[str, list[str]] = {name: [] for name, _ in named}
    for name, _ in named:
        if name:
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            while parent not in children:        # a parent registered under another path (shared module)
                parent = parent.rsplit(".", 1)[0] if "." in parent else ""
            children[parent].append(name)

    def total(table: dict[str, Any], name: str) -> Any:
        if name in table:
            return table[name]
        return sum(total(table, c) for c in children[name])

    rows = []
    for name, m in named:
        params = sum(p.numel() for p in m.parameters())
        rows.append(ModuleProfile(name=name, kind=type(m).__name__, depth=name.count(".") + 1 if name else 0,
                                  params=params, flops=int(total(flops, name)), latency_ms=float(total(latency, name))))
    return rows


def _table_header() -> str:
    return f"{'module':<36}{'class':<18}{'params':>12}{'fwd flops':>14}{'flops %':>9}{'latency (ms)':>14}" \
           f"{'FLOPS':>14}"


def _table_row(p: ModuleProfile, top: ModuleProfile, display: str) -> str:
    share = 100 * p.flops / top.flops if top.flops else 0.0
    name = "  " * p.depth + (display.rsplit(".", 1)[-1] if display else "(model)")
    return (f"{name:<36}{p.kind:<18}{p.params:>12}{p.flops:>14}{share:>8.1f}%{p.latency_ms:>14.3f}"
            f"{si(p.flops_per_s):>14}")
