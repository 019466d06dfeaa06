"""ZeRO-3 with offload_optimizer on 2 ranks, gradient accumulation 2, fp32 and bf16: on the boundary's backward
each unit flat's (and persistent bucket's) final gradient shard is sent to its pinned host buffer as soon as its
reduce-scatter is done, while backward still has units to compute; earlier micro-batches send nothing; the step
reads the copies; the buffers are allocated once and counted in `memory_report()["host_staging"]`; training is
bitwise the run without offload (on the CPU the copies are synchronous and the arithmetic is the same)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.parallel.zero.copies import CopyStream
from shardwise.testing import lm_pair, run_distributed, tiny_gpt, token_batches

MICRO_BATCHES = 6       # 3 optimizer steps of 2 micro-batches


def _train(bf16: bool, offload: bool) -> dict:
    import shardwise
    zero: dict = {"stage": 3, "reduce_bucket_size": 4000, "stage3_param_persistence_threshold": 40}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
              **({"bf16": {"enabled": True}} if bf16 else {})}
    engine, *_ = shardwise.initialize(model=tiny_gpt(n_layer=4), config=config)
    runtime, updater = engine.dp_runtime, engine.updater
    flats = [f for f in runtime.partition.flats if f.group is not None]
    # Each send: (micro-batch, its source's data pointer, inside autograd's backward, flats still waiting for
    # their first gradient of this backward: > 0 means backward had units left to compute).
    sends: list[tuple[int, int, bool, int]] = []
    micro = [0]
    real = CopyStream.to_host

    def spy(self: CopyStream, dst: torch.Tensor, src: torch.Tensor):
        waiting = sum(1 for f in flats if f.ready == 0)
        sends.append((micro[0], src.data_ptr(), torch._C._current_graph_task_id() != -1, waiting))
        return real(self, dst, src)

    CopyStream.to_host = spy
    pending, buffers, losses = [], [], []
    try:
        data = [lm_pair(b) for b in token_batches(MICRO_BATCHES, 2, 17, seed=9 + dist.get_rank())]
        for i, batch in enumerate(data):
            micro[0] = i
            loss = engine(batch)
            engine.backward(loss)
            losses.append(loss.item())
            if offload and i % 2 == 1:          # the boundary's backward is done, the step has not run
                pending.append(all(h.pending for h in updater._sent))
            engine.step()
            if offload and i % 2 == 1:
                pending.append(any(h.pending for h in updater._sent))
                buffers.append([h.buffer.data_ptr() for h in updater._sent])
    finally:
        CopyStream.to_host = real
    state = {k: v.detach().clone() for k, v in runtime.gathered_state_dict(engine.module, rank0_only=False).items()}
    shards = {b.grad_shard.data_ptr(): ("flat" if j < len(flats) else "persistent")
              for j, b in enumerate(updater.buckets)}
    # per shard, pinned and in the model dtype: its gradient sent [S] and its master cast for the device [S]
    staged = sum(2 * b.grad_shard.numel() * b.grad_shard.element_size() for b in updater.buckets) if offload else 0
    out = {"losses": losses, "state": state, "sends": sends, "shards": shards, "pending": pending,
           "buffers": buffers, "host_staging": engine.memory_report()["host_staging"], "staged": staged,
           "flats": len(flats), "persistent": len(updater.persistent)}
    engine.close()
    return out


def _cases() -> dict:
    return {(bf16, offload): _train(bf16, offload) for bf16 in (False, True) for offload in (False, True)}


def test_zero3_sends_each_unit_gradient_during_the_boundary_backward_and_trains_exactly() -> None:
    for rank, results in enumerate(run_distributed(_cases, world_size=2)):
        for bf16 in (False, True):
            what = f"rank {rank} {'bf16' if bf16 else 'fp32'}"
            plain, off = results[(bf16, False)], results[(bf16, True)]
            assert off["losses"] == plain["losses"], what
            for k, v in plain["state"].items():
                assert torch.equal(off["state"][k], v), f"{what} {k}"
            assert plain["sends"] == [] and plain["host_staging"] == 0, what
            assert off["flats"] >= 5 and off["persistent"] >= 1, what      # 4 blocks and the root; small params
            # Only the boundary micro-batches send, each shard once, all of them from inside backward.
            boundaries = [i for i in range(MICRO_BATCHES) if i % 2 == 1]
            assert sorted({s[0] for s in off["sends"]}) == boundaries, what
            for i in boundaries:
                sent = [s for s in off["sends"] if s[0] == i]
                assert sorted(s[1] for s in sent) == sorted(off["shards"]), what
                assert all(s[2] for s in sent), what
                # unit flats left while backward still had units to run (not all at its end)
                assert any(s[3] > 0 for s in sent if off["shards"][s[1]] == "flat"), what
            assert off["pending"] == [True, False] * 3, what
            assert all(b == off["buffers"][0] for b in off["buffers"]), what                # allocated once
            # the host buffers hold the shards in the model dtype: half the bytes under bf16
            assert off["host_staging"] == off["staged"] > 0, what
