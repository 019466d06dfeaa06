"""A batch handed to the engine as one argument reaches a Hugging Face model as DeepSpeed users mean it.

A Hugging Face causal LM's forward is `(input_ids, attention_mask, ...)` (Llama) or `(input_ids,
past_key_values, ...)` (GPT-2), with `labels` far down. `engine((ids, labels))`, a list pair, a dict and
`train_batch` over `(ids, labels)` pairs must all give the loss of `model(input_ids=ids, labels=labels)`, exactly
(fp32, one process: the same operations); a longer tuple, whose middle items have no safe place, is refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardwise.testing import run_distributed, token_batches

pytest.importorskip("transformers")

SEQ, VOCAB = 8, 64


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ))


def _one_model(build) -> dict:
    import shardwise
    model = build()
    reference = copy.deepcopy(model)
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "steps_per_print": 10 ** 6}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = token_batches(1, 2, SEQ, seed=4, vocab=VOCAB)[0]
    labels = torch.roll(ids, 1, dims=1)             # not the inputs: a model that ignored them would differ
    mask = torch.ones_like(ids)
    want = float(reference(input_ids=ids, labels=labels).loss)

    def loss_of(batch) -> float:
        out = engine(batch)
        loss = getattr(out, "loss", out)
        engine.backward(loss)
        engine.step()
        return float(loss)

    got = {"tuple": loss_of((ids, labels)), "list": loss_of([ids, labels]),
           "dict": loss_of({"input_ids": ids, "labels": labels}),
           "train_batch": float(engine.train_batch(iter([(ids, labels)])))}
    try:
        engine((ids, mask, labels))
        refusal = ""
    except shardwise.UserError as e:
        refusal = str(e)
    engine.destroy()
    return {"want": want, "got": got, "refusal": refusal}


def _ranks() -> dict:
    return {"gpt2": _one_model(gpt2), "llama": _one_model(llama)}


def test_a_pair_batch_maps_to_input_ids_and_labels() -> None:
    res = run_distributed(_ranks, 1, timeout=120)[0]
    for name, case in res.items():
        assert case["got"] == dict.fromkeys(case["got"], case["want"]), name     # lr 0: every call the same loss
        assert "3-item tuple" in case["refusal"] and "labels" in case["refusal"], case["refusal"]
