"""Execute one stage's schedule: forwards and backwards of micro-batches, with asynchronous p2p.

    runtime = PipelineRuntime(stage_module, pp_comm, schedule="1f1b", num_microbatches=M)
    result = runtime.step(micro_batches)     # [(inputs, labels)] * M on the first/last stage, else None
    result.loss, result.records, result.peak_in_flight

The stage runs its `comm_plan` program: its actions (`build_schedule`) in order, and between them the batches
of sends and receives of the lockstep grid that keeps NCCL from hanging or mismatching messages (see `comm_plan`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

import torch
from torch import Tensor

from shardwise.comm.collectives import Comm
from shardwise.config import PipelineSchedule
from shardwise.parallel.outputs import loss_of
from shardwise.parallel.pipeline.comm_plan import Batch, Step, build_programs
from shardwise.parallel.pipeline.p2p import Outgoing, TensorMeta, Wire
from shardwise.parallel.pipeline.schedules import (
    Action, ActionTable, Message, Op, PipelineError, Transfers, build_schedule, format_actions, forward_only,
    parse_schedule_kind, transfers)
from shardwise.parallel.pipeline.simulate import ActionRecord
from shardwise.parallel.pipeline.tensors import (
    checked_loss, flatten, free_data, module_device, sole_owner, to_device)
from shardwise.parallel.pipeline.stage import PipelineStage
from shardwise.telemetry.activations import ActivationMeter, storage_key

if TYPE_CHECKING:
    from shardwise.parallel.interfaces import DataParallelRuntime


@dataclass
class StepResult:
    """One pipeline step on one stage."""

    stage: int
    losses: list[float]
    """Loss of each micro-batch (unscaled, before the division by M); only on the stage with the last chunk."""
    records: list[ActionRecord]
    """(stage, action, start, end) of every action's compute (waits excluded), in `time.perf_counter` seconds:
    CLOCK_MONOTONIC on Linux, so the records of all ranks on one host share a time axis."""
    peak_in_flight: int
    """Most (micro-batch, chunk) forwards whose saved activations were alive at once."""
    peak_activation_bytes: int
    """Most bytes of saved activations alive at once (storages counted once)."""
    measured: bool = True
    """Whether this step ran the activation meter; if not, the two peaks are those of the last step that did."""

    @property
    def loss(self) -> float | None:
        """Mean loss over the micro-batches (the step's loss), on the last stage; else None."""
        return sum(self.losses) / len(self.losses) if self.losses else None


@dataclass
class _Slot:
    """What F(m, v) keeps for B(m, v)."""

    inputs: list[Tensor]                  # received activations that require grad: their .grad goes back
    outputs: list[Tensor]                 # outputs that require grad: the backward roots (data freed once sent)
    out_metas: list[TensorMeta]           # their shapes: the gradients to receive
    loss: Tensor | None = None            # last chunk: loss / M * loss_scale
    unscaled_loss: Tensor | None = None   # last chunk: the loss function's value
    local_out: list[Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class _Plan:
    """One schedule as this stage runs it: its actions, its program (computes and p2p batches, `comm_plan`),
    each action's transfers, and the remote inputs of actions i+1 .. i+lookahead (posted early with gloo)."""

    actions: list[Action]
    program: list[Step]
    transfers: list[Transfers]
    ahead: list[list[tuple[Message, int]]]

    @classmethod
    def of(cls, schedule: ActionTable, stage: PipelineStage, lookahead: int) -> "_Plan":
        actions = schedule[stage.stage]
        plan = [transfers(a, stage=stage.stage, num_stages=stage.num_stages, virtual_stages=stage.virtual_stages)
                for a in actions]
        remote = [(t.recv.message, t.recv.peer) if t.recv is not None and not t.recv_local else None for t in plan]
        ahead = [[r for r in remote[i + 1:i + 1 + lookahead] if r is not None] for i in range(len(remote))]
        return cls(actions, build_programs(schedule)[stage.stage], plan, ahead)


LOOKAHEAD = 2
"""With gloo, the receives of the inputs of the next LOOKAHEAD actions are posted before an action runs."""
MEASURE_EVERY = 50
"""The activation meter runs on the first step and then on one step in MEASURE_EVERY. Measured, not assumed:
`telemetry.activations.ActivationMeter` follows every tensor autograd saves during each forward until it is freed,
giving the peak number of micro-batch chunks whose activations are alive at once and their bytes."""


class PipelineRuntime:
    """Runs ``stage``'s actions of one schedule; ``comm`` is the pipeline group (group rank = stage)."""

    def __init__(self, stage: PipelineStage, comm: Comm, *, schedule: str | PipelineSchedule, num_microbatches: int,
                 device: torch.device | None = None, eager_receives: bool | None = None,
                 lookahead: int = LOOKAHEAD, measure_every: int = MEASURE_EVERY) -> None:
        if comm.size != stage.num_stages or comm.rank != stage.stage:
            raise PipelineError(f"the pipeline group has {comm.size} rank(s) and this is rank {comm.rank}, but the "
                                f"stage module is stage {stage.stage} of {stage.num_stages}: they must match")
        self.stage = stage
        self.comm = comm
        self.kind = parse_schedule_kind(schedule)
        self.num_microbatches = num_microbatches
        self.device = device if device is not None else module_device(stage)
        self.lookahead = lookahead
        self.train_plan = _Plan.of(self._schedule(num_microbatches), stage, lookahead)
        self.actions: list[Action] = self.train_plan.actions
        self._last_backward = max(i for i, a in enumerate(self.actions) if a.op is Op.BACKWARD)
        self.wire = Wire(comm, device=self.device, eager_receives=eager_receives)
        self._eval_plans: dict[int, _Plan] = {}            # M -> the forward-only plan (`evaluate`)
        if measure_every < 1:
            raise PipelineError(f"measure_every = {measure_every}: the activation meter needs a period >= 1 step")
        self.meter = ActivationMeter(follow=True)
        self.measure_every = measure_every
        self._steps_run = 0
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._local: dict[Message, list[Tensor]] = {}     # hand-offs between chunks of this stage (P = 1)
        self._outbox: dict[Message, Outgoing] = {}         # outputs waiting for the next batch
        self._saved_output: dict[tuple[int, int], bool] = {}   # (chunk, output j) -> autograd saves it (metered)
        self._backward_seed: Callable[[Tensor, Tensor], Tensor | None] | None = None   # the step's (`step`)

    def _schedule(self, num_microbatches: int) -> ActionTable:
        return build_schedule(self.kind, num_stages=self.stage.num_stages, num_microbatches=num_microbatches,
                              virtual_stages=self.stage.virtual_stages)

    def describe(self) -> str:
        return f"{self.stage.describe()}\n  {self.kind.value}: {format_actions(self.actions)}"

    # -- the step -----------------------------------------------------------------------------------
    def step(self, micro_batches: Sequence[Any] | None, *, loss_scale: float = 1.0,
             dp_runtime: DataParallelRuntime | None = None,
             around_forward: Callable[[int], ContextManager[Any]] | None = None,
             backward_seed: Callable[[Tensor, Tensor], Tensor | None] | None = None) -> StepResult:
        """Run every action of one global batch. ``micro_batches``: M pairs (inputs, labels) on a stage that
        holds the first or the last model chunk (inputs / labels are tensors or tuples of tensors); ignored
        elsewhere (None is fine). Parameter gradients accumulate into ``.grad`` (not zeroed here).
        ``around_forward(m)``: a context entered around each forward of micro-batch m (a profiler's).
        ``backward_seed(scaled, loss)``: the gradient each loss backward starts from (None: torch's 1), given the
        scaled loss the backward starts at and the loss function's value; the engine's seeds an inf/nan loss with
        nan, so that its step is skipped even where the loss's gradients are finite."""
        self._backward_seed = backward_seed
        batches = self._check_batches(micro_batches, self.num_microbatches)
        measure = self._steps_run % self.measure_every == 0
        self._steps_run += 1
        if measure:
            self.meter.reset_peaks()
        # Storages autograd may save that are not activations: parameters and buffers (their views too).
        params = [*self.stage.parameters(), *self.stage.buffers()]
        skip = {k for k in map(storage_key, params) if k is not None} if measure else None
        losses: dict[int, Tensor] = {}

        def compute(i: int, inputs: list[Tensor] | None) -> None:
            if self.actions[i].op is Op.FORWARD:
                with around_forward(self.actions[i].microbatch) if around_forward else contextlib.nullcontext():
                    self._forward(i, inputs, batches, skip, losses, loss_scale)
            else:
                self._backward(i, inputs, dp_runtime)

        records = self._run(self.train_plan, self.wire, compute, self._grad_metas)
        if dp_runtime is not None:
            # The boundary backward's data-parallel finish (waiting for every gradient bucket) comes only now,
            # after the exchanges that sent its input gradient upstream: the previous stage's backward need not
            # wait for this stage's gradient all-reduce.
            dp_runtime.end_backward(True)
        if self._slots or self._local or self._outbox:
            raise PipelineError(f"stage {self.stage.stage}: micro-batches left without backward after the step: "
                                f"{sorted(self._slots)}")
        return StepResult(stage=self.stage.stage, losses=[float(losses[m]) for m in sorted(losses)], records=records,
                          peak_in_flight=self.meter.peak_count, peak_activation_bytes=self.meter.peak_bytes,
                          measured=measure)

    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[Any] | None, *, num_microbatches: int | None = None) -> list[float]:
        """Forward only, for evaluation: every micro-batch through the pipeline in the schedule's forward order
        (`forward_only`), nothing kept for a backward, no gradient touched. ``micro_batches`` as in `step`; M =
        ``num_microbatches`` (the training M by default) may differ from training's, and so may the shapes: this
        pass agrees them afresh on a wire of its own (traffic recorded under ``<comm name>:eval``). Returns each
        micro-batch's loss on the stage holding the last chunk, [] elsewhere. Every stage must call it."""
        m = self.num_microbatches if num_microbatches is None else num_microbatches
        if m < 1:
            raise PipelineError(f"evaluate: num_microbatches = {m}; it must be >= 1")
        batches = self._check_batches(micro_batches, m)
        if m not in self._eval_plans:
            self._eval_plans[m] = _Plan.of(forward_only(self._schedule(m)), self.stage, self.lookahead)
        plan = self._eval_plans[m]
        # Same group as training's wire: it needs joining (NCCL's first operation) only if no wire joined it yet.
        wire = Wire(dataclasses.replace(self.comm, name=f"{self.comm.name}:eval"), device=self.device,
                    eager_receives=self.wire.eager_receives, join_first=self.wire.join_first)
        losses: dict[int, Tensor] = {}
        self._run(plan, wire, lambda i, inputs: self._eval_forward(plan, i, inputs, batches, losses),
                  lambda message: None)
        wire.close()
        self.wire.join_first = False          # joined now, by either wire
        if self._local or self._outbox:
            raise PipelineError(f"stage {self.stage.stage}: outputs left unsent after the evaluation pass")
        return [float(losses[k]) for k in sorted(losses)]

    def _run(self, plan: _Plan, wire: Wire, compute: Any, grad_metas: Any) -> list[ActionRecord]:
        """Walk ``plan``'s program on ``wire``: post each batch, and before each action post the receives ahead
        and wait for its input; ``compute(i, inputs)`` runs action i. Returns the computes' records, the
        per-action (stage, action, start, end) times that feed `Timeline.from_records`.

        A receive is waited on right before the action that needs it (with gloo, the receives of the next
        `LOOKAHEAD` actions are posted before each action); a send is never waited on before the end of the
        step (`p2p.Wire`)."""
        wire.begin_step(plan.program)
        records = []
        for item in plan.program:
            if isinstance(item, Batch):
                wire.exchange(item, self._outbox, grad_metas)
                continue
            i, action = item.index, item.action
            for message, peer in plan.ahead[i]:   # before waiting for this action's input
                wire.post_ahead(message, peer, grad_metas)
            inputs = self._take_input(plan, wire, i)
            start = time.perf_counter()
            compute(i, inputs)
            records.append(ActionRecord(self.stage.stage, action, start, time.perf_counter()))
            del inputs
        wire.end_step()
        return records

    def _eval_forward(self, plan: _Plan, i: int, received: list[Tensor] | None, batches: list[tuple[Any, Any]],
                      losses: dict[int, Tensor]) -> None:
        action, t = plan.actions[i], plan.transfers[i]
        m, v = action.microbatch, action.chunk
        chunk = self.stage.chunks[v]
        if self.stage.is_first(v):
            x = batches[m][0]
        else:
            assert received is not None
            x = received[0] if len(received) == 1 else tuple(received)
        out = chunk(x)
        if self.stage.is_last(v):
            losses[m] = checked_loss(loss_of(self.stage.loss_fn(out, batches[m][1])))
            return
        outs = flatten(out, f"model chunk {chunk.model_chunk}")
        assert t.send is not None
        if t.send_local:
            self._local[t.send.message] = outs
        else:
            self._outbox[t.send.message] = Outgoing([o.contiguous() for o in outs], [False] * len(outs))

    def close(self) -> None:
        self.wire.close()

    def _check_batches(self, micro_batches: Sequence[Any] | None, expected: int) -> list[tuple[Any, Any]]:
        """The ``expected`` micro-batches on this stage's device, checked; [] on a stage that reads no data."""
        if not self.stage.reads_data:
            return []
        if micro_batches is None or len(micro_batches) != expected:
            got = "None" if micro_batches is None else f"{len(micro_batches)}"
            raise PipelineError(f"stage {self.stage.stage} holds the first or last layers and needs "
                                f"{expected} micro-batches per step (gradient_accumulation_steps in training), "
                                f"got {got}")
        out = []
        for m, mb in enumerate(micro_batches):
            if not (isinstance(mb, (tuple, list)) and len(mb) == 2):
                raise PipelineError(f"micro-batch {m} is a {type(mb).__name__}: a pipeline micro-batch must be a pair "
                                    f"(inputs, labels); the first stage reads the inputs, the last the labels")
            out.append((to_device(mb[0], self.device), to_device(mb[1], self.device)))
        return out

    # -- inputs -------------------------------------------------------------------------------------
    def _grad_metas(self, message: Message) -> list[TensorMeta] | None:
        """Shapes of a gradient to receive: those of this stage's own output (None until its forward ran; at
        the gradient's batch it has: the peer's backward comes after the peer's forward, which needed it)."""
        slot = self._slots.get((message.microbatch, (message.source - 1) // self.stage.num_stages))
        return None if slot is None else slot.out_metas

    def _take_input(self, plan: _Plan, wire: Wire, i: int) -> list[Tensor] | None:
        t = plan.transfers[i]
        if t.recv is None:
            return None
        message = t.recv.message
        if t.recv_local:
            tensors = self._local.pop(message)
            if message.op is Op.FORWARD:
                return [x.detach().requires_grad_(x.requires_grad) for x in tensors]
            return tensors
        return wire.take(message)

    # -- compute ------------------------------------------------------------------------------------
    def _forward(self, i: int, received: list[Tensor] | None, batches: list[tuple[Any, Any]],
                 skip: set[int] | None, losses: dict[int, Tensor], loss_scale: float) -> None:
        """F(m, v): the chunk's forward on micro-batch m. ``skip``: storages the meter ignores; None on a step
        that is not metered.

        Received activations become leaves that require grad; the output goes to the outbox of the next batch
        and its data is freed at once (only its autograd node is kept: the backward root needs no data; the send
        buffer holds the storage until the send completes), unless something else holds it (`sole_owner`: e.g.
        autograd saved it, as tanh does). The last model chunk also computes ``loss_fn(output, labels) / M``
        (times the loss scale), the root of its backward.
        """
        action, t = self.actions[i], self.train_plan.transfers[i]
        m, v = action.microbatch, action.chunk
        chunk = self.stage.chunks[v]
        where = f"model chunk {chunk.model_chunk} ({chunk.names[0]}..{chunk.names[-1]})"
        data: list[Tensor] = []
        if self.stage.is_first(v):
            x = batches[m][0]
            data += flatten(x, f"micro-batch {m}'s inputs")
        else:
            assert received is not None
            x = received[0] if len(received) == 1 else tuple(received)
        if self.stage.is_last(v):
            data += flatten(batches[m][1], f"micro-batch {m}'s labels")
        if skip is not None and data:
            skip = skip | {k for k in map(storage_key, data) if k is not None}
        with self.meter.track((m, v), _in(skip)) if skip is not None else contextlib.nullcontext():
            out = chunk(x)
            loss = loss_of(self.stage.loss_fn(out, batches[m][1])) if self.stage.is_last(v) else None
        slot = _Slot(inputs=[r for r in (received or []) if r.requires_grad], outputs=[], out_metas=[])
        self._slots[(m, v)] = slot
        if loss is not None:
            losses[m] = checked_loss(loss)   # read after the step: no device sync per micro-batch
            slot.loss = loss.float() / self.num_microbatches * loss_scale
            slot.unscaled_loss = loss
            if skip is not None:
                self.meter.sample()
            return
        outs = flatten(out, where)
        slot.outputs = [o for o in outs if o.requires_grad]
        slot.out_metas = [TensorMeta.of(o) for o in slot.outputs]
        assert t.send is not None
        if t.send_local:
            self._local[t.send.message] = outs
            if skip is not None:
                self.meter.sample()
            return
        # Which outputs' data can go once sent: asked before the send buffers share their storages.
        if skip is not None:   # metered: the meter saw exactly what autograd saved (its hooks hide it otherwise)
            saved = self.meter.saved_storages((m, v))
            for j, o in enumerate(slot.outputs):
                self._saved_output[(v, j)] = storage_key(o) in saved
        free = [not self._saved_output.get((v, j), False) and sole_owner(o) for j, o in enumerate(slot.outputs)]
        self._outbox[t.send.message] = Outgoing([o.detach().contiguous() for o in outs],
                                                [o.requires_grad for o in outs])
        for o, f in zip(slot.outputs, free):
            if f:
                free_data(o)
        if skip is not None:
            self.meter.sample()

    def _backward(self, i: int, grads: list[Tensor] | None, dp_runtime: DataParallelRuntime | None) -> None:
        """B(m, v): backward from the saved output with the received gradient (from the loss on the last chunk);
        the gradients of the received activations go back to the previous chunk. Parameter gradients accumulate
        over the micro-batches; the data-parallel runtime's `begin_backward(boundary)` / `end_backward(boundary)`
        bracket every backward, with ``boundary`` true for the stage's last one, so data-parallel sync overlaps
        it; the boundary's `end_backward` (the wait for every bucket) runs after the step's last exchange
        (`step`), so the input gradient goes upstream first."""
        action, t = self.actions[i], self.train_plan.transfers[i]
        slot = self._slots.pop((action.microbatch, action.chunk))
        boundary = i == self._last_backward
        if dp_runtime is not None:
            dp_runtime.begin_backward(boundary)
        if slot.loss is not None:
            assert slot.unscaled_loss is not None
            seed = self._backward_seed(slot.loss, slot.unscaled_loss) if self._backward_seed is not None else None
            torch.autograd.backward(slot.loss, seed)
        elif slot.outputs:
            assert grads is not None and len(grads) == len(slot.outputs)
            torch.autograd.backward(slot.outputs, grads)
        if dp_runtime is not None and not boundary:      # the boundary's end_backward: after the step's sends
            dp_runtime.end_backward(boundary)
        if t.send is None:
            return
        back = [x.grad if x.grad is not None else torch.zeros_like(x) for x in slot.inputs]
        if t.send_local:
            self._local[t.send.message] = back
        else:
            self._outbox[t.send.message] = Outgoing(back, [False] * len(back))


def _in(keys: set[int]) -> Callable[[int, Tensor], bool]:
    """The meter's exclusion test for a fixed set of storages (parameters, this micro-batch's data)."""
    return lambda key, _: key in keys
