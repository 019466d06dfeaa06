"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters` import path: `Init`, `GatheredParameters` and the
`ZeroParamStatus` enum with DeepSpeed's members and values, the `ds_status` every ZeRO-3 parameter carries (with
`ds_id`, `ds_numel`, `ds_shape`, `ds_tensor`, `ds_persist`: `shardwise.parallel.zero.gathered`).
"""

from shardwise.parallel.zero.states import ZeroParamStatus
from shardwise.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
