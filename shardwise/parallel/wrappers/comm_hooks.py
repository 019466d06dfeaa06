"""torch DDP's communication hooks on shardwise's buckets: `hook(state, bucket) -> torch.futures.Future[Tensor]`.

torch's own hooks run unchanged (`default_hooks.fp16_compress_hook`, `bf16_compress_hook`, `allreduce_hook`,
`powerSGD_hook.powerSGD_hook`, a user's own): each bucket is handed over as a `HookBucket`, which answers the
calls those hooks make on torch's `GradBucket` (`index`, `buffer`, `gradients`, `parameters`, `is_last`,
`set_buffer`). The hook owns the averaging, as in torch (the buffer is not pre-divided), and the future's value
becomes the bucket's gradients when backward ends. The hook's collectives go to torch directly, so the wrapper's
ledger does not see them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardwise.comm.collectives import Handle
from shardwise.config import AllReduceImpl
from shardwise.errors import UserError

CommHook = Callable[[Any, Any], Any]


class HookBucket:
    """One shardwise bucket as torch's `GradBucket`: `buffer()` is the flat gradient buffer [numel] itself, whose
    slots the parameters' `.grad`s view."""

    def __init__(self, bucket: Any, *, last: bool):
        self._bucket = bucket
        self._last = last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._bucket.buffer

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.buffer.copy_(tensor.reshape(-1))


def future_handle(future: Any, buffer: torch.Tensor, hook_name: str) -> Handle:
    """A handle whose wait takes the future's tensor into `buffer` (a hook may return the buffer itself)."""
    # torch's hooks return torch._C.Future (what `get_future().then(...)` gives), not the Python subclass
    if not callable(getattr(future, "wait", None)):
        raise UserError(f"comm hook {hook_name} returned {type(future).__name__}: it must return a "
                        f"torch.futures.Future holding the bucket's new gradients")

    def wait() -> None:
        value = future.wait()
        if isinstance(value, (list, tuple)):
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.numel() != buffer.numel():
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise UserError(f"comm hook {hook_name}: its future holds {got}; it must hold one tensor of the "
                            f"bucket's {buffer.numel()} elements")
        if value.data_ptr() != buffer.data_ptr():
            buffer.copy_(value.reshape(-1))
    return Handle(wait, lambda: None)


def check_hook(hook: Any, *, registered: bool, impl: AllReduceImpl) -> str:
    """The hook's name for messages; refuses what torch refuses and a hook on top of shardwise's own all-reduce."""
    if registered:
        raise UserError("register_comm_hook: a hook is already registered; register one hook, once, before the "
                        "first backward (as torch DDP)")
    if impl is not AllReduceImpl.BACKEND:
        raise UserError(f"register_comm_hook with all_reduce='{impl.value}': shardwise's own all-reduce already "
                        f"chooses how buckets are reduced; build the wrapper with all_reduce='backend' to use a hook")
    if not callable(hook):
        raise UserError(f"register_comm_hook: hook = {hook!r} is not callable; give hook(state, bucket) -> Future")
    return getattr(hook, "__qualname__", repr(hook))
