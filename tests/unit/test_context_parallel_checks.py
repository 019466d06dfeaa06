"""Context parallelism without processes: the token layout (golden chunks, positions, the inverse of the split),
the config block and DeepSpeed's sequence_parallel_size, and every bad input refused in one line before any rank
starts work."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.config import ConfigError, load_config, load_config_for_world
from shardwise.config.schema import ContextParallelConfig, ContextParallelImpl
from shardwise.errors import UserError
from shardwise.models.context_parallel import check_model_for_context_parallel
from shardwise.parallel.context import ContextParallel, SequenceLayout, SequenceSplitError
from shardwise.testing import tiny_gpt

RING, ULYSSES = ContextParallelImpl.RING, ContextParallelImpl.ULYSSES


def test_balanced_layout_gives_rank_i_chunks_i_and_2c_minus_1_minus_i() -> None:
    assert SequenceLayout(2, 0, balanced=True).spans(8) == [(0, 2), (6, 8)]
    assert SequenceLayout(2, 1, balanced=True).spans(8) == [(2, 4), (4, 6)]
    assert SequenceLayout(4, 1, balanced=True).positions(4, torch.device("cpu")).tolist() == [2, 3, 12, 13]
    assert SequenceLayout(4, 3, balanced=False).spans(8) == [(6, 8)]
    x = torch.arange(16).view(1, 16)
    assert SequenceLayout(4, 0, balanced=True).take(x, dim=1).tolist() == [[0, 1, 14, 15]]


@given(st.integers(1, 6), st.integers(1, 4), st.booleans())
def test_the_ranks_parts_are_the_sequence_once_each_with_their_positions(size: int, per_chunk: int,
                                                                         balanced: bool) -> None:
    seq = per_chunk * (2 * size if balanced else size)
    x = torch.arange(seq).view(1, seq)
    parts = [SequenceLayout(size, r, balanced).take(x, dim=1)[0] for r in range(size)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    for r, part in enumerate(parts):
        assert part.tolist() == SequenceLayout(size, r, balanced).positions(seq // size, x.device).tolist()


def test_config_block_and_deepspeed_sequence_parallel_size() -> None:
    cfg = load_config_for_world({"train_batch_size": 4, "context_parallel": {"size": 2}}, world_size=8)
    assert (cfg.context_parallel.size, cfg.context_parallel.impl, cfg.batch.micro_batch) == (2, RING, 1)  # dp 4
    cfg = load_config_for_world({"train_batch_size": 4, "sequence_parallel_size": 4}, world_size=8)
    assert (cfg.context_parallel.size, cfg.context_parallel.impl, cfg.batch.micro_batch) == (4, ULYSSES, 2)  # dp 2
    with pytest.raises(ConfigError, match='give only one of "sequence_parallel_size"'):
        load_config({"train_batch_size": 4, "sequence_parallel_size": 2, "context_parallel": {"size": 2}},
                    dp_size=1)


def test_cp_size_not_dividing_the_world_is_one_line_naming_it() -> None:
    with pytest.raises(ConfigError) as err:
        load_config_for_world({"train_batch_size": 4, "context_parallel": {"size": 3}}, world_size=4)
    assert [p.key for p in err.value.problems] == ["context_parallel.size"]
    assert "\n" not in str(err.value) and "context_parallel.size 3" in str(err.value)


@pytest.mark.parametrize("model, section, match", [
    (dict(seq_len=12), ContextParallelConfig(size=4), r"the model's seq_len 12 does not cut into 2 \* "
                                                      r"context_parallel.size = 8 chunks.*multiple of 8"),
    (dict(seq_len=12), ContextParallelConfig(size=3, impl=ULYSSES), "attention heads 4 are not divisible by "
                                                                    "context_parallel.size = 3"),
    (dict(seq_len=12, n_head=6, n_kv_head=3), ContextParallelConfig(size=2, impl=ULYSSES),
     "key/value heads 3 neither divide nor are divisible by context_parallel.size = 2"),
    (dict(dropout=0.1), ContextParallelConfig(size=2), "attention dropout 0.1 under ring attention"),
])
def test_a_model_that_cannot_split_is_one_line(model: dict, section: ContextParallelConfig, match: str) -> None:
    with pytest.raises(SequenceSplitError, match=match) as err:
        check_model_for_context_parallel(tiny_gpt(d_model=24 if model.get("n_head") == 6 else 32, **model), section)
    assert "\n" not in str(err.value)


def test_ulysses_spreads_the_heads_of_one_tensor_parallel_rank() -> None:
    check_model_for_context_parallel(tiny_gpt(seq_len=16, n_head=8, n_kv_head=4),
                                     ContextParallelConfig(size=2, impl=ULYSSES), tp=2)
    with pytest.raises(SequenceSplitError, match="attention heads 2 are not divisible by context_parallel.size = 4"):
        check_model_for_context_parallel(tiny_gpt(seq_len=16), ContextParallelConfig(size=4, impl=ULYSSES), tp=2)


def test_accepted_models_and_a_model_without_a_hook() -> None:
    check_model_for_context_parallel(tiny_gpt(seq_len=16, n_kv_head=2), ContextParallelConfig(size=4, impl=ULYSSES))
    check_model_for_context_parallel(tiny_gpt(seq_len=16), ContextParallelConfig(size=4))
    with pytest.raises(UserError, match="Linear has no context-parallel attention hook") as err:
        check_model_for_context_parallel(nn.Linear(2, 2), ContextParallelConfig(size=2))
    assert "\n" not in str(err.value)


def test_a_batch_whose_sequence_does_not_split_is_one_line() -> None:
    cp = ContextParallel(ContextParallelConfig(size=2), Comm(None, CommLedger(), name="cp"))
    ids = torch.zeros(2, 8, dtype=torch.long)
    (local_ids, weights), kwargs = cp.local_batch((ids, torch.ones(2)), {"labels": ids})
    assert local_ids.shape == kwargs["labels"].shape == (2, 4) and weights.shape == (2,)
    with pytest.raises(SequenceSplitError, match=r"sequence length 10 does not cut into 2 \* context_parallel.size "
                                                 r"= 4 chunks") as err:
        cp.local_batch((torch.zeros(2, 10),), {})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_causal_ring_rounds_give_every_rank_the_same_work(size: int) -> None:
    from shardwise.parallel.context.ring import _rows_and_keys
    s = 8                       # local tokens: two chunks of 4
    work, skipped = [], []
    for rank in range(size):
        layout = SequenceLayout(size, rank, balanced=True)
        pairs = 0.0
        for step in range(size):
            rows, keys, masked = _rows_and_keys(layout, step, True, s)
            area = (rows.stop - rows.start) * (keys.stop - keys.start)
            pairs += area / 2 if masked else area
            if step:            # after the diagonal round, half of every block is above the diagonal: skipped
                skipped.append(area == s * s // 2)
        work.append(pairs)
    assert len(set(work)) == 1 and all(skipped)
    assert work[0] == pytest.approx(size * s * s / 2)     # the causal half of the whole S x S, shared out


def test_deepspeed_distributed_attention_is_importable_by_its_path_and_refuses_other_indices() -> None:
    import shardwise as deepspeed
    from shardwise.sequence.layer import DistributedAttention
    assert deepspeed.sequence.layer.DistributedAttention is DistributedAttention
    with pytest.raises(UserError, match=r"scatter_idx=1, gather_idx=0.*use scatter_idx=2, gather_idx=0") as err:
        DistributedAttention(nn.Identity(), None, scatter_idx=1)
    assert "\n" not in str(err.value)


def _hf_llama(**overrides) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    keys = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, attention_dropout=0.0)
    config = transformers.LlamaConfig(**{**keys, **overrides})
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("overrides, section, match", [
    ({"attention_dropout": 0.1}, ContextParallelConfig(size=2), "attention_dropout = 0.1"),
    ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48},
     ContextParallelConfig(size=4, impl=ULYSSES), "attention heads 6 are not divisible by context_parallel.size = 4"),
])
def test_a_hugging_face_model_that_cannot_split_is_one_line(overrides: dict, section: ContextParallelConfig,
                                                            match: str) -> None:
    with pytest.raises(UserError, match=match) as err:
        check_model_for_context_parallel(_hf_llama(**overrides), section)
    assert "\n" not in str(err.value)


def test_a_hugging_face_decoder_is_accepted_and_one_whose_attention_is_its_own_is_refused() -> None:
    model = _hf_llama()
    check_model_for_context_parallel(model, ContextParallelConfig(size=2))
    check_model_for_context_parallel(model, ContextParallelConfig(size=2, impl=ULYSSES))
    type(model)._supports_attention_backend = False     # as transformers marks a model with attention of its own
    try:
        with pytest.raises(UserError, match="does not call its attention through transformers' AttentionInterface"):
            check_model_for_context_parallel(model, ContextParallelConfig(size=2))
    finally:
        del type(model)._supports_attention_backend


def test_hugging_face_labels_are_shifted_before_the_split_and_positions_passed() -> None:
    from shardwise.models.hf_context_parallel import HuggingFaceBatchPart, shift_labels
    labels = torch.arange(8).view(1, 8)
    assert shift_labels(labels).tolist() == [[1, 2, 3, 4, 5, 6, 7, -100]]
    cp = ContextParallel(ContextParallelConfig(size=2), Comm(None, CommLedger(), name="cp"))   # rank 0 of 2
    ids = torch.arange(8).view(1, 8) + 10
    inputs, kwargs = HuggingFaceBatchPart(cp).local_batch((ids,), {"labels": labels})
    assert inputs[0].tolist() == [[10, 11, 16, 17]]
    assert kwargs["labels"].tolist() == [[1, 2, 7, -100]]           # token 1's label (2) crossed no boundary
    assert kwargs["position_ids"].tolist() == [[0, 1, 6, 7]]
    given = shift_labels(labels)                                     # shift_labels= come shifted: kept
    _, kwargs = HuggingFaceBatchPart(cp).local_batch((ids,), {"labels": labels, "shift_labels": given})
    assert kwargs["shift_labels"].tolist() == [[1, 2, 7, -100]] and kwargs["labels"].tolist() == [[0, 1, 6, 7]]


def test_hugging_face_all_ones_mask_is_dropped_and_a_padding_mask_refused() -> None:
    """The Trainer's collators pass an all-ones attention_mask: nothing to mask, dropped (keyword or positional,
    any dtype); a mask with a zero anywhere is padding cp attention would not mask: one line naming the fix."""
    from shardwise.models.hf_context_parallel import HuggingFaceBatchPart
    cp = ContextParallel(ContextParallelConfig(size=2), Comm(None, CommLedger(), name="cp"))   # rank 0 of 2
    ids, labels = torch.arange(8).view(1, 8) + 10, torch.arange(8).view(1, 8)
    part = HuggingFaceBatchPart(cp)
    for ones in (torch.ones_like(ids), torch.ones(1, 8, dtype=torch.bool)):
        inputs, kwargs = part.local_batch((ids,), {"labels": labels, "attention_mask": ones})
        assert "attention_mask" not in kwargs and inputs[0].tolist() == [[10, 11, 16, 17]]
        inputs, kwargs = part.local_batch((ids, ones), {"labels": labels})
        assert inputs[1] is None and inputs[0].tolist() == [[10, 11, 16, 17]]
    for zero_at in (0, 3, 7):                   # left padding, a hole, right padding: all refused
        mask = torch.ones_like(ids)
        mask[0, zero_at] = 0
        with pytest.raises(UserError, match="attention_mask has zeros .* pad on the right and mark the padding with "
                                            "labels -100"):
            part.local_batch((ids,), {"labels": labels, "attention_mask": mask})
        with pytest.raises(UserError, match="attention_mask has zeros"):
            part.local_batch((ids, mask), {"labels": labels})
