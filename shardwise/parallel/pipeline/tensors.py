"""What the pipeline runtime does to the tensors of a stage: flatten what chunks return, move micro-batches to
the device, check the loss, and decide whether an output's data may be freed once it has been sent."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardwise.parallel.pipeline.schedules import PipelineError


def flatten(value: Any, where: str) -> list[Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(torch.is_tensor(v) for v in value):
        return list(value)
    raise PipelineError(f"{where} gave a {type(value).__name__}: values passed between pipeline stages must be a "
                        f"tensor or a tuple of tensors")


def to_device(value: Any, device: torch.device) -> Any:
    if torch.is_tensor(value):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


def free_data(t: Tensor) -> None:
    """Drop ``t``'s activation data and keep its autograd node (Megatron's output deallocation): the
    backward root only needs the node and the shape (a 1-element expanded placeholder keeps the shape).
    Only results computed by the chunk: a leaf (a parameter, an input passed through) is left alone, and a
    view shares its base's storage, so there is nothing to free."""
    if t.grad_fn is not None and t._base is None:
        t.data = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)


def checked_loss(loss: Any) -> Tensor:
    """The detached loss of one micro-batch, or an error saying what the loss function must return."""
    if not (torch.is_tensor(loss) and loss.dim() == 0):
        raise PipelineError(f"the loss function returned {type(loss).__name__} "
                            f"{list(loss.shape) if torch.is_tensor(loss) else ''}: it must return a scalar "
                            f"tensor (the mean loss of the micro-batch)")
    return loss.detach()


def sole_owner(t: Tensor) -> bool:
    """Whether nothing but ``t`` holds its tensor and its storage: then its data may be freed once sent. An output
    autograd saved for backward (tanh, sigmoid read their result; a later op of the chunk may read it as input),
    one the model keeps, or one sharing its storage with another tensor is left alone. Saved-tensor hooks that
    keep the Python tensor itself (the meter's) hide the first case: the meter's own record covers it."""
    try:
        # 1 reference to the TensorImpl: this Python object; 2 to the storage: t's TensorImpl and the
        # temporary Python storage object of the query itself.
        # (`_use_count` is private and absent from torch's stubs; the except covers a torch without it.)
        return (t._use_count() == 1  # type: ignore[attr-defined]
                and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2)
    except (AttributeError, RuntimeError, NotImplementedError):   # no such introspection: keep the data
        return False


def module_device(module: torch.nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    return torch.device("cpu")
