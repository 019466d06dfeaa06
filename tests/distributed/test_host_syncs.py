"""At most one host read per optimizer step on the engine's own path: the loss average, the overflow verdict and
the gradient norm come back together in one device-to-host copy (on a GPU each read is a synchronisation).

On the CPU a read costs nothing, so `HostReadCounter` counts the calls shardwise's own files make (`.item()`,
`.tolist()`, `.cpu()`, `float(t)`, `bool(t)`, ...). One launch of 2 ranks runs every configuration; it also checks
that ZeRO's verdict and the loss share one all-reduce over "dp:metrics"."""

from __future__ import annotations

import torch

from shardwise.testing import HostReadCounter, lm_pair, tiny_gpt, token_batches

CONFIGS = {
    "stage0_fp32": {},
    "stage0_bf16": {"bf16": {"enabled": True}},
    "zero1_fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}, "zero_optimization": {"stage": 1}},
}
STEPS = 2


def _config(extra: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}


def _count_reads() -> dict[str, list]:
    import shardwise
    out: dict[str, list] = {}
    batches = token_batches(2 * STEPS + 2, 2, 17, seed=3)
    for name, extra in CONFIGS.items():
        engine, *_ = shardwise.initialize(model=tiny_gpt(), config=_config(extra))
        micro = iter([lm_pair(b) for b in batches])
        per_step, metrics_reduces = [], []
        with HostReadCounter() as counter:
            for step in range(STEPS):
                engine.train_batch(micro)
                per_step.append(counter.take())
                report = engine.comm_report(step)
                metrics_reduces.append(sum(r["count"] for r in report if r["group"] == "dp:metrics"))
            # A plain loop (no loss average): the step's verdict is the one read.
            for _ in range(2):
                engine.backward(engine(next(micro)))
                engine.step()
            per_step.append(counter.take())
        engine.close()
        out[name] = [per_step, metrics_reduces]
    return out


def test_one_host_read_and_one_metrics_all_reduce_per_step() -> None:
    from shardwise.testing import run_distributed
    results = run_distributed(_count_reads, world_size=2, timeout=240)
    for rank, result in enumerate(results):
        for name, (per_step, metrics_reduces) in result.items():
            assert [len(c) for c in per_step] == [1] * (STEPS + 1), (rank, name, per_step)
            assert metrics_reduces == [1] * STEPS, (rank, name, metrics_reduces)


def test_counter_sees_shardwise_reads_only() -> None:
    t = torch.ones(2)
    with HostReadCounter() as counter:
        t.tolist()                                   # this test's own read: not counted
        from shardwise.parallel.grad_norm import StepVerdict
        assert StepVerdict(torch.zeros(()), torch.ones(()), None).read() == (False, 1.0, [])
    assert [name for name, _ in counter.calls] == ["tolist"]        # the parts in one copy
