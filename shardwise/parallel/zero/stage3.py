"""ZeRO-3's runtime (`ZeroParamRuntime`): hooks that gather each unit around its forward and its backward and
reduce-scatter its gradients, moving the lifecycle states of `states.py`."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from shardwise.comm.collectives import Comm
from shardwise.parallel.zero.copies import CopyStream, HostGrad, discard_sent
from shardwise.parallel.zero.flat import FlatShard
from shardwise.parallel.zero.grads import ZeroGradReducer
from shardwise.parallel.zero.params import Partition, Unit, load_full_tensors
from shardwise.parallel.zero.states import (
    BACKWARD_MOVES, BackwardState, GatherState, ReduceState, TrainingState, advance,
)


_FLAT_TAG_BASE = 1 << 20


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


def _in_backward() -> bool:
    """True while autograd runs a backward: a forward now is activation recomputation, whose unit must stay
    gathered for the backward that follows it."""
    return torch._C._current_graph_task_id() != -1


class ZeroParamRuntime:
    """The engine's data-parallel runtime for stage 3 (`interfaces.DataParallelRuntime`), also what `fully_shard`
    drives: the hooks that gather and free the parameters of `module`, and the reduce-scatter of its gradients.

        forward, unit u    pre-hook: all-gather u (or wait for its prefetch); prefetch the next units in the
                           order the previous forward ran them. post-hook: free u; hook u's outputs for backward.
                           The root unit (the model itself) stays gathered from its forward into backward when
                           training, as in FSDP2: backward needs the lm-head at once (`reshard_root_after_forward`
                           frees it too, for exactly 3 psi of traffic per step, psi = parameters).
        backward, unit u   a hook on u's forward outputs fires when their gradient is ready, before u's backward
                           runs: all-gather u again; prefetch the previous units. Each parameter's
                           post-accumulate-grad hook adds its gradient into its flat's [padded] buffer and drops
                           .grad; a complete flat is reduce-scattered (async) into [S], divided by dp and added to
                           grad_shard (gradients accumulate as shards over micro-batches; communication every
                           micro-batch, as in ZeRO-2); when all of u's gradients arrived, u is freed.
        end of backward    (autograd's final callback, or the engine's end_backward) flats that got no gradient
                           are reduce-scattered as zeros in unit order (the same on every rank); every
                           reduce-scatter is waited on; every unit is freed.

    The states follow these phases: a unit is FORWARD between its forward hooks, PRE_BACKWARD from its backward
    hook until all its gradients arrived (POST_BACKWARD), IDLE again when the backward ends; a flat's gradients are
    COLLECTING, then REDUCING while its reduce-scatter is in flight, then REDUCED; the runtime's `backward_state`
    is DUE after a training forward and RUNNING once a backward reached a hook.

    Persistent parameters (whole on every rank) are ZeRO-2 buckets: `persistent`, a
    `ZeroGradReducer(partition_grads=True)`, reduces their gradients and `Stage3Update` all-gathers them after each
    step. Collectives are launched from module and autograd hooks, in the same order on every rank as long as
    every rank's forward runs the same modules (ZeRO-3's and FSDP's requirement)."""

    def __init__(self, module: nn.Module, partition: Partition, comm: Comm, *,
                 persistent: ZeroGradReducer | None, prefetch_numel: int, max_live_numel: int,
                 reshard_root_after_forward: bool = False, max_reduce_in_flight: int = 2,
                 roots: list[nn.Module] | None = None):
        self.module = module
        self.partition = partition
        self.units = partition.units
        self.comm = comm
        self.persistent = persistent
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.reshard_root_after_forward = reshard_root_after_forward
        self.max_reduce_in_flight = max_reduce_in_flight
        self.root = next((u for u in self.units if u.is_root), None)
        self.live_numel = 0                     # elements of the units gathered or being gathered
        self.peak_live_numel = 0
        self.loaded_placeholders = False        # the last load_state_dict got ZeRO-3 placeholders
        # False (the wrappers' set_requires_gradient_sync(False)): gradients accumulate in each flat's [padded]
        # buffer across backwards, nothing is reduce-scattered until a backward with it True.
        self.reduce_grads = True
        # Debugging aid (tests): fill a unit's buffer with NaN before freeing it, so that a computation reading
        # parameters after their unit was freed (memory the allocator has not reused yet) shows up as NaN.
        self.poison_freed = False
        # `roots`: the modules whose forward is one whole forward (default: `module`). A pipeline stage runs its
        # model chunks one at a time, so each chunk is a root with its own unit order.
        self._roots = list(roots) if roots is not None else [module]
        self._orders: dict[int, list[Unit]] = {}   # root id -> its units in the order its last forward ran them
        # offload_param on a GPU: host shards are copied and gathered on a side stream, so prefetches overlap.
        offloaded = [f.compute_device for f in partition.flats
                     if f.compute_device is not None and f.compute_device.type == "cuda"]
        self._copies = CopyStream(offloaded[0]) if offloaded else None
        # offload_optimizer: flat id -> the pinned host copy its final gradient shard is sent to, on the boundary's
        # backward (`send_final_grads`); `_boundary` is that backward's (True when no engine says otherwise).
        self._host_grads: dict[int, HostGrad] = {}
        self._boundary = True
        self._position: dict[int, tuple[int, int]] = {}   # unit id -> (root id, index in that order)
        self._current_root = id(module)                    # the root whose forward ran last
        self._ran: list[Unit] = []                         # units the current root's forward ran, in order
        self._in_flight: list[FlatShard] = []              # flats whose reduce-scatter is launched, oldest first
        self.backward_state = BackwardState.NONE
        self._where = partition.where()
        # exchange tags of the flats' reduce-scatters, apart from the persistent buckets' (their bucket indices)
        self._tags = {id(f): _FLAT_TAG_BASE + i for i, f in enumerate(partition.flats)}
        self._named = dict(module.named_parameters(remove_duplicate=False))
        hooks = [module.register_load_state_dict_pre_hook(self._on_load_state_dict)]
        for r in self._roots:
            hooks += [r.register_forward_pre_hook(self._pre_forward_root),
                      r.register_forward_hook(self._post_forward_root)]
        for u in self.units:
            if not u.is_root:
                hooks.append(u.module.register_forward_pre_hook(functools.partial(self._pre_forward, u)))
                hooks.append(u.module.register_forward_hook(functools.partial(self._post_forward, u)))
        hooks += [p.register_post_accumulate_grad_hook(self._on_grad)
                  for f in partition.flats for p in f.params if p.requires_grad]
        self._hooks = hooks
        if persistent is not None:
            persistent.begin_backward(True)     # partition_grads: enabled on every micro-batch

    # -- engine interface ---------------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        """Stage 3 reduce-scatters on every micro-batch; only the boundary's (the last micro-batch before the
        optimizer step, DeepSpeed's gradient accumulation boundary) shards are final (sent to the host)."""
        self._boundary = boundary
        discard_sent(self._host_grads.values())
        if self.persistent is not None:
            self.persistent.begin_backward(boundary)

    def send_final_grads(self, flat: FlatShard, host: HostGrad) -> None:
        """From now on, `flat`'s gradient shard goes to `host` as soon as its reduction on the boundary's
        backward is done (offload_optimizer: the step then reads it on the host)."""
        self._host_grads[id(flat)] = host

    def wait_shard_reads(self) -> None:
        """Block the host until the copy stream has read the offloaded (host) shards it was given: before the
        step writes them (nothing on the CPU, or without offload_param)."""
        if self._copies is not None and self._copies.stream is not None:
            self._copies.stream.synchronize()

    def end_backward(self, boundary: bool) -> None:
        if self.backward_state is not BackwardState.NONE:    # autograd's callback did not run (no unit took part)
            self._finish_backward()

    def zero_grad(self) -> None:
        for f in self.partition.flats:
            if f.grad_shard is not None:
                f.grad_shard.zero_()
        discard_sent(self._host_grads.values())
        if self.persistent is not None:
            self.persistent.zero_grad()

    @property
    def accumulates_locally(self) -> bool:
        """Gradients are reduce-scattered into shards as they are produced."""
        return False

    @property
    def grad_bytes(self) -> int:
        own = sum(f.grad_shard.numel() * f.grad_shard.element_size()
                  for f in self.partition.flats if f.grad_shard is not None)
        return own + (self.persistent.grad_bytes if self.persistent is not None else 0)

    def param_storage_keys(self) -> set[int]:
        """Identities of the gathered parameter buffers' storages (stable across free/gather, which resize
        the same storage), so the activation meter does not count weights autograd saves."""
        return {f.full.untyped_storage()._cdata for f in self.partition.flats if f.full is not None}

    def release_gathered(self) -> None:
        """Free every unit (DeepSpeed's empty_partition_cache); the next forward gathers what it needs."""
        for u in self.units:
            self._free(u)

    def gather_unit(self, u: Unit) -> None:
        """Gather one unit now (for `shardwise.zero.GatheredParameters`), counted in the live elements."""
        self._gather_now(u)

    def free_unit(self, u: Unit) -> None:
        self._free(u)

    def prefetch_units(self, units: list[Unit]) -> None:
        """Launch the all-gathers of `units` now, outside the prefetch bounds (FSDP2's explicit prefetch: the
        module wrappers' `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`)."""
        for u in units:
            self._launch(u)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.persistent is not None:
            self.persistent.close()

    def _move_backward(self, to: BackwardState) -> None:
        self.backward_state = advance(BACKWARD_MOVES, self.backward_state, to, "ZeRO-3 runtime's backward state")

    def _backward_due(self) -> None:
        """A forward hooked its outputs: a backward will come (or the engine's end_backward ends it)."""
        if self.backward_state is BackwardState.NONE:
            self._move_backward(BackwardState.DUE)

    # -- gather / free ------------------------------------------------------------------------------
    def _launch(self, u: Unit) -> None:
        if u.gather_state is GatherState.SHARDED:
            u.start_gather(self.comm, self._copies)
            self.live_numel += u.padded_numel
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _gather_now(self, u: Unit) -> None:
        self._launch(u)
        if u.gather_state is GatherState.GATHERING:
            u.finish_gather()

    def _free(self, u: Unit) -> None:
        if u.gather_state is GatherState.SHARDED:
            return
        if u.gather_state is GatherState.GATHERING:
            u.finish_gather()           # never resize a buffer an all-gather is still writing into
        if self.poison_freed:
            for f in u.flats:
                assert f.full is not None       # the unit is gathered: each flat's buffer is allocated
                f.full.fill_(float("nan"))
        u.reshard()
        self.live_numel -= u.padded_numel

    def _prefetch(self, upcoming: list[Unit]) -> None:
        """Launch all-gathers of the next units (in the order they will be needed) while the elements gathered
        ahead stay within `prefetch_numel` (stage3_prefetch_bucket_size) and the elements gathered at once within
        `max_live_numel` (stage3_max_live_parameters). A unit needed now is gathered whatever the bound."""
        ahead = 0
        for v in upcoming:
            n = v.padded_numel
            if v.gather_state is GatherState.SHARDED:
                if ahead + n > self.prefetch_numel or self.live_numel + n > self.max_live_numel:
                    return
                self._launch(v)
            ahead += n
            if ahead >= self.prefetch_numel:
                return

    # -- forward hooks ------------------------------------------------------------------------------
    def _pre_forward_root(self, module: nn.Module, args: Any) -> None:
        if _in_backward():                      # recomputation: gathered for the backward that follows
            if self.root is not None:
                self._gather_now(self.root)
            return
        self._ran = []
        if self.root is not None:
            self.root.move_training(TrainingState.FORWARD)
            self._gather_now(self.root)
        self._current_root = id(module)
        self._prefetch(self._orders.get(id(module), []))

    def _pre_forward(self, u: Unit, module: nn.Module, args: Any) -> None:
        if _in_backward():                      # recomputation: gathered for the backward that follows
            self._gather_now(u)
            return
        u.move_training(TrainingState.FORWARD)
        self._ran.append(u)
        self._gather_now(u)
        position = self._position.get(id(u))
        if position is not None:
            root, pos = position
            self._prefetch(self._orders[root][pos + 1:])

    def _post_forward(self, u: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if _in_backward():
            return
        u.move_training(TrainingState.IDLE)
        tensors = _grad_tensors(output)
        if tensors:
            self._backward_due()
            torch.autograd.graph.register_multi_grad_hook(tensors, functools.partial(self._pre_backward, u),
                                                          mode="any")
            if not u.reshard_after_forward and module.training:
                return                          # kept gathered for its backward (FSDP2's reshard_after_forward=False)
        self._free(u)

    def _post_forward_root(self, module: nn.Module, args: Any, output: Any) -> None:
        if _in_backward():
            return
        if self.root is not None:
            self.root.move_training(TrainingState.IDLE)
        self._orders[id(module)] = self._ran
        self._position.update({id(u): (id(module), i) for i, u in enumerate(self._ran)})
        kept = {id(u) for u in self._ran if not u.reshard_after_forward and module.training}
        for u in self.units:                    # prefetched but not run (the forward took another path)
            if not u.is_root and id(u) not in kept:
                self._free(u)
        tensors = _grad_tensors(output)
        if tensors:
            self._backward_due()
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._pre_backward_root, id(module)), mode="any")
        if self.root is not None and not (tensors and module.training and not self.reshard_root_after_forward):
            self._free(self.root)

    # -- backward hooks -----------------------------------------------------------------------------
    def _pre_backward(self, u: Unit, grad: torch.Tensor) -> None:
        """Fires when the gradient of unit u's forward outputs is ready: gather u, prefetch the units its
        root's forward ran before it (in reverse)."""
        self._backward_starts()
        u.move_training(TrainingState.PRE_BACKWARD)
        self._gather_now(u)
        if id(u) in self._position:
            root, pos = self._position[id(u)]
        else:                                   # not run under a root's forward: all of the current root's
            root = self._current_root
            pos = len(self._orders.get(root, []))
        self._prefetch(self._orders.get(root, [])[:pos][::-1])

    def _pre_backward_root(self, root: int, grad: torch.Tensor) -> None:
        """Fires when the gradient of a root's outputs is ready (root: the id of the root module): gather the
        root unit, prefetch every unit of that root's forward, last first."""
        self._backward_starts()
        if self.root is not None:
            self.root.move_training(TrainingState.PRE_BACKWARD)
            self._gather_now(self.root)
        self._prefetch(self._orders.get(root, [])[::-1])

    def _backward_starts(self) -> None:
        """Every backward that reaches a hook is finished by autograd's final callback (pipelines run several)."""
        if self.backward_state is not BackwardState.RUNNING:
            self._move_backward(BackwardState.RUNNING)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad(self, p: nn.Parameter) -> None:
        flat, i = self._where[id(p)]
        if flat.group is None:                  # not optimized: the gradient is not wanted
            p.grad = None
            return
        if flat.grad_full is None:
            flat.grad_full = _zeros_full(flat)
        # added, not copied: without reduce_grads the buffer holds the earlier backwards' sum (cast to reduce dtype);
        # straight into the reduce-scatter's rank-major order, whatever the layout
        flat.layout.add_grad(flat.grad_full, i, p.grad)
        p.grad = None                           # the full gradient is not kept: stage 2/3's saving
        flat.ready += 1
        if flat.ready == len(flat.params):
            if self.reduce_grads:
                self._launch_reduce(flat)
            u = self.units[flat.unit]
            if all(f.ready == len(f.params) for f in u.flats if f.group is not None):
                u.move_training(TrainingState.POST_BACKWARD)
                self._free(u)

    def _launch_reduce(self, flat: FlatShard) -> None:
        self._drain(self.max_reduce_in_flight - 1)
        if flat.grad_full is None:              # no parameter of it got a gradient in this backward
            flat.grad_full = _zeros_full(flat)
        # A separate [S] output in the reduce dtype, on the gradients' device: the input must not alias it.
        assert flat.grad_shard is not None      # only optimized flats are reduced, and each has a gradient shard
        flat.move_reduce(ReduceState.REDUCING)
        flat.received = flat.grad_full.new_empty(flat.grad_shard.shape)
        flat.has_grads = True
        comm = flat.comm if flat.comm is not None else self.comm
        flat.handle = comm.reduce_scatter_sum(flat.received, flat.grad_full, tag=self._tags[id(flat)], async_op=True)
        self._in_flight.append(flat)

    def _drain(self, keep: int) -> None:
        """Complete launched reduce-scatters, oldest first, until at most `keep` remain in flight."""
        while len(self._in_flight) > keep:
            flat = self._in_flight.pop(0)
            flat.move_reduce(ReduceState.REDUCED)
            # `_launch_reduce` set the handle and the output, and checked the gradient shard
            assert flat.handle is not None and flat.received is not None and flat.grad_shard is not None
            flat.handle.wait()
            flat.handle = None
            flat.received.div_(self.comm.size)
            # a wrapper's CPU offload keeps grad_shard on the host: a blocking copy, ordered after the reduction
            flat.grad_shard.add_(flat.received.to(flat.grad_shard.device))
            flat.received = None
            flat.grad_full = None
            host = self._host_grads.get(id(flat))
            if host is not None and self._boundary:
                # Offloaded masters: the final shard leaves for the host now, on a side stream, while backward
                # goes on with the next units (the step then waits for this flat's event only).
                host.send(flat.grad_shard)

    def _finish_backward(self) -> None:
        if self.backward_state is BackwardState.NONE:
            return
        self._move_backward(BackwardState.NONE)
        for u in self.units:                    # unit order: the same on every rank
            for f in u.flats:
                if f.group is not None and f.reduce_state is ReduceState.COLLECTING and self.reduce_grads:
                    self._launch_reduce(f)
        self._drain(0)
        for u in self.units:
            self._free(u)
            if u.training_state is not TrainingState.IDLE:
                u.move_training(TrainingState.IDLE)
            for f in u.flats:
                f.ready = 0
                if f.reduce_state is ReduceState.REDUCED:
                    f.move_reduce(ReduceState.COLLECTING)
        if self.persistent is not None:
            self.persistent.end_backward(True)

    # -- state dicts --------------------------------------------------------------------------------
    @torch.no_grad()
    def gathered_state_dict(self, module: nn.Module | None = None, *, rank0_only: bool = True
                            ) -> dict[str, torch.Tensor] | None:
        """The module's full state dict (collective: every rank must call it). Gathers one unit at a time;
        with rank0_only, ranks other than 0 keep nothing and get None. `module` (the engine's, for the common
        interface) must be the module this runtime shards."""
        if module is not None and module is not self.module:
            raise ValueError("ZeroParamRuntime.gathered_state_dict: not the module this runtime shards")
        keep = not rank0_only or self.comm.rank == 0
        values: dict[int, torch.Tensor] = {}
        for u in self.units:
            was_free = u.gather_state is GatherState.SHARDED
            self._gather_now(u)
            if keep:
                for f in u.flats:
                    values.update({id(p): v.detach().clone() for p, v in zip(f.params, f.views)})
            if was_free:
                self._free(u)
        if not keep:
            return None
        state = self.module.state_dict()
        for name, p in self._named.items():
            if id(p) in values and name in state:
                state[name] = values[id(p)]
        return state

    def _on_load_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        """Full tensors are split into this rank's shards; ZeRO-3 placeholders (a per-rank checkpoint's
        module states) are noted: the values then come from the optimizer shard files."""
        for u in self.units:
            self._free(u)
        named = {prefix + n: p for n, p in self._named.items()}
        self.loaded_placeholders = bool(load_full_tensors(self.partition, named, state_dict))


def _zeros_full(flat: FlatShard) -> torch.Tensor:
    """The [padded] full gradient of a flat, where its gradients are computed and reduce-scattered: the compute
    device, also when offload_param keeps the parameter shard on the CPU (NCCL takes device tensors only)."""
    return torch.zeros(flat.layout.padded_numel, dtype=flat.reduce_dtype or flat.key.dtype,
                       device=flat.compute_device or flat.shard.device)
