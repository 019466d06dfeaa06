"""Context parallelism's activation memory, measured by the engine (`memory_report()["activations"]`: the storages
autograd saved in the last training forward, on this rank) against the planner, on the small Llama preset (grouped
-query heads, RMSNorm, rotary positions): cp 1, ring attention at cp 2 and 4, Ulysses at cp 2 (its 6 heads do not
spread over 4 ranks), fp32, and ring at cp 4 in bf16. One launch of 4 ranks: cp 1 runs as dp 4, cp 2 as dp 2.

- the planner's prediction is within 10% of the measured bytes of every case;
- the bytes a rank stores at cp C are within 10% of 1/C of the cp-1 figure (nothing else grows with cp).

The planner is asked with `flash_attention=True`: our GPT's SDPA (and ring attention, which never stores a
block's scores) keep no [s, s] scores.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.testing import run_distributed

SEQ, MICRO, WORLD = 64, 2, 4
CASES = [(1, "ring", "fp32"), (2, "ring", "fp32"), (4, "ring", "fp32"), (2, "ulysses", "fp32"), (4, "ring", "bf16")]


def _measure() -> dict[tuple[int, str, str], int]:
    import shardwise
    from shardwise.models import GPT, gpt_config
    out = {}
    for cp, impl, dtype in CASES:
        torch.manual_seed(0)
        model = GPT(gpt_config("llama-small", seq_len=SEQ))
        dp = dist.get_world_size() // cp
        cfg = {"train_batch_size": MICRO * dp, "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
               "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "context_parallel": {"size": cp, "impl": impl}}
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        x = torch.randint(0, 256, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1))
        engine.train_batch(iter([(x[:, :-1], x[:, 1:])]))
        out[(cp, impl, dtype)] = engine.memory_report()["activations"]
        engine.close()
    return out


def _predicted(cp: int, impl: str, dtype: str) -> float:
    from shardwise.models import gpt_config
    from shardwise.planner import JobSpec, Plan, Precision, activation_bytes
    job = JobSpec(global_batch=MICRO * WORLD // cp, seq_len=SEQ, precision=Precision(dtype), flash_attention=True)
    plan = Plan(dp=WORLD // cp, cp=cp, cp_impl=impl, micro_batch=MICRO)
    return activation_bytes(gpt_config("llama-small", seq_len=SEQ), job, plan).total


def test_measured_activations_under_cp_match_the_planner_and_shrink_as_one_over_cp() -> None:
    measured = run_distributed(_measure, WORLD, timeout=600)[0]
    for case, got in measured.items():
        want = _predicted(*case)
        assert abs(got / want - 1) <= 0.10, (case, got, want, got / want)
    cp1 = measured[(1, "ring", "fp32")]
    for (cp, impl, dtype), got in measured.items():
        if dtype == "fp32" and cp > 1:
            assert abs(got * cp / cp1 - 1) <= 0.10, (cp, impl, got, cp1, got * cp / cp1)
