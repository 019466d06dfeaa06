"""Activation recomputation is exact: with every policy, losses and parameters after several steps are bitwise
those of the same run without recomputation (fp32, CPU), with dropout on, under DP, ZeRO-3, TP with sequence
parallelism, a pipeline, and a Hugging Face Llama; and it stores less.

Each case trains twice in the same ranks from the same seed, once per policy; dropout 0.1 makes every step draw
masks (the embedding's, attention probabilities' on each TP rank's own stream, the residual ones), so a replay
that drew other numbers would change the losses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import micro_steps, run_distributed, tiny_gpt, token_batches

SEQ, MICRO, STEPS = 16, 2, 3
POLICIES = {
    "none": {"policy": "none"},
    "full": {"policy": "full"},
    "selective": {"policy": "selective"},
    "every_2": {"policy": "every_n", "every": 2},
    "first_1": {"policy": "every_n", "blocks": 1},
}
LAYOUTS = {
    "dp2": dict(world=2, zero=0),
    "dp2_zero3": dict(world=2, zero=3),
    "tp2_sp": dict(world=2, zero=1, tp=2),
    "pp2_1f1b": dict(world=2, zero=0, pp=2, gas=2),
    "pp2_gpipe": dict(world=2, zero=0, pp=2, gas=2, schedule="gpipe"),
    "pp2_interleaved": dict(world=2, zero=0, pp=2, gas=2, schedule="interleaved_1f1b", v=2),
}


def _config(layout: dict, policy: dict) -> dict:
    dp = layout["world"] // (layout.get("tp", 1) * layout.get("pp", 1))
    cfg = {"train_batch_size": MICRO * dp * layout.get("gas", 1), "train_micro_batch_size_per_gpu": MICRO,
           "gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "zero_optimization": {"stage": layout["zero"], "reduce_bucket_size": 4000,
                                 "stage3_param_persistence_threshold": 0},
           "activation_checkpointing": policy}
    if layout.get("tp", 1) > 1:
        cfg["tensor_parallel"] = {"size": layout["tp"], "sequence_parallel": True}
    if layout.get("pp", 1) > 1:
        cfg["pipeline"] = {"stages": layout["pp"], "schedule": layout.get("schedule", "1f1b"),
                           "virtual_stages": layout.get("v", 1)}
    return cfg


def _train(layout: dict, policy: dict) -> dict:
    import shardwise
    model = tiny_gpt(n_layer=4, seq_len=SEQ, dropout=0.1)
    torch.manual_seed(7 + dist.get_rank())               # the dropout streams start per rank, as in a real run
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(layout, policy))
    gas = engine.gradient_accumulation_steps()
    batches = token_batches(STEPS, MICRO * engine.dp_size * gas, SEQ + 1, seed=5)
    losses = [float(engine.train_batch(iter(m)))
              for m in micro_steps(batches, dp_size=engine.dp_size, dp_rank=engine.dp_rank, grad_accum=gas)]
    activations = engine.memory_report()["activations"]
    state = engine.consolidated_state_dict()
    engine.close()
    return {"losses": losses, "state": state, "activations": activations}


def _all_policies(layout: dict) -> dict:
    return {name: _train(layout, policy) for name, policy in POLICIES.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_policy_is_bitwise_the_run_without_recomputation(layout: str):
    spec = LAYOUTS[layout]
    results = run_distributed(_all_policies, spec["world"], args=(spec,))
    for rank, runs in enumerate(results):
        base = runs["none"]
        for name, run in runs.items():
            assert run["losses"] == base["losses"], (layout, name, rank, run["losses"], base["losses"])
            if rank == 0:
                assert run["state"].keys() == base["state"].keys()
                for k in base["state"]:
                    assert torch.equal(run["state"][k], base["state"][k]), (layout, name, k)
    if "pp" in layout:
        return       # the pipeline meters its peak over micro-batches in flight: compared in its own test below
    act = {name: results[0][name]["activations"] for name in POLICIES}
    # full keeps one [b, s, h] input per block; every other policy keeps more, and none the most
    assert act["full"] < act["every_2"] < act["none"], act
    assert act["full"] < act["first_1"] < act["none"], act
    assert act["selective"] < act["none"], act


def _hf_llama(policy: dict, attention: str = "sdpa", *, zero: int = 3, use_cache: bool = True) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attention_dropout=0.1, use_cache=use_cache)
    config._attn_implementation = attention
    return _train_llama(LlamaForCausalLM(config), zero=zero, policy=policy)


def _train_llama(model: torch.nn.Module, *, zero: int, policy: dict) -> dict:
    """STEPS steps of the engine's plain loop at 2 ranks (each its half of a global batch); the losses, the
    gathered weights and the activations the last forward saved."""
    import shardwise
    torch.manual_seed(3 + dist.get_rank())
    cfg = {"train_batch_size": 2 * MICRO, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": zero, "reduce_bucket_size": 4000, "stage3_param_persistence_threshold": 0},
           "activation_checkpointing": policy}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for b in token_batches(STEPS, 2 * MICRO, SEQ, seed=3, vocab=128):
        mine = b[MICRO * engine.dp_rank:MICRO * (engine.dp_rank + 1)]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out = {"losses": losses, "activations": engine.memory_report()["activations"],
           "state": engine.dp_runtime.gathered_state_dict(engine.module, rank0_only=False)}
    engine.close()
    return out


def _hf_all() -> dict:
    out = {name: _hf_llama(block) for name, block in
           {"none": {"policy": "none"}, "full": {"policy": "full"}, "every_2": {"policy": "every_n", "every": 2},
            "selective": {"policy": "selective"}}.items()}
    # eager attention stores the [b, a, s, s] probabilities: what selective recomputation exists to drop
    out["eager_none"] = _hf_llama({"policy": "none"}, "eager")
    out["eager_selective"] = _hf_llama({"policy": "selective"}, "eager")
    # Llama's use_cache default (True) makes each layer append its keys and values to a cache as it runs: full
    # recomputation must not run a layer against what its own forward appended (eager attention fails on it)
    out["eager_full"] = _hf_llama({"policy": "full"}, "eager")
    out["eager_none_zero0"] = _hf_llama({"policy": "none"}, "eager", zero=0)
    out["eager_full_zero0"] = _hf_llama({"policy": "full"}, "eager", zero=0)
    out["eager_full_zero0_no_cache"] = _hf_llama({"policy": "full"}, "eager", zero=0, use_cache=False)
    return out


def test_hugging_face_llama_under_zero3_recomputes_exactly():
    for runs in run_distributed(_hf_all, 2):
        for name, base in (("full", "none"), ("every_2", "none"), ("selective", "none"),
                           ("eager_selective", "eager_none"), ("eager_full", "eager_none"),
                           ("eager_full_zero0", "eager_none_zero0"), ("eager_full_zero0_no_cache", "eager_none_zero0")):
            assert runs[name]["losses"] == runs[base]["losses"], name
            for k, v in runs[base]["state"].items():
                assert torch.equal(runs[name]["state"][k], v), (name, k)
        assert runs["full"]["activations"] < runs["every_2"]["activations"] < runs["none"]["activations"]
        # 3 layers x [b=2, a=4, s=16, s=16] fp32 probabilities (+ their dropout masks) no longer stored
        probs = 3 * 2 * 4 * SEQ * SEQ * 4
        assert runs["eager_none"]["activations"] - runs["eager_selective"]["activations"] >= probs


def test_selective_on_a_model_without_attention_cores_names_the_fix():
    from shardwise.config import ActivationCheckpointingConfig, RecomputePolicy
    from shardwise.errors import UserError
    from shardwise.parallel.recompute import plan_recompute
    blocks = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    with pytest.raises(UserError, match='use "full" or "every_n"'):
        plan_recompute(blocks, ActivationCheckpointingConfig(policy=RecomputePolicy.SELECTIVE))
    every = plan_recompute(list(range(5)), ActivationCheckpointingConfig(policy=RecomputePolicy.EVERY_N, every=2))
    first = plan_recompute(list(range(5)), ActivationCheckpointingConfig(policy=RecomputePolicy.EVERY_N, blocks=2))
    assert every == [1, 3] and first == [0, 1]


def _hf_gradient_checkpointing(zero: int) -> dict:
    """Hugging Face's own switch, `model.gradient_checkpointing_enable()`, under the engine."""
    from transformers import LlamaConfig, LlamaForCausalLM
    out = {}
    for enabled in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=SEQ, attention_dropout=0.1))
        if enabled:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        out[enabled] = _train_llama(model, zero=zero, policy={"policy": "none"})
    return out


@pytest.mark.parametrize("zero", [0, 3])
def test_hugging_face_gradient_checkpointing_enable_works_under_the_engine(zero: int):
    for runs in run_distributed(_hf_gradient_checkpointing, 2, args=(zero,)):
        assert runs[True]["losses"] == runs[False]["losses"]
        for k, v in runs[False]["state"].items():
            assert torch.equal(runs[True]["state"][k], v), k
        assert runs[True]["activations"] < runs[False]["activations"]
