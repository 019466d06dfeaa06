"""Models that return Hugging Face outputs (an object with `.loss`, not a tensor) train and evaluate through every
path of the engine: `engine.backward(output)`, `train_batch` and `eval_batch` on a transformers Llama at dp 2,
and a 2-stage pipeline whose loss function returns a ModelOutput. Each must give exactly what the same run with
plain tensor losses gives (one launch of 2 ranks; fp32, bitwise)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.parallel.outputs import loss_of
from shardwise.testing import run_distributed, token_batches

SEQ = 8


def test_loss_of_reads_tensors_outputs_and_dicts() -> None:
    t = torch.tensor(2.0)
    assert loss_of(t) is t
    assert loss_of({"loss": t, "logits": None}) is t

    class Output:
        loss = t
    assert loss_of(Output()) is t
    assert loss_of((t, t)) == (t, t)          # unknown shapes come back unchanged, for the caller to refuse


class _Out:
    """A ModelOutput stand-in: the loss as an attribute, nothing else."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


def _pipeline_model(wrap: bool) -> nn.Module:
    from shardwise.parallel.pipeline.stage import PipelineModel
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 3)]
    mse = nn.functional.mse_loss
    return PipelineModel(layers, (lambda out, y: _Out(mse(out, y))) if wrap else mse)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ))


def _run() -> dict:
    import shardwise
    torch.set_num_threads(1)
    out: dict = {}
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    for wrap in (False, True):
        engine, *_ = shardwise.initialize(model=(m := _pipeline_model(wrap)), model_parameters=m.parameters(),
                                          config={"train_batch_size": 4, "gradient_accumulation_steps": 2,
                                                  "optimizer": sgd, "pipeline": {"stages": 2}})
        g = torch.Generator().manual_seed(3)
        data = [(torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)) for _ in range(6)]
        out[f"pipe_{wrap}"] = [float(engine.train_batch(iter(data[:2]))), float(engine.eval_batch(iter(data[2:4]))),
                               float(engine.train_batch(iter(data[4:])))]
        engine.close()
    rank = torch.distributed.get_rank()
    ids = token_batches(3, 4, SEQ, seed=1, vocab=64)
    for how in ("tensor", "output"):
        engine, *_ = shardwise.initialize(model=(m := _llama()), model_parameters=m.parameters(),
                                          config={"train_batch_size": 4, "optimizer": sgd})
        mine = [b[rank * 2:(rank + 1) * 2] for b in ids]
        if how == "tensor":       # the loss taken out by hand, as scripts did
            loss = engine(input_ids=mine[0], labels=mine[0]).loss
        else:                     # the output handed over whole
            loss = engine.backward(engine(input_ids=mine[0], labels=mine[0]))
        if how == "tensor":
            engine.backward(loss)
        engine.step()
        batches = iter([{"input_ids": mine[1], "labels": mine[1]}])
        out[f"llama_{how}"] = [float(loss), float(engine.train_batch(batches)),
                               float(engine.eval_batch(iter([{"input_ids": mine[2], "labels": mine[2]}]), 1))]
        engine.close()
    return out


def test_hf_outputs_train_and_evaluate_everywhere(one_thread) -> None:
    pytest.importorskip("transformers")
    for result in run_distributed(_run, 2, timeout=240):
        assert result["pipe_True"] == result["pipe_False"]
        assert result["llama_output"] == result["llama_tensor"]
        assert all(v > 0 for v in result["llama_output"])
