"""DeepSpeed's `deepspeed.checkpointing` for scripts (`import shardwise as deepspeed`): activation checkpointing a
model calls itself and the model-parallel random-number tracker, implemented in `shardwise.parallel.recompute_api`."""

from shardwise.parallel.recompute_api import (
    MODEL_PARALLEL_RNG, RNGStatesTracker, checkpoint, configure, get_cuda_rng_tracker, is_configured,
    model_parallel_cuda_manual_seed, model_parallel_reconfigure_tp_seed, non_reentrant_checkpoint,
    partition_activations_in_checkpoint, profile_sink, profile_times, reset, set_num_layers,
)

__all__ = ["MODEL_PARALLEL_RNG", "RNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker",
           "is_configured", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
           "non_reentrant_checkpoint", "partition_activations_in_checkpoint", "profile_sink", "profile_times", "reset",
           "set_num_layers"]
