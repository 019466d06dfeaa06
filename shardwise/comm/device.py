"""Which device a rank computes on, and which devices a process group's backends can carry.

The device comes from the hardware, never from the backend's name: after a user's own
`init_process_group()` the backend reads "undefined" or "cpu:gloo,cuda:nccl", and a test may run gloo with
CUDA tensors. Under torchrun, local rank r of a node uses GPU r mod (GPUs on the node); `set_device` is
always called, so every later `torch.cuda.current_device()` (NCCL's communicators, staging copies,
`torch.cuda.Event`s) names this rank's GPU rather than GPU 0.

`SHARDWISE_DEVICE` ("cpu", "cuda"; unset or "auto": CUDA when available) overrides the choice: the test
harness runs gloo ranks on the CPU with it, and `scripts/gpu_check.sh --device cpu` runs every phase on the
CPU of a GPU machine.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.distributed as dist

from shardwise.errors import UserError

DEVICE_ENV = "SHARDWISE_DEVICE"
_CHOICES = ("auto", "cpu", "cuda")


def device_choice() -> str:
    """The value of SHARDWISE_DEVICE, checked: "auto", "cpu" or "cuda"."""
    choice = os.environ.get(DEVICE_ENV, "").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise UserError(f"{DEVICE_ENV}={os.environ[DEVICE_ENV]!r} is not a device choice: set it to one of "
                        f"{', '.join(_CHOICES)} (or unset it: CUDA when available)")
    return choice


def uses_cuda() -> bool:
    """Whether this process trains on a GPU: CUDA is available and SHARDWISE_DEVICE does not say "cpu"."""
    choice = device_choice()
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{DEVICE_ENV}=cuda but torch.cuda.is_available() is False: install a CUDA build of torch, "
                        f"check the driver (nvidia-smi), or set {DEVICE_ENV}=cpu")
    return choice != "cpu" and torch.cuda.is_available()


def local_cuda_index() -> int:
    """This rank's GPU on its node: LOCAL_RANK mod the number of visible GPUs (a node launched with more
    local ranks than GPUs shares them round-robin rather than piling every rank on GPU 0)."""
    count = torch.cuda.device_count()
    if count < 1:
        raise UserError("CUDA reports no visible GPU (CUDA_VISIBLE_DEVICES may be empty): make one visible, or set "
                        f"{DEVICE_ENV}=cpu")
    return int(os.environ.get("LOCAL_RANK", "0")) % count


def select_device() -> torch.device:
    """This rank's compute device; on CUDA also made the current device (`torch.cuda.set_device`)."""
    if not uses_cuda():
        return torch.device("cpu")
    index = local_cuda_index()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def backend_device_types(group: dist.ProcessGroup | None = None) -> frozenset[str]:
    """Device types the group's backends take tensors of: "gloo" -> {cpu, cuda}, "nccl" -> {cuda},
    "cpu:gloo,cuda:nccl" -> {cpu, cuda}; a group made with backend=None reads "undefined" and is asked per type."""
    name = str(dist.get_backend(group)).lower()
    if ":" in name:        # "device:backend" pairs, comma separated
        return frozenset(pair.split(":", 1)[0].strip() for pair in name.split(",") if ":" in pair)
    known = dist.Backend.backend_capability.get(name)
    if known is not None:
        return frozenset(known)
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("backend_device_types: the default process group is not initialized")
    found = set()
    for kind in ("cpu", "cuda"):
        try:
            pg._get_backend(torch.device(kind))
            found.add(kind)
        except (RuntimeError, ValueError):
            pass
    return frozenset(found)


def has_cpu_backend(group: dist.ProcessGroup | None = None) -> bool:
    """Whether host tensors can go through the group as they are (else they are staged on the GPU)."""
    return "cpu" in backend_device_types(group)


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """`torch.cuda.device(device)` for a CUDA device (kernels and p2p launched inside go to its streams, whatever
    thread runs them); nothing for the CPU."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@contextlib.contextmanager
def side_stream(device: torch.device, stream: "torch.cuda.Stream | None") -> Iterator[None]:
    """Run the block on `stream` (CUDA) after it waits for the current stream's queued work; on the CPU, or with
    no stream, the block runs in place (copies there are synchronous, so nothing can overlap or race)."""
    if stream is None or device.type != "cuda":
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
