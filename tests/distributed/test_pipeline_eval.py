"""`engine.eval_batch`: a forward-only pass equal to the single-process model's eval loss, that leaves training
exactly where it was.

One spawn of 4 gloo ranks runs each case: evaluate the fresh model, whose dropout (0.1) only eval mode turns
off; then, dropout set to 0 so that training is deterministic, train one step, evaluate twice (M =
gradient_accumulation_steps on the training shapes, then M = 3 micro-batches of another batch size and sequence
length, which the pipeline agrees afresh), train one more step, and gather the whole model. The reference is
plain torch on one process doing the same: eval losses of every micro-batch in eval mode without gradients
(mean over micro-batches and data-parallel ranks), training steps on the concatenated dp shares. Eval and
training losses and the final parameters must match (fp32, rtol = atol = 1e-5): an evaluation that touched a
gradient, a step counter or the wire's agreed shapes would show in the second step.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.testing import (
    assert_close_lists, assert_state_close, mean_over_ranks, micro_steps, reference_train, run_distributed,
    state_copy, tiny_gpt, token_batches,
)

SEQ, D, MICRO, LAYERS = 16, 32, 2, 4
EVAL_SEQ, EVAL_MICRO, EVAL_M = 8, 3, 3
CASES = {
    "pp2dp2_1f1b": dict(pp=2, schedule="1f1b", v=1, gas=2, zero=0),
    "pp2dp2_interleaved_zero1": dict(pp=2, schedule="interleaved_1f1b", v=2, gas=4, zero=1),
    "pp4_gpipe": dict(pp=4, schedule="gpipe", v=1, gas=3, zero=0),
    "dp4_zero3": dict(pp=1, schedule="1f1b", v=1, gas=2, zero=3),
}


def model_with_dropout() -> nn.Module:
    return tiny_gpt(n_layer=LAYERS, d_model=D, seq_len=SEQ, dropout=0.1)


def batches(seed: int, *, seq: int, micro: int, count: int, dp: int, dp_rank: int) -> list[tuple]:
    """``count`` micro-batches (inputs, labels) of ``micro`` sequences: this dp rank's share of a global batch."""
    (micro_batches,) = micro_steps(token_batches(1, micro * count * dp, seq + 1, seed=seed), dp_size=dp,
                                   dp_rank=dp_rank, grad_accum=count)
    return micro_batches


def plan(case: dict, dp: int, dp_rank: int) -> dict:
    """Everything one dp rank feeds in, in order: train, eval (training shapes), eval (other shapes), train."""
    m = case["gas"]
    return {"eval_fresh": batches(5, seq=SEQ, micro=MICRO, count=m, dp=dp, dp_rank=dp_rank),
            "train1": batches(1, seq=SEQ, micro=MICRO, count=m, dp=dp, dp_rank=dp_rank),
            "eval_same": batches(2, seq=SEQ, micro=MICRO, count=m, dp=dp, dp_rank=dp_rank),
            "eval_other": batches(3, seq=EVAL_SEQ, micro=EVAL_MICRO, count=EVAL_M, dp=dp, dp_rank=dp_rank),
            "train2": batches(4, seq=SEQ, micro=MICRO, count=m, dp=dp, dp_rank=dp_rank)}


def no_dropout(model: nn.Module) -> None:
    from shardwise.models.gpt import CoreAttention
    for mod in model.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
        elif isinstance(mod, CoreAttention):
            mod.dropout = 0.0


def _case(name: str) -> dict:
    import shardwise
    case = CASES[name]
    world = dist.get_world_size()
    model = model_with_dropout()
    config = {"train_batch_size": MICRO * case["gas"] * world // case["pp"], "gradient_accumulation_steps": case["gas"],
              "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
              "zero_optimization": {"stage": case["zero"], "reduce_bucket_size": 3000}}
    if case["pp"] > 1:
        config["pipeline"] = {"stages": case["pp"], "schedule": case["schedule"], "virtual_stages": case["v"]}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = plan(case, world // case["pp"], engine.dp_rank)
    fresh = engine.eval_batch(iter(data["eval_fresh"]))
    no_dropout(engine.module)
    if case["pp"] > 1:
        train = [engine.train_batch(iter(data["train1"]))]
    else:   # the DeepSpeed loop without a pipeline: the model returns the loss
        train = [_loop_step(engine, data["train1"])]
    evals = [fresh, engine.eval_batch(iter(data["eval_same"])),
             engine.eval_batch(iter(data["eval_other"]), num_micro_batches=EVAL_M)]
    training_mode = engine.module.training
    train.append(engine.train_batch(iter(data["train2"])) if case["pp"] > 1 else _loop_step(engine, data["train2"]))
    state = consolidated_state(engine)
    engine.close()
    return {"train": train, "eval": evals, "training_mode": training_mode, "state": state}


def _loop_step(engine, micro: list[tuple]) -> float:
    total = 0.0
    for mb in micro:
        loss = engine(mb)
        engine.backward(loss)
        engine.step()
        total += float(loss.detach())
    return mean_over_ranks(total / len(micro))


def dataset() -> list[tuple]:
    """12 samples (inputs, labels) of SEQ tokens: 3 micro-batches of 2 per dp rank and epoch at dp = 2."""
    g = torch.Generator().manual_seed(21)
    rows = torch.randint(0, 256, (12, SEQ + 1), generator=g)
    return [(r[:-1], r[1:]) for r in rows]


def _training_data_case() -> dict:
    """DeepSpeed's pipeline loop: initialize(training_data=...) then engine.train_batch() with no iterator; 3 steps
    of 2 micro-batches run past the end of the 3 batches each dp rank has per epoch."""
    import shardwise
    model = model_with_dropout()
    no_dropout(model)
    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
              "pipeline": {"stages": 2, "schedule": "1f1b"}}
    engine, _, loader, _ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=dataset())
    losses = [engine.train_batch() for _ in range(3)]
    state = consolidated_state(engine)
    engine.close()
    return {"losses": losses, "state": state, "loader": loader is not None}


def consolidated_state(engine) -> dict | None:
    return engine.consolidated_state_dict()


def _all_cases() -> dict:
    torch.set_num_threads(1)
    out = {name: _case(name) for name in CASES}
    out["training_data"] = _training_data_case()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_all_cases, 4, timeout=300)


@lru_cache(maxsize=None)
def reference(name: str) -> tuple[list[float], list[float], dict]:
    case = CASES[name]
    dp = 4 // case["pp"]
    model = model_with_dropout()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    plans = [plan(case, dp, r) for r in range(dp)]

    def global_step(key: str) -> list:
        # micro-step k of the global batch: every dp rank's micro-batch k, concatenated (the dp mean)
        return [[(torch.cat([p[key][k][0] for p in plans]), torch.cat([p[key][k][1] for p in plans]))
                 for k in range(len(plans[0][key]))]]

    def run_train(key: str) -> float:
        model.train()
        return reference_train(model, opt, global_step(key), loss_fn=lambda mod, mb: mod(*mb))[0]

    @torch.no_grad()
    def run_eval(key: str) -> float:
        model.eval()
        losses = [float(model(*mb)) for p in plans for mb in p[key]]
        return sum(losses) / len(losses)

    fresh = run_eval("eval_fresh")
    no_dropout(model)
    train = [run_train("train1")]
    evals = [fresh, run_eval("eval_same"), run_eval("eval_other")]
    train.append(run_train("train2"))
    return train, evals, state_copy(model)


@pytest.mark.parametrize("name", list(CASES))
def test_eval_batch_matches_single_process(runs, name):
    ref_train, ref_eval, ref_state = reference(name)
    for rank, res in enumerate(runs):
        out = res[name]
        assert_close_lists(out["eval"], ref_eval, rtol=1e-5, atol=1e-6, what=f"{name} rank {rank} eval losses")
        assert_close_lists(out["train"], ref_train, rtol=1e-5, atol=1e-6, what=f"{name} rank {rank} train losses")
        assert out["training_mode"], f"{name}: eval_batch left the module in eval mode"
    state = runs[0][name]["state"]
    assert_state_close({k: state[k] for k in ref_state}, ref_state, what=f"{name} parameters after eval and train")


def test_train_batch_reads_the_training_data_loader(runs):
    """The reference reads the samples in DistributedSampler's order (dp = 2, not shuffled under a pipeline, as
    DeepSpeed's PipelineEngine reads them) in micro-batches of 2; micro-step k of a step concatenates both dp
    ranks' k-th micro-batch."""
    from torch.utils.data.distributed import DistributedSampler
    data, dp = dataset(), 2
    per_rank: list[list[tuple]] = [[] for _ in range(dp)]
    for epoch in range(2):
        for r in range(dp):
            sampler = DistributedSampler(data, num_replicas=dp, rank=r, shuffle=False)
            order = list(sampler)
            for k in range(0, len(order), MICRO):
                rows = [data[i] for i in order[k:k + MICRO]]
                per_rank[r].append((torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])))
    micro = [(torch.cat([per_rank[r][k][0] for r in range(dp)]), torch.cat([per_rank[r][k][1] for r in range(dp)]))
             for k in range(6)]
    model = model_with_dropout()
    no_dropout(model)
    ref = reference_train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                          [micro[0:2], micro[2:4], micro[4:6]], loss_fn=lambda mod, mb: mod(*mb))
    for rank, res in enumerate(runs):
        got = res["training_data"]
        assert got["loader"]
        assert_close_lists(got["losses"], ref, rtol=1e-5, atol=1e-6, what=f"rank {rank} train_batch() losses")
    ref_state = {k: t.detach() for k, t in model.state_dict().items()}
    state = runs[0]["training_data"]["state"]
    assert_state_close({k: state[k] for k in ref_state}, ref_state, what="parameters after 3 train_batch() steps")


def test_eval_loss_differs_from_train_mode_loss():
    """The reference itself: dropout is on in the fresh GPT, so the first eval loss depends on eval mode (else
    the first comparison above could not catch an eval_batch that forgot it)."""
    model = model_with_dropout()
    x, y = batches(2, seq=SEQ, micro=MICRO, count=1, dp=1, dp_rank=0)[0]
    with torch.no_grad():
        model.train()
        train_mode = float(model(x, y))
        model.eval()
        eval_mode = float(model(x, y))
    assert abs(train_mode - eval_mode) > 1e-4
