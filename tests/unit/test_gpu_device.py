"""Device selection, the process group's device binding and host-tensor staging, with CUDA mocked: what a GPU rank
does at start-up, checked on a machine without one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.comm import device as devmod
from shardwise.engine import initialize as initialization
from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.errors import UserError


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """CUDA 'available' with 4 GPUs; returns the list of set_device calls."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(int(i)))
    monkeypatch.delenv(devmod.DEVICE_ENV, raising=False)
    return calls


@pytest.mark.parametrize("local_rank, index", [("0", 0), ("3", 3), ("6", 2)])
def test_local_rank_modulo_gpus_is_always_made_current(four_gpus: list[int], monkeypatch: pytest.MonkeyPatch,
                                                       local_rank: str, index: int) -> None:
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert devmod.select_device() == torch.device("cuda", index)
    assert four_gpus == [index]


def test_cpu_without_cuda_or_when_asked(four_gpus: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(devmod.DEVICE_ENV, "cpu")
    assert devmod.select_device() == torch.device("cpu") and four_gpus == []
    monkeypatch.setenv(devmod.DEVICE_ENV, "tpu")
    with pytest.raises(UserError, match="SHARDWISE_DEVICE='tpu'.*cpu, cuda"):
        devmod.select_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(devmod.DEVICE_ENV, "cuda")
    with pytest.raises(UserError, match="is_available"):
        devmod.select_device()


def test_init_distributed_binds_nccl_to_the_ranks_gpu(four_gpus: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    initialization.init_distributed()
    assert seen == {"backend": "nccl", "device_id": torch.device("cuda", 1)}
    assert four_gpus == [1]
    seen.clear()
    initialization.init_distributed("gloo")          # a gloo group binds no device
    assert seen == {"backend": "gloo"}


@pytest.mark.parametrize("name, types", [("gloo", {"cpu", "cuda"}), ("nccl", {"cuda"}),
                                         ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}), ("cuda:nccl", {"cuda"})])
def test_backend_device_types_from_the_backend_string(monkeypatch: pytest.MonkeyPatch, name: str,
                                                      types: set[str]) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    assert devmod.backend_device_types() == types
    assert devmod.has_cpu_backend() == ("cpu" in types)


def test_undefined_backend_is_asked_per_device_type(monkeypatch: pytest.MonkeyPatch) -> None:
    class Group:
        def _get_backend(self, device: torch.device) -> object:
            if device.type != "cpu":
                raise RuntimeError("no backend for cuda")
            return object()

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    assert devmod.backend_device_types(Group()) == {"cpu"}


def test_host_tensors_are_staged_only_without_a_cpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert Comm(None, CommLedger())._staged(torch.zeros(2)) is None     # gloo takes it as it is
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    moved: list[torch.device] = []
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, *a, **k: moved.append(device) or self)
    Comm(None, CommLedger())._staged(torch.zeros(2))
    assert moved == [torch.device("cuda", 3)]


def test_train_refuses_more_local_ranks_than_gpus(four_gpus: list[int]) -> None:
    from shardwise.cli.train import _check_gpus
    _check_gpus(4)
    with pytest.raises(UserError, match=r"--nproc 5: this node has 4 visible GPU\(s\).*--nproc 4 or fewer"):
        _check_gpus(5)


def test_train_on_cpu_takes_any_nproc(four_gpus: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.cli.train import _check_gpus
    monkeypatch.setenv(devmod.DEVICE_ENV, "cpu")
    _check_gpus(16)                 # no GPU check at all: raises nothing
