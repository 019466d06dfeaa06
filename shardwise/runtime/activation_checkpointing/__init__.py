"""DeepSpeed's `deepspeed.runtime.activation_checkpointing` import path (its `checkpointing` module)."""
