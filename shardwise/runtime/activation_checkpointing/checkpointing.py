"""DeepSpeed's `deepspeed.runtime.activation_checkpointing.checkpointing` import path: the same names as
`shardwise.checkpointing` (`deepspeed.checkpointing`), which is where DeepSpeed's come from too."""

from shardwise.checkpointing import (
    MODEL_PARALLEL_RNG, RNGStatesTracker, checkpoint, configure, get_cuda_rng_tracker, is_configured,
    model_parallel_cuda_manual_seed, model_parallel_reconfigure_tp_seed, non_reentrant_checkpoint,
    partition_activations_in_checkpoint, profile_sink, profile_times, reset, set_num_layers,
)

__all__ = ["MODEL_PARALLEL_RNG", "RNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker",
           "is_configured", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
           "non_reentrant_checkpoint", "partition_activations_in_checkpoint", "profile_sink", "profile_times", "reset",
           "set_num_layers"]
