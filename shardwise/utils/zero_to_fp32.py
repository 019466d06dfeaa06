"""DeepSpeed's `deepspeed.utils.zero_to_fp32` functions: the whole model's fp32 weights from a checkpoint's files,
on one process without the ranks that wrote them, for checkpoints written by shardwise or by DeepSpeed (any ZeRO
stage, any dp size; tensor-parallel slices joined).

    state = get_fp32_state_dict_from_zero_checkpoint("ckpts")              # name -> tensor ("latest" tag)
    convert_zero_checkpoint_to_fp32_state_dict("ckpts", "out")             # out/pytorch_model.bin
    model = load_state_dict_from_zero_checkpoint(model, "ckpts")           # loaded into model, on the CPU

Trained parameters come from the fp32 masters the optimizer stepped (`checkpoint/index.py` says where each
element is; DeepSpeed's own metadata gives the same index, `checkpoint/deepspeed_read.py`); buffers and
parameters no optimizer steps come from the model states as saved. Differences from DeepSpeed's: no `lazy_mode`
(every tensor is loaded), `exclude_frozen_parameters` is refused (a checkpoint index does not tell a frozen
parameter from a buffer), and `max_shard_size` / `safe_serialization` write one file (safetensors when asked).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import deepspeed_read
from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint.index import CheckpointIndex, read_index
from shardwise.checkpoint.reshard import VALUE, Assembler, FileReader
from shardwise.errors import CheckpointError, UserError

WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"


def _tag_dir(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    path = ckpt.resolve_tag(checkpoint_dir, tag)
    if path is None:
        raise CheckpointError(f"{str(checkpoint_dir)!r} holds no checkpoint{f' tag {tag!r}' if tag else ''}: give "
                              f"the directory passed to save_checkpoint (with a 'latest' file) or name the tag")
    return path


def _open(path: Path) -> tuple[CheckpointIndex, FileReader]:
    """The tag's index and a reader of its files: ours, or DeepSpeed's seen through its own metadata."""
    index = read_index(path)
    if index is not None:
        return index, FileReader(path)
    read = deepspeed_read.DeepSpeedReader(path)
    if ckpt.head_name(path) is not None and deepspeed_read.written_by_deepspeed(read(read.head)):
        return deepspeed_read.deepspeed_index(read), read
    raise CheckpointError(f"{path}: no checkpoint index and not written by DeepSpeed: a checkpoint saved before "
                          f"indexes were written is consolidated with shardwise.checkpoint.consolidate "
                          f"(it needs the model)")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state dict (single-process names) on the CPU, trained parameters in fp32."""
    if exclude_frozen_parameters:
        raise UserError("exclude_frozen_parameters=True: not supported here (the checkpoint does not tell frozen "
                        "parameters from buffers); drop the names you do not want from the returned dict")
    index, read = _open(_tag_dir(checkpoint_dir, tag))
    build = Assembler(index, read)
    out: dict[str, torch.Tensor] = {}
    for name, info in index.tensors.items():
        numel = torch.Size(info.shape).numel()
        if name in index.fragments:
            value = build.local(name, 0, 1, info.tp_dim, 0, numel, VALUE).to(torch.float32)
        elif name in index.module:
            value = build.local(name, 0, 1, info.tp_dim, 0, numel, "module")
        else:
            continue
        out[name] = value.reshape(info.shape).clone()
    return out


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str], max_shard_size: str = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the fp32 state dict to `output_dir`/pytorch_model.bin (model.safetensors with safe_serialization)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / SAFE_WEIGHTS_NAME))
    else:
        torch.save(state, out / WEIGHTS_NAME)


def load_state_dict_from_zero_checkpoint(model: Any, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None) -> Any:
    """Load the fp32 weights into `model` (moved to the CPU, as DeepSpeed's) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]
