"""ZeRO-3's lifecycle states on one process (a data-parallel group of one): each unit's `GatherState` and
`TrainingState`, each flat's `ReduceState` and the runtime's `BackwardState` through a forward, a backward and a
prefetch, and an illegal transition refused with a message naming the unit and both states."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm.ledger import CommLedger
from shardwise.comm.topology import SoloComm
from shardwise.parallel.zero.flat import FlatKey
from shardwise.parallel.zero.params import shard_model
from shardwise.parallel.zero.stage3 import ZeroParamRuntime
from shardwise.parallel.zero.states import BackwardState, GatherState, ReduceState, TrainingState
from shardwise.testing import lm_pair, tiny_gpt, token_batches


def _sharded(n_layer: int = 3):
    model = tiny_gpt(n_layer=n_layer)
    comm = SoloComm(None, CommLedger(), name="dp")
    partition = shard_model(model, key_of=lambda p: FlatKey(0, p.dtype), dp_size=1, dp_rank=0,
                            persistence_threshold=0, model_persistence_threshold=0)
    # the largest unit fits the prefetch bound, so the next block is gathered ahead of its forward
    largest = max(u.padded_numel for u in partition.units)
    runtime = ZeroParamRuntime(model, partition, comm, persistent=None, prefetch_numel=largest,
                               max_live_numel=1 << 62)
    return model, partition, runtime, comm


def test_forward_and_backward_walk_the_states() -> None:
    model, partition, runtime, _ = _sharded()
    blocks = [u for u in partition.units if not u.is_root]
    seen: dict[str, list] = {u.name: [] for u in blocks}

    def record(u, *_):
        seen[u.name].append((u.training_state, u.gather_state))

    hooks = [u.module.register_forward_hook(lambda m, a, o, u=u: record(u), prepend=True) for u in blocks]
    assert all(u.gather_state is GatherState.SHARDED and u.training_state is TrainingState.IDLE
               for u in partition.units)
    ids, labels = lm_pair(token_batches(1, 2, 17, seed=0)[0])
    loss = model(ids, labels)
    # at the end of its forward (the recording hook runs ahead of the runtime's post-hook) a block is gathered
    assert all(v == [(TrainingState.FORWARD, GatherState.UNSHARDED)] for v in seen.values())
    # after forward: blocks freed and idle; the root stays gathered for backward, which is now due
    assert all(u.gather_state is GatherState.SHARDED and u.training_state is TrainingState.IDLE for u in blocks)
    assert runtime.root.gather_state is GatherState.UNSHARDED
    assert runtime.backward_state is BackwardState.DUE
    loss.backward()
    # autograd's final callback finished the backward: every gradient reduced, every unit freed and idle again
    assert runtime.backward_state is BackwardState.NONE
    assert all(u.gather_state is GatherState.SHARDED and u.training_state is TrainingState.IDLE
               for u in partition.units)
    assert all(f.reduce_state is ReduceState.COLLECTING and f.ready == 0 and f.has_grads for f in partition.flats)
    assert runtime.live_numel == 0
    for h in hooks:
        h.remove()


def test_prefetch_leaves_the_next_block_gathering_and_a_free_waits_for_it() -> None:
    model, partition, runtime, _ = _sharded()
    blocks = [u for u in partition.units if not u.is_root]
    ids, labels = lm_pair(token_batches(1, 2, 17, seed=0)[0])
    with torch.no_grad():
        model(ids, labels)                  # records the order the blocks run in
    states = []
    hook = blocks[0].module.register_forward_hook(lambda *_: states.append(blocks[1].gather_state))
    with torch.no_grad():
        model(ids, labels)
    hook.remove()
    assert states == [GatherState.GATHERING]         # launched ahead during block 0's forward, not waited on
    assert runtime.backward_state is BackwardState.NONE    # no gradient: no backward due
    runtime.release_gathered()
    assert all(u.gather_state is GatherState.SHARDED for u in partition.units) and runtime.live_numel == 0


def test_illegal_transitions_are_refused() -> None:
    _, partition, runtime, comm = _sharded()
    u = partition.units[0]
    with pytest.raises(AssertionError, match=rf"unit {u.name}: SHARDED -> UNSHARDED is not a legal transition"):
        u.finish_gather()
    u.start_gather(comm)
    with pytest.raises(AssertionError, match="GATHERING -> GATHERING"):
        u.start_gather(comm)
    with pytest.raises(AssertionError, match="GATHERING -> SHARDED"):
        u.reshard()
    u.free()                                # waits for the gather, then frees
    assert u.gather_state is GatherState.SHARDED
    with pytest.raises(AssertionError, match="IDLE -> IDLE"):
        u.move_training(TrainingState.IDLE)
    u.move_training(TrainingState.PRE_BACKWARD)
    u.move_training(TrainingState.POST_BACKWARD)
    with pytest.raises(AssertionError, match="POST_BACKWARD -> FORWARD"):    # a forward inside a backward
        u.move_training(TrainingState.FORWARD)
    flat = partition.flats[0]
    with pytest.raises(AssertionError, match="COLLECTING -> REDUCED"):        # waited on before its launch
        flat.move_reduce(ReduceState.REDUCED)
    with pytest.raises(AssertionError, match="NONE -> NONE"):
        runtime._move_backward(BackwardState.NONE)
