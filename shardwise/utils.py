"""DeepSpeed's `deepspeed.utils` for scripts: the full fp32 value and gradient of a trained parameter under
every ZeRO stage (`shardwise.engine.param_access`)."""

from shardwise.engine.param_access import safe_get_full_fp32_param, safe_get_full_grad

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad"]
