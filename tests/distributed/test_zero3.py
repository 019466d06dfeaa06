"""ZeRO stage 3 equals single-process training (fp32, 2 and 4 ranks; AdamW, SGD-momentum, Adam; accumulation,
clipping, persistent parameters, two param groups, a meta-device build); model-state bytes are (2+2+K) psi/N;
traffic is 3 psi per step; prefetch stays within stage3_max_live_parameters; eval forward; checkpoint round
trip; a model whose full states exceed a per-rank budget trains without any rank holding it whole.

Rank processes are expensive to spawn, so each test runs many cases in one `run_distributed` call."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from test_dp_parity import CASES, SEQ, global_batches, run_reference
from shardwise.testing import (
    assert_close_growing, assert_close_lists, assert_state_close, lm_pair, micro_steps, run_distributed, tiny_gpt,
)

# label -> (CASES entry, stage3_param_persistence_threshold, meta-device build, two param groups,
#           blocks recomputed in backward with torch.utils.checkpoint)
ZERO3_CASES = {
    "adamw": ("adamw", 0, False, False, False),
    "sgd_accum_clip_meta_groups": ("sgd_accum_clip", 100, True, True, False),
    "adam_accum_clip_persistent_recompute": ("adam_ring_accum_clip", 100, False, False, True),
}


def _config(name: str, threshold: int, **zero) -> dict:
    case = CASES[name]
    return {"train_batch_size": 8, "gradient_accumulation_steps": case["gas"], "gradient_clipping": case["clip"],
            "optimizer": case["optimizer"],
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold, **zero}}


def _meta_model(threshold: int, **overrides) -> torch.nn.Module:
    """tiny_gpt(seq_len=SEQ) built on the meta device and materialized as shards (the seed, 1234, is set
    before the build; materializing draws the weights from it)."""
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    from shardwise.models import GPT
    from shardwise.parallel.zero.materialize import materialize_sharded
    with torch.device("meta"):
        model = tiny_gpt(seq_len=SEQ, seed=1234, **overrides)
    return materialize_sharded(model, comm=Comm(None, CommLedger(), name="init"), init=GPT.init_weights,
                               persistence_threshold=threshold)


def _two_groups(model: torch.nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    small = [p for n, p in named if n.endswith("bias") or ".ln_" in n or ".norm." in n]
    return [{"params": [p for _, p in named if not any(p is q for q in small)]}, {"params": small}]


def _recomputing_forward(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """GPT.forward with every block recomputed in backward: the block (a stage-3 unit) runs again, hooks
    included, while autograd is in the middle of the backward pass."""
    x = model.embed_forward(input_ids)
    with set_checkpoint_early_stop(False):     # recompute whole blocks: their forward post-hooks run too
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=False)
    return model.loss(model.head_forward(x), labels)


def _train(engine, name: str, batches: list[torch.Tensor]) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    return [engine.train_batch(iter(micro))
            for micro in micro_steps(batches, dp_size=world, dp_rank=rank, grad_accum=CASES[name]["gas"])]


def _parity_cases() -> dict:
    import shardwise
    out = {}
    for label, (name, threshold, meta, two_groups, recompute) in ZERO3_CASES.items():
        model = _meta_model(threshold) if meta else tiny_gpt(seq_len=SEQ)
        if recompute:
            model.forward = functools.partial(_recomputing_forward, model)
        params = _two_groups(model) if two_groups else model.parameters()
        engine, *_ = shardwise.initialize(model=model, model_parameters=params, config=_config(name, threshold))
        engine.dp_runtime.poison_freed = True        # a use after free turns into NaN
        losses = _train(engine, name, global_batches())
        out[label] = {"losses": losses, "state": engine.dp_runtime.gathered_state_dict(rank0_only=False),
                      "live_after": engine.dp_runtime.live_numel, "groups": len(engine.optimizer.param_groups)}
        engine.close()
    return out


def _memory_and_comm(bf16: bool, reshard_root: bool) -> dict:
    import shardwise
    model = tiny_gpt(seq_len=SEQ)
    psi = sum(p.numel() for p in model.parameters())
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config={**_config("adamw", 0), **extra})
    engine.dp_runtime.reshard_root_after_forward = reshard_root
    losses = _train(engine, "adamw", global_batches()[:2])
    flats = engine.dp_runtime.partition.flats
    root = engine.dp_runtime.root
    out = {"memory": engine.memory_report(), "comm": engine.comm_report(), "psi": psi, "losses": losses,
           "shard_numel": sum(f.shard.numel() for f in flats), "flats": len(flats),
           "root_padded": root.padded_numel, "padded": sum(f.layout.padded_numel for f in flats)}
    engine.close()
    return out


def _prefetch_bounds() -> dict:
    """Peak elements gathered at once with no room for prefetch (max_live 0) and with ample room."""
    import shardwise
    out = {}
    for label, zero in (("no_room", {"stage3_max_live_parameters": 0}), ("ample", {})):
        model = tiny_gpt(seq_len=SEQ)
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config("adamw", 0, **zero))
        losses = _train(engine, "adamw", global_batches()[:2])
        units = engine.dp_runtime.units
        out[label] = {"peak": engine.dp_runtime.peak_live_numel, "losses": losses,
                      "root": engine.dp_runtime.root.padded_numel,
                      "blocks": sorted(u.padded_numel for u in units if not u.is_root)}
        engine.close()
    return out


def _eval_and_checkpoint(ckpt_dir: str) -> dict:
    import shardwise
    name, batches = "sgd_accum_clip", global_batches()
    cfg = _config(name, 100)
    model = tiny_gpt(seq_len=SEQ)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    _train(engine, name, batches[:2])
    # eval: no-grad and grad-enabled forwards without backward leave nothing gathered
    ids, labels = lm_pair(batches[2][:2])
    engine.eval()
    with torch.no_grad():
        eval_loss = float(engine(ids, labels))
    live_no_grad = engine.dp_runtime.live_numel
    eval_loss_grad = float(engine(ids, labels).detach())
    live_grad = engine.dp_runtime.live_numel
    engine.train()
    full = engine.dp_runtime.gathered_state_dict(rank0_only=False)
    plain = tiny_gpt(seq_len=SEQ)
    plain.load_state_dict(full)
    plain.eval()
    with torch.no_grad():
        plain_loss = float(plain(ids, labels))
    # checkpoint round trip: continue after saving, vs a fresh engine that loads it
    engine.save_checkpoint(ckpt_dir, tag="t")
    after_save = _train(engine, name, batches[2:4])
    final = engine.dp_runtime.gathered_state_dict(rank0_only=False)
    engine.close()
    torch.manual_seed(99)                       # a different start: only the checkpoint can make it equal
    model2 = _other_model()
    engine2, *_ = shardwise.initialize(model=model2, model_parameters=model2.parameters(), config=cfg)
    engine2.load_checkpoint(ckpt_dir, tag="t")
    after_load = _train(engine2, name, batches[2:4])
    final2 = engine2.dp_runtime.gathered_state_dict(rank0_only=False)
    # weights only: the sharded parameters' values come from the optimizer files' masters (the module states
    # hold placeholders for them, as DeepSpeed's do)
    engine2.load_checkpoint(ckpt_dir, tag="t", load_module_only=True)
    module_only = engine2.dp_runtime.gathered_state_dict(rank0_only=False)
    # a full state dict loaded into the stage-3 module is split into the shards
    engine2.module.load_state_dict(full)
    reloaded = engine2.dp_runtime.gathered_state_dict(rank0_only=False)
    engine2.close()
    return {"eval": (eval_loss, eval_loss_grad, plain_loss), "live": (live_no_grad, live_grad),
            "after_save": after_save, "after_load": after_load, "final": final, "final2": final2,
            "module_only": module_only, "full": full, "reloaded": reloaded}


def _other_model() -> torch.nn.Module:
    return tiny_gpt(seq_len=SEQ, seed=None)     # weights from the caller's seed


def _meta_init_is_bit_identical() -> dict:
    """A tied-embedding GPT materialized from the meta device equals the direct build, bit for bit."""
    import shardwise
    direct = tiny_gpt(seq_len=SEQ, tie_embeddings=True)
    model = _meta_model(100, tie_embeddings=True)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=_config("adamw", 100))
    gathered = engine.dp_runtime.gathered_state_dict(rank0_only=False)
    engine.close()
    return {"equal": {k: torch.equal(gathered[k], v) for k, v in direct.state_dict().items()},
            "tied": model.head.lm_head.weight is model.embed.tok.weight}


def _suite_two(ckpt_dir: str) -> dict:
    return {"parity": _parity_cases(),
            "memory": {(bf16, rr): _memory_and_comm(bf16, rr) for bf16, rr in ((False, False), (True, False),
                                                                              (False, True))},
            "prefetch": _prefetch_bounds(), "eval_ckpt": _eval_and_checkpoint(ckpt_dir),
            "meta": _meta_init_is_bit_identical()}


def _reset_peak_rss() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: /proc/self/clear_refs) and return it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak_rss()


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _over_budget_model() -> dict:
    """A 7.2M-parameter GPT whose fp32 Adam model states (16 bytes/param, 115 MB) exceed the per-rank budget
    (3/4 of that), built on the meta device and trained under stage 3 with prefetch bounded to one block.

    Memory is the growth of the process's peak RSS over its RSS before the build (the peak is reset first).
    Large blocks are mmapped (mallopt M_MMAP_THRESHOLD), so freed tensors leave RSS instead of staying
    cached in glibc's arenas and the figure tracks what is alive; gloo's transient buffers and allocator
    slack (about 30 MB here) are included, so this is an upper bound on what stage 3 holds."""
    import ctypes
    import shardwise
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    from shardwise.models import GPT, gpt_config
    from shardwise.parallel.zero.materialize import materialize_sharded
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)          # M_MMAP_THRESHOLD
    cfg = gpt_config("tiny", n_layer=16, d_model=192, n_head=4, seq_len=SEQ, tie_embeddings=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    before = _reset_peak_rss()
    materialize_sharded(model, comm=Comm(None, CommLedger(), name="init"), init=GPT.init_weights,
                        persistence_threshold=1000)
    block = 12 * cfg.d_model ** 2 + 4 * cfg.d_model            # one unit: a block's matrices and big biases
    config = {"train_batch_size": dist.get_world_size(), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000,
                                    "stage3_prefetch_bucket_size": block, "stage3_max_live_parameters": 3 * block}}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(2):
        rows = torch.randint(0, 256, (1, SEQ + 1), generator=g)
        losses.append(engine.train_batch(iter([lm_pair(rows)])))
    growth = _peak_rss() - before
    out = {"psi": psi, "growth": growth, "peak_live": engine.dp_runtime.peak_live_numel, "losses": losses,
           "block": block, "model_states": engine.memory_report()["model_states"]}
    engine.close()
    return out


def _suite_four() -> dict:
    return {"parity": _parity_cases(), "memory": _memory_and_comm(False, False), "budget": _over_budget_model()}


# -- in-process checks of the planning and materialization (no process group: a world of one) ---------

def _meta_gpt(**overrides) -> torch.nn.Module:
    with torch.device("meta"):
        return tiny_gpt(seq_len=SEQ, seed=None, **overrides)


def test_plan_units_blocks_root_and_persistent_follow_deepspeed_rules():
    from shardwise.parallel.zero.params import plan_units
    model = _meta_gpt(tie_embeddings=True)
    plans, persistent = plan_units(model, persistence_threshold=32, model_persistence_threshold=2 ** 62)
    assert [p.name for p in plans] == ["blocks.0", "blocks.1", "<root>"] and plans[-1].module is model
    named = dict(model.named_parameters())
    assert [n for n, p in named.items() if any(p is q for q in persistent)] == \
        [n for n, p in named.items() if p.numel() <= 32]                 # DeepSpeed: numel <= threshold
    root = plans[-1].params
    assert sum(p is model.embed.tok.weight for p in root) == 1          # the tied table: once, in the root
    assert any(p is model.embed.pos.weight for p in root)
    covered = [p for plan in plans for p in plan.params] + persistent
    assert len(covered) == len(named) == len({id(p) for p in covered})  # every parameter exactly once
    _, capped = plan_units(model, persistence_threshold=32, model_persistence_threshold=100)
    assert sum(p.numel() for p in capped) <= 100 and 0 < len(capped) < len(persistent)


def test_materialize_on_one_rank_equals_direct_build_and_refuses_misuse():
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    from shardwise.errors import UserError
    from shardwise.models import GPT
    from shardwise.parallel.zero.materialize import materialize_sharded
    from shardwise.parallel.zero.params import PARTITION_ATTR
    comm = Comm(None, CommLedger())
    torch.manual_seed(5)
    reference = GPT(_meta_gpt().cfg)
    torch.manual_seed(5)
    model = materialize_sharded(_meta_gpt(), comm=comm, init=GPT.init_weights, persistence_threshold=32)
    partition = getattr(model, PARTITION_ATTR)
    for f in partition.flats:                  # one rank: the shard is the whole flat buffer
        expected = torch.cat([dict(reference.named_parameters())[n].reshape(-1) for n in
                              [next(k for k, q in model.named_parameters() if q is p) for p in f.params]])
        assert torch.equal(f.shard[:expected.numel()], expected) and f.shard.numel() == expected.numel()
        assert all(p.numel() == 0 for p in f.params)                    # placeholders between uses
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if any(p is q for q in partition.persistent):
            assert torch.equal(p, ref[name]), name
    with pytest.raises(UserError, match="not on the meta device"):
        materialize_sharded(reference, comm=comm)
    with pytest.raises(UserError, match="did not walk model.named_modules"):
        materialize_sharded(_meta_gpt(), comm=comm, init=lambda m: None)


def _check_parity(results: list[dict]) -> None:
    for label, (name, *_rest) in ZERO3_CASES.items():
        ref_losses, ref_state = run_reference(CASES[name])
        for rank, res in enumerate(results):
            got = res["parity"][label]
            assert_close_lists(got["losses"], ref_losses, rtol=1e-5, what=f"stage 3 {label} rank {rank}")
            assert_state_close(got["state"], ref_state, what=f"stage 3 {label} rank {rank}",
                               adam="Adam" in CASES[name]["optimizer"]["type"])
            assert got["live_after"] == 0, f"{label}: parameters still gathered after the step"
        assert results[0]["parity"][label]["groups"] == (2 if ZERO3_CASES[label][3] else 1)


def _check_memory(r: dict, n: int, *, bf16: bool) -> None:
    e = 2 if bf16 else 4                         # model dtype bytes
    k = 12 if bf16 else 8                        # Adam m, v (+ fp32 masters under bf16)
    mem, shard, psi = r["memory"], r["shard_numel"], r["psi"]
    assert psi <= shard * n <= psi + n * r["flats"]            # padding: < n elements per flat
    assert mem["params"] == e * shard                          # threshold 0: nothing persistent
    assert mem["grads"] == e * shard
    assert k * shard <= mem["optimizer"] <= k * shard + 8 * r["flats"]   # + Adam's step counters
    assert mem["model_states"] <= (e + e + k) * (psi + n * r["flats"]) // n + 8 * r["flats"]


def _check_traffic(r: dict, *, e: int, reshard_root: bool) -> None:
    ops = {c["op"]: c["bytes"] for c in r["comm"] if c["group"] == "dp"}
    assert set(ops) == {"all_gather", "reduce_scatter"}
    padded = e * r["padded"]
    assert ops["reduce_scatter"] == padded                     # every gradient once
    # forward + backward gather of every unit; the root is kept from forward into backward unless resharded
    expected = 2 * padded - (0 if reshard_root else e * r["root_padded"])
    assert ops["all_gather"] == expected
    total = ops["all_gather"] + ops["reduce_scatter"]
    if reshard_root:
        assert 3 * e * r["psi"] <= total <= 3 * padded          # 3 psi, within padding


def test_zero3_on_two_ranks(tmp_path):
    results = run_distributed(_suite_two, 2, args=(str(tmp_path / "ckpt"),), timeout=400)
    _check_parity(results)
    ref_losses, _ = run_reference(CASES["adamw"])
    for r in results:
        for (bf16, rr), m in r["memory"].items():
            _check_memory(m, 2, bf16=bf16)
            _check_traffic(m, e=2 if bf16 else 4, reshard_root=rr)
            if bf16:   # vs the fp32 reference: bf16's rounding (eps = 2**-7) grows with the updates behind a step
                assert_close_growing(m["losses"], ref_losses[:2], rtol_per_step=torch.finfo(torch.bfloat16).eps / 64,
                                     steps=[1, 2], what="bf16 losses")
            else:
                assert_close_lists(m["losses"], ref_losses[:2], rtol=1e-5, what="fp32 losses")
        p = r["prefetch"]
        assert p["no_room"]["peak"] == p["no_room"]["root"] + max(p["no_room"]["blocks"])   # nothing ahead
        assert p["ample"]["peak"] == p["ample"]["root"] + sum(p["ample"]["blocks"])         # all ahead
        assert_close_lists(p["no_room"]["losses"], p["ample"]["losses"], rtol=0, what="prefetch changes nothing")
        ec = r["eval_ckpt"]
        assert ec["eval"][0] == ec["eval"][1] and abs(ec["eval"][0] - ec["eval"][2]) < 1e-6, ec["eval"]
        assert ec["live"] == (0, 0)
        assert_close_lists(ec["after_load"], ec["after_save"], rtol=0, what="resumed vs continued")
        for k, v in ec["final"].items():
            assert torch.equal(ec["final2"][k], v), k
            assert torch.equal(ec["reloaded"][k], ec["full"][k]), k
            assert torch.equal(ec["module_only"][k], ec["full"][k]), k
        assert all(r["meta"]["equal"].values()), r["meta"]["equal"]
        assert r["meta"]["tied"]


def test_zero3_on_four_ranks_and_over_budget_model():
    results = run_distributed(_suite_four, 4, timeout=400)
    _check_parity(results)
    for r in results:
        _check_memory(r["memory"], 4, bf16=False)
        _check_traffic(r["memory"], e=4, reshard_root=False)
        b = r["budget"]
        full_states = 16 * b["psi"]                 # fp32 params, grads, Adam m and v
        budget = 3 * full_states // 4
        assert b["growth"] < budget < full_states, (b["growth"], budget)
        assert b["model_states"] < full_states // 3
        assert b["peak_live"] <= 3 * b["block"] < b["psi"] // 4    # at most a few units gathered at once
        assert all(math.isfinite(x) for x in b["losses"])
