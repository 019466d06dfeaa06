"""Test support shared by the test suite, the benchmarks and the ranks they spawn: `ranks.py` (run a function on
N gloo ranks, with every failing rank's traceback and no hangs), `reference.py` (the tiny GPT, token batches, the
single-process reference trainer, parity assertions), `host_reads.py` (counting device-to-host reads)."""

from shardwise.testing.host_reads import HostReadCounter
from shardwise.testing.ranks import DistributedTestError, run_distributed
from shardwise.testing.reference import (
    tiny_gpt, token_batches, lm_pair, micro_steps, state_copy, mean_over_ranks, reference_train, shard_global_batch, assert_close_lists, assert_close_growing, assert_state_close, gpt_forward_flops,
)

__all__ = ["DistributedTestError", "HostReadCounter", "run_distributed", "tiny_gpt", "token_batches", "lm_pair", "micro_steps", "state_copy", "mean_over_ranks", "reference_train", "shard_global_batch", "assert_close_lists", "assert_close_growing", "assert_state_close", "gpt_forward_flops"]
