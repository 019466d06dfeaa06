"""DeepSpeed's `deepspeed.utils` for scripts (`import shardwise as deepspeed`): the tensor-fragment API, a trained
parameter's fp32 value, gradient and optimizer state, whole or this rank's elements, under every ZeRO stage
(`shardwise.engine.param_access`), and `RepeatingLoader`."""

from shardwise.engine.param_access import (
    safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state, safe_get_local_fp32_param,
    safe_get_local_grad, safe_get_local_optimizer_state, safe_set_full_fp32_param, safe_set_full_grad,
    safe_set_full_optimizer_state, safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from shardwise.utils.repeating_loader import RepeatingLoader

__all__ = [
    "RepeatingLoader", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_fp32_param",
    "safe_set_full_grad", "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
    "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized",
]
