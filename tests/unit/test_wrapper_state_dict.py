"""get_state_dict / set_state_dict on a model that is not sharded (one process, no process group): the same
names and layout as torch's `torch.distributed.checkpoint.state_dict`, several optimizers, and a resume that
continues bitwise. The sharded cases run in tests/distributed/test_wrappers.py."""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

import shardwise
from shardwise.errors import UserError
from shardwise.testing import lm_pair, token_batches, tiny_gpt


def _two_optimizers(model):
    """AdamW on the blocks, SGD with momentum (two param groups) on the rest: state of both kinds."""
    blocks = {id(p) for p in model.blocks.parameters()}
    rest = [p for p in model.parameters() if id(p) not in blocks]
    return [torch.optim.AdamW(model.blocks.parameters(), lr=3e-3),
            torch.optim.SGD([{"params": rest[:1]}, {"params": rest[1:], "lr": 0.02}], lr=0.05, momentum=0.9)]


def _step(model, optims, batch) -> float:
    for o in optims:
        o.zero_grad()
    loss = model(*lm_pair(batch))
    loss.backward()
    for o in optims:
        o.step()
    return float(loss.detach())


def _copy(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copy(v) for v in tree)
    return tree


def test_unsharded_state_dicts_match_torch_and_resume_bitwise():
    batches = token_batches(3, 4, 17, seed=2)
    model = tiny_gpt()
    optims = _two_optimizers(model)
    for b in batches[:2]:
        _step(model, optims, b)
    model_sd, optim_sd = _copy(shardwise.get_state_dict(model, optims, full_state_dict=True))
    theirs_model, theirs_optim = torch_get_state_dict(model, optims, options=StateDictOptions(full_state_dict=True))
    assert model_sd.keys() == theirs_model.keys()
    assert optim_sd["param_groups"] == theirs_optim["param_groups"]
    assert optim_sd["state"].keys() == theirs_optim["state"].keys()
    for fqn, state in theirs_optim["state"].items():
        assert state.keys() == optim_sd["state"][fqn].keys()
        for key, value in state.items():
            assert torch.equal(optim_sd["state"][fqn][key], value), (fqn, key)

    fresh = tiny_gpt(seed=9)
    fresh_optims = _two_optimizers(fresh)
    for o in fresh_optims:                  # the loaded param groups bring the learning rates back
        for g in o.param_groups:
            g["lr"] = 1.0
    shardwise.set_state_dict(fresh, fresh_optims, model_state_dict=model_sd, optim_state_dict=optim_sd,
                             full_state_dict=True)
    assert _step(fresh, fresh_optims, batches[2]) == _step(model, optims, batches[2])
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
    # training on did not change the loaded dicts (the optimizers hold copies)
    assert all(float(s["step"]) == 2 for s in optim_sd["state"].values() if "step" in s)


def test_refusals_name_the_key():
    model = tiny_gpt()
    optims = _two_optimizers(model)
    _step(model, optims, token_batches(1, 4, 17, seed=2)[0])
    _, optim_sd = shardwise.get_state_dict(model, optims)
    with pytest.raises(UserError, match=r"^set_state_dict: the optimizer state dict has 3 param groups, the "
                                        r"optimizers 1;"):
        shardwise.set_state_dict(model, optims[:1], model_state_dict=None, optim_state_dict=optim_sd)
    swapped = _copy(optim_sd)
    swapped["param_groups"][1]["params"], swapped["param_groups"][2]["params"] = \
        swapped["param_groups"][2]["params"], swapped["param_groups"][1]["params"]
    with pytest.raises(UserError, match=r'^set_state_dict: "\S+" is in another param group'):
        shardwise.set_state_dict(model, optims, model_state_dict=None, optim_state_dict=swapped)
    stray = _copy(optim_sd)
    stray["state"]["blocks.9.mlp.fc_in.weight"] = {}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError, match=r'"blocks.9.mlp.fc_in.weight", which no param group lists'):
        shardwise.set_state_dict(model, optims, model_state_dict=tiny_gpt(seed=9).state_dict(),
                                 optim_state_dict=stray)
    # refused before anything loaded: the model keeps its weights
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(UserError, match=r"^get_state_dict: the optimizer steps a tensor of shape \(3,\) that is not"):
        shardwise.get_state_dict(model, [other])
