"""GPU telemetry checked with CUDA mocked: ledger durations from CUDA events (recorded around the collective on the
current stream, read only once the end event completed) and the MFU peak of known GPUs."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm.ledger import CommLedger, CommRecord
from shardwise.telemetry import peak


class FakeEvent:
    """A CUDA event on a fake clock: `record` stamps it, `done` says whether the GPU has reached it."""

    clock = 0.0
    log: list[str] = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.t: float | None = None
        self.done = False

    def record(self, stream: object = None) -> None:
        self.t = FakeEvent.clock
        FakeEvent.log.append("record")

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        FakeEvent.log.append("synchronize")
        self.done = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.t is not None and end.t is not None and end.done
        return (end.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeEvent.clock, FakeEvent.log = 0.0, []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())


def _finish(ledger: CommLedger, token: int, op: str = "all_reduce") -> None:
    ledger.finish(token, op=op, group="dp", group_size=2, nbytes=64, dtype="float32")


def test_device_ops_are_timed_by_events_and_recorded_once_complete(fake_cuda: None) -> None:
    ledger = CommLedger()
    heard: list[CommRecord] = []
    ledger.listeners.append(heard.append)
    cuda = torch.device("cuda", 0)
    a = ledger.start("all_reduce", "dp", device=cuda)
    FakeEvent.clock = 0.25                      # the collective ran 250 ms on the GPU
    _finish(ledger, a)
    b = ledger.start("all_gather", "dp", device=cuda)
    FakeEvent.clock = 0.5
    _finish(ledger, b, "all_gather")
    assert ledger.records == [] and heard == []         # nothing read from the GPU yet: no host wait
    first_end = ledger._unresolved[0][2]
    first_end.done = True                               # the GPU passed the first collective only
    ledger.begin_step(1)
    assert [r.op for r in heard] == ["all_reduce"] and "synchronize" not in FakeEvent.log
    assert heard[0].duration_s == pytest.approx(0.25) and heard[0].step == 0
    summary = ledger.summary(step=0)                    # a report waits for the rest
    assert FakeEvent.log.count("synchronize") == 1
    assert {s.op: s.duration_s for s in summary} == pytest.approx({"all_reduce": 0.25, "all_gather": 0.25})
    assert [r.op for r in heard] == ["all_reduce", "all_gather"]


def test_host_ops_keep_the_host_clock(fake_cuda: None) -> None:
    ledger = CommLedger()
    _finish(ledger, ledger.start("all_reduce", "dp", device=torch.device("cpu")))
    assert len(ledger.records) == 1 and FakeEvent.log == []


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H200", torch.bfloat16, 989.0), ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
    ("NVIDIA H100 PCIe", torch.float16, 756.0), ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
    ("NVIDIA A100-SXM4-80GB", torch.float32, None), ("NVIDIA GeForce RTX 4090", torch.bfloat16, None)])
def test_spec_peak_of_known_gpus(name: str, dtype: torch.dtype, tflops: float | None) -> None:
    got = peak.spec_peak_flops(name, dtype)
    assert got == (None if tflops is None else tflops * 1e12)


def test_unknown_gpu_is_measured_with_a_large_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict = {}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    monkeypatch.setattr(peak, "measure_matmul_peak_flops", lambda **kw: seen.update(kw) or 1.5e15)
    assert peak.device_peak_flops("cuda:0", torch.bfloat16, seconds=0.1) == (1.5e15, "measured")
    assert seen["size"] == 8192 and seen["dtype"] is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak.device_peak_flops("cuda:0", torch.bfloat16) == (989e12, "spec")
