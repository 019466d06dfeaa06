"""Mixture of experts under expert parallelism.

- Exactness: a tiny MoE GPT (GELU experts) and a Llama-style one (SwiGLU experts and a shared expert), no token
  dropping, at ep 2 and ep 4 on 4 ranks, under ZeRO 0, 1, 2 and 3, equal the single-process model for 5 steps (fp32,
  rtol 1e-5): losses, and each rank's dense parameters and experts against the reference's same experts. The
  reference runs the 4 ranks' shards as 4 micro-batches of one step, so its loss is the mean of the shards'
  losses, load-balancing loss included (that loss is not linear in the tokens: a mean over one big batch differs).
- Telemetry: each step's MoE figures summed over the ranks (tokens per expert, dropped tokens, auxiliary losses).
- The config's expert parallelism: two cases split the experts through `initialize` ("expert_parallel": {"size": 2}
  and DeepSpeed AutoEP's {"enabled": true, "autoep_size": 2}), the others by `shard_experts` before it.
- Checkpoints: three cases save after step 3 (experts in DeepSpeed's per-expert files); an engine at ep 1 loads the
  tag and its steps 4-5 equal the continued run's, then saves again right after loading, and an engine at the
  case's ep loads that one: its steps 4-5 equal them too (ep E -> 1 -> E).
- DeepSpeed parity: the same model built with `import shardwise as deepspeed` and with DeepSpeed 0.19's `MoE`
  layer, at ep 2 on the same 4 ranks (two expert-dp groups of 2), token dropping on (capacity factor 1.0, random
  token selection) and off.

Every case runs in one launch of 4 ranks.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import (
    assert_close_lists, assert_state_close, micro_steps, reference_train, run_distributed, shard_global_batch,
    state_copy, token_batches,
)

STEPS = 5
SEQ = 8
WORLD = 4

_SGD = {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}}
# name -> (preset overrides, ep size, zero_optimization block (with gradient_accumulation_steps), optimizer, clip)
EP_CASES: dict[str, tuple[dict, int, dict, dict, float]] = {
    "gpt_ep2_zero0_sgd_clip": ({}, 2, {"stage": 0}, _SGD, 0.05),
    # two micro-batches per step: gradients accumulate locally (ZeRO-1) between the exchanges of each
    "gpt_ep4_zero1_sgd_accum2": ({}, 4, {"stage": 1, "gradient_accumulation_steps": 2}, _SGD, 0.0),
    "llama_ep2_zero2_adam_clip": ({"llama": True}, 2, {"stage": 2},
                                  {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}, 0.05),
    "llama_ep4_zero2_sgd": ({"llama": True}, 4, {"stage": 2}, _SGD, 0.0),
    # every parameter sharded (no persistence threshold): experts in flats of their own over expert-dp
    "gpt_ep2_zero3_sgd_clip": ({}, 2, {"stage": 3, "stage3_param_persistence_threshold": 0}, _SGD, 0.05),
    # the default threshold keeps these small experts whole: persistent buckets gathered over expert-dp
    "gpt_ep2_zero3_persistent": ({}, 2, {"stage": 3}, _SGD, 0.0),
}
# Cases whose experts `initialize` splits (the config's block), the others split by `shard_experts` before it.
BY_CONFIG = {"gpt_ep2_zero0_sgd_clip": {"size": 2}, "llama_ep2_zero2_adam_clip": {"enabled": True, "autoep_size": 2},
             "gpt_ep2_zero3_sgd_clip": {"size": 2}}
# Cases that save after step CHECKPOINT_AT and reload at ep 1 and back at their own ep.
CHECKPOINT_CASES = ("gpt_ep2_zero0_sgd_clip", "llama_ep2_zero2_adam_clip", "gpt_ep2_zero3_sgd_clip")
CHECKPOINT_AT = 3


def _tiny_moe_config(llama: bool = False):
    from shardwise.models import gpt_config
    name = "llama-moe-tiny" if llama else "gpt-moe-tiny"
    return gpt_config(name, n_layer=2, d_model=32, n_head=4, n_kv_head=2 if llama else None, seq_len=SEQ,
                      moe_d_ff=32, moe_z_loss_coef=1e-3, moe_aux_loss_coef=0.05)


def _expert_names(state: dict, first: int, local: int) -> dict:
    """The reference's entries of experts first .. first + local - 1, under this rank's local names."""
    out = {}
    for k, v in state.items():
        m = re.match(r"(.*\.experts\.)(\d+)(\..*)", k)
        if m is None:
            out[k] = v
        elif first <= int(m.group(2)) < first + local:
            out[f"{m.group(1)}{int(m.group(2)) - first}{m.group(3)}"] = v
    return out


def _train(engine, batches: list, ga: int) -> list[float]:
    """The mean loss over every rank of each global batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for batch in batches:
        total = torch.zeros(())
        for micro in shard_global_batch(batch, dp_size=world, dp_rank=rank, grad_accum=ga):
            loss = engine(micro[:, :-1], micro[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(float(total) / (world * ga))
    return losses


def _moe_engine(overrides: dict, config: dict, ep_block: dict | None):
    """A fresh model from seed 0, its experts split by the config's `ep_block` (None: left whole)."""
    import shardwise
    from shardwise.models import GPT
    torch.manual_seed(0)
    model = GPT(_tiny_moe_config(**overrides))
    config = {**config, "expert_parallel": ep_block} if ep_block is not None else config
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _checkpoint_round_trip(overrides: dict, config: dict, ep_block: dict, folder: str, batches: list) -> dict:
    """Load the tag saved at step CHECKPOINT_AT at ep 1 and run the next steps; save again right after loading
    and load that at the case's ep (`ep_block`): both runs' losses, and the files and index of the first tag."""
    from shardwise.checkpoint.index import read_index
    at_one = _moe_engine(overrides, config, {"size": 1})
    at_one.load_checkpoint(folder, tag="ep")
    at_one.save_checkpoint(folder, tag="ep1")
    losses_at_one = _train(at_one, batches[CHECKPOINT_AT:], 1)
    at_one.close()
    back = _moe_engine(overrides, config, ep_block)
    back.load_checkpoint(folder, tag="ep1")
    losses_back = _train(back, batches[CHECKPOINT_AT:], 1)
    back.close()
    index = read_index(Path(folder) / "ep")
    assert index is not None
    experts = {name: sorted(by_rank.values()) for name, by_rank in index.module.items() if ".experts." in name}
    return {"at_one": losses_at_one, "back": losses_back, "files": sorted(os.listdir(Path(folder) / "ep")),
            "index_experts": experts}


def _ep_case(name: str, overrides: dict, ep: int, zero: dict, optimizer: dict, clip: float) -> dict:
    import shardwise
    from shardwise.models import GPT
    from shardwise.parallel.experts import build_expert_groups, moe_layers, moe_step_metrics, shard_experts
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT(_tiny_moe_config(**overrides))
    reference = copy.deepcopy(model)
    ep_block = BY_CONFIG.get(name)
    if ep_block is None:
        shard_experts(model, build_expert_groups(ep))
    zero = dict(zero)
    ga = zero.pop("gradient_accumulation_steps", 1)
    config = {"train_batch_size": 4 * world * ga, "train_micro_batch_size_per_gpu": 4, "optimizer": optimizer,
              "gradient_clipping": clip, "zero_optimization": {**zero, "reduce_bucket_size": 2000},
              "steps_per_print": 10_000}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config={**config, "expert_parallel": ep_block} if ep_block else config)
    first = next(moe_layers(model)).first_expert
    local = len(next(moe_layers(model)).experts)
    batches = token_batches(STEPS, 4 * world * ga, SEQ + 1, seed=3)
    folder = [tempfile.mkdtemp(prefix="moe-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(folder)
    losses, norms, moe_rows = [], [], []
    for step, batch in enumerate(batches):
        if name in CHECKPOINT_CASES and step == CHECKPOINT_AT:
            engine.save_checkpoint(folder[0], tag="ep")
        losses += _train(engine, [batch], ga)
        norms.append(engine.get_global_grad_norm())
        moe_rows.append(moe_step_metrics(model, engine.metrics_comm))
    # The layers' all-to-alls are in the engine's ledger (and passed the per-step desync check with row counts
    # that differ between ranks): per MoE layer and micro-batch the counts, the tokens out, the results back, and
    # the two reverse exchanges of backward.
    a2a = [r for r in engine.comm_report() if r["op"] == "all_to_all"]
    a2a_count = sum(r["count"] for r in a2a)
    a2a_groups = sorted({(r["group"], r["group_size"]) for r in a2a})
    # DeepSpeed's tensor-fragment API on an expert: this rank's expert, assembled over its expert-dp group
    expert_name, expert_param = next((n, p) for n, p in model.named_parameters() if ".experts." in n)
    full_expert = shardwise.utils.safe_get_full_fp32_param(expert_param)
    state = {k: v.detach().clone() for k, v in engine.dp_runtime.gathered_state_dict(model, rank0_only=False).items()}
    engine.close()
    checkpoint = None
    if name in CHECKPOINT_CASES:
        checkpoint = _checkpoint_round_trip(overrides, config, ep_block or {"size": ep}, folder[0], batches)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0])

    # The reference: the same global batches, the 4 shards as 4 micro-batches (the mean of their losses).
    opt_cls = torch.optim.SGD if optimizer["type"] == "SGD" else torch.optim.AdamW
    params = {k: v for k, v in optimizer["params"].items() if k != "torch_adam"}
    ref_opt = opt_cls(reference.parameters(), **params)
    ref_losses = reference_train(reference, ref_opt, micro_steps(batches, grad_accum=world * ga),
                                 loss_fn=lambda m, mb: m(*mb), clip=clip)
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "checkpoint": checkpoint, "state": state,
            "full_expert": (expert_name, full_expert), "a2a": (a2a_count, a2a_groups),
            "moe_layers": len(list(moe_layers(model))), "moe_rows": moe_rows,
            "ref_state": _expert_names(state_copy(reference), first, local)}


def _dense_model_refused() -> str:
    """The config's expert parallelism on a model without MoE layers: one line on every rank."""
    import shardwise
    from shardwise.models import GPT, gpt_config
    model = GPT(gpt_config("tiny", n_layer=1, d_model=16, n_head=2, seq_len=SEQ))
    try:
        shardwise.initialize(model=model, model_parameters=model.parameters(),
                             config={"train_batch_size": 4 * dist.get_world_size(), "expert_parallel": {"size": 2},
                                     "optimizer": _SGD})
    except shardwise.UserError as e:
        return str(e)
    return ""


def _all_cases(ep_cases: dict, ds_cases: dict) -> dict:
    torch.set_num_threads(1)
    out = {name: _ep_case(name, *case) for name, case in ep_cases.items()}
    return {"ep": out, "dense_refused": _dense_model_refused(),
            "deepspeed": _ds_cases(ds_cases) if ds_cases else {}}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """Every case in one launch (the DeepSpeed ones when DeepSpeed is installed)."""
    try:
        import deepspeed  # noqa: F401
        ds_cases = DS_CASES
    except ImportError:
        ds_cases = {}
    return run_distributed(_all_cases, WORLD, args=(EP_CASES, ds_cases), timeout=500)


@pytest.fixture(scope="module")
def ep_results(results: list[dict]) -> list[dict]:
    return [r["ep"] for r in results]


@pytest.mark.parametrize("name", list(EP_CASES))
def test_expert_parallel_equals_single_process(ep_results: list[dict], name: str) -> None:
    adam = EP_CASES[name][3]["type"] != "SGD"
    for rank, res in enumerate(ep_results):
        case = res[name]
        assert_close_lists(case["losses"], case["ref_losses"], rtol=1e-5, what=f"{name} rank {rank} losses")
        assert_state_close(case["state"], case["ref_state"], what=f"{name} rank {rank}", adam=adam)
    for rank, res in enumerate(ep_results):
        key, value = res[name]["full_expert"]
        torch.testing.assert_close(value, res[name]["ref_state"][key], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name} rank {rank} safe_get_full_fp32_param({key}): {m}")
    for res in ep_results:
        count, groups = res[name]["a2a"]
        ep = EP_CASES[name][1]
        ga = EP_CASES[name][2].get("gradient_accumulation_steps", 1)
        assert count == 5 * res[name]["moe_layers"] * ga and groups == [(f"ep:ep_size_{ep}", ep)], (count, groups)
    # The step's MoE telemetry, summed over the ranks: no token dropped (no capacity), every (token, choice) pair
    # of the step's global batch ran on one expert of each layer, and the auxiliary losses are the layers' means.
    k, ga = 2, EP_CASES[name][2].get("gradient_accumulation_steps", 1)
    for res in ep_results:
        for row in res[name]["moe_rows"]:
            assert row["moe_dropped_tokens"] == 0
            assert [sum(per_layer) for per_layer in row["moe_tokens_per_expert"]] == \
                [4 * WORLD * ga * SEQ * k] * res[name]["moe_layers"]
            # E * sum_e (mean score of e) * (share of e): within (0, E]
            assert 0 < row["moe_aux_loss"] <= 4 and row["moe_z_loss"] > 0
    assert all(res[name]["moe_rows"] == ep_results[0][name]["moe_rows"] for res in ep_results)
    clip = EP_CASES[name][4]
    if clip:    # the clip scaled every step, so the parity above needed the whole model's norm over the experts
        assert min(ep_results[0][name]["norms"]) > clip


def test_expert_parallel_config_on_a_dense_model_is_one_line(results: list[dict]) -> None:
    for res in results:
        assert res["dense_refused"].startswith('"expert_parallel.size" = 2 but the model has no MoE layer'), \
            res["dense_refused"]


@pytest.mark.parametrize("name", CHECKPOINT_CASES)
def test_checkpoint_with_experts_loads_at_another_ep_size(ep_results: list[dict], name: str) -> None:
    ep, zero = EP_CASES[name][1], EP_CASES[name][2]["stage"]
    for rank, res in enumerate(ep_results):
        continued, checkpoint = res[name]["losses"][CHECKPOINT_AT:], res[name]["checkpoint"]
        assert_close_lists(checkpoint["at_one"], continued, rtol=1e-5, what=f"{name} rank {rank}: ep {ep} -> 1")
        assert_close_lists(checkpoint["back"], continued, rtol=1e-5, what=f"{name} rank {rank}: ep 1 -> {ep}")
    checkpoint = ep_results[0][name]["checkpoint"]
    files = checkpoint["files"]
    # DeepSpeed's per-expert files (ZeRO-3 keeps the values in the optimizer shards, as DeepSpeed's model states
    # hold placeholders there) and, without ZeRO, one optimizer file per ep rank.
    layers, experts = 2, 4
    expected = {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in range(layers)
                for e in range(experts)} if zero != 3 else set()
    assert {f for f in files if f.startswith("layer_")} == expected, files
    assert {f for f in files if f.startswith("expp_")} == ({f"expp_rank_{r}_mp_rank_00_optim_states.pt"
                                                            for r in range(ep)} if zero == 0 else set()), files
    # The index says which file holds each expert: expert e of layer l in its own file, under its global name.
    index = checkpoint["index_experts"]
    if zero != 3:
        assert len({re.sub(r"\.experts\.(\d+)\..*", r".\1", n) for n in index}) == layers * experts, index
        for n, where in index.items():
            m = re.match(r"blocks\.(\d+)\.mlp\.experts\.(\d+)\.", n)
            assert m is not None and where == [f"layer_{m.group(1)}_expert_{m.group(2)}_mp_rank_00_model_states.pt"], \
                (n, where)


# -- DeepSpeed's MoE layer ------------------------------------------------------------------------------------

DS_HIDDEN = 16
DS_CASES: dict[str, dict] = {
    "no_drop_adam": {"drop_tokens": False, "optimizer": {"type": "Adam", "params": {"lr": 3e-3,
                                                                                   "torch_adam": True}}},
    "drop_cf1_rts_sgd": {"drop_tokens": True, "capacity_factor": 1.0,
                         "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}},
}


class _MoENet(torch.nn.Module):
    """Embedding -> x + MoE(x) (4 GELU experts, top-1, ep 2) -> Linear head; loss = CE + 0.01 * l_aux, as
    Megatron-DeepSpeed adds it."""

    def __init__(self, moe_cls, **moe_args) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, DS_HIDDEN)
        expert = torch.nn.Sequential(torch.nn.Linear(DS_HIDDEN, 2 * DS_HIDDEN), torch.nn.GELU(),
                                     torch.nn.Linear(2 * DS_HIDDEN, DS_HIDDEN))
        self.moe = moe_cls(hidden_size=DS_HIDDEN, expert=expert, num_experts=4, ep_size=2, k=1, **moe_args)
        self.head = torch.nn.Linear(DS_HIDDEN, 256)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        y, l_aux, _ = self.moe(x)
        logits = self.head(x + y)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1)) + 0.01 * l_aux


def _ds_run(deepspeed, case: dict) -> dict:
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: F401 (theirs)
    world, rank = dist.get_world_size(), dist.get_rank()
    moe_args = {k: v for k, v in case.items() if k != "optimizer"}
    torch.manual_seed(0)
    model = _MoENet(deepspeed.moe.layer.MoE, **moe_args)
    groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense"})
    config = {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4, "optimizer": case["optimizer"],
              "gradient_clipping": 0.0, "steps_per_print": 10_000}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    torch.manual_seed(1)         # random token selection draws from here on, alike in both runs
    losses, dropped = [], 0
    for batch in token_batches(STEPS, 4 * world, SEQ + 1, seed=5):
        (micro,) = shard_global_batch(batch, dp_size=world, dp_rank=rank, grad_accum=1)
        loss = engine(micro[:, :-1], micro[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        routing = getattr(model.moe.deepspeed_moe, "routing", None)      # shardwise's layer keeps it
        if routing is not None:
            dropped += int((~routing.kept).sum())
    return {"losses": losses, "state": state_copy(model), "dropped": dropped}


def _ds_cases(cases: dict) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel(logging.WARNING)
    import shardwise
    out = {}
    for name, case in cases.items():
        out[name] = {"shardwise": _ds_run(shardwise, case), "deepspeed": _ds_run(deepspeed, case)}
    # Both libraries made their ep_size_2 groups above: their expert group helpers answer alike.
    out["groups"] = {side: _group_answers(lib.utils.groups) for side, lib in
                     (("shardwise", shardwise), ("deepspeed", deepspeed))}
    return out


_GROUP_HELPERS = ("_get_expert_parallel_rank", "_get_expert_parallel_world_size", "_get_expert_parallel_src_rank",
                  "_get_expert_data_parallel_rank", "_get_expert_data_parallel_world_size",
                  "_get_expert_broadcast_src_rank", "_get_expert_parallel_group_ranks",
                  "_get_expert_data_parallel_group_ranks")


def _group_answers(groups) -> dict:
    answers = {name: getattr(groups, name)("ep_size_2") for name in _GROUP_HELPERS}
    answers = {k: list(v) if isinstance(v, range) else v for k, v in answers.items()}
    answers.update(max_size=groups._get_max_expert_size(), max_name=groups._get_max_expert_size_name(),
                   names=sorted(groups._get_expert_parallel_group_dict()),
                   dp=(groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()),
                   expert_mp=groups._get_expert_model_parallel_world_size())
    return answers


@pytest.fixture(scope="module")
def ds_results(results: list[dict]) -> list[dict]:
    pytest.importorskip("deepspeed")
    return [r["deepspeed"] for r in results]


@pytest.mark.parametrize("name", list(DS_CASES))
def test_deepspeed_moe_layer_parity(ds_results: list[dict], name: str) -> None:
    for rank, res in enumerate(ds_results):
        ours, theirs = res[name]["shardwise"], res[name]["deepspeed"]
        assert_close_lists(ours["losses"], theirs["losses"], rtol=1e-5, what=f"{name} rank {rank} losses")
        assert_state_close(ours["state"], theirs["state"], what=f"{name} rank {rank}", rtol=1e-5, atol=1e-5)
    dropped = sum(res[name]["shardwise"]["dropped"] for res in ds_results)
    assert (dropped > 0) == DS_CASES[name]["drop_tokens"], f"{name}: {dropped} tokens dropped"


def test_expert_group_helpers_answer_as_deepspeeds(ds_results: list[dict]) -> None:
    for rank, res in enumerate(ds_results):
        ours, theirs = res["groups"]["shardwise"], res["groups"]["deepspeed"]
        assert ours == theirs, f"rank {rank}: {ours} vs {theirs}"
    assert ds_results[1]["groups"]["shardwise"]["_get_expert_parallel_group_ranks"] == [0, 1]
    assert ds_results[1]["groups"]["shardwise"]["_get_expert_data_parallel_group_ranks"] == [1, 3]
