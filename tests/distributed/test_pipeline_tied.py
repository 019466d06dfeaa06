"""Weights tied across pipeline stages (`shardwise.pipe.TiedLayerSpec`): a GPT-2-style model whose token
embedding is also its output projection, pipelined over 4 stages and over 2 stages x dp 2, under ZeRO 0, 1
and 2, equals the single-process model (losses, parameters, the clipped global norm, which counts the tied
weight once); a checkpoint holds the tied weight once and loads it back on every holder; and DeepSpeed's own
PipelineModule with TiedLayerSpec, on the same 4 gloo ranks, trains to the same losses and weights. The
built-in GPT with tie_embeddings, pipelined, equals its single-process run too.

All cases run one after the other in one launch of 4 ranks (each case builds its own engine and groups).
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

from shardwise.errors import UserError
from shardwise.testing import (
    assert_close_lists, assert_state_close, lm_pair, micro_steps, reference_train, run_distributed,
    shard_global_batch, tiny_gpt, token_batches)

VOCAB, HIDDEN, SEQ, ROWS, GAS, STEPS = 24, 16, 6, 8, 2, 3     # ROWS: the global batch


class Positions(nn.Module):
    """Learned positions added to the token embeddings [b, s, h]."""

    def __init__(self, seq: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(seq, hidden) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


class Block(nn.Module):
    """Pre-norm residual MLP: x + W2 gelu(W1 ln(x)), [b, s, h] -> [b, s, h]."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.ln(x))))


def project(embed: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    """The output projection through the token embedding: [b, s, h] @ [h, V] -> logits [b, s, V]."""
    return h @ embed.weight.T


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def layer_specs(pipe) -> list:
    """8 layers (2 per stage at 4 stages): embedding, positions, 4 blocks, final norm, projection (tied)."""
    return [pipe.TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN), pipe.LayerSpec(Positions, SEQ, HIDDEN),
            *[pipe.LayerSpec(Block, HIDDEN) for _ in range(4)], pipe.LayerSpec(nn.LayerNorm, HIDDEN),
            pipe.TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN, forward_fn=project)]


def gpt2_style(num_stages: int | None, seed: int = 11):
    from shardwise import pipe
    torch.manual_seed(seed)
    return pipe.PipelineModule(layers=layer_specs(pipe), loss_fn=lm_loss, num_stages=num_stages,
                               partition_method="uniform")


def batches() -> list[torch.Tensor]:
    return token_batches(STEPS, ROWS, SEQ + 1, seed=3, vocab=VOCAB)


def config(dp: int, **extra) -> dict:
    return {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // (GAS * dp),
            "gradient_accumulation_steps": GAS, "steps_per_print": 1 << 30, **extra}


SGD = {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}}
ADAM = {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}
# name -> (stages, config extras); clipping at 0.5 is active on every step (norms ~1-3)
CASES = {
    "pp4_stage0_sgd": (4, {"optimizer": SGD, "gradient_clipping": 0.5}),
    "pp2_dp2_zero1_adam": (2, {"optimizer": ADAM, "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}}),
    "pp2_dp2_zero2_sgd": (2, {"optimizer": SGD, "gradient_clipping": 0.5,
                              "zero_optimization": {"stage": 2, "reduce_bucket_size": 200}}),
}


def _micro(dp: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [lm_pair(m) for b in batches() for m in shard_global_batch(b, dp_size=dp, dp_rank=dp_rank,
                                                                      grad_accum=GAS)]


def _train(stages: int, extra: dict, steps: int = STEPS) -> tuple:
    import shardwise
    dp = 4 // stages
    net = gpt2_style(stages)
    engine, *_ = shardwise.initialize(model=net, model_parameters=net.parameters(), config=config(dp, **extra))
    data = iter(_micro(dp, engine.dp_rank))
    losses, norms = [], []
    for _ in range(steps):
        losses.append(float(engine.train_batch(data)))
        norms.append(engine.get_global_grad_norm())
    return engine, losses, norms, engine.consolidated_state_dict()


def _checkpoint(root: str) -> dict:
    """Train 2 steps at pp 2 x dp 2, save; a model built from another seed loads it and continues: every holder
    gets the tied weight back from the first holder's file, the only one holding it."""
    import shardwise
    extra = {"optimizer": SGD, "gradient_clipping": 0.5}
    engine, *_ = _train(2, extra, steps=2)
    engine.save_checkpoint(root, tag="t")
    files = {name: sorted(torch.load(os.path.join(root, "t", name), weights_only=False)["module"])
             for name in ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt")}
    before = engine.consolidated_state_dict()
    engine.close()
    net = gpt2_style(2, seed=12)
    fresh, *_ = shardwise.initialize(model=net, model_parameters=net.parameters(), config=config(2, **extra))
    fresh.load_checkpoint(root, tag="t")
    loaded = fresh.consolidated_state_dict()
    tied = fresh.pipeline.stage.tied["embed"].weight.detach().clone()
    data = iter(_micro(2, fresh.dp_rank)[2 * GAS:])          # the third global batch
    loss = float(fresh.train_batch(data))
    fresh.close()
    return {"files": files, "before": before, "loaded": loaded, "tied": tied, "loss": loss}


def _deepspeed() -> tuple[list[float], dict]:
    """DeepSpeed's PipelineModule with TiedLayerSpec, 2 stages x dp 2, SGD, no clipping (its fp32 pipeline
    clip counts only stage 0's parameters). Each DeepSpeed stage builds its own layers: the weights are copied
    from the full model built as shardwise's is."""
    import deepspeed
    from deepspeed import pipe
    deepspeed.init_distributed(dist_backend="gloo")      # joins the process group already there
    torch.manual_seed(11)
    net = pipe.PipelineModule(layers=layer_specs(pipe), loss_fn=lm_loss, num_stages=2, partition_method="uniform")
    full = gpt2_style(None)
    with torch.no_grad():
        for name, p in net.named_parameters():         # "tied_modules.embed.weight" or "<layer index>.<param>"
            index, rest = name.split(".", 1)
            source = full if index == "tied_modules" else full.layers[int(index)]
            p.copy_(source.get_parameter(name if index == "tied_modules" else rest))
    engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()),
                                      config=config(2, optimizer=SGD, gradient_clipping=0.0))
    data = iter(_micro(2, engine.grid.get_data_parallel_rank()))
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(STEPS)]
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return losses, state


def _gpt_tied() -> tuple[list[float], dict]:
    """The built-in GPT with tie_embeddings over 2 stages x dp 2 (ZeRO-1): the embedding on stage 0 and the
    lm-head on stage 1 are one parameter registered by both."""
    import shardwise
    model = tiny_gpt(seq_len=SEQ, tie_embeddings=True)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config(
        2, optimizer=SGD, gradient_clipping=0.5, pipeline={"stages": 2}, zero_optimization={"stage": 1}))
    data = iter([lm_pair(m) for b in gpt_batches() for m in shard_global_batch(b, dp_size=2, dp_rank=engine.dp_rank,
                                                                                grad_accum=GAS)])
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    state = engine.consolidated_state_dict()
    engine.close()
    return losses, state


def gpt_batches() -> list[torch.Tensor]:
    return token_batches(STEPS, ROWS, SEQ + 1, seed=4)


def _all() -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    for name, (stages, extra) in CASES.items():
        engine, losses, norms, state = _train(stages, extra)
        engine.close()
        out[name] = {"losses": losses, "norms": norms, "state": state}
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]
        torch.distributed.broadcast_object_list(root, src=0)   # one directory for every rank
        out["checkpoint"] = _checkpoint(root[0])
        torch.distributed.barrier()
    engine, losses, _, state = _train(2, {"optimizer": SGD, "gradient_clipping": 0.0})
    engine.close()
    out["unclipped"] = {"losses": losses, "state": state}
    out["deepspeed"] = _deepspeed()
    out["gpt"] = _gpt_tied()
    try:
        _train(2, {"optimizer": SGD, "zero_optimization": {"stage": 3}}, steps=0)
    except UserError as e:
        out["zero3"] = str(e)
    return out


def _reference(optimizer: dict, clip: float) -> tuple[list[float], list[float], dict]:
    net = gpt2_style(None)
    params = optimizer["params"]
    opt = (torch.optim.SGD(net.parameters(), lr=params["lr"], momentum=params["momentum"])
           if optimizer["type"] == "SGD" else torch.optim.AdamW(net.parameters(), lr=params["lr"]))
    losses, norms = [], []
    for b in batches():
        opt.zero_grad()
        total = 0.0
        for x, y in (lm_pair(m) for m in shard_global_batch(b, dp_size=1, dp_rank=0, grad_accum=GAS)):
            loss = net(x, y)
            (loss / GAS).backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        losses.append(total / GAS)
    return losses, norms, {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_tied_embedding_pipelines_equal_one_process_and_deepspeed() -> None:
    results = run_distributed(_all, 4, timeout=300)
    first = results[0]
    for name, (_, extra) in CASES.items():
        losses, norms, state = _reference(extra["optimizer"], extra["gradient_clipping"])
        adam = extra["optimizer"]["type"] == "Adam"
        for rank, res in enumerate(results):
            assert_close_lists(res[name]["losses"], losses, rtol=1e-5, what=f"{name} rank {rank} losses")
            assert_close_lists(res[name]["norms"], norms, rtol=1e-5, what=f"{name} rank {rank} global norms")
        assert_state_close(first[name]["state"], state, what=name, adam=adam)
    ckpt = first["checkpoint"]
    assert "tied_modules.embed.weight" in ckpt["files"]["mp_rank_00_model_states.pt"]
    assert "tied_modules.embed.weight" not in ckpt["files"]["mp_rank_01_model_states.pt"]
    assert_state_close(ckpt["loaded"], ckpt["before"], what="after load", rtol=0, atol=0)
    for rank, res in enumerate(results):      # every holder (stage 0: ranks 0, 1; stage 1: ranks 2, 3) got it back
        torch.testing.assert_close(res["checkpoint"]["tied"], ckpt["before"]["tied_modules.embed.weight"],
                                   rtol=0, atol=0)
    losses, _, _ = _reference(SGD, 0.5)
    assert_close_lists([r["checkpoint"]["loss"] for r in results], [losses[2]] * 4, rtol=1e-5,
                       what="the step after loading")
    losses, _, state = _reference(SGD, 0.0)
    assert_close_lists(first["unclipped"]["losses"], losses, rtol=1e-5, what="unclipped losses")
    assert_state_close(first["unclipped"]["state"], state, what="unclipped")
    assert "stage = 3 with weights tied across pipeline stages" in first["zero3"]
    gpt = tiny_gpt(seq_len=SEQ, tie_embeddings=True)
    losses = reference_train(gpt, torch.optim.SGD(gpt.parameters(), lr=0.2, momentum=0.9),
                             micro_steps(gpt_batches(), grad_accum=GAS), loss_fn=lambda m, mb: m(*mb), clip=0.5)
    for rank, res in enumerate(results):
        assert_close_lists(res["gpt"][0], losses, rtol=1e-5, what=f"tied GPT rank {rank} losses")
    assert_state_close(first["gpt"][1], gpt.state_dict(), what="tied GPT")
    for rank, res in enumerate(results):
        ds_losses, ds_state = res["deepspeed"]
        assert_close_lists(res["unclipped"]["losses"], ds_losses, rtol=1e-5, what=f"rank {rank} vs DeepSpeed")
    # DeepSpeed's stage files: stage 0 (ranks 0-1) holds layers 0-3 and the tied module, stage 1 (ranks 2-3) 4-7
    for rank in (0, 2):
        ds_state = results[rank]["deepspeed"][1]
        for key, value in ds_state.items():
            index, rest = key.split(".", 1)
            mine = key if index == "tied_modules" else f"layers.{index}.{rest}"
            torch.testing.assert_close(value, first["unclipped"]["state"][mine], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key: f"DeepSpeed rank {rank} {k}: {m}")
