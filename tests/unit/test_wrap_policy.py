"""FullyShardedDataParallel's auto_wrap_policy picks the modules torch's FSDP1 would wrap: the transformer
blocks by default, a set of classes, or torch's own policy callables."""

import functools

import pytest
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

from shardwise.errors import UserError
from shardwise.models.gpt import MLP, Attention, Block
from shardwise.parallel.wrappers.fsdp import wrap_targets
from shardwise.testing import tiny_gpt


def test_default_and_torch_policies_pick_the_blocks():
    model = tiny_gpt(n_layer=3)
    blocks = list(model.blocks)
    assert wrap_targets(model, None) == blocks
    assert wrap_targets(model, {Block}) == blocks
    assert wrap_targets(model, ModuleWrapPolicy({Block})) == blocks
    assert wrap_targets(model, functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})) == blocks


def test_nested_classes_inner_first_and_size_policy():
    model = tiny_gpt(n_layer=2)
    # nested classes: inner modules first, then the block that holds them (the order fully_shard needs)
    assert wrap_targets(model, {Attention, MLP, Block}) == [m for b in model.blocks for m in (b.attn, b.mlp, b)]
    # size: each block's attention (4,224 parameters) and MLP (8,352) are too small alone, a block is not;
    # the ModuleList above them is a container, never wrapped
    assert wrap_targets(model, functools.partial(size_based_auto_wrap_policy, min_num_params=10_000)) == \
        list(model.blocks)
    # 5,000: the token table and the lm-head (8,192 each) and each MLP; a block's remaining 4,416 are too few
    assert wrap_targets(model, functools.partial(size_based_auto_wrap_policy, min_num_params=5_000)) == \
        [model.embed.tok, *(b.mlp for b in model.blocks), model.head.lm_head]


def test_a_bad_policy_is_one_line():
    with pytest.raises(UserError, match="auto_wrap_policy = 'blocks'"):
        wrap_targets(tiny_gpt(), "blocks")
