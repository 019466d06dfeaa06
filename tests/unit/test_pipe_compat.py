"""`shardwise.pipe`: DeepSpeed's PipelineModule / LayerSpec names, what they build and what they refuse."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.config import ConfigError
from shardwise.parallel.pipeline import PipelineError
from shardwise.parallel.pipeline.stage import split_model
from shardwise.pipe import LayerSpec, PipelineModule, TiedLayerSpec


def test_layers_specs_modules_and_callables_run_as_one_model() -> None:
    torch.manual_seed(0)
    net = PipelineModule([LayerSpec(nn.Linear, 3, 5), nn.ReLU(), lambda x: x * 2, LayerSpec(nn.Linear, 5, 2)],
                         loss_fn=nn.MSELoss(), num_stages=2)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    lin0, lin3 = net.layers[0], net.layers[3]
    expected = nn.functional.mse_loss(lin3(torch.relu(lin0(x)) * 2), y)
    torch.testing.assert_close(net(x, y), expected)
    assert isinstance(lin0, nn.Linear) and lin0.in_features == 3
    # the split follows the partition method on the built layers
    stage0 = split_model(net, num_stages=2, stage=0, partition=net.partition_method)
    stage1 = split_model(net, num_stages=2, stage=1, partition=net.partition_method)
    assert len(list(stage0.parameters())) + len(list(stage1.parameters())) == 4


def test_seed_layers_builds_each_spec_under_its_own_seed() -> None:
    a = PipelineModule([LayerSpec(nn.Linear, 3, 3), LayerSpec(nn.Linear, 3, 3)], loss_fn=nn.MSELoss(),
                       seed_layers=True, base_seed=7)
    torch.manual_seed(8)
    alone = nn.Linear(3, 3)           # layer 1 of `a` is built right after manual_seed(7 + 1)
    torch.testing.assert_close(a.layers[1].weight, alone.weight)


def test_no_loss_fn_means_the_output_is_the_loss() -> None:
    net = PipelineModule([lambda x: x.sum()], num_stages=1)
    assert float(net(torch.ones(3), labels=torch.zeros(3))) == 3.0


def test_pipeline_block_from_the_module_and_conflicts() -> None:
    net = PipelineModule([nn.Linear(2, 2)] * 2, loss_fn=nn.MSELoss(), num_stages=2, partition_method="Uniform")
    assert net.pipeline_block({"train_batch_size": 4})["pipeline"] == {"stages": 2, "partition": "uniform",
                                                                       "schedule": "1f1b"}
    kept = net.pipeline_block({"pipeline": {"stages": 2, "schedule": "gpipe"}})["pipeline"]
    assert kept == {"stages": 2, "schedule": "gpipe", "partition": "uniform"}
    with pytest.raises(ConfigError, match="num_stages = 2"):
        net.pipeline_block({"pipeline": {"stages": 4}})
    assert net.pipeline_block({"pipeline": {"stages": "auto"}})["pipeline"]["stages"] == 2   # DeepSpeed's default
    no_stages = PipelineModule([nn.Linear(2, 2)], loss_fn=nn.MSELoss())
    assert no_stages.pipeline_block({"a": 1}) == {"a": 1}


@pytest.mark.parametrize("kwargs, match", [
    ({"topology": object()}, "give num_stages="),
    ({"partition_method": "type:transformer"}, "'type:<regex>' is not"),
    ({"activation_checkpoint_interval": 1}, "activation recomputation"),
    ({"dynamic_shape": True}, "agreed once"),
    ({"num_stages": 0}, "positive number of stages"),
])
def test_refusals_name_the_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(PipelineError, match=match):
        PipelineModule([nn.Linear(2, 2)], loss_fn=nn.MSELoss(), **kwargs)


def test_bad_layers_and_specs() -> None:
    with pytest.raises(PipelineError, match="layer 1 is a int"):
        PipelineModule([nn.Linear(2, 2), 3], loss_fn=nn.MSELoss())
    with pytest.raises(PipelineError, match="not an nn.Module class"):
        LayerSpec(len)
    with pytest.raises(PipelineError, match="tied_weight_attr 'bias' is not a parameter of Embedding"):
        PipelineModule([TiedLayerSpec("embed", nn.Embedding, 10, 4, tied_weight_attr="bias")], loss_fn=nn.MSELoss())


def _tied_net() -> PipelineModule:
    torch.manual_seed(0)
    return PipelineModule([TiedLayerSpec("embed", nn.Embedding, 10, 4), LayerSpec(nn.Linear, 4, 4), nn.Tanh(),
                           TiedLayerSpec("embed", nn.Embedding, 10, 4, forward_fn=lambda emb, h: h @ emb.weight.T)],
                          loss_fn=lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))


def test_tied_layer_specs_share_one_module_under_deepspeeds_name() -> None:
    net = _tied_net()
    assert net.layers[0].tied_module is net.layers[3].tied_module is net.tied_modules["embed"]
    assert sorted(net.state_dict()) == ["layers.1.bias", "layers.1.weight", "tied_modules.embed.weight"]
    x = torch.randint(0, 10, (2, 3))
    emb = net.tied_modules["embed"].weight
    expected = torch.tanh(net.layers[1](emb[x])) @ emb.T           # [2, 3, 10] logits through the same weight
    torch.testing.assert_close(net(x), expected, rtol=0, atol=0)
    net(x, x).backward()                                             # both uses add into the one gradient
    assert emb.grad is not None and emb.grad.abs().sum() > 0


def test_split_stages_each_hold_a_copy_of_the_tied_module() -> None:
    from shardwise.parallel.pipeline.stage import layer_costs, split_model
    net = _tied_net()
    # DeepSpeed counts a tied module in every layer that uses it: 40 + 20 + 0 + 40
    assert layer_costs(net, "parameters") == [40.0, 20.0, 0.0, 40.0]
    first, last = (split_model(net, num_stages=2, stage=s, partition="uniform") for s in (0, 1))
    assert first.tie_stages == last.tie_stages == {"embed": (0, 1)}
    assert first.tied["embed"] is last.tied["embed"] is net.tied_modules["embed"]
    assert "tied_modules.embed.weight" in first.full_state_dict() and "tied_modules.embed.weight" in \
        last.full_state_dict()
    assert sum(p.numel() for p in last.parameters()) == 40          # the copy counts once per stage
    alone = split_model(net, num_stages=1, stage=0)
    assert alone.tie_stages == {"embed": (0,)}


def test_a_parameter_registered_on_two_stages_is_tied_under_its_first_name() -> None:
    from shardwise.parallel.pipeline.stage import split_model
    from shardwise.testing import tiny_gpt
    gpt = tiny_gpt(tie_embeddings=True)                  # lm_head.weight is embed.tok.weight
    first, last = (split_model(gpt, num_stages=2, stage=s) for s in (0, 1))
    assert first.tie_stages == last.tie_stages == {"embed.tok.weight": (0, 1)}
    assert first.tied_weights() == {"embed.tok.weight": [gpt.embed.tok.weight]}
    assert last.tied_weights()["embed.tok.weight"][0] is gpt.head.lm_head.weight
    assert split_model(gpt, num_stages=1, stage=0).tie_stages == {}
