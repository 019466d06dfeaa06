"""Random numbers under tensor parallelism (Megatron's model-parallel RNG, written for this code base).

Dropout on replicated activations must draw the same mask on every TP rank, or the replicas drift apart; dropout
on split activations must draw independent masks. `TensorParallelRNG` gives both: one shared default stream and a
per-rank stream the modules of split activations run on (`fork`, `run_forked`).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch
from torch import nn

from shardwise.comm.collectives import Comm

MODEL_PARALLEL_SEED_OFFSET = 2718
TP_RNG_ATTR = "_shardwise_tp_rng"
"""Set on a module whose forward runs on a rank's own stream: activation recomputation rewinds that stream."""


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TensorParallelRNG:
    """The TP group's shared default stream and this rank's own stream for split activations.

    - on replicated activations ([b, s, h] after a row-parallel all-reduce, the embeddings): every TP rank holds
      the same tensor, so every rank must draw the same mask, or the replicas drift apart (and the replicated
      parameters' gradients with them). The default generator is therefore made identical on the TP group
      once, here at parallelization (rank 0's state broadcast): from then on all TP ranks draw the same numbers
      in the same order, whatever seed each process was given;
    - on split activations (attention probabilities of this rank's heads [b, h/t, s, s]; with sequence
      parallelism the [b, s/t, h] shards after a reduce-scatter): each rank's part is a different slice of the
      full tensor, so the masks must be independent. Such modules run inside `fork()`, which swaps a per-rank
      generator state in (seed = rank 0's initial seed + 2718 + tp rank, as Megatron's offset) and swaps it out
      after, so the default stream advances identically on every TP rank.

    The fork touches the generator of the device the module runs on (CPU, or the current CUDA device).
    """

    def __init__(self, comm: Comm, device: torch.device) -> None:
        self.device = device
        # Broadcast where the backend can send it: NCCL needs device tensors, gloo host ones.
        home = device if device.type == "cuda" else torch.device("cpu")
        state = _get_state(device).to(home)
        seed = torch.tensor([torch.initial_seed()], dtype=torch.int64, device=home)
        if comm.size > 1:
            comm.broadcast(state, src_group_rank=0)      # the generator's state bytes (a few KiB, once)
            comm.broadcast(seed, src_group_rank=0)
        _set_state(device, state.cpu())
        self.seed = int(seed) + MODEL_PARALLEL_SEED_OFFSET + comm.rank
        # A separate generator makes the per-rank state without reseeding any default generator.
        local = torch.Generator(device=device)
        local.manual_seed(self.seed)
        self._local = local.get_state()

    @property
    def local_state(self) -> torch.Tensor:
        """This rank's own stream, as a generator state (recomputation saves it before a forward and puts it
        back to replay the same masks)."""
        return self._local

    @local_state.setter
    def local_state(self, state: torch.Tensor) -> None:
        self._local = state

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body on this rank's own stream; the default stream is left where it was."""
        shared = _get_state(self.device)
        _set_state(self.device, self._local)
        try:
            yield
        finally:
            self._local = _get_state(self.device)
            _set_state(self.device, shared)


class _ForkHooks:
    """Forward pre/post hooks that bracket a module's forward with `TensorParallelRNG.fork()`."""

    def __init__(self, rng: TensorParallelRNG) -> None:
        self.rng = rng
        self._open: list[contextlib.AbstractContextManager] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        ctx = self.rng.fork()
        ctx.__enter__()
        self._open.append(ctx)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self._open.pop().__exit__(None, None, None)


def run_forked(module: nn.Module, rng: TensorParallelRNG) -> None:
    """Make `module`'s forward draw from this rank's own stream (its dropout masks differ across TP ranks)."""
    hooks = _ForkHooks(rng)
    setattr(module, TP_RNG_ATTR, rng)
    module.register_forward_pre_hook(hooks.enter)
    module.register_forward_hook(hooks.leave, always_call=True)   # also when the forward raises


# -- named streams, DeepSpeed's and Megatron's way: models fork them explicitly -----------------------------

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The tracker's stream for dropout on tensor-parallel (split) activations."""


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class RNGStatesTracker:
    """Named random streams of the compute device (CUDA, else the CPU): `fork(name)` runs a block on that stream
    and leaves the default stream where it was (DeepSpeed's CudaRNGStatesTracker)."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"random seed {seed} is already tracked: give each stream its own seed")
        if name in self.states_:
            raise ValueError(f"random stream {name!r} is already tracked: reset() the tracker first")
        self.seeds_.add(seed)
        gen = torch.Generator(device=_device())
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"random stream {name!r} is not tracked: call model_parallel_cuda_manual_seed(seed) "
                             f"or get_cuda_rng_tracker().add({name!r}, seed) first")
        device = _device()
        outside = _get_state(device)
        _set_state(device, self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state(device)
            _set_state(device, outside)


_tracker = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (module state, as DeepSpeed's and Megatron's: models call it from anywhere)."""
    return _tracker
