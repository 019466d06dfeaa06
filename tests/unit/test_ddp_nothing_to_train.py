"""`DistributedDataParallel` of a module with nothing to train is refused as torch's DDP refuses it: a
RuntimeError (what torch's own DDP tests and user code catch), still shardwise's one-line UserError."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise.errors import UserError


def _frozen() -> nn.Module:
    model = nn.Linear(4, 4)
    model.requires_grad_(False)
    return model


@pytest.mark.parametrize("build", [nn.Module, _frozen], ids=["no parameters", "all frozen"])
def test_refused_as_runtime_error(build):
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(RuntimeError, match="no parameter that requires grad") as caught:
        shardwise.DistributedDataParallel(build())
    assert isinstance(caught.value, UserError) and "\n" not in str(caught.value)
