"""Context parallelism on gloo ranks, two launches (2 and 4 ranks) that share several checks each:

- ring and Ulysses attention (forward and the gradients of q, k, v) equal single-process SDPA on the whole sequence,
  causal and not, with grouped-query heads (at cp 4 fewer key/value heads than ranks), fp32 at torch's fp32
  tolerance, with no host read on the way (a synchronisation on a GPU);
- `shardwise.sequence.layer.DistributedAttention` equals DeepSpeed's own (outputs and gradients, both layouts);
- training 5 steps through `initialize` equals the single-process run (losses and parameters, rtol 1e-5): the
  Llama preset under causal ring attention at cp 2 (dp 1) with ignored labels spread unevenly over the ranks, the
  GPT under Ulysses at cp 2, and on 4 ranks cp 2 x dp 2 (ring; ring with ZeRO-3; Ulysses with ZeRO-1 and
  accumulation), Ulysses at cp 4, and tp 2 (with sequence parallelism) x cp 2: ring on the Llama preset, Ulysses
  with ZeRO-1 and accumulation on the GPT (vocabulary-parallel loss summed over the cp ranks), and a 2-stage
  pipeline x cp 2 (ring, Llama, 2 micro-batches, clipped);
- a checkpoint saved at cp 2 loads at cp 1 (dp 2) with the same parameters and optimizer state, and trains on as
  the reference does;
- `initialize(training_data=)` gives the cp ranks of one dp rank the same micro-batches, and the engine reports the
  plain dp size, rank and group (as DeepSpeed does under sequence parallelism);
- a Hugging Face Llama (transformers' own model, its attention replaced through its attention interface) trains 5
  steps at cp 2 as the single-process model does (losses and parameters, rtol 1e-5), under ring attention and
  Ulysses, with the recomputation policies (full, selective, every_n), labels given unshifted as transformers
  takes them and some ignored; and driven as Hugging Face's Trainer drives the engine (dict micro-batches with an
  all-ones attention_mask and `num_items_in_batch`, two micro-batches per step, losses not scaled by the
  accumulation), equal to the single-process model given the same.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.testing import (
    assert_close_lists, assert_state_close, reference_train, run_distributed, shard_global_batch, state_copy, tiny_gpt,
    token_batches,
)

STEPS, GLOBAL_BATCH, SEQ = 5, 4, 16
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
LLAMA = dict(positions="rotary", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2, d_ff=64)


# -- attention --------------------------------------------------------------------------------------------------

def _attention_cases(size: int) -> list[tuple[str, bool, int, int]]:
    """(impl, causal, heads, kv heads): plain and grouped-query; at cp 4 Ulysses repeats 2 kv heads over 4 ranks."""
    return [(impl, causal, heads, kv) for impl in ("ring", "ulysses") for causal in (True, False)
            for heads, kv in ((4, 4), (8, 2) if size == 4 else (4, 2))]


def _check_attention(size: int) -> None:
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    from shardwise.parallel.context import RingAttention, SequenceLayout, UlyssesAttention, grouped_sdpa
    from shardwise.testing.host_reads import HostReadCounter
    comm, rank = Comm(None, CommLedger(), name="cp"), dist.get_rank()
    for impl, causal, heads, kv in _attention_cases(size):
        g = torch.Generator().manual_seed(heads * 10 + kv)
        b, s, d = 2, 8 * size, 8
        q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (heads, kv, kv))
        dout = torch.randn(b, heads, s, d, generator=g)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = grouped_sdpa(*full, causal=causal)
        expected.backward(dout)
        layout = SequenceLayout(size, rank, balanced=causal and impl == "ring")
        local = [layout.take(t, dim=2).requires_grad_() for t in (q, k, v)]
        attention = (RingAttention if impl == "ring" else UlyssesAttention)(comm, layout)
        with HostReadCounter() as reads:        # nothing waits for the device inside the ring or the all-to-alls
            out = attention(*local, causal=causal)
            out.backward(layout.take(dout, dim=2))
        assert reads.calls == [], reads.calls
        what = f"{impl} causal={causal} heads={heads}/{kv} at cp {size}"
        torch.testing.assert_close(out, layout.take(expected.detach(), dim=2), msg=lambda m: f"{what} output: {m}")
        for name, mine, ref in zip("qkv", local, full):
            assert ref.grad is not None and mine.grad is not None
            torch.testing.assert_close(mine.grad, layout.take(ref.grad, dim=2),
                                       msg=lambda m: f"{what} d{name}: {m}")


class _LocalSDPA(nn.Module):
    """Causal SDPA in DeepSpeed's layouts: [S, b, h, d] (batch_dim_idx 1) or [b, S, h, d] (0)."""

    def __init__(self, batch_dim_idx: int):
        super().__init__()
        self.batch_dim_idx = batch_dim_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        order = (0, 2, 1, 3) if self.batch_dim_idx == 0 else (1, 2, 0, 3)
        out = torch.nn.functional.scaled_dot_product_attention(*(t.permute(order) for t in (q, k, v)), is_causal=True)
        return out.permute(order) if self.batch_dim_idx == 0 else out.permute(2, 0, 1, 3)


def _check_deepspeed_distributed_attention() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.comm
    import deepspeed.ops
    from deepspeed.sequence.layer import DistributedAttention as Theirs

    import shardwise as ours_root
    # Its shared-memory all-reduce kernel (inference only) would otherwise be JIT-compiled here: ~20 s to minutes.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    ours_cls = ours_root.sequence.layer.DistributedAttention
    size, rank = dist.get_world_size(), dist.get_rank()
    for batch_dim_idx in (0, 1):
        g = torch.Generator().manual_seed(batch_dim_idx)
        s_local, b, heads, kv, d = 4, 2, 4, 2, 8
        shape = (b, s_local, None, d) if batch_dim_idx == 0 else (s_local, b, None, d)
        inputs = [torch.randn(*[heads if x is None else x for x in shape], generator=g)] + \
                 [torch.randn(*[kv if x is None else x for x in shape], generator=g) for _ in range(2)]
        inputs = [t + rank for t in inputs]          # each rank its own part of the sequence
        dout = torch.randn(*[heads if x is None else x for x in shape], generator=g)
        results = []
        for cls in (Theirs, ours_cls):
            # k, v at kv heads, repeated in the local attention as GQA would
            local = _LocalSDPA(batch_dim_idx)
            module = cls(_RepeatKV(local, heads // kv), dist.group.WORLD)
            leaves = [t.clone().requires_grad_() for t in inputs]
            out = module(*leaves, batch_dim_idx)
            out.backward(dout)
            results.append([out.detach()] + [t.grad for t in leaves])
        for name, theirs, ours in zip(("output", "dq", "dk", "dv"), *results):
            torch.testing.assert_close(ours, theirs, msg=lambda m: f"batch_dim_idx={batch_dim_idx} {name}: {m}")
    assert size == 2


class _RepeatKV(nn.Module):
    def __init__(self, inner: nn.Module, groups: int):
        super().__init__()
        self.inner, self.groups = inner, groups

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.inner(q, k.repeat_interleave(self.groups, dim=2), v.repeat_interleave(self.groups, dim=2))


# -- training through initialize --------------------------------------------------------------------------------

def _global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches (ids [B, SEQ], labels [B, SEQ]), labels shifted before any split; some labels ignored
    (-100), more of them late in the sequence, so the cp ranks hold different numbers of valid tokens."""
    out = []
    for i, rows in enumerate(token_batches(STEPS, GLOBAL_BATCH, SEQ + 1, seed=11)):
        ids, labels = rows[:, :-1], rows[:, 1:].clone()
        labels[:, SEQ - 3 - i % 2:] = -100
        labels[0, 1] = -100
        out.append((ids, labels))
    return out


def _micro(batches: list, *, dp: int, dp_rank: int, gas: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    return [list(zip(shard_global_batch(ids, dp_size=dp, dp_rank=dp_rank, grad_accum=gas),
                     shard_global_batch(labels, dp_size=dp, dp_rank=dp_rank, grad_accum=gas)))
            for ids, labels in batches]


def _optimizer(spec: dict, params) -> torch.optim.Optimizer:
    return (torch.optim.AdamW if spec["type"] == "AdamW" else torch.optim.SGD)(params, **spec["params"])


TRAIN_CASES = {
    # name: (world, cp, impl, model overrides, optimizer, zero stage, gradient accumulation, clip). Clipping and Adam
    # both hide a gradient's scale, so the cp 2 ring case steps SGD unclipped.
    "llama_ring_cp2": (2, 2, "ring", LLAMA, SGD, 0, 1, 0.0),
    "gpt_ulysses_cp2": (2, 2, "ulysses", dict(n_kv_head=2), ADAMW, 0, 1, 0.5),
    "llama_ring_cp2_dp2": (4, 2, "ring", LLAMA, ADAMW, 0, 2, 0.5),
    "llama_ring_cp2_dp2_zero3": (4, 2, "ring", LLAMA, SGD, 3, 1, 0.0),
    "gpt_ulysses_cp2_dp2_zero1": (4, 2, "ulysses", dict(positions="rotary"), ADAMW, 1, 2, 0.5),
    "llama_ulysses_cp4": (4, 4, "ulysses", LLAMA, SGD, 0, 1, 0.5),
    "llama_ring_tp2_cp2_sp": (4, 2, "ring", LLAMA, SGD, 0, 1, 0.0),
    "gpt_ulysses_tp2_cp2_sp": (4, 2, "ulysses", dict(n_kv_head=4), ADAMW, 1, 2, 0.5),
    "llama_ring_pp2_cp2": (4, 2, "ring", LLAMA, SGD, 0, 2, 0.5),
}


TENSOR_PARALLEL = {"llama_ring_tp2_cp2_sp": 2, "gpt_ulysses_tp2_cp2_sp": 2}
"""Cases with tensor parallelism 2 + sequence parallelism (mesh tp x cp x dp, tp innermost)."""
PIPELINE = {"llama_ring_pp2_cp2": 2}
"""Cases with a 2-stage pipeline (mesh pp x cp; pp outermost)."""


def _config(cp: int, impl: str, optimizer: dict, stage: int, gas: int, clip: float = 0.5, tp: int = 1,
            pp: int = 1) -> dict:
    return {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
            "optimizer": optimizer, "zero_optimization": {"stage": stage},
            "context_parallel": {"size": cp, "impl": impl},
            "tensor_parallel": {"size": tp, "sequence_parallel": tp > 1}, "pipeline": {"stages": pp}}


def _train(name: str, checkpoint_dir: str | None = None) -> None:
    import shardwise
    world, cp, impl, overrides, optimizer, stage, gas, clip = TRAIN_CASES[name]
    tp, pp = TENSOR_PARALLEL.get(name, 1), PIPELINE.get(name, 1)
    rank = dist.get_rank()
    model = tiny_gpt(seq_len=SEQ, **overrides)
    reference = copy.deepcopy(model)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(cp, impl, optimizer, stage, gas, clip, tp, pp))
    batches = _global_batches()
    dp = world // (cp * tp * pp)
    inner = world // pp                        # ranks per stage: pp is outermost, then dp, cp, tp
    losses = [engine.train_batch(iter(m))
              for m in _micro(batches, dp=dp, dp_rank=rank % inner // (cp * tp), gas=gas)]
    if pp > 1:
        mine = engine.pipeline.module_state_dict(engine.module)     # full-model names, this stage's layers
        parts: list = [None] * world
        dist.all_gather_object(parts, {k: v.detach().clone() for k, v in mine.items()})
        state = {k: v for part in parts for k, v in part.items()}
    elif tp > 1:
        from shardwise.parallel.tensor_parallel import gather_full_state_dict
        state = gather_full_state_dict(model, next(m.comm for m in model.modules() if hasattr(m, "comm")))
    else:
        state = engine.dp_runtime.gathered_state_dict(model, rank0_only=False) if stage == 3 else state_copy(model)
    reference_optimizer = _optimizer(optimizer, reference.parameters())
    # A loss is the mean over one micro-batch's valid tokens, averaged over micro-batches and dp ranks (DeepSpeed's
    # rule): the reference runs the dp ranks' micro-batches as accumulation steps.
    expected = reference_train(reference, reference_optimizer,
                               _micro(batches, dp=1, dp_rank=0, gas=gas * dp),
                               loss_fn=lambda m, mb: m(*mb), clip=clip or None)
    assert_close_lists(losses, expected, what=f"{name} losses")
    assert_state_close(state, state_copy(reference), what=f"{name} parameters", adam=optimizer is ADAMW)
    if checkpoint_dir is not None:
        engine.save_checkpoint(checkpoint_dir, tag="cp2")
        _load_at_cp1(name, checkpoint_dir, reference, reference_optimizer, state, engine)
    engine.close()


def _load_at_cp1(name: str, checkpoint_dir: str, reference: nn.Module, reference_optimizer: torch.optim.Optimizer,
                 state: dict, saved_engine) -> None:
    """The cp 2 checkpoint loads at cp 1 (dp 2 on the same ranks): same parameters, same optimizer state, and one
    more step equals the reference's."""
    import shardwise
    world, _, _, overrides, optimizer, _, gas, clip = TRAIN_CASES[name]
    model = tiny_gpt(seq_len=SEQ, seed=99, **overrides)        # other weights: the load must replace them
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(1, "ring", optimizer, 0, gas, clip))
    engine.load_checkpoint(checkpoint_dir, tag="cp2")
    assert engine.global_steps == STEPS
    assert_state_close(state_copy(model), state, what=f"{name} loaded at cp 1")
    saved_opt, loaded_opt = saved_engine.optimizer.state_dict()["state"], engine.optimizer.state_dict()["state"]
    assert saved_opt.keys() == loaded_opt.keys()
    for i in saved_opt:
        for key, value in saved_opt[i].items():
            torch.testing.assert_close(loaded_opt[i][key], value, msg=lambda m: f"optimizer state {i}.{key}: {m}")
    extra = _global_batches()[:1]
    loss = engine.train_batch(iter(_micro(extra, dp=world, dp_rank=dist.get_rank(), gas=gas)[0]))
    expected = reference_train(reference, reference_optimizer, _micro(extra, dp=1, dp_rank=0, gas=gas * world),
                               loss_fn=lambda m, mb: m(*mb), clip=clip or None)
    assert_close_lists([loss], expected, what=f"{name} step after loading at cp 1")
    assert_state_close(state_copy(model), state_copy(reference), what=f"{name} parameters after a step at cp 1")
    engine.close()


def _check_loader(cp: int) -> None:
    """`initialize(training_data=...)` deals samples over dp only: the cp ranks of one dp rank read the same."""
    import shardwise
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = token_batches(1, 16, SEQ + 1, seed=3)[0]
    dataset = [(r[:-1], r[1:]) for r in rows]
    model = tiny_gpt(seq_len=SEQ)
    engine, _, loader, _ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=dataset, config=_config(cp, "ring", SGD, 0, 1))
    ids, _ = next(iter(loader))
    seen = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(seen, ids)
    for other in range(world):
        assert torch.equal(seen[other], ids) == (other // cp == rank // cp), (rank, other)
    # The engine reports plain dp, as DeepSpeed does under sequence_parallel_size; dp x cp stays the parameters'.
    dp = world // cp
    assert (engine.dp_world_size, engine.dp_size, engine.dp_rank) == (dp, dp, rank // cp)
    assert engine.get_data_parallel_rank() == rank // cp
    assert engine.train_batch_size() == engine.train_micro_batch_size_per_gpu() * \
        engine.gradient_accumulation_steps() * engine.dp_world_size
    if dp > 1:
        assert dist.get_process_group_ranks(engine.data_parallel_group) == [rank % cp + cp * d for d in range(dp)]
    engine.close()


def _hf_llama() -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return AutoModelForCausalLM.from_config(config)


HF_CASES = {
    # name: (impl, activation_checkpointing, optimizer, clip)
    "hf_llama_ring_selective": ("ring", {"policy": "selective"}, SGD, 0.0),
    "hf_llama_ulysses_full": ("ulysses", {"policy": "full"}, ADAMW, 0.5),
    "hf_llama_ring_every_n": ("ring", {"policy": "every_n", "every": 2}, ADAMW, 0.5),
}


def _train_hf(name: str) -> None:
    """A Hugging Face Llama at cp 2 (dp 1) against itself on one process: labels unshifted (transformers shifts),
    some ignored, more of them late in the sequence."""
    import shardwise
    impl, policy, optimizer, clip = HF_CASES[name]
    model = _hf_llama()
    reference = copy.deepcopy(model)
    config = {**_config(2, impl, optimizer, 0, 1, clip), "activation_checkpointing": policy}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    batches = []
    for i, ids in enumerate(token_batches(STEPS, GLOBAL_BATCH, SEQ, seed=5, vocab=256)):
        labels = ids.clone()
        labels[:, SEQ - 2 - i % 3:] = -100
        labels[1, 3] = -100
        batches.append([(ids, labels)])
    losses = [engine.train_batch(iter(m)) for m in batches]
    expected = reference_train(reference, _optimizer(optimizer, reference.parameters()), batches,
                               loss_fn=lambda m, mb: m(mb[0], labels=mb[1]).loss, clip=clip or None)
    assert_close_lists(losses, expected, what=f"{name} losses")
    assert_state_close(state_copy(model), state_copy(reference), what=f"{name} parameters",
                       adam=optimizer is ADAMW)
    engine.close()


def _train_hf_as_the_trainer_does() -> None:
    """The Trainer's calls: engine(**batch, num_items_in_batch=N) with N the step's valid tokens (counted on the
    unshifted labels' positions 1.., as the Trainer counts), engine.backward(loss, scale_wrt_gas=False), and
    engine.step() after every micro-batch. Each loss is the micro-batch's token-loss sum over N, so the step's
    gradient is that of the mean over all its valid tokens; SGD unclipped, so a wrong scale shows."""
    import shardwise
    model = _hf_llama()
    reference = copy.deepcopy(model)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(2, "ring", SGD, 0, 2, 0.0))
    reference_optimizer = _optimizer(SGD, reference.parameters())
    losses, expected = [], []
    for i, ids in enumerate(token_batches(STEPS, GLOBAL_BATCH, SEQ, seed=7, vocab=256)):
        labels = ids.clone()
        labels[:, SEQ - 1 - i % 4:] = -100
        labels[2, 5] = -100                      # the two micro-batches hold different numbers of valid tokens
        items = labels[:, 1:].ne(-100).sum()
        for rows in (slice(0, 2), slice(2, 4)):
            batch = {"input_ids": ids[rows], "attention_mask": torch.ones_like(ids[rows]), "labels": labels[rows]}
            loss = engine(**batch, num_items_in_batch=items).loss
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
            losses.append(float(loss))
            ref_loss = reference(**batch, num_items_in_batch=items).loss
            ref_loss.backward()
            expected.append(float(ref_loss))
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
    assert_close_lists(losses, expected, what="hf trainer-style losses")
    assert_state_close(state_copy(model), state_copy(reference), what="hf trainer-style parameters")
    engine.close()


# -- the launches -----------------------------------------------------------------------------------------------

def _at_two(checkpoint_dir: str, with_deepspeed: bool) -> None:
    _check_attention(2)
    if with_deepspeed:
        _check_deepspeed_distributed_attention()
    _train("llama_ring_cp2", checkpoint_dir)
    _train("gpt_ulysses_cp2")
    _check_loader(2)
    for name in HF_CASES:
        _train_hf(name)
    _train_hf_as_the_trainer_does()


def _at_four() -> None:
    _check_attention(4)
    for name in ("llama_ring_cp2_dp2", "llama_ring_cp2_dp2_zero3", "gpt_ulysses_cp2_dp2_zero1",
                 "llama_ulysses_cp4", "llama_ring_tp2_cp2_sp", "gpt_ulysses_tp2_cp2_sp", "llama_ring_pp2_cp2"):
        _train(name)
    _check_loader(2)


def _deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def test_context_parallel_at_two_ranks() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_at_two, world_size=2, args=(tmp, _deepspeed_available()), timeout=600)


def test_context_parallel_at_four_ranks() -> None:
    run_distributed(_at_four, world_size=4, timeout=600)
